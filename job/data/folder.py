"""Image folders: train/<class>/* and test/<class>/* (JPEG or PNG), as a folder or a .tar/.tar.gz of one."""

from __future__ import annotations

import io
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from job.data.dataset import Dataset, Split
from job.data.files import Log, read_entries
from job.errors import DataError, one_line

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
SPLITS = ("train", "test")
SUFFIXES = "|".join(s.lstrip(".") for s in IMAGE_SUFFIXES)  # as the layout's messages name them: jpg|jpeg|png|webp


def load_folder(cfg, cache: Path | None, log: Log) -> Dataset:
    """The train/ and test/ images at cfg.path; remote data are kept in the folder `cache` (None: no cache)."""
    url = cfg.path
    by_split: dict[str, list[tuple[str, str, bytes]]] = {s: [] for s in SPLITS}
    for name, data in read_entries(url, layout_key, cache, log):
        split, cls = layout_key(name)
        by_split[split].append((cls, name, data))
    if not by_split["train"]:
        raise DataError(f"{url}: no images in the train/<class>/*.{SUFFIXES} layout")
    classes = sorted({cls for cls, _, _ in by_split["train"]})
    unknown = sorted({cls for cls, _, _ in by_split["test"]} - set(classes))
    if unknown:
        raise DataError(f"{url}: test classes without training images: {', '.join(unknown[:5])}")
    size, fit = cfg.resize_size or cfg.image_size, cfg.resize_size is not None
    train = decode_split(sorted(by_split["train"]), classes, size, url, fit)
    test = decode_split(sorted(by_split["test"]), classes, size, url, fit) if by_split["test"] else None
    if test is None:
        raise DataError(f"{url}: no images in the test/<class>/*.{SUFFIXES} layout")
    if train.x.shape[1:] != test.x.shape[1:]:
        raise DataError(
            f"{url}: train images are {tuple(train.x.shape[2:])}, test images {tuple(test.x.shape[2:])}; "
            "set data.image_size"
        )
    return Dataset(train, test, classes, f"folder {url}")


def layout_key(name: str) -> tuple[str, str] | None:
    """(split, class) when a path ends in train|test/<class>/<image>, else None (hidden files skipped)."""
    parts = name.replace("\\", "/").split("/")
    if len(parts) < 3 or parts[-3] not in SPLITS or parts[-1].startswith("."):
        return None
    if not parts[-1].lower().endswith(IMAGE_SUFFIXES):
        return None
    return parts[-3], parts[-2]


def decode_split(
    items: list[tuple[str, str, bytes]], classes: list[str], size: int | None, url: str, fit: bool = False
) -> Split:
    """Decode every image to uint8 3 x H x W, in threads (Pillow's decoders release the GIL); resized to size x size
    when given (`fit`: the short side resized to it and the centre kept, as photos are held)."""
    chunks = [items[i : i + 256] for i in range(0, len(items), 256)]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        decoded = pool.map(lambda c: [decode(n, b, size, url, fit) for _, n, b in c], chunks)
        images = [img for chunk in decoded for img in chunk]
    shapes = {img.shape for img in images}
    if len(shapes) > 1:
        first = images[0].shape
        odd = next(n for (_, n, _), img in zip(items, images) if img.shape != first)
        raise DataError(
            f"{url}: images differ in size ({tuple(first[1:])} and {tuple(shapes.difference({first}).pop()[1:])}, "
            f"e.g. {odd}); set data.image_size"
        )
    y = torch.tensor([classes.index(cls) for cls, _, _ in items])
    return Split(torch.stack(images), y)


def decode(name: str, data: bytes, size: int | None, url: str, fit: bool = False) -> torch.Tensor:
    try:
        with Image.open(io.BytesIO(data)) as img:
            rgb = img.convert("RGB")
            if size is not None and rgb.size != (size, size):
                if fit:
                    rgb = ImageOps.fit(rgb, (size, size), Image.Resampling.BILINEAR)
                else:
                    rgb = rgb.resize((size, size), Image.Resampling.BILINEAR)
            pixels = np.asarray(rgb, dtype=np.uint8)
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise DataError(f"{url}: cannot decode image {name}: {image_fault(data, e)}") from None
    return torch.from_numpy(pixels.transpose(2, 0, 1).copy())


def image_fault(data: bytes, e: Exception) -> str:
    """Why Pillow could not read an image, in words (its own message for bytes names a BytesIO object)."""
    if not data:
        return "an empty file"
    if isinstance(e, UnidentifiedImageError):
        return f"not an image file ({SUFFIXES.replace('|', ', ')})"
    return one_line(e)
