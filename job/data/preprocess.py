"""How an image file becomes the pixels a model's input is cut from, decided once as a value: the host applies it
with Pillow, the device decoder with torchvision, and model.json describes it for a Pillow user, all from the same
fields, so that the three cannot drift (as timm's one data config makes its one eval transform).

The steps, in order, on the photo as it is shown (after its EXIF turn, in 8-bit RGB: job/data/image.py):
    draft  a JPEG decoded on the host at libjpeg's reduced DCT scale, no smaller than the held size (Pillow's
           img.draft("RGB", (d, d)) before it loads): a 12 MP photo held at 256 px decodes several times faster.
           The device decoder (nvJPEG) decodes at full size.
    box    the region that is resized, in the image's own pixels: the largest centred region with the held size's
           aspect (photos: the centre square of the short side), or the whole image (stretched)
    held   that region resized to the held size, bilinear, antialiased when shrinking (Pillow's
           img.crop(box).resize((w, h), BILINEAR); torchvision's resize(antialias=True) of the same crop)
    crop   evaluation's centre of the held image, whole pixels (done on the batch: job/data/augment.py's View)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from PIL import Image


def centre_box(w: int, h: int, bw: int, bh: int) -> tuple[int, int, int, int]:
    """(x0, y0, x1, y1) of the bw x bh centre of a w x h image, at whole pixels: the offset rounded half to even, as
    torchvision's center_crop and model.json's "crop" round it."""
    x0, y0 = int(round((w - bw) / 2)), int(round((h - bh) / 2))
    return x0, y0, x0 + bw, y0 + bh


@dataclass(frozen=True)
class Preprocess:
    """The evaluation's preprocessing of one model, for every reader of image files.

    size: (h, w) images are held at (None: as the files are, every image one size); keep_aspect: the box is the
    centred region with size's aspect (else the whole image, stretched); crop: evaluation's centre (h, w) of the held
    image (None: all of it)."""

    size: tuple[int, int] | None = None
    keep_aspect: bool = True
    crop: tuple[int, int] | None = None

    @classmethod
    def of(cls, data_cfg, input_shape: tuple[int, ...] | None = None) -> Preprocess:
        """A run's (the resolved config's data section): data.resize_size holds photos square by their short side,
        evaluated on the centre image_size; data.image_size alone stretches them to it. Neither: as the files are;
        given the model's `input_shape` (predict, export), every image is brought to it, the centre kept (a
        non-square input: stretched, as model.json's resize says)."""
        held, image = data_cfg.resize_size, data_cfg.image_size
        if held is not None:
            crop = (image, image) if image is not None and image < held else None
            return cls((held, held), True, crop)
        if image is not None:
            return cls((image, image), False)
        if input_shape is not None:
            h, w = input_shape[-2:]
            return cls((h, w), h == w)
        return cls()

    @property
    def draft(self) -> int | None:
        """The side no smaller than which a JPEG is decoded on the host (None: full size): the held size's larger."""
        return max(self.size) if self.size is not None else None

    def box(self, w: int, h: int) -> tuple[int, int, int, int]:
        """The region of a w x h image (as shown, after its turn) that is resized to the held size."""
        if self.size is None or not self.keep_aspect:
            return 0, 0, w, h
        th, tw = self.size
        if w * th >= h * tw:  # wider than the held aspect: the full height, the width in proportion
            return centre_box(w, h, min(w, round(h * tw / th)), h)
        return centre_box(w, h, w, min(h, round(w * th / tw)))

    def hold(self, img: Image.Image) -> Image.Image:
        """A Pillow RGB image held: its box resized to the held size."""
        from PIL import Image

        if self.size is None:
            return img
        box, (th, tw) = self.box(*img.size), self.size
        if box == (0, 0, *img.size) and img.size == (tw, th):
            return img
        return img.crop(box).resize((tw, th), Image.Resampling.BILINEAR)

    def hold_tensor(self, img: torch.Tensor) -> torch.Tensor:
        """A uint8 C x H x W image (on any device) held: the same box, resized by torchvision."""
        from torchvision.transforms.v2.functional import resize

        if self.size is None:
            return img
        h, w = img.shape[-2:]
        x0, y0, x1, y1 = self.box(w, h)
        img = img[..., y0:y1, x0:x1]
        if (y1 - y0, x1 - x0) == self.size:
            return img
        return resize(img, list(self.size), antialias=True)

    def describe(self) -> dict[str, Any]:
        """model.json's exact fields for these steps (see job/use/bundle.py): draft, box and held."""
        return {
            "draft": [self.draft, self.draft] if self.draft is not None else None,
            "box": "centre" if self.keep_aspect else "whole",
            "held": list(self.size) if self.size is not None else None,
        }
