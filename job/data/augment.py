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


@dataclass(frozen=True)
class Policy:
    """data.augment's per-image policies, with torchvision.transforms.v2's operations and magnitudes: TrivialAugment
    (TrivialAugmentWide: one operation a image, its magnitude one of 31 at random), RandAugment (its defaults: 2
    operations a image at magnitude 9 of 31) and random erasing (RandomErasing's boxes, of `erasing` probability)."""

    trivial: bool = False
    rand: bool = False
    erasing: float = 0.0

    RAND_OPS = 2  # torchvision's RandAugment defaults
    RAND_MAGNITUDE = 9
    BINS = 31

    def __bool__(self) -> bool:
        return self.trivial or self.rand or self.erasing > 0

    def spaces(self) -> list[tuple[dict, bool]]:
        """(torchvision's augmentation space, magnitude drawn) of each round of operations."""
        from torchvision.transforms import v2

        if self.trivial:
            return [(v2.TrivialAugmentWide._AUGMENTATION_SPACE, True)]
        return [(v2.RandAugment._AUGMENTATION_SPACE, False)] * (self.RAND_OPS if self.rand else 0)


@dataclass(frozen=True)
class PolicyDraws:
    """Per-image draws of a Policy: `ops` (n x rounds, on the host: the batch is grouped by operation without the
    host reading the device), their signed magnitudes and the erased boxes (y0, x0, y1, x1; empty where none), on the
    device."""

    ops: torch.Tensor
    magnitudes: torch.Tensor
    erase: torch.Tensor | None

    def part(self, lo: int, hi: int) -> PolicyDraws:
        return PolicyDraws(self.ops[lo:hi], self.magnitudes[lo:hi], None if self.erase is None else self.erase[lo:hi])


def draw_policy(
    policy: Policy, g: torch.Generator, n: int, size: tuple[int, int], view: View | None = None
) -> PolicyDraws | None:
    """n images' operations, magnitudes and erased boxes, drawn from g in that order (None when the policy is off);
    `size`: the held images' (the operations'), `view`: what makes the model's inputs of them (the boxes' size).
    As torchvision draws them per image: an operation, a magnitude bin (TrivialAugment's at random, RandAugment's
    fixed), a sign for signed ones; RandomErasing's probability, then up to 10 tries of area and aspect."""
    if not policy:
        return None
    h, w = size
    ops, magnitudes = [], []
    for space, random_bins in policy.spaces():
        names = list(space)
        table = torch.zeros(len(names), policy.BINS)
        signed = torch.zeros(len(names), dtype=torch.bool)
        for k, (magnitudes_of, is_signed) in enumerate(space.values()):
            values = magnitudes_of(policy.BINS, h, w)
            if values is not None:
                table[k], signed[k] = values.float(), is_signed
        op = torch.randint(len(names), (n,), generator=g)
        bins = torch.randint(policy.BINS, (n,), generator=g) if random_bins else torch.full((n,), policy.RAND_MAGNITUDE)
        flip = (torch.rand(n, generator=g) <= 0.5) & signed[op]
        ops.append(op)
        magnitudes.append(torch.where(flip, -table[op, bins], table[op, bins]))
    out = (view.size, view.size) if view is not None else size
    erase = erasing_boxes(g, n, *out, policy.erasing) if policy.erasing else None
    empty = torch.zeros(n, 0)
    return PolicyDraws(
        torch.stack(ops, 1) if ops else empty.long(), torch.stack(magnitudes, 1) if magnitudes else empty, erase
    )


def erasing_boxes(g: torch.Generator, n: int, h: int, w: int, p: float, tries: int = 10) -> torch.Tensor:
    """RandomErasing's boxes (y0, x0, y1, x1) for n images: with probability p, the first of `tries` draws of
    area (0.02 to 0.33 of the image) and aspect (0.3 to 3.3, log-uniform) that fits; an empty box otherwise."""
    chosen = torch.rand(n, generator=g) < p
    area = h * w * (0.02 + 0.31 * torch.rand(n, tries, generator=g, dtype=torch.float64))
    logs = math.log(0.3), math.log(3.3)
    aspect = torch.exp(logs[0] + (logs[1] - logs[0]) * torch.rand(n, tries, generator=g, dtype=torch.float64))
    eh, ew = (area * aspect).sqrt().round(), (area / aspect).sqrt().round()
    fits = (eh < h) & (ew < w)
    first = fits.int().argmax(1, keepdim=True)
    eh, ew = eh.gather(1, first)[:, 0], ew.gather(1, first)[:, 0]
    u = torch.rand(n, 2, generator=g, dtype=torch.float64)
    y0, x0 = (u[:, 0] * (h - eh + 1)).floor(), (u[:, 1] * (w - ew + 1)).floor()
    boxes = torch.stack([y0, x0, y0 + eh, x0 + ew], 1).float()
    return torch.where((chosen & fits.any(1))[:, None], boxes, torch.zeros_like(boxes))


def placed(d: PolicyDraws | None, device: torch.device, move: Callable) -> PolicyDraws | None:
    """The draws' magnitudes and boxes on the device (through `move`: page-locked, no host wait); ops stay."""
    if d is None:
        return None
    return PolicyDraws(d.ops, move(d.magnitudes, device), None if d.erase is None else move(d.erase, device))


