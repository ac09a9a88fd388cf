"""job/study/results.py: a sweep's picture of its metric against each parameter, drawn with the report's Pillow
charts (job/sinks/pictures.py) and read back as a person would see it."""

from __future__ import annotations

import io
import sys

import numpy as np
from PIL import Image

from job.sinks import pictures
from job.study.results import picture
from job.study.space import Range, Space


def dot_columns(pixels: np.ndarray) -> list[float]:
    """The x centres of the dots drawn in the charts' first colour, left to right."""
    cols = np.flatnonzero((pixels == pictures.COLOURS[0]).all(2).any(0))
    groups = np.split(cols, np.flatnonzero(np.diff(cols) > 1) + 1) if cols.size else []
    return [float(g.mean()) for g in groups]


def test_the_params_picture_has_a_panel_a_parameter_and_a_dot_per_finished_trial(monkeypatch):
    space = Space(
        "s", "val_accuracy", "maximize", 5, "tpe", 0, "none",
        {"optim.lr": Range(1e-3, 1.0, log=True), "optim.momentum": Range(0.0, 0.9), "model.name": ["mlp", "cnn"]},
    )  # fmt: skip
    rows = [
        {"trial": 0, "optim.lr": 1e-3, "optim.momentum": 0.0, "model.name": "mlp", "val_accuracy": 0.2},
        {"trial": 1, "optim.lr": 1e-2, "optim.momentum": 0.3, "model.name": "cnn", "val_accuracy": 0.5},
        {"trial": 2, "optim.lr": 1e-1, "optim.momentum": 0.6, "model.name": "mlp", "val_accuracy": 0.7},
        {"trial": 3, "optim.lr": 1.0, "optim.momentum": 0.9, "model.name": "cnn", "val_accuracy": 0.4},
        {"trial": 4, "optim.lr": 3e-3, "optim.momentum": 0.45, "model.name": "mlp", "val_accuracy": None},  # failed
    ]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # one plotting stack: an import of matplotlib fails here
    img = Image.open(io.BytesIO(picture(rows, space)))
    assert img.format == "PNG"
    pixels = np.asarray(img.convert("RGB"))
    height, width = pixels.shape[:2]
    assert 200 <= height <= 400 and 3 * 250 <= width <= 3 * 450, img.size  # three panels side by side
    assert (pixels < 128).all(2).sum() > 500  # axes, ticks and labels in black: not a blank page
    panel = width // 3
    lr, momentum, name = (dot_columns(pixels[:, i * panel : (i + 1) * panel]) for i in range(3))
    assert len(lr) == 4 and len(momentum) == 4  # the failed trial has no dot
    gaps = np.diff(lr)  # 1e-3, 1e-2, 1e-1, 1: evenly spaced on the log scale (on a linear one, 3 in the last gap)
    assert gaps.max() - gaps.min() <= 2, lr
    gaps = np.diff(momentum)  # 0, 0.3, 0.6, 0.9: evenly spaced
    assert gaps.max() - gaps.min() <= 2, momentum
    assert len(name) == 2  # mlp and cnn: a column each


def test_log_ticks_are_round_values_within_the_range():
    assert [v for _, v in pictures.log_ticks(-3, 0)] == ["0.001", "0.01", "0.1", "1"]
    assert [v for _, v in pictures.log_ticks(np.log10(0.02), np.log10(0.6))] == ["0.02", "0.05", "0.1", "0.2", "0.5"]
    assert len(pictures.log_ticks(-12, 12)) <= 9
    assert len(pictures.log_ticks(np.log10(3), np.log10(3.5))) >= 1  # a narrow range still gets a tick
