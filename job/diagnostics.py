"""Where the model fails, as files: a split's report folder (`report/<split>/` in the run folder at the end of a
run, `DIR/<split>/` from `job evaluate --report DIR`):

    classes.csv        class, precision, recall, f1, support (weakest F1 first)
    most_confused.csv  true, predicted, count: the off-diagonal cells of the confusion matrix, largest first
    confusion.png      the confusion matrix, raw counts and normalised by row (the 30 most confused classes of many)
    worst.csv          the samples of the highest loss: path (or sample number), true, predicted, probability, loss
    worst.png          a grid of those images, each with its true label, the predicted label and its probability

One pass over the split in order, in this process: each sample's loss and prediction kept (two numbers a sample), the
confusion matrix from them; the images of the worst only are kept for the grid.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable

import torch
import torch.nn.functional as F

from job import scores
from job.data.batches import IGNORED

WORST = 36  # samples in worst.csv and worst.png
SHOWN = 30  # classes drawn in confusion.png at most: the most confused ones


@torch.no_grad()
def per_sample(model, loader, amp) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(losses, predictions, their probabilities, labels) of every sample of a one-process loader, in its order."""
    model.eval()
    losses, predicted, probability, labels = [], [], [], []
    for batch in loader.batches():
        with amp():
            out = model(batch.x).float()
        p = torch.softmax(out, 1)
        losses.append(F.cross_entropy(out, batch.y, reduction="none").cpu())
        top = p.max(1)
        predicted.append(top.indices.cpu())
        probability.append(top.values.cpu())
        labels.append(batch.y.cpu())
    model.train()
    return torch.cat(losses), torch.cat(predicted), torch.cat(probability), torch.cat(labels)


def write(
    put: Callable[[str, bytes], None], model, loader, amp, split, classes: list[str], images=None, names=None
) -> torch.Tensor:
    """The split's report files through `put(name, bytes)`; returns its confusion matrix. `images`: the split's
    uint8 images (for worst.png; None for tables); `names`: each sample's file (else its number)."""
    losses, predicted, probability, labels = per_sample(model, loader, amp)
    k, counted = len(classes), labels != IGNORED  # a streamed sample that could not be decoded is left out
    confusion = torch.bincount((labels * k + predicted)[counted], minlength=k * k).view(k, k)
    put("classes.csv", classes_csv(confusion, classes))
    put("most_confused.csv", most_confused_csv(confusion, classes))
    put("confusion.png", confusion_png(confusion, classes, split))
    ranked = losses.masked_fill(~counted, float("-inf")).argsort(descending=True)
    worst = ranked[: min(WORST, int(counted.sum()))].tolist()
    rows = [
        (names[i] if names else str(i), classes[int(labels[i])], classes[int(predicted[i])], float(probability[i]),
         float(losses[i]))
        for i in worst
    ]  # fmt: skip
    put("worst.csv", table(["path", "true", "predicted", "probability", "loss"], rows))
    if images is not None:
        put("worst.png", worst_png(images[worst].cpu(), rows))
    return confusion


def table(head: list[str], rows: list) -> bytes:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(head)
    w.writerows(rows)
    return buf.getvalue().encode()


def classes_csv(confusion: torch.Tensor, classes: list[str]) -> bytes:
    s = scores.per_class(confusion)
    order = sorted(range(len(classes)), key=lambda i: (float(s["f1"][i]), i))
    rows = [
        (classes[i], f"{float(s['precision'][i]):.6f}", f"{float(s['recall'][i]):.6f}", f"{float(s['f1'][i]):.6f}",
         int(s["support"][i]))
        for i in order
    ]  # fmt: skip
    return table(["class", "precision", "recall", "f1", "support"], rows)


def most_confused_csv(confusion: torch.Tensor, classes: list[str]) -> bytes:
    off = confusion.clone()
    off.fill_diagonal_(0)
    cells = [(int(off[t, p]), t, p) for t, p in (off > 0).nonzero().tolist()]
    rows = [(classes[t], classes[p], n) for n, t, p in sorted(cells, key=lambda c: (-c[0], c[1], c[2]))]
    return table(["true", "predicted", "count"], rows)


def most_confused_classes(confusion: torch.Tensor, n: int) -> list[int]:
    """The n classes with the most mistakes, in or out (all of them when there are no more than n)."""
    if len(confusion) <= n:
        return list(range(len(confusion)))
    off = confusion.clone()
    off.fill_diagonal_(0)
    return sorted((off.sum(0) + off.sum(1)).argsort(descending=True)[:n].tolist())


def confusion_png(confusion: torch.Tensor, classes: list[str], split: str) -> bytes:
    """Two panels, raw counts and normalised by row, of the most confused classes (of all, up to SHOWN)."""
    from matplotlib.figure import Figure  # without pyplot: no global backend switched

    keep = most_confused_classes(confusion, SHOWN)
    sub = confusion[keep][:, keep].double()
    rows = sub / sub.sum(1, keepdim=True).clamp(min=1)
    names = [classes[i] for i in keep]
    size = 3 + 0.35 * len(keep)
    fig = Figure(figsize=(2 * size + 1, size))
    for ax, values, title in zip(fig.subplots(1, 2), (sub, rows), ("counts", "normalised by row")):
        ax.imshow(values.numpy(), cmap="Blues")
        ax.set(xticks=range(len(names)), yticks=range(len(names)), xlabel="predicted", ylabel="true")
        ax.set_xticklabels(names, rotation=90, fontsize=7)
        ax.set_yticklabels(names, fontsize=7)
        some = f" ({len(keep)} most confused classes)" if len(keep) < len(classes) else ""
        ax.set_title(f"{split}: {title}{some}")
        if len(keep) <= 12:  # few enough to print each cell
            for t in range(len(keep)):
                for p in range(len(keep)):
                    v = float(values[t, p])
                    ax.text(p, t, f"{v:.0f}" if values is sub else f"{v:.2f}", ha="center", va="center", fontsize=6)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()


def worst_png(images: torch.Tensor, rows: list) -> bytes:
    """A grid of the worst images, each titled true / predicted (probability) and its file name beneath."""
    from matplotlib.figure import Figure

    n = len(rows)
    cols = 6
    lines = -(-n // cols)
    fig = Figure(figsize=(cols * 2.2, lines * 2.6))
    for i, ((path, true, predicted, p, _), img) in enumerate(zip(rows, images)):
        ax = fig.add_subplot(lines, cols, i + 1)
        ax.imshow(img.permute(1, 2, 0).numpy())
        ax.set_title(f"{true} -> {predicted} ({p:.2f})", fontsize=7)
        ax.set_xlabel(str(path).rsplit("/", 1)[-1][-28:], fontsize=6)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    return buf.getvalue()
