"""Where the model fails, as files: a split's report folder (`report/<split>/` in the run folder at the end of a
run, `DIR/<split>/` from `job evaluate --report DIR`):

    classes.csv        class, precision, recall, f1, support (weakest F1 first)
    most_confused.csv  true, predicted, count: the off-diagonal cells of the confusion matrix, largest first
    confusion.png      the confusion matrix, raw counts and normalised by row (the 30 most confused classes of many)
    worst.csv          the samples of the highest loss: path (a file, shard:key of a streamed sample, "row N" of a
                       table; else its number), true, predicted, probability, loss
    worst.png          a grid of those images as the model saw them, each with its true label, the predicted label
                       and its probability, its name beneath

One pass over the split, each process of a group over its part: each sample's loss and prediction kept (a few numbers
a sample), the confusion matrix from them; the model's inputs of the worst only are kept for the grid. The parts meet
in the writer (rank 0), which writes the files. At each evaluation,
TensorBoard gets the confusion matrix drawn by confusion_picture.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from job import scores
from job.data.augment import viewed_logits
from job.data.batches import IGNORED

WORST = 36  # samples in worst.csv and worst.png
SHOWN = 30  # classes drawn in confusion.png at most: the most confused ones


def write_splits(
    r,
    put: Callable[[str, str, bytes], None],
    group: tuple[int, int] = (0, 1),
    gather=None,
    thresholds: list[float] | None = None,
    augmentation: str = "none",
) -> dict[str, float] | None:
    """Each held-out split's report files of the recipe's model through `put(split, name, bytes)`. In a group of
    processes (`group`: rank, world) each scores its part of the split and `gather` brings the parts to the writer
    (a list by rank there, None elsewhere; without it, this process is alone). TensorBoard's confusion images are
    drawn at each evaluation instead (confusion_picture). Multi-label: classes.csv and pr_curves.png
    (write_multilabel), at `thresholds`. One class an image: scored with the run's test-time views
    (`augmentation`), a temperature fitted on val (job/calibrate.py) and each split's calibration before and after
    it (reliability.png); returns, on the writer, the temperature and the expected calibration errors (calibrated())."""
    rank, world = group
    stats = r.feed.stats_cpu() if r.feed.is_image else None
    passes: dict[str, Passed] = {}
    for split in r.held_out:
        loader = r.feed.test(r.feed.batch_size, rank, world, split)
        if r.multilabel:
            part = multilabel_part(r.evaluated, loader, r.amp, len(r.classes), augmentation)
            write_multilabel(lambda name, data, split=split: put(split, name, data), part, r.classes, split, thresholds)
            continue
        part = per_sample(r.evaluated, loader, r.amp, stats, augmentation)
        parts = gather(part) if gather is not None else [part]
        if parts is not None:
            passes[split] = merged(parts)
            write(lambda name, data, split=split: put(split, name, data), passes[split], split, r.classes)
    return calibrated(passes, put) if passes else None


def calibrated(passes: dict[str, Passed], put: Callable[[str, str, bytes], None]) -> dict[str, float]:
    """The temperature fitted on val's logits (1 without a val split), and each split's expected calibration error
    before and after it, with its reliability diagram."""
    from job import calibrate

    def counted(s: Passed) -> tuple[torch.Tensor, torch.Tensor]:
        keep = s.labels != IGNORED
        return s.logits[keep], s.labels[keep]

    t = calibrate.fit_temperature(*counted(passes["val"])) if "val" in passes else 1.0
    out = {"temperature": t}
    for split, s in passes.items():
        logits, labels = counted(s)
        if not len(labels):
            continue
        out[f"{split}_ece"] = calibrate.expected_calibration_error(torch.softmax(logits, 1), labels)
        out[f"{split}_ece_calibrated"] = calibrate.expected_calibration_error(torch.softmax(logits / t, 1), labels)
        put(split, "reliability.png", calibrate.reliability_png(logits, labels, t, split))
    return out


@dataclass
class Passed:
    """One process's pass over its part of a split: every sample's loss, prediction, its probability and label (on
    the host, in the loader's order), each sample's name (its number where the loader names none), and the highest
    losses: their places and, for images, the model's inputs there as uint8 pictures."""

    losses: torch.Tensor
    predicted: torch.Tensor
    probability: torch.Tensor
    labels: torch.Tensor
    logits: torch.Tensor  # every sample's, float32: what the temperature is fitted to (a few MB for 10,000 x 100)
    names: list[str]
    worst: torch.Tensor  # places of the WORST highest losses among the counted samples, highest first
    pictures: torch.Tensor | None  # the inputs at those places (None: a table, or no sample counted)

    def totals(self) -> tuple[float, int, int]:
        """The sum of the counted samples' losses, how many were right, and how many were counted (test_sums'
        first three, from the same pass)."""
        counted = self.labels != IGNORED
        right = (self.predicted == self.labels) & counted
        return float(self.losses[counted].double().sum()), int(right.sum()), int(counted.sum())


@torch.no_grad()
def per_sample(model, loader, amp, stats=None, augmentation: str = "none") -> Passed:
    """A loader's samples through the model (padding left out), with the run's test-time views (`augmentation`, as
    its evaluations score them). The inputs of the highest losses so far are kept on the device as the pass goes (a
    top-k over those and each batch), so memory holds WORST inputs, not the split. `stats`: the inputs' (mean, std)
    per channel, to draw them (None: a table; (None, None): not normalised)."""
    model.eval()
    losses, predicted, probability, labels, outs, names = [], [], [], [], [], []
    top_loss = top_at = top_x = None
    seen = 0
    for batch in loader.batches():
        if not batch.own:  # padding: this process's samples have run out
            continue
        with amp():
            out = viewed_logits(model, batch.x, augmentation).float()
        p = torch.softmax(out, 1)
        loss = F.cross_entropy(out, batch.y, reduction="none", ignore_index=IGNORED)
        ranked = loss.masked_fill(batch.y == IGNORED, float("-inf"))  # never counted, never among the worst
        at = torch.arange(seen, seen + len(loss), device=loss.device)
        if top_loss is not None:
            ranked, at = torch.cat([top_loss, ranked]), torch.cat([top_at, at])
        keep = ranked.topk(min(WORST, len(ranked))).indices
        if stats is not None:
            top_x = (batch.x if top_x is None else torch.cat([top_x, batch.x]))[keep]
        top_loss, top_at = ranked[keep], at[keep]
        losses.append(loss.cpu())
        top = p.max(1)
        predicted.append(top.indices.cpu())
        probability.append(top.values.cpu())
        labels.append(batch.y.cpu())
        outs.append(out.cpu())
        names += batch.names if len(batch.names) == len(batch.y) else [str(i) for i in range(seen, seen + len(loss))]
        seen += len(loss)
    model.train()
    found = int((top_loss != float("-inf")).sum()) if top_loss is not None else 0  # counted (a NaN loss is too)
    worst = top_at[:found].cpu() if found else torch.zeros(0, dtype=torch.long)
    drawn = pixels(top_x[:found], *stats) if top_x is not None and found else None
    held = [torch.cat(t) if t else torch.zeros(0) for t in (losses, predicted, probability, labels)]
    return Passed(*held, torch.cat(outs) if outs else torch.zeros(0, 0), names, worst, drawn)


def merged(parts: list[Passed]) -> Passed:
    """The processes' parts of a split as one (rank 0's samples first), its worst the highest over all of them."""
    if len(parts) == 1:
        return parts[0]
    offsets = torch.tensor([0] + [len(p.losses) for p in parts[:-1]]).cumsum(0).tolist()
    joined = [torch.cat([getattr(p, f) for p in parts]) for f in ("losses", "predicted", "probability", "labels")]
    joined.append(torch.cat([p.logits for p in parts if len(p.logits)] or [parts[0].logits]))  # (0, 0): no class count
    worst = torch.cat([p.worst + off for p, off in zip(parts, offsets)])
    drawn = [p.pictures for p in parts if p.pictures is not None]
    order = joined[0][worst].argsort(descending=True, stable=True)[:WORST]
    pictures = torch.cat(drawn)[order] if drawn else None
    return Passed(*joined, [n for p in parts for n in p.names], worst[order], pictures)


def write(put: Callable[[str, bytes], None], s: Passed, split: str, classes: list[str]) -> torch.Tensor:
    """A split's report files from its pass through `put(name, bytes)`; returns its confusion matrix."""
    k, counted = len(classes), s.labels != IGNORED  # a streamed sample that could not be decoded is left out
    confusion = torch.bincount((s.labels.long() * k + s.predicted.long())[counted], minlength=k * k).view(k, k)
    put("classes.csv", classes_csv(confusion, classes))
    put("most_confused.csv", most_confused_csv(confusion, classes))
    put("confusion.png", confusion_png(confusion, classes, split))
    rows = [
        (s.names[i], classes[int(s.labels[i])], classes[int(s.predicted[i])], float(s.probability[i]),
         float(s.losses[i]))
        for i in s.worst.tolist()
    ]  # fmt: skip
    put("worst.csv", table(["path", "true", "predicted", "probability", "loss"], rows))
    if s.pictures is not None and rows:
        put("worst.png", worst_png(s.pictures, rows))
    return confusion


def multilabel_part(model, loader, amp, classes: int, augmentation: str = "none") -> list:
    """A multi-label model's (probabilities, targets) on a split, with the run's test-time views, every process's
    part (on the host), by rank."""
    from job import distributed
    from job.multilabel import multilabel_outputs

    _, probs, ys = multilabel_outputs(model, loader, amp, classes, augmentation)
    return distributed.gather_objects((probs.cpu().numpy(), ys.cpu().numpy()))


def write_multilabel(
    put: Callable[[str, bytes], None], parts: list, classes: list[str], split: str, thresholds: list[float] | None
) -> None:
    """A multi-label split's report from its (probabilities, targets) parts: classes.csv (class, ap, threshold,
    precision, recall, f1, support: lowest AP first) at `thresholds` (default: the split's best-F1 ones), and
    pr_curves.png, each class's precision-recall curve. The writer (rank 0) writes."""
    from job import distributed, multilabel

    if not distributed.is_writer():
        return
    y, p = multilabel.joined(parts)
    s = multilabel.scored(y, p, 0.0, thresholds)
    rows = sorted(s.table(classes), key=lambda row: (row[1], classes.index(row[0])))
    cells = [(c, f"{ap:.10f}", f"{t:.6f}", f"{p:.6f}", f"{rc:.6f}", f"{f:.6f}", n) for c, ap, t, p, rc, f, n in rows]
    put("classes.csv", table(["class", "ap", "threshold", "precision", "recall", "f1", "support"], cells))
    put("pr_curves.png", pr_curves_png(y, p, classes, s.ap, split))


def pr_curves_png(y, p, classes: list[str], ap: list[float], split: str) -> bytes:
    """Each class's precision-recall curve (of the 20 of lowest AP, among many), its AP in the legend."""
    from matplotlib.figure import Figure

    from job.multilabel import curves

    shown = sorted(range(len(classes)), key=lambda i: ap[i])[:20]
    fig = Figure(figsize=(6, 5))
    ax = fig.add_subplot(1, 1, 1)
    for i in shown:
        recall, precision = curves(y[:, i], p[:, i])
        ax.step(recall, precision, where="post", label=f"{classes[i]} (AP {ap[i]:.3f})")
    ax.set_xlabel("recall")
    ax.set_ylabel("precision")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    ax.set_title(
        f"{split}: precision-recall by class" + (f" (20 lowest AP of {len(classes)})" if len(classes) > 20 else "")
    )
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    return buf.getvalue()


def pixels(x: torch.Tensor, mean: torch.Tensor | None, std: torch.Tensor | None) -> torch.Tensor:
    """The model's inputs as uint8 images on the host again: the normalisation undone."""
    x = x.float().cpu()
    if mean is not None:
        x = x * std.view(1, -1, 1, 1) + mean.view(1, -1, 1, 1)
    return (x.clamp(0, 1) * 255).round().to(torch.uint8)


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


def confusion_picture(confusion: torch.Tensor, classes: list[str], split: str) -> torch.Tensor:
    """The confusion matrix normalised by row as an HWC uint8 picture, class names on its axes (the SHOWN most
    confused of many). Drawn with Pillow at each evaluation: a few milliseconds, where a matplotlib figure takes a
    third of a second."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    keep = most_confused_classes(confusion, SHOWN)
    sub = confusion[keep][:, keep].double()
    rows = (sub / sub.sum(1, keepdim=True).clamp(min=1)).numpy()
    names = [classes[i][:24] for i in keep]
    n, font = len(keep), ImageFont.load_default(11)
    cell = max(16, min(48, 480 // n))
    label = max(int(font.getlength(name)) for name in names) + 8
    title = f"{split}: confusion, normalised by row" + (
        f" ({n} most confused of {len(classes)} classes)" if n < len(classes) else "")  # fmt: skip
    top, left = 20 + label + 14, 30 + label
    width = max(left + n * cell + 8, int(font.getlength(title)) + 16)
    img = Image.new("RGB", (width, top + n * cell + 8), "white")
    draw = ImageDraw.Draw(img)
    draw.text((6, 4), title, fill="black", font=font)
    light, dark = np.array([247, 251, 255]), np.array([8, 48, 107])  # matplotlib's Blues, its two ends
    for t in range(n):
        draw.text((left - 4, top + t * cell + cell / 2), names[t], fill="black", font=font, anchor="rm")
        for p in range(n):
            v = float(rows[t, p])
            colour = tuple(int(c) for c in light + (dark - light) * v)
            x0, y0 = left + p * cell, top + t * cell
            draw.rectangle((x0, y0, x0 + cell - 1, y0 + cell - 1), fill=colour)
            if n <= 12:  # few enough to print each cell
                ink = "white" if v > 0.5 else "black"
                draw.text((x0 + cell / 2, y0 + cell / 2), f"{v:.2f}", fill=ink, font=font, anchor="mm")
    for p, name in enumerate(names):  # the predicted classes along the top, written upwards
        text = Image.new("RGB", (label, cell), "white")
        ImageDraw.Draw(text).text((2, cell / 2), name, fill="black", font=font, anchor="lm")
        img.paste(text.rotate(90, expand=True), (left + p * cell, top - label - 2))
    draw.text((2, top + n * cell / 2), "true", fill="grey", font=font, anchor="lm")
    draw.text((left + n * cell / 2, top - label - 12), "predicted", fill="grey", font=font, anchor="mm")
    return torch.from_numpy(np.asarray(img).copy())


def worst_png(images: torch.Tensor, rows: list) -> bytes:
    """A grid of the worst images, each titled true / predicted (probability) and its file name beneath."""
    from matplotlib.figure import Figure

    n = len(rows)
    cols = 6
    lines = -(-n // cols)
    fig = Figure(figsize=(cols * 2.2, lines * 2.6))
    for i, ((path, true, predicted, p, _), img) in enumerate(zip(rows, images)):
        ax = fig.add_subplot(lines, cols, i + 1)
        picture = img.permute(1, 2, 0).numpy()
        ax.imshow(picture[..., 0] if picture.shape[2] == 1 else picture, cmap="gray")
        ax.set_title(f"{true} -> {predicted} ({p:.2f})", fontsize=7)
        ax.set_xlabel(str(path).rsplit("/", 1)[-1][-28:], fontsize=6)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    return buf.getvalue()
