"""A self-describing model: model.json beside model.pt, and the same in every checkpoint, so that a run's weights can
be used without the run: the model to build (its name, keyword arguments, number of classes), the class names in
index order, the metrics it reached, and the exact preprocessing, complete enough to make the model's input from an
image file with Pillow and numpy alone (what `job predict`, an export's metadata and a person serving it read).

The preprocessing is the run's evaluation's (job/data/preprocess.py), in the order a Pillow script applies it:
    draft             [d, d]: a JPEG file is decoded at libjpeg's reduced scale no smaller than d x d: Pillow's
                      img.draft("RGB", (d, d)) before anything else (null: at full size). Not for other formats.
    exif_orientation  turn the photo by its EXIF tag (Pillow's ImageOps.exif_transpose)
    mode              convert to RGB (16-bit images scaled to 8 bits first: job/data/image.py)
    box               the region of the turned image (w x h) that is resized, at whole pixels: "centre": the largest
                      centred region with the aspect of `held` (the full height and round(h * held_w / held_h) of
                      the width, or the full width and round(w * held_h / held_w) of the height, whichever fits),
                      its offset round((w - box_w) / 2), round((h - box_h) / 2) (Python's round, half to even);
                      "whole": all of it
    held              [h, w]: that region resized: img.crop(box).resize((w, h), Image.Resampling.BILINEAR);
                      null: as the file is
    crop              {"center": [h, w]}: the centre h x w of the held image, its offset rounded as the box's;
                      null: none
    input_size        [h, w]: the model's input, what the steps above make of any image
    scale, mean, std  x * scale, then (x - mean) / std per channel (mean and std of values already scaled; null:
                      none), in NCHW float32
    resize            the first form's description of draft, box and held, for readers that know only it:
                      {"short_side": s}: the short side to s (the other in proportion, rounded), then `crop`;
                      {"size": [h, w]}: to h x w, aspect not kept; null: the run fixed no size (its images were
                      one size, as they were; `held` brings another to it). It gives the same region within a
                      pixel; draft, box and held give it exactly.
    interpolation     bilinear, antialiased when shrinking (Pillow's resize)
For a table (csv): the feature columns in order and the min-max scaler's parameters instead.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from job.data.preprocess import Preprocess

MODEL_JSON = "model.json"
FORMAT = 1  # model.json's own version


def preprocessing(data_cfg, input_shape: tuple[int, ...], mean: list[float] | None, std: list[float] | None) -> dict:
    """The image preprocessing of a run's evaluation (see the module's doc); `data_cfg`: the resolved config's data
    section; `input_shape`: the model's; `mean`, `std`: the normalisation the run used (None: none)."""
    size = list(input_shape[-2:])
    trained = Preprocess.of(data_cfg)  # resize as its first form said it: null where the run fixed no size
    if trained.size is None:
        resize: dict | None = None
    elif trained.keep_aspect:
        resize = {"short_side": trained.size[0]}
    else:
        resize = {"size": list(trained.size)}
    crop = {"center": [data_cfg.image_size or trained.size[0]] * 2} if trained.keep_aspect and trained.size else None
    return {
        "exif_orientation": True,
        "mode": "RGB",
        "resize": resize,
        "crop": crop,
        **Preprocess.of(data_cfg, input_shape).describe(),
        "input_size": size,
        "interpolation": "bilinear",
        "antialias": True,
        "scale": 1 / 255,
        "mean": mean,
        "std": std,
        "layout": "NCHW",
        "dtype": "float32",
    }


def recipe_input(pre: dict, data: bytes) -> np.ndarray:
    """A model's float32 3 x H x W input made from an image file by model.json's recipe alone (`pre`: its
    preprocessing), step by step as the module's doc says, with Pillow and numpy: what a person serving an export
    does, and what export's check compares with the job's own preprocessing."""
    from PIL import Image, ImageOps

    from job.data.image import to_rgb

    with Image.open(io.BytesIO(data)) as img:
        if pre.get("draft") and img.format == "JPEG":
            img.draft("RGB", tuple(pre["draft"]))
        img.load()
        img = to_rgb(ImageOps.exif_transpose(img) if pre["exif_orientation"] else img)
    if pre.get("held"):
        (h, w), (iw, ih) = pre["held"], img.size
        box = (0, 0, iw, ih)
        if pre["box"] == "centre":
            bw, bh = (min(iw, round(ih * w / h)), ih) if iw * h >= ih * w else (iw, min(ih, round(iw * h / w)))
            left, top = int(round((iw - bw) / 2)), int(round((ih - bh) / 2))
            box = (left, top, left + bw, top + bh)
        if box != (0, 0, iw, ih) or img.size != (w, h):
            img = img.crop(box).resize((w, h), Image.Resampling.BILINEAR)
    if pre.get("crop"):
        (ch, cw), (iw, ih) = pre["crop"]["center"], img.size
        left, top = int(round((iw - cw) / 2)), int(round((ih - ch) / 2))
        img = img.crop((left, top, left + cw, top + ch))
    x = np.asarray(img, dtype=np.float32) * np.float32(pre["scale"])
    if pre["mean"] is not None:
        x = (x - np.asarray(pre["mean"], np.float32)) / np.asarray(pre["std"], np.float32)
    return x.transpose(2, 0, 1)


def describe(cfg, classes: list[str], input_shape: tuple[int, ...], feed_stats, features, metrics: dict) -> dict:
    """model.json's content. `feed_stats`: (mean, std) tensors or (None, None); `features`: a table's columns and
    scaler (None for images); `metrics`: what the run reached (val and test)."""
    from job import __version__

    mean, std = feed_stats
    entry: dict[str, Any] = {
        "format": FORMAT,
        "job_version": __version__,
        "model": {"name": cfg.model.name, "kwargs": dict(cfg.model.kwargs), "num_classes": len(classes)},
        "classes": list(classes),
        "input_shape": list(input_shape),
        "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and v is not None},
    }
    if cfg.model.name == "mlp":
        entry["model"]["hidden"] = list(cfg.model.hidden)
    if cfg.model.name == "resnet18":
        from job.models import small_stem

        entry["model"]["small_stem"] = small_stem(cfg.model, input_shape)
    if features is not None:
        entry["features"] = features
    else:
        stats = (mean.tolist(), std.tolist()) if mean is not None else (None, None)
        entry["preprocessing"] = preprocessing(cfg.data, input_shape, *stats)
    return entry
