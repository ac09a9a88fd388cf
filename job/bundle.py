"""A self-describing model: model.json beside model.pt, and the same in every checkpoint, so that a run's weights can
be used without the run: the model to build (its name, keyword arguments, number of classes), the class names in
index order, the metrics it reached, and the exact preprocessing, complete enough to make the model's input from an
image file with Pillow and numpy alone (what `job predict`, an export's metadata and a person serving it read).

The preprocessing is the run's evaluation's, in the order a Pillow script applies it:
    exif_orientation  turn the photo by its EXIF tag (Pillow's ImageOps.exif_transpose)
    mode              convert to RGB (16-bit images scaled to 8 bits first: job/data/image.py)
    resize            {"short_side": s}: the short side to s (the other in proportion, rounded) then the centre s x s;
                      {"size": [h, w]}: to h x w, aspect not kept; null: as the file is (every image one size)
    crop              {"center": [h, w]}: the centre h x w; null: none
    interpolation     bilinear, antialiased when shrinking (Pillow's resize)
    scale, mean, std  x * scale, then (x - mean) / std per channel (mean and std of values already scaled; null:
                      none), in NCHW float32
For a table (csv): the feature columns in order and the min-max scaler's parameters instead.
"""

from __future__ import annotations

from typing import Any

MODEL_JSON = "model.json"
FORMAT = 1  # model.json's own version


def preprocessing(data_cfg, mean: list[float] | None, std: list[float] | None) -> dict[str, Any]:
    """The image preprocessing of a run's evaluation (see the module's doc); `data_cfg`: the resolved config's data
    section; `mean`, `std`: the normalisation the run used (None: none)."""
    image, held = data_cfg.image_size, data_cfg.resize_size
    if held is not None:  # held square by the short side and centre, evaluated on the centre image_size
        resize: dict | None = {"short_side": held}
        crop: dict | None = {"center": [image or held, image or held]}
    elif image is not None:
        resize, crop = {"size": [image, image]}, None
    else:
        resize = crop = None
    return {
        "exif_orientation": True,
        "mode": "RGB",
        "resize": resize,
        "crop": crop,
        "interpolation": "bilinear",
        "antialias": True,
        "scale": 1 / 255,
        "mean": mean,
        "std": std,
        "layout": "NCHW",
        "dtype": "float32",
    }


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
        entry["preprocessing"] = preprocessing(cfg.data, *stats)
    return entry
