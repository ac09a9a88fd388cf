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

Loading a bundle lives here too (load_predictor): the model at a URL with what makes its inputs, for predict,
evaluate and export alike.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from job.config import read_yaml, validate
from job.data.augment import to_float, viewed_logits
from job.data.preprocess import Preprocess
from job.errors import CheckpointError, StorageError
from job.recipe.models import build_model
from job.run import checkpoint
from job.storage.cloud import describe_storage_error, filesystem

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

    from job.data.image import heif_readable, to_rgb

    heif_readable()
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
        # The run's resolved config (config.yaml's content): model.pt with model.json is a model the job uses with
        # nothing beside them (a registry's copy, `models:/NAME/N`, holds those two alone).
        "config": cfg.model_dump(mode="json"),
    }
    if cfg.model.name == "mlp":
        entry["model"]["hidden"] = list(cfg.model.hidden)
    if cfg.model.name == "resnet18":
        from job.recipe.models import small_stem

        entry["model"]["small_stem"] = small_stem(cfg.model, input_shape)
    if features is not None:
        entry["features"] = features
    else:
        stats = (mean.tolist(), std.tolist()) if mean is not None else (None, None)
        entry["preprocessing"] = preprocessing(cfg.data, input_shape, *stats)
    return entry


def multilabel_entry(classes: list[str], thresholds: list[float] | None) -> dict:
    """model.json's multi-label part: the task, and each class's threshold (by class name; 0.5 before any
    evaluation has chosen them)."""
    chosen = thresholds if thresholds is not None else [0.5] * len(classes)
    return {"task": "multilabel", "thresholds": {c: float(t) for c, t in zip(classes, chosen)}}


