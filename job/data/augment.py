"""What both loaders do to a batch on the device, in one place so they cannot drift: crops and flips for the whole
batch as one gather, the view that resizes held images to the model's input, uint8 to normalised float, and the
per-epoch seed their draws come from."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from job.data.preprocess import centre_box


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
        import torchvision  # noqa: F401  (registers torch.ops.torchvision)

        n, _, h, w = x.shape
        if boxes is None:
            if self.centre == 1.0 and (h, w) == (self.size, self.size):
                return x
            # At whole pixels, as every reader's preprocessing cuts it (job/data/preprocess.py): a box half a pixel
            # in would blend neighbours, which a Pillow user's crop of model.json's centre does not.
            box = centre_box(w, h, round(w * self.centre), round(h * self.centre))
            # Filled on the device: a tensor of these values made on the host is a copy the host waits for.
            boxes = torch.empty(n, 4, device=x.device)
            for i, v in enumerate(box):
                boxes[:, i] = v
        rois = torch.cat([torch.arange(n, device=x.device, dtype=boxes.dtype)[:, None], boxes], 1)
        # torchvision's operator itself: its forward is deterministic (no atomics), where torchvision.ops.roi_align
        # in deterministic mode on a GPU turns to a torch.compile'd Python version (a compile at the first batch).
        return torch.ops.torchvision.roi_align(x.contiguous(), rois, 1.0, self.size, self.size, -1, True)


def draws(
    g: torch.Generator,
    n: int,
    size: tuple[int, int],
    crop_padding: int,
    hflip: bool | str,
    view: View | None,
    resized_crops: bool,
    alternate: Callable[[], torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """n images' crop offsets, flips and resized-crop boxes (None for each not asked), drawn from g in that order:
    the one order both loaders draw in. Alternate flips come from `alternate()`: their side is a function of the
    image and the epoch's parity, not of g."""
    crops = torch.randint(0, 2 * crop_padding + 1, (n, 2), generator=g) if crop_padding else None
    flips = torch.rand(n, generator=g) < 0.5 if hflip is True else None
    flips = alternate() if hflip == "alternate" else flips
    boxes = view.draw(n, *size, g) if resized_crops else None
    return crops, flips, boxes


def alternate_flips(n: int, seed: int, epoch: int) -> torch.Tensor:
    """random_hflip alternate for n images held in memory: a draw of the run's seed (the same in every epoch),
    inverted in odd epochs."""
    first = torch.rand(n, generator=torch.Generator().manual_seed(epoch_seed(seed, -1))) < 0.5
    return first ^ bool(epoch % 2)


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
