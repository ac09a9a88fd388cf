"""Batches made by indexing tensors held in memory, with augmentation done for the whole batch on the device.

There is no per-item Python work and no worker process: a batch is one gather from the held tensor
(on the training device when it fits, so nothing crosses the bus), then crop, flip and scaling as a few
batched tensor ops. The epoch's order and augmentation draws come from a generator seeded by (seed, epoch),
so any step of any epoch can be reproduced, which is what exact resume needs.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from job.data import Split


class BatchLoader:
    """Batches of one split on `device`; the split itself is held on `held_on` (the device or the host)."""

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
        hflip: bool = False,
        mean: torch.Tensor | None = None,
        std: torch.Tensor | None = None,
        shard: tuple[int, int] = (0, 1),
        channels_last: bool = False,
    ) -> None:
        self.device, self.held_on = device, held_on
        self.rank, self.world = shard  # this process takes its slice of every batch (data-parallel training)
        # Host-held batches are gathered into page-locked memory so their copy to the GPU is asynchronous.
        self.pin = held_on.type == "cpu" and device.type == "cuda"
        self.x, self.y = split.x.to(held_on), split.y.to(held_on)
        self.n = len(split)
        self.batch_size = min(batch_size, self.n)
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.crop_padding, self.hflip = crop_padding, hflip
        self.is_image = self.x.dtype == torch.uint8
        self.layout = torch.channels_last if channels_last and self.is_image else torch.contiguous_format
        self.mean = mean.to(device).view(1, -1, 1, 1) if mean is not None else None
        self.std = std.to(device).view(1, -1, 1, 1) if std is not None else None

    def __len__(self) -> int:
        full, rest = divmod(self.n, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The epoch's batches from step `start` on, as (inputs, labels) on the training device."""
        order, crops, flips = self.draws(epoch)
        for i in range(start, len(self)):
            lo, hi = self.slice(i)
            if order is None:
                x, y = self.x[lo:hi], self.y[lo:hi]
            else:
                idx = order[lo:hi]
                x, y = self.x[idx], self.y[idx]
            if self.pin:
                x, y = x.pin_memory(), y.pin_memory()
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            if crops is not None or flips is not None:
                x = crop_flip(
                    x,
                    self.crop_padding,
                    crops[lo:hi] if crops is not None else None,
                    flips[lo:hi] if flips is not None else None,
                )
            yield self.scale(x), y

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
        size = min(self.n, (i + 1) * self.batch_size) - i * self.batch_size
        return (hi - lo) * self.world / size

    def draws(self, epoch: int) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The epoch's order, crop offsets and flips, drawn on the CPU from (seed, epoch), placed once per epoch."""
        shuffle = self.shuffle and len(self) > 1  # one batch holding every sample: its order changes nothing
        if not (shuffle or self.crop_padding or self.hflip):
            return None, None, None
        g = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        order = torch.randperm(self.n, generator=g) if shuffle else None
        crops = torch.randint(0, 2 * self.crop_padding + 1, (self.n, 2), generator=g) if self.crop_padding else None
        flips = torch.rand(self.n, generator=g) < 0.5 if self.hflip else None
        return self.place(order, self.held_on), self.place(crops, self.device), self.place(flips, self.device)

    def place(self, t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
        """Move a CPU tensor without making the host wait (through page-locked memory for a GPU)."""
        if t is None or device.type == "cpu":
            return t
        return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 images to float in [0, 1], then normalised; tables pass through."""
        return to_float(x, self.layout, self.mean, self.std) if self.is_image else x


def to_float(
    x: torch.Tensor, layout: torch.memory_format, mean: torch.Tensor | None, std: torch.Tensor | None
) -> torch.Tensor:
    """uint8 images to float in [0, 1] in the model's memory layout, normalised when given the statistics."""
    x = x.to(torch.float32, memory_format=layout).div_(255)
    if mean is not None:
        x = x.sub_(mean).div_(std)
    return x


def crop_flip(x: torch.Tensor, padding: int, crops: torch.Tensor | None, flips: torch.Tensor | None) -> torch.Tensor:
    """Per-image random crop of a zero-padded batch and horizontal flip, as one gather.

    The same as torchvision's RandomCrop(size, padding) and RandomHorizontalFlip(0.5) applied per image,
    without a Python loop over images.
    """
    b, c, h, w = x.shape
    if padding:
        x = F.pad(x, (padding, padding, padding, padding))
    rows = torch.arange(h, device=x.device).expand(b, h)
    cols = torch.arange(w, device=x.device).expand(b, w)
    if crops is not None:
        rows = rows + crops[:, :1]
        cols = cols + crops[:, 1:]
    if flips is not None:
        cols = torch.where(flips[:, None], cols.flip(1), cols)
    bi = torch.arange(b, device=x.device)[:, None, None, None]
    ci = torch.arange(c, device=x.device)[None, :, None, None]
    return x[bi, ci, rows[:, None, :, None], cols[:, None, None, :]]


def epoch_seed(seed: int, epoch: int) -> int:
    """The data-order seed of one epoch: independent of every other RNG in the run."""
    return (seed * 1_000_003 + epoch) % (2**63)


def channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and std of uint8 images, in the [0, 1] scale, computed in chunks."""
    total = torch.zeros(x.shape[1], dtype=torch.float64)
    squares = torch.zeros(x.shape[1], dtype=torch.float64)
    for chunk in x.split(4096):
        f = chunk.to(torch.float64).div_(255)
        total += f.sum((0, 2, 3))
        squares += f.square().sum((0, 2, 3))
    count = x.shape[0] * x.shape[2] * x.shape[3]
    mean = total / count
    std = (squares / count - mean.square()).clamp_min(1e-12).sqrt()
    return mean.float(), std.float()


def choose_placement(
    nbytes: int, device: torch.device, placement: str, share: float, cap: float | None = None
) -> torch.device:
    """Where the data is held: on the training device when asked or when it fits in `share` of free memory (of
    at most `cap` bytes, where the process is held to less than the device has)."""
    if device.type == "cpu" or placement == "host":
        return torch.device("cpu")
    if placement == "device":
        return device
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        free = min(free, cap) if cap is not None else free
        return device if nbytes <= share * free else torch.device("cpu")
    return device
