"""Where a classifier fails, from its confusion matrix (rows: the true class, columns: the predicted one): each
class's precision, recall, F1 and support, their macro and weighted averages, the weakest classes, and whether the
model predicts one class for everything. Pure arithmetic on a small matrix, on the host, once an evaluation; and
the one counting of a pass's batches into the sums the matrix comes from (count), on the device."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from job.data.batches import IGNORED


def count(sums: torch.Tensor, out: torch.Tensor, y: torch.Tensor, classes: int = 0) -> None:
    """Add a batch's [summed loss, correct, counted] to `sums` and, with `classes` (their number), [top-5 correct,
    the classes x classes confusion matrix (row: true class)] after them, on the device without the host waiting.
    Samples labelled IGNORED are never counted. Every pass that scores a split counts through here (evaluate's
    test_sums, and diagnostics.per_sample for the end's report), so their totals agree to the bit."""
    predicted, counted = out.argmax(1), y != IGNORED
    sums[0] += F.cross_entropy(out.float(), y, reduction="sum", ignore_index=IGNORED)
    sums[1] += (predicted == y).sum()
    sums[2] += counted.sum()
    if classes:
        k = min(5, out.shape[1])
        sums[3] += (out.topk(k, dim=1).indices == y[:, None]).any(1).sum()
        confusion_add(sums[4:], y.clamp(min=0) * classes + predicted, counted)


def confusion_add(cells: torch.Tensor, at: torch.Tensor, counted: torch.Tensor) -> None:
    """Add one to `cells` at each index of `at` where `counted`. On a GPU without the host waiting: a bincount reads
    the indices' range on the host, and leaving out the uncounted by a mask waits for their number; an index_add_ of
    0 or 1 does neither, and its sums are whole numbers, so exact in any order (in deterministic mode, which warns
    of index_add_ on a GPU, and on a CPU: the bincount)."""
    if at.is_cuda and not torch.are_deterministic_algorithms_enabled():
        cells.index_add_(0, at, counted.to(cells.dtype))
    else:
        cells += torch.bincount(at[counted], minlength=len(cells))[: len(cells)]


def per_class(confusion: torch.Tensor) -> dict[str, torch.Tensor]:
    """precision, recall, f1, support per class (0 where undefined: no predictions, or no samples, of it)."""
    c = confusion.double()
    hits, predicted, support = c.diag(), c.sum(0), c.sum(1)
    precision = torch.where(predicted > 0, hits / predicted.clamp(min=1), torch.zeros_like(hits))
    recall = torch.where(support > 0, hits / support.clamp(min=1), torch.zeros_like(hits))
    both = precision + recall
    f1 = torch.where(both > 0, 2 * precision * recall / both.clamp(min=1e-12), torch.zeros_like(hits))
    return {"precision": precision, "recall": recall, "f1": f1, "support": support}


def averages(confusion: torch.Tensor) -> dict[str, float]:
    """macro (each class alike) and weighted (by support) precision, recall and F1, over the classes with samples."""
    s = per_class(confusion)
    present = s["support"] > 0
    weights = s["support"] / s["support"].sum().clamp(min=1)
    out = {}
    for name in ("precision", "recall", "f1"):
        out[f"macro_{name}"] = float(s[name][present].mean()) if present.any() else 0.0
        out[f"weighted_{name}"] = float((s[name] * weights).sum())
    return out


def weakest(confusion: torch.Tensor, classes: list[str], n: int = 3) -> list[tuple[str, float]]:
    """The n classes with samples of the lowest F1, lowest first."""
    s = per_class(confusion)
    present = [i for i in range(len(classes)) if s["support"][i] > 0]
    order = sorted(present, key=lambda i: (float(s["f1"][i]), i))
    return [(classes[i], float(s["f1"][i])) for i in order[:n]]


def table(confusion: torch.Tensor, classes: list[str], most: int = 50) -> str:
    """Per-class precision, recall, F1 and support as a Markdown table, weakest F1 first (at most `most` rows: a
    thousand classes stay readable; the weakest are the ones to see)."""
    s = per_class(confusion)
    order = sorted(range(len(classes)), key=lambda i: (float(s["f1"][i]), i))[:most]
    rows = ["| class | precision | recall | f1 | support |", "| --- | --- | --- | --- | --- |"]
    for i in order:
        p, r, f, n = (float(s[k][i]) for k in ("precision", "recall", "f1", "support"))
        rows.append(f"| {classes[i]} | {p:.3f} | {r:.3f} | {f:.3f} | {int(n)} |")
    return "\n".join(rows)


def one_class(confusion: torch.Tensor) -> int | None:
    """The class the model predicts for every sample, when it predicts only one (of two or more) over samples of two
    classes or more, else None."""
    predicted, present = confusion.sum(0), int((confusion.sum(1) > 0).sum())
    used = (predicted > 0).nonzero().flatten()
    # Over samples of one class alone, saying one class is being right, not telling none apart.
    if len(confusion) > 1 and len(used) == 1 and confusion.sum() > 1 and present > 1:
        return int(used[0])
    return None