@dataclass
class Predictor:
    """A trained model and what makes its inputs."""

    model: torch.nn.Module
    classes: list[str]
    pre: Preprocess  # how an image file is held: the run's evaluation's, brought to the model's input size
    view: object  # the centre view of evaluation, or None
    mean: torch.Tensor | None
    std: torch.Tensor | None
    device: torch.device
    features: dict | None = None  # a table's model: its feature columns and scaler (model.json's)
    thresholds: list[float] | None = None  # multi-label: each class's, in class order (sigmoids, not a softmax)
    temperature: float = 1.0  # model.json's: the logits divided by it before the softmax (job/recipe/calibrate.py)
    augmentation: str = "none"  # the run's train.test_time_augmentation: the views its evaluations averaged

    def served(self) -> torch.nn.Module:
        """The model as predict, evaluate and the exports serve it: the logits of the run's test-time views, averaged,
        over the temperature."""
        return Served(self.model, self.augmentation, self.temperature).eval()

    @torch.no_grad()
    def table_probabilities(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of raw feature values, in the model's column order, scaled as in training."""
        low, span = torch.tensor(self.features["min"]), torch.tensor(self.features["span"])
        return self.activated(self.served()(((x - low) / span).to(self.device)).float()).cpu()

    @torch.no_grad()
    def probabilities(self, images: torch.Tensor) -> torch.Tensor:
        x = to_float(images.to(self.device), torch.contiguous_format, self.mean, self.std, self.view)
        return self.activated(self.served()(x).float()).cpu()

    def activated(self, logits: torch.Tensor) -> torch.Tensor:
        """Probabilities of served logits: each class's sigmoid (multi-label), else the softmax over the classes."""
        return torch.sigmoid(logits) if self.thresholds is not None else torch.softmax(logits, dim=1)

    def label_set(self, probs: torch.Tensor) -> list[str]:
        """A multi-label image's classes: those whose probability is above their threshold."""
        return [c for c, v, t in zip(self.classes, probs.tolist(), self.thresholds) if v > t]


class Served(torch.nn.Module):
    """A model's logits as a run serves them: averaged over its test-time views, divided by its temperature (1: as
    they are; job/recipe/calibrate.py fits it on val)."""

    def __init__(self, model: torch.nn.Module, augmentation: str = "none", temperature: float = 1.0) -> None:
        super().__init__()
        self.model, self.augmentation, self.temperature = model, augmentation, temperature

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = viewed_logits(self.model, x, self.augmentation)
        return out if self.temperature == 1.0 else out / self.temperature


def load_predictor(url: str, device: torch.device) -> Predictor:
    """The model at `url` (a run folder, its model.pt, or a checkpoint) on `device`, in evaluation mode."""
    from job.recipe.build import model_input, resolved

    payload, card, raw_config = model_files(url)
    cfg = resolved(validate(raw_config))
    pre = card.get("preprocessing")
    shape = tuple(card["input_shape"])
    if pre is None:  # a table's model: its features' columns and scaler instead
        model = build_model(cfg.model, shape, len(card["classes"]))
        model.load_state_dict(checkpoint.evaluated_weights(payload))
        model.to(device).eval()
        return Predictor(
            model, list(card["classes"]), Preprocess(), None, None, None, device, card["features"], thresholds_of(card),
            float(card.get("temperature", 1.0)),
        )  # fmt: skip
    # A run that fixed no size held its images as they were (one size): every image is brought to that size here,
    # so that a photo of another size is labelled, not refused in the model or with its whole batch.
    held = Preprocess.of(cfg.data, shape)
    _, view = model_input(cfg, (3, *held.size), True)
    model = build_model(cfg.model, shape, len(card["classes"]))
    try:
        model.load_state_dict(checkpoint.evaluated_weights(payload))
    except RuntimeError as e:
        raise CheckpointError(f"{url}: weights do not fit model {cfg.model.name}: {str(e).splitlines()[0]}") from None
    model.to(device).eval()
    stats = [
        None if pre["mean"] is None else torch.tensor(pre[k]).view(1, -1, 1, 1).to(device) for k in ("mean", "std")
    ]
    calibrated = {"temperature": float(card.get("temperature", 1.0)), "augmentation": cfg.train.test_time_augmentation}
    return Predictor(
        model, list(card["classes"]), held, view, *stats, device, thresholds=thresholds_of(card), **calibrated
    )


def thresholds_of(card: dict) -> list[float] | None:
    """A multi-label model.json's thresholds in class order; None for one class an input."""
    if card.get("task") != "multilabel":
        return None
    return [float(card["thresholds"][c]) for c in card["classes"]]


def model_files(url: str) -> tuple[dict, dict, dict]:
    """(weights payload, model.json's content, config) of a run folder, its model.pt, or a checkpoint: a checkpoint
    holds all three; model.pt has model.json beside it, which holds the config (one of an earlier version: the run's
    config.yaml beside them)."""
    fs, path = filesystem(url)
    try:
        folder = fs.isdir(path)
        chosen = folder and fs.exists(f"{path.rstrip('/')}/model.pt")
    except Exception as e:  # the stores' clients raise many types
        raise StorageError(f"cannot read the model: {describe_storage_error(url, e)}") from None
    weights_url = f"{url.rstrip('/')}/model.pt" if chosen else url
    payload, _ = checkpoint.load_url(weights_url, weights=True)
    if "model_json" in payload and "config" in payload:
        return payload, payload["model_json"], payload["config"]
    beside = weights_url.rsplit("/", 1)[0] if "/" in weights_url else "."
    card = read_json(f"{beside}/{MODEL_JSON}")
    if card is None:
        raise CheckpointError(
            f"{url}: no {MODEL_JSON} beside the weights ({beside}/{MODEL_JSON}; runs of earlier versions wrote none): "
            "put the run's model.json there, or pass the run's checkpoint instead (--model RUN/checkpoints/<name>.pt)"
        )
    if isinstance(card.get("config"), dict):
        return payload, card, card["config"]
    config_url = f"{beside}/config.yaml"  # a model.json of an earlier version holds no config: the run's, beside it
    if not exists(config_url):
        raise CheckpointError(
            f"{url}: its {MODEL_JSON} (of an earlier version) holds no config, and there is no config.yaml beside it "
            f"({config_url}): put the run's config.yaml there, or pass the run's checkpoint (--model "
            "RUN/checkpoints/<name>.pt)"
        )
    return payload, card, read_yaml(config_url)


def exists(url: str) -> bool:
    """Whether there is a file at `url`; a store that fails to say is a StorageError."""
    fs, path = filesystem(url)
    try:
        return fs.exists(path)
    except Exception as e:  # the stores' clients raise many types
        raise StorageError(f"cannot read the model: {describe_storage_error(url, e)}") from None


def read_json(url: str) -> dict | None:
    if not exists(url):
        return None
    fs, path = filesystem(url)
    try:
        return json.loads(fs.cat_file(path))
    except ValueError:
        raise CheckpointError(f"{url}: not JSON") from None
    except Exception as e:  # the stores' clients raise many types
        raise StorageError(f"cannot read the model: {describe_storage_error(url, e)}") from None
