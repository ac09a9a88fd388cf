"""Batches made by indexing tensors held in memory, with augmentation done for the whole batch on the device.

There is no per-item Python work and no worker process: a batch is one gather from the held tensor
(on the training device when it fits, so nothing crosses the bus), then crop, flip and scaling as a few
batched tensor ops. The epoch's order and augmentation draws come from a generator seeded by (seed, epoch),
so any step of any epoch can be reproduced, which is what exact resume needs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

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
        reflect: bool = False,
        hflip: bool | str = False,
        mean: torch.Tensor | None = None,
        std: torch.Tensor | None = None,
        shard: tuple[int, int] = (0, 1),
        channels_last: bool = False,
        view: View | None = None,
        resized_crops: bool = False,
    ) -> None:
        self.device, self.held_on = device, held_on
        self.view, self.resized_crops = view, resized_crops  # images viewed at the model's size; random crops
        self.rank, self.world = shard  # this process takes its slice of every batch (data-parallel training)
        # Host-held batches are gathered into page-locked memory so their copy to the GPU is asynchronous.
        self.pin = held_on.type == "cpu" and device.type == "cuda"
        self.x, self.y = split.x.to(held_on), split.y.to(held_on)
        self.n = len(split)
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

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The epoch's batches from step `start` on, as (inputs, labels) on the training device."""
        order, crops, flips, boxes = self.draws(epoch)
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
                    self.reflect,
                )
            yield self.scale(x, boxes[lo:hi] if boxes is not None else None), y

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
        """The epoch's order, crop offsets, flips and resized-crop boxes, drawn on the CPU from (seed, epoch),
        placed once per epoch."""
        shuffle = self.shuffle and len(self) > 1  # one batch holding every sample: its order changes nothing
        if not (shuffle or self.crop_padding or self.hflip or self.resized_crops):
            return None, None, None, None
        g = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        order = torch.randperm(self.n, generator=g) if shuffle else None
        crops = torch.randint(0, 2 * self.crop_padding + 1, (self.n, 2), generator=g) if self.crop_padding else None
        flips = draw_flips(self.n, g, self.hflip, self.seed, epoch)
        if self.hflip == "alternate" and order is not None:  # drawn per image: taken in the epoch's order
            flips = flips[order]
        boxes = self.view.draw(self.n, *self.x.shape[-2:], g) if self.resized_crops else None
        placed = self.place(crops, self.device), self.place(flips, self.device), self.place(boxes, self.device)
        return self.place(order, self.held_on), *placed

    def place(self, t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
        """Move a CPU tensor without making the host wait (through page-locked memory for a GPU)."""
        if t is None or device.type == "cpu":
            return t
        return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)

    def scale(self, x: torch.Tensor, boxes: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 images to float in [0, 1] (through the view), then normalised; tables pass through."""
        return to_float(x, self.layout, self.mean, self.std, self.view, boxes) if self.is_image else x


def to_float(
    x: torch.Tensor,
    layout: torch.memory_format,
    mean: torch.Tensor | None,
    std: torch.Tensor | None,
    view: View | None = None,
    boxes: torch.Tensor | None = None,
) -> torch.Tensor:
    """uint8 images to float in [0, 1] in the model's memory layout, through the view when given (its boxes, else
    its centre crop), normalised when given the statistics."""
    if view is not None:
        x = view(x.float().div_(255), boxes).contiguous(memory_format=layout)
    else:
        x = x.to(torch.float32, memory_format=layout).div_(255)
    if mean is not None:
        x = x.sub_(mean).div_(std)
    return x


@dataclass(frozen=True)
class View:
    """How held images become the model's inputs when they are not already: a box of each image resized to
    size x size, for the whole batch in one call (torchvision's roi_align, bilinear, averaging over the box where it
    shrinks). Training draws random resized crops (`scale`, `ratio`: torchvision's RandomResizedCrop); evaluation,
    and training without them, takes the centre `centre` of each side."""

    size: int
    centre: float = 1.0
    scale: tuple[float, float] | None = None
    ratio: tuple[float, float] = (3 / 4, 4 / 3)

    def draw(self, n: int, h: int, w: int, g: torch.Generator, tries: int = 10) -> torch.Tensor:
        """n random crop boxes (x0, y0, x1, y1) in an h x w image, as RandomResizedCrop draws them: up to `tries`
        area and aspect draws each, the first that fits taken, else the whole image cut to the ratio range."""
        lo, hi = self.scale
        area = h * w * (lo + (hi - lo) * torch.rand(n, tries, generator=g, dtype=torch.float64))
        logs = math.log(self.ratio[0]), math.log(self.ratio[1])
        aspect = torch.exp(logs[0] + (logs[1] - logs[0]) * torch.rand(n, tries, generator=g, dtype=torch.float64))
        cw, ch = (area * aspect).sqrt().round(), (area / aspect).sqrt().round()
        fits = (cw > 0) & (cw <= w) & (ch > 0) & (ch <= h)
        first = fits.int().argmax(1, keepdim=True)  # the first try that fits (0 when none does)
        cw, ch, any_fit = cw.gather(1, first)[:, 0], ch.gather(1, first)[:, 0], fits.any(1)
        fw, fh = float(w), float(h)  # none fits: the whole image, cut to the ratio range, centred
        if w / h < self.ratio[0]:
            fh = float(round(w / self.ratio[0]))
        elif w / h > self.ratio[1]:
            fw = float(round(h * self.ratio[1]))
        cw, ch = torch.where(any_fit, cw, fw), torch.where(any_fit, ch, fh)
        u = torch.rand(n, 2, generator=g, dtype=torch.float64)
        x0 = torch.where(any_fit, (u[:, 0] * (w - cw + 1)).floor(), ((w - cw) / 2).floor())
        y0 = torch.where(any_fit, (u[:, 1] * (h - ch + 1)).floor(), ((h - ch) / 2).floor())
        return torch.stack([x0, y0, x0 + cw, y0 + ch], 1).float()

    def __call__(self, x: torch.Tensor, boxes: torch.Tensor | None = None) -> torch.Tensor:
        """Float images N x C x H x W to N x C x size x size: the boxes given, else the centre crop."""
        from torchvision.ops import roi_align

        n, _, h, w = x.shape
        if boxes is None:
            if self.centre == 1.0 and (h, w) == (self.size, self.size):
                return x
            cw, ch = w * self.centre, h * self.centre
            box = torch.tensor([(w - cw) / 2, (h - ch) / 2, (w + cw) / 2, (h + ch) / 2], device=x.device)
            boxes = box.expand(n, 4)
        rois = torch.cat([torch.arange(n, device=x.device, dtype=boxes.dtype)[:, None], boxes], 1)
        return roi_align(x.contiguous(), rois, self.size, sampling_ratio=-1, aligned=True)


def draw_flips(n: int, g: torch.Generator, how: bool | str, seed: int, epoch: int) -> torch.Tensor | None:
    """Which of n images are flipped in this epoch: drawn from g (True); alternate: a draw of the run's seed (the
    same in every epoch), inverted in odd epochs; None when none are."""
    if how == "alternate":
        first = torch.rand(n, generator=torch.Generator().manual_seed(epoch_seed(seed, -1))) < 0.5
        return first ^ bool(epoch % 2)
    return torch.rand(n, generator=g) < 0.5 if how else None


def crop_flip(
    x: torch.Tensor,
    padding: int,
    crops: torch.Tensor | None,
    flips: torch.Tensor | None,
    reflect: bool = False,
) -> torch.Tensor:
    """Per-image random crop of a padded batch (zeros, or the image mirrored at its edges with `reflect`) and
    horizontal flip, as one gather.

    The same as torchvision's RandomCrop(size, padding, padding_mode) and RandomHorizontalFlip(0.5) applied per
    image, without a Python loop over images.
    """
    b, c, h, w = x.shape
    if padding and not reflect:
        x = F.pad(x, (padding, padding, padding, padding))
    rows = torch.arange(h, device=x.device).expand(b, h)
    cols = torch.arange(w, device=x.device).expand(b, w)
    if crops is not None:
        rows = rows + crops[:, :1]
        cols = cols + crops[:, 1:]
        if reflect:  # an index past an edge reads the pixel as far inside it, the edge itself not repeated
            rows, cols = mirror(rows - padding, h), mirror(cols - padding, w)
    if flips is not None:
        cols = torch.where(flips[:, None], cols.flip(1), cols)
    bi = torch.arange(b, device=x.device)[:, None, None, None]
    ci = torch.arange(c, device=x.device)[None, :, None, None]
    return x[bi, ci, rows[:, None, :, None], cols[:, None, None, :]]


def mirror(i: torch.Tensor, n: int) -> torch.Tensor:
    """Indices in [-n + 1, 2n - 2] reflected into [0, n - 1] about the first and last."""
    i = i.abs()
    return torch.where(i > n - 1, 2 * (n - 1) - i, i)


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
