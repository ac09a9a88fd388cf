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

from job.data.augment import viewed_logits
from job.data.batches import IGNORED
from job.use import scores

WORST = 36  # samples in worst.csv and worst.png
SHOWN = 30  # classes drawn in confusion.png at most: the most confused ones


def write_splits(
    r,
    put: Callable[[str, str, bytes], None],
    group: tuple[int, int] = (0, 1),
    gather=None,
    thresholds: list[float] | None = None,
    augmentation: str = "none",
    kept: dict[str, Passed] | None = None,
) -> dict[str, float] | None:
    """Each held-out split's report files of the recipe's model through `put(split, name, bytes)`. In a group of
    processes (`group`: rank, world) each scores its part of the split and `gather` brings the parts to the writer
    (a list by rank there, None elsewhere; without it, this process is alone). TensorBoard's confusion images are
    drawn at each evaluation instead (confusion_picture). Multi-label: classes.csv and pr_curves.png
    (write_multilabel), at `thresholds`. One class an image: scored with the run's test-time views
    (`augmentation`), a temperature fitted on val (recipe/calibrate.py) and each split's calibration before and after
    it (reliability.png); returns, on the writer, the temperature and the expected calibration errors (calibrated()).
    `kept`: this process's passes already made over splits on the same weights (the run's last ones), not made again."""
    rank, world = group
    stats = r.feed.stats_cpu() if r.feed.is_image else None
    passes: dict[str, Passed] = {}
    for split in r.held_out:
        loader = r.feed.test(r.feed.batch_size, rank, world, split)
        if r.multilabel:
            part = multilabel_part(r.evaluated, loader, r.amp, len(r.classes), augmentation)
            write_multilabel(lambda name, data, split=split: put(split, name, data), part, r.classes, split, thresholds)
            continue
        part = (kept or {}).get(split) or per_sample(r.evaluated, loader, r.amp, stats, augmentation)
        parts = gather(part) if gather is not None else [part]
        if parts is not None:
            passes[split] = merged(parts)
            write(lambda name, data, split=split: put(split, name, data), passes[split], split, r.classes)
    return calibrated(passes, put) if passes else None


def calibrated(passes: dict[str, Passed], put: Callable[[str, str, bytes], None]) -> dict[str, float]:
    """The temperature fitted on val's logits (1 without a val split, on one too small to fit on, or where it would
    not lower val's calibration error: calibrate.calibrating_temperature), and each split's expected calibration
    error before and after it, with its reliability diagram; the val split's samples and wrong ones, as the rule
    judged them."""
    from job.recipe import calibrate

    def counted(s: Passed) -> tuple[torch.Tensor, torch.Tensor]:
        keep = s.labels != IGNORED
        return s.logits[keep], s.labels[keep]

    t, out = 1.0, {}
    if "val" in passes:
        logits, labels = counted(passes["val"])
        t = calibrate.calibrating_temperature(logits, labels)
        wrong = int((logits.argmax(1) != labels).sum()) if len(labels) else 0
        out = {"val_calibration_samples": len(labels), "val_calibration_wrong": wrong}  # what the rule judged
    out["temperature"] = t
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
    sums: torch.Tensor  # the pass as evaluate.test_sums counts it, with top-5 and the confusion (scores.count)

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
    top_loss = top_at = top_x = sums = None
    seen = 0
    for batch in loader.batches():
        if not batch.own:  # padding: this process's samples have run out
            continue
        with amp():
            out = viewed_logits(model, batch.x, augmentation).float()
        if sums is None:
            sums = torch.zeros(4 + out.shape[1] ** 2, device=out.device)
        scores.count(sums, out, batch.y, out.shape[1])
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
    sums = sums if sums is not None else torch.zeros(4, device=loader.device)  # no sample: a part of nothing
    return Passed(*held, torch.cat(outs) if outs else torch.zeros(0, 0), names, worst, drawn, sums)


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
    sums = [p.sums.cpu() for p in parts if len(p.sums) > 4] or [parts[0].sums.cpu()]
    return Passed(*joined, [n for p in parts for n in p.names], worst[order], pictures, sum(sums))


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
    from job.group import distributed
    from job.recipe.multilabel import multilabel_outputs

    _, probs, ys = multilabel_outputs(model, loader, amp, classes, augmentation)
    return distributed.gather_objects((probs.cpu().numpy(), ys.cpu().numpy()))


