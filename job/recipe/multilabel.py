"""Multi-label scores from each image's class probabilities (sigmoids) and its 0/1 targets: average precision per
class as scikit-learn's average_precision_score computes it, its macro mean (mAP) over the classes with positives,
each class's threshold chosen for its best F1, and at those thresholds precision, recall and F1 per class, micro and
macro F1, and the share of images whose whole label set is right. Computed on the host, in float64, once an
evaluation has brought the split's probabilities there (its one host sync)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from job.data.augment import viewed_logits
from job.data.batches import Loader
from job.recorded import split_scores


def ranked(y: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One class's scores from the highest: each distinct score, and the true and false positives at or above it
    (scikit-learn's _binary_clf_curve)."""
    if not len(p):
        return p, y, y
    order = np.argsort(-p, kind="mergesort")
    p, y = p[order], y[order]
    last = np.r_[np.flatnonzero(np.diff(p)), len(p) - 1]  # the last sample of each distinct score
    tps = np.cumsum(y)[last]
    return p[last], tps, last + 1 - tps


def average_precision(y: np.ndarray, p: np.ndarray) -> float:
    """Sum over the distinct scores, from the highest, of (recall gained) x precision there: scikit-learn's
    average_precision_score (0 for a class with no positives)."""
    _, tps, fps = ranked(y.astype(np.float64), p.astype(np.float64))
    if not len(tps) or tps[-1] == 0:
        return 0.0
    precision, recall = tps / (tps + fps), tps / tps[-1]
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def best_threshold(y: np.ndarray, p: np.ndarray) -> float:
    """The threshold (a class is predicted where its probability is above it) of the best F1: halfway between the
    score of the best cut and the next lower score, so that probabilities a little off (another batch, another
    runtime) fall on the same side. No positives: above every score."""
    scores, tps, fps = ranked(y.astype(np.float64), p.astype(np.float64))
    positives = tps[-1] if len(tps) else 0
    if not positives:
        return float((max(scores, default=0.0) + 1.0) / 2)
    f1 = 2 * tps / (tps + fps + positives)
    k = int(np.argmax(f1))  # the first of the best: the highest cut
    below = scores[k + 1] if k + 1 < len(scores) else 0.0
    return float((scores[k] + below) / 2)


@dataclass
class MultiScored:
    """An evaluation of a multi-label model over the whole group. `accuracy` is the mAP: what the run chooses on
    (job/run/choose.py)."""

    loss: float
    ap: list[float]
    thresholds: list[float]
    precision: list[float]
    recall: list[float]
    f1: list[float]
    support: list[int]
    micro_f1: float
    macro_f1: float
    exact_match: float
    extra: list[float] = field(default_factory=list)
    confusion = None  # multi-label has no confusion matrix

    @property
    def accuracy(self) -> float:
        """The mAP: the macro mean of AP over the classes with positives."""
        kept = [a for a, n in zip(self.ap, self.support) if n]
        return float(np.mean(kept)) if kept else 0.0

    def record(self, on: str) -> dict:
        """metrics.jsonl's fields of it."""
        values = {"map": self.accuracy, "loss": self.loss, "micro_f1": self.micro_f1, "macro_f1": self.macro_f1}
        values["exact_match"] = self.exact_match
        return {f"{on}_{k}": values[k] for k in split_scores(True, len(self.ap))}

    def table(self, classes: list[str]) -> list[tuple]:
        """(class, ap, threshold, precision, recall, f1, support) of each class, in class order."""
        return list(zip(classes, self.ap, self.thresholds, self.precision, self.recall, self.f1, self.support))


def scored(
    y: np.ndarray, p: np.ndarray, loss: float, thresholds: list[float] | None = None, extra: list[float] | None = None
) -> MultiScored:
    """The scores of probabilities `p` against 0/1 targets `y` (both N x classes); `thresholds`: those to score at
    (default: each class's best-F1 one on this split)."""
    y, p = y.astype(np.float64), p.astype(np.float64)
    k = y.shape[1]
    ap = [average_precision(y[:, i], p[:, i]) for i in range(k)]
    t = list(thresholds) if thresholds is not None else [best_threshold(y[:, i], p[:, i]) for i in range(k)]
    pred = p > np.asarray(t)[None, :]
    tp, fp, fn = ((pred & (y == 1)).sum(0), (pred & (y == 0)).sum(0), (~pred & (y == 1)).sum(0))
    precision = tp / np.maximum(tp + fp, 1)
    recall = tp / np.maximum(tp + fn, 1)
    f1 = 2 * tp / np.maximum(2 * tp + fp + fn, 1)
    micro = 2 * tp.sum() / max(2 * tp.sum() + fp.sum() + fn.sum(), 1)
    exact = float((pred == (y == 1)).all(1).mean()) if len(y) else 0.0
    return MultiScored(
        loss,
        ap,
        t,
        precision.tolist(),
        recall.tolist(),
        f1.tolist(),
        y.sum(0).astype(int).tolist(),
        float(micro),
        float(f1.mean()) if k else 0.0,
        exact,
        list(extra or []),
    )


def joined(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """(targets, probabilities) of every process's (probabilities, targets), the samples that count only (a streamed
    sample that could not be decoded has targets below 0)."""
    p = np.concatenate([a for a, _ in parts])
    y = np.concatenate([b for _, b in parts])
    kept = (y >= 0).all(1)
    return y[kept], p[kept]


def curves(y: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One class's precision-recall curve (recall, precision), from the highest score down."""
    _, tps, fps = ranked(y.astype(np.float64), p.astype(np.float64))
    if not len(tps) or tps[-1] == 0:
        return np.zeros(1), np.ones(1)
    return np.r_[0.0, tps / tps[-1]], np.r_[1.0, tps / (tps + fps)]


@torch.no_grad()
def multilabel_outputs(
    model, loader: Loader, amp, classes: int, augmentation: str = "none"
) -> tuple[torch.Tensor, ...]:
    """Multi-label: [summed loss, samples counted] over this process's samples of the split, and every sample's class
    probabilities (sigmoids) and targets, all left on the device: rows are kept whether they count or not (a mask
    would make the host wait for their number) and the uncounted (targets below 0) are dropped on the host."""
    model.eval()
    sums = torch.zeros(2, device=loader.device)
    probs, ys = [], []
    for batch in loader.batches():
        if not batch.own:
            continue
        with amp():
            out = viewed_logits(model, batch.x, augmentation).float()
        counted = (batch.y >= 0).all(1)
        losses = F.binary_cross_entropy_with_logits(out, batch.y.clamp(min=0), reduction="none").mean(1)
        sums[0] += (losses * counted).sum()
        sums[1] += counted.sum()
        probs.append(torch.sigmoid(out))
        ys.append(batch.y)
    model.train()
    if not probs:
        return sums, torch.zeros(0, classes), torch.zeros(0, classes)
    return sums, torch.cat(probs), torch.cat(ys)
