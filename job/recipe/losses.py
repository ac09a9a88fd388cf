"""The training losses a recipe takes besides plain cross-entropy: samples that count, class weights, multi-label."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from job.data.dataset import Dataset
from job.data.stream import StreamData
from job.errors import ConfigError


class CountedLoss:
    """Cross-entropy averaged over the batch's samples that count: a streamed sample that could not be decoded is
    labelled IGNORED and left out, and a batch of none of them gives 0, not torch's NaN. `weight`: each class's
    weight on its samples' losses (Keras's class_weight; torch's weight= divides by the batch's summed weights
    instead, which a batch split over processes would not reproduce)."""

    def __init__(self, weight: torch.Tensor | None, smoothing: float = 0.0) -> None:
        self.weight, self.smoothing = weight, smoothing

    def __call__(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y`: class indexes, or (train.mixup, train.cutmix) probabilities per class, whose weight is the classes'
        weights mixed alike, and which count where they hold any class (a row of zeros: IGNORED samples)."""
        losses = F.cross_entropy(logits, y, reduction="none", label_smoothing=self.smoothing)
        soft = y.is_floating_point()
        counted = y.sum(1) > 0 if soft else y >= 0
        if self.weight is not None:
            losses = losses * (y @ self.weight if soft else self.weight[y.clamp(min=0)])
        return (losses * counted).sum() / counted.sum().clamp(min=1)


class MultiLabelLoss:
    """Multi-label: binary cross-entropy of each class's sigmoid against its 0/1 target (BCEWithLogitsLoss), the mean
    over the classes and the samples that count (a streamed sample that could not be decoded has targets below 0).
    `pos_weight`: each class's weight on its positives (train.class_weights=balanced)."""

    def __init__(self, pos_weight: torch.Tensor | None) -> None:
        self.pos_weight = pos_weight

    def __call__(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        counted = (y >= 0).all(1)
        losses = F.binary_cross_entropy_with_logits(
            logits.float(), y.clamp(min=0), pos_weight=self.pos_weight, reduction="none"
        ).mean(1)
        return (losses * counted).sum() / counted.sum().clamp(min=1)


def positive_weights(data: Dataset | StreamData) -> torch.Tensor:
    """train.class_weights balanced, multi-label: each class's negatives / positives among the training samples, as
    BCEWithLogitsLoss's pos_weight (1 for a class with none)."""
    if isinstance(data, StreamData):
        if data.inventory is None:
            raise ConfigError("train.class_weights=balanced: these shards do not record their class counts")
        inv = data.inventory
        positives = torch.tensor([float(inv.counts["train"].get(c, 0)) for c in data.classes])
        n = float(inv.total("train"))
    else:
        positives, n = data.train.y.cpu().double().sum(0), float(len(data.train))
    return torch.where(positives > 0, (n - positives) / positives.clamp(min=1), torch.ones_like(positives)).float()


def balanced_weights(data: Dataset | StreamData) -> torch.Tensor:
    """train.class_weights balanced: n_samples / (n_classes x the class's samples), as scikit-learn's
    compute_class_weight('balanced'); 0 for a class with no training samples."""
    k = len(data.classes)
    if isinstance(data, StreamData):
        if data.inventory is None:
            raise ConfigError(
                "train.class_weights=balanced: these shards do not record their class counts (shards packed by "
                "`python -m job shard` do)"
            )
        per = data.inventory.counts["train"]
        counts = torch.tensor([float(per.get(c, 0)) for c in data.classes])
    else:
        counts = torch.bincount(data.train.y.cpu(), minlength=k).double()
    weights = torch.where(counts > 0, counts.sum() / (k * counts.clamp(min=1)), torch.zeros_like(counts))
    return weights.float()