def write_multilabel(
    put: Callable[[str, bytes], None], parts: list, classes: list[str], split: str, thresholds: list[float] | None
) -> None:
    """A multi-label split's report from its (probabilities, targets) parts: classes.csv (class, ap, threshold,
    precision, recall, f1, support: lowest AP first) at `thresholds` (default: the split's best-F1 ones), and
    pr_curves.png, each class's precision-recall curve. The writer (rank 0) writes."""
    from job.group import distributed
    from job.recipe import multilabel

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
    from job.recipe.multilabel import curves
    from job.sinks import pictures

    shown = sorted(range(len(classes)), key=lambda i: ap[i])[:20]
    lines = []
    for i in shown:
        recall, precision = curves(y[:, i], p[:, i])
        lines.append((f"{classes[i]} (AP {ap[i]:.3f})", [float(v) for v in recall], [float(v) for v in precision]))
    title = f"{split}: precision-recall by class" + (f" (20 lowest AP of {len(classes)})" if len(classes) > 20 else "")
    chart = pictures.chart(
        lines,
        title,
        "recall",
        "precision",
        ylim=(0, 1.02),
        xlim=(0, 1),
        steps=True,
        size=(520, 420),
        legend="lower left",
    )
    return pictures.png(chart)


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


def shown_confusion(confusion: torch.Tensor, classes: list[str]) -> tuple[torch.Tensor, torch.Tensor, list[str], str]:
    """What the confusion pictures draw: the counts among the most confused classes (of all, up to SHOWN), the same
    normalised by row, their names, and the words saying they are some of many ('' for all)."""
    keep = most_confused_classes(confusion, SHOWN)
    counts = confusion[keep][:, keep].double()
    some = f" ({len(keep)} most confused of {len(classes)} classes)" if len(keep) < len(classes) else ""
    return counts, counts / counts.sum(1, keepdim=True).clamp(min=1), [classes[i][:24] for i in keep], some


def confusion_png(confusion: torch.Tensor, classes: list[str], split: str) -> bytes:
    """Two panels, raw counts and normalised by row, of the most confused classes (of all, up to SHOWN)."""
    from job.sinks import pictures

    counts, rows, names, some = shown_confusion(confusion, classes)
    left = pictures.matrix(counts.numpy(), names, f"{split}: counts{some}", "{:.0f}")
    right = pictures.matrix(rows.numpy(), names, f"{split}: normalised by row{some}", "{:.2f}", 1.0)
    return pictures.png(pictures.side_by_side([left, right], gap=16))


def confusion_picture(confusion: torch.Tensor, classes: list[str], split: str) -> torch.Tensor:
    """The confusion matrix normalised by row as an HWC uint8 picture, class names on its axes (the SHOWN most
    confused of many), for TensorBoard at each evaluation."""
    import numpy as np

    from job.sinks import pictures

    _, rows, names, some = shown_confusion(confusion, classes)
    img = pictures.matrix(rows.numpy(), names, f"{split}: confusion, normalised by row{some}", "{:.2f}", 1.0)
    return torch.from_numpy(np.asarray(img).copy())


def worst_png(images: torch.Tensor, rows: list) -> bytes:
    """A grid of the worst images, each titled true -> predicted (probability), its file name beneath."""
    from job.sinks import pictures

    titles = [f"{true} -> {predicted} ({p:.2f})" for _, true, predicted, p, _ in rows]
    names = [str(path).rsplit("/", 1)[-1][-28:] for path, *_ in rows]
    return pictures.png(pictures.grid(images[: len(rows)].permute(0, 2, 3, 1).numpy(), titles, names))