def apply_policy(x: torch.Tensor, d: PolicyDraws | None, move: Callable) -> torch.Tensor:
    """uint8 images N x C x H x W with each image's operations done, round by round. The batch is grouped by
    operation on the host's copy of the draws, so each operation runs once on its images, with their magnitudes as a
    tensor: a few kernels per operation, no per-image Python loop and no host sync. Out of place: `x` may be a view
    of the held data."""
    if d is None:
        return x
    names = list(Policy(trivial=True).spaces()[0][0])  # both spaces name the same operations in the same order
    for r in range(d.ops.shape[1]):
        column = d.ops[:, r]
        for k in column.unique().tolist():
            if names[k] == "Identity":
                continue
            idx = move(torch.nonzero(column == k)[:, 0], x.device)
            done = operation(x.index_select(0, idx), names[k], d.magnitudes[:, r].index_select(0, idx))
            x = x.index_copy(0, idx, done)
    return x


def operation(x: torch.Tensor, name: str, m: torch.Tensor) -> torch.Tensor:
    """One of torchvision's auto-augment operations on uint8 images, each at its own magnitude `m` (as
    v2.TrivialAugmentWide._apply_image_or_video_transform does to one image: nearest pixels, black fill)."""
    from torchvision.transforms.v2 import functional as TF

    f = (1.0 + m).view(-1, 1, 1, 1)
    if name == "Identity":
        return x
    if name in ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate"):
        return affine(x, name, m)
    if name == "Brightness":
        return blend(x, torch.zeros_like(x), f)
    if name == "Color":
        return blend(x, TF.adjust_saturation(x, 0.0), f) if x.shape[1] == 3 else x
    if name == "Contrast":
        gray = TF.rgb_to_grayscale(x) if x.shape[1] == 3 else x
        return blend(x, gray.float().mean((1, 2, 3), keepdim=True).expand_as(x), f)
    if name == "Sharpness":
        return blend(x, TF.adjust_sharpness(x, 0.0), f)
    if name == "Posterize":
        bits = m.to(torch.int32).view(-1, 1, 1, 1)
        return x & (((1 << bits) - 1) << (8 - bits)).to(torch.uint8)
    if name == "Solarize":
        return torch.where(x >= (255 * m).view(-1, 1, 1, 1), 255 - x, x)
    if name == "AutoContrast":
        return TF.autocontrast(x)
    if name == "Equalize":
        return TF.equalize(x)
    raise ValueError(f"no operation {name}")


def blend(x: torch.Tensor, degenerate: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """torchvision's _blend with a ratio per image: x * f + degenerate * (1 - f), clamped, back to uint8."""
    return (x.float() * f + degenerate.float() * (1 - f)).clamp_(0, 255).to(torch.uint8)


def affine(x: torch.Tensor, name: str, m: torch.Tensor) -> torch.Tensor:
    """Shears (about the top-left corner, as torchvision's), translations (whole pixels) and rotations (about the
    centre, in degrees), each image by its own magnitude, as one grid sample: nearest pixels, zeros outside. The
    direction of a positive magnitude is immaterial: the policies draw the sign at random."""
    n, _, h, w = x.shape
    theta = torch.zeros(n, 2, 3, device=x.device)
    theta[:, 0, 0] = theta[:, 1, 1] = 1
    if name == "ShearX":  # x_in = x + m y in pixels, y from the top edge; in [-1, 1] coordinates:
        theta[:, 0, 1] = theta[:, 0, 2] = m * h / w
    elif name == "ShearY":
        theta[:, 1, 0] = theta[:, 1, 2] = m * w / h
    elif name == "TranslateX":
        theta[:, 0, 2] = -2 * m.trunc() / w
    elif name == "TranslateY":
        theta[:, 1, 2] = -2 * m.trunc() / h
    else:
        a = torch.deg2rad(m)
        theta[:, 0, 0], theta[:, 0, 1] = a.cos(), -a.sin() * h / w
        theta[:, 1, 0], theta[:, 1, 1] = a.sin() * w / h, a.cos()
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x.float(), grid, mode="nearest", padding_mode="zeros", align_corners=False).to(torch.uint8)


def erase(x: torch.Tensor, d: PolicyDraws | None) -> torch.Tensor:
    """Float images with each one's erased box set to 0 (the mean, once normalised: torchvision's recipe erases
    after Normalize, with value 0)."""
    if d is None or d.erase is None:
        return x
    b = d.erase
    rows = torch.arange(x.shape[2], device=x.device)
    cols = torch.arange(x.shape[3], device=x.device)
    inside_rows = (rows >= b[:, :1]) & (rows < b[:, 2:3])
    inside_cols = (cols >= b[:, 1:2]) & (cols < b[:, 3:4])
    return x.masked_fill(inside_rows[:, None, :, None] & inside_cols[:, None, None, :], 0.0)


def viewed_logits(model, x: torch.Tensor, augmentation: str = "none") -> torch.Tensor:
    """The model's logits for images x; with flip, the mean over each image and its mirror image; with flip_shift,
    half that and half the same mean for the image shifted a pixel up-left and a pixel down-right (its edges
    mirrored in)."""
    if augmentation == "none":
        return model(x)
    flipped = (model(x).float() + model(x.flip(-1)).float()) / 2
    if augmentation == "flip":
        return flipped
    h, w = x.shape[-2:]
    padded = F.pad(x, (1, 1, 1, 1), mode="reflect")
    shifted = [viewed_logits(model, padded[..., :h, :w], "flip"), viewed_logits(model, padded[..., 2:, 2:], "flip")]
    return (flipped + (shifted[0] + shifted[1]) / 2) / 2
