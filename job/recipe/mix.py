"""train.mixup and train.cutmix: each training batch mixed with itself reversed, as timm's Mixup does in its batch
mode, on the training device; the labels become the mixed one-hot targets the loss takes as probabilities.

The draws are our own, not torchvision.transforms.v2.MixUp/CutMix's: those draw from torch's global generator
(a Beta distribution's sample and torch.rand), which no seed of the run's can hold apart. Here each batch's draws come
from numpy's generator seeded by (seed, epoch, step), so a resumed run mixes exactly as the uninterrupted one did, and
they are Python numbers on the host: the device is never waited for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from job.data.augment import epoch_seed
from job.data.batches import IGNORED


@dataclass(frozen=True)
class Mix:
    """MixUp (Beta(mixup, mixup) blend of whole images) and CutMix (a box of the reversed batch pasted in, the
    targets weighed by its area), on a batch with `probability`; with both on, CutMix a `switch` share of the time."""

    classes: int
    seed: int
    mixup: float = 0.0
    cutmix: float = 0.0
    probability: float = 1.0
    switch: float = 0.5

    def __call__(self, x: torch.Tensor, y: torch.Tensor, epoch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Images and their targets as probabilities (N x classes; a sample whose label is IGNORED, and its partner in a
        mix: zeros, which the loss does not count). Multi-label
        targets (N x classes, 0/1; below 0: a sample that could not be decoded) are mixed alike, each class's weight
        the share of the image that shows it; a mix with an undecoded sample counts for nothing (below 0)."""
        rng = np.random.default_rng([epoch_seed(self.seed, epoch), step, 0x4D4958])  # "MIX": apart from the data's
        if y.dim() == 2:
            targets = y.to(torch.float32)
            mixed, lam = self.mix(x, rng)
            lost = (targets < 0).any(1)
            out = targets.clamp(min=0) * lam + targets.clamp(min=0).flip(0) * (1 - lam)
            return mixed, out.masked_fill((lost | lost.flip(0))[:, None], -1.0) if lam < 1 else targets
        targets = F.one_hot(y.clamp(min=0), self.classes).to(torch.float32) * (y != IGNORED)[:, None]
        mixed, lam = self.mix(x, rng)
        if lam == 1:
            return mixed, targets
        lost = y == IGNORED  # a mix with an undecoded sample (zeros for an image) counts for nothing, as multi-label's
        out = targets * lam + targets.flip(0) * (1 - lam)
        return mixed, out.masked_fill((lost | lost.flip(0))[:, None], 0.0)

    def mix(self, x: torch.Tensor, rng: np.random.Generator) -> tuple[torch.Tensor, float]:
        """The batch mixed with its reverse, and the share of each image that is still its own (1: not mixed)."""
        if rng.random() >= self.probability or x.shape[0] < 2:
            return x, 1.0
        cut = self.cutmix > 0 and (self.mixup == 0 or rng.random() < self.switch)
        lam = float(rng.beta(*(2 * [self.cutmix if cut else self.mixup])))
        other = x.flip(0)
        if cut:
            h, w = x.shape[-2:]
            ch, cw = int(h * math.sqrt(1 - lam)), int(w * math.sqrt(1 - lam))
            cy, cx = int(rng.integers(h)), int(rng.integers(w))
            y0, y1 = max(cy - ch // 2, 0), min(cy + ch // 2, h)
            x0, x1 = max(cx - cw // 2, 0), min(cx + cw // 2, w)
            x = x.clone()
            x[..., y0:y1, x0:x1] = other[..., y0:y1, x0:x1]
            lam = 1 - (y1 - y0) * (x1 - x0) / (h * w)  # the share of the image that is still its own
        else:
            x = x * lam + other * (1 - lam)
        return x, lam
