"""Batches made by indexing tensors held in memory, with augmentation done for the whole batch on the device.

There is no per-item Python work and no worker process: a batch is one gather from the held tensor
(on the training device when it fits, so nothing crosses the bus), then crop, flip and scaling as a few
batched tensor ops. The epoch's order and augmentation draws come from a generator seeded by (seed, epoch),
so any step of any epoch can be reproduced, which is what exact resume needs.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from job.data.augment import (
    Policy,
    View,
    alternate_flips,
    apply_policy,
    crop_flip,
    draw_policy,
    draws,
    epoch_seed,
    erase,
    placed,
    to_float,
)
from job.data.batches import Batch, move
from job.data.dataset import Split


class BatchLoader:
    """Batches of one split on `device`; the split itself is held on `held_on` (the device or the host). The loader
    contract (job/data/batches.py): its place in an epoch is a function of the step alone."""

    def __init__(
        self,
        split: Split,
        batch_size: int,
        device: torch.device,
        held_on: torch.device,
        *,
        seed: int = 0,
        shuffle: bool = False,
        drop_last: bool = False,
        crop_padding: int = 0,
        reflect: bool = False,
        hflip: bool | str = False,
        mean: torch.Tensor | None = None,
        std: torch.Tensor | None = None,
        shard: tuple[int, int] = (0, 1),
        channels_last: bool = False,
        view: View | None = None,
        resized_crops: bool = False,
        policy: Policy = Policy(),
    ) -> None:
        self.device, self.held_on = device, held_on
        self.view, self.resized_crops = view, resized_crops  # images viewed at the model's size; random crops
        self.policy = policy  # data.augment
        self.rank, self.world = shard  # this process takes its slice of every batch (data-parallel training)
        self.x, self.y = split.x.to(held_on), split.y.to(held_on)
        self.n = len(split)
        self.kept: Batch | None = None  # an epoch's one batch when it is the split as held (a table's, full batch)
        # What an unshuffled pass's batches name (a report): each sample's file, else its place in the split.
        self.names = None if shuffle else split.names or [str(i) for i in range(self.n)]
        self.batch_size = min(batch_size, self.n)
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.crop_padding, self.reflect, self.hflip = crop_padding, reflect, hflip  # hflip: True, False or "alternate"
        self.is_image = self.x.dtype == torch.uint8
        self.layout = torch.channels_last if channels_last and self.is_image else torch.contiguous_format
        self.mean = mean.to(device).view(1, -1, 1, 1) if mean is not None else None
        self.std = std.to(device).view(1, -1, 1, 1) if std is not None else None

    def __len__(self) -> int:
        full, rest = divmod(self.n, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def position(self) -> dict:
        return {}  # the epoch's order and draws follow from (seed, epoch): the step says where it stands

    def resume_at(self, epoch: int, step: int, places: list[dict]) -> None:
        """Nothing to restore: batches(epoch, step) is where the run stood, with any number of processes."""

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator[Batch]:
        """The epoch's batches from step `start` on, on the training device."""
        if self.kept is not None and start == 0:
            yield self.kept  # the whole split as it is held, every epoch's one batch: made once (Iris: 8 us a step)
            return
        order, crops, flips, boxes, drawn = self.draws(epoch)
        for i in range(start, len(self)):
            lo, hi = self.slice(i)
            if order is None:
                whole = hi - lo == self.n
                x, y = (self.x, self.y) if whole else (self.x[lo:hi], self.y[lo:hi])
            else:
                idx = order[lo:hi]
                x, y = self.x[idx], self.y[idx]
            x, y = move(x, self.device), move(y, self.device)  # host-held: through page-locked memory
            if crops is not None or flips is not None:
                x = crop_flip(
                    x,
                    self.crop_padding,
                    crops[lo:hi] if crops is not None else None,
                    flips[lo:hi] if flips is not None else None,
                    self.reflect,
                )
            part = drawn.part(lo, hi) if drawn is not None else None
            x = apply_policy(x, part, move)
            x = erase(self.scale(x, boxes[lo:hi] if boxes is not None else None), part)
            named = tuple(self.names[lo:hi]) if self.names else ()
            batch = Batch(x, y, self.loss_weight(i), self.samples(i), hi - lo, named)
            if len(self) == 1 and x is self.x and y is self.y and part is None:  # nothing drawn, copied or converted
                self.kept = batch
            yield batch

    def samples(self, i: int) -> int:
        """Samples in batch i over all processes."""
        return min(self.n, (i + 1) * self.batch_size) - i * self.batch_size

    def slice(self, i: int) -> tuple[int, int]:
        """Where batch i lies in the epoch's order; in a group of processes, this process's contiguous part of it.
        Every process draws the same order, so the parts cover each global batch once, without communication."""
        lo, hi = i * self.batch_size, min(self.n, (i + 1) * self.batch_size)
        size = hi - lo
        return lo + size * self.rank // self.world, lo + size * (self.rank + 1) // self.world

    def loss_weight(self, i: int) -> float:
        """What this process's mean loss on batch i is multiplied by so that the average DDP takes over the
        processes is the mean over the global batch: its share of the batch times the number of processes.
        1.0 whenever the batch splits evenly (and for one process)."""
        if self.world == 1:
            return 1.0
        lo, hi = self.slice(i)
        return (hi - lo) * self.world / self.samples(i)

    def draws(self, epoch: int) -> tuple[torch.Tensor | None, ...]:
        """The epoch's order, crop offsets, flips, resized-crop boxes and data.augment's draws, drawn on the CPU
        from (seed, epoch), placed once per epoch."""
        shuffle = self.shuffle and len(self) > 1  # one batch holding every sample: its order changes nothing
        if not (shuffle or self.crop_padding or self.hflip or self.resized_crops or self.policy):
            return None, None, None, None, None
        g = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        order = torch.randperm(self.n, generator=g) if shuffle else None

        def alternate() -> torch.Tensor:  # drawn per image: taken in the epoch's order
            flips = alternate_flips(self.n, self.seed, epoch)
            return flips[order] if order is not None else flips

        size = tuple(self.x.shape[-2:])
        crops, flips, boxes = draws(
            g, self.n, size, self.crop_padding, self.hflip, self.view, self.resized_crops, alternate
        )
        drawn = placed(draw_policy(self.policy, g, self.n, size, self.view), self.device, move)
        on_device = [move(t, self.device) if t is not None else None for t in (crops, flips, boxes)]
        return move(order, self.held_on) if order is not None else None, *on_device, drawn

    def scale(self, x: torch.Tensor, boxes: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 images to float in [0, 1] (through the view), then normalised; tables pass through."""
        return to_float(x, self.layout, self.mean, self.std, self.view, boxes) if self.is_image else x
