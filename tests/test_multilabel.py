"""Multi-label classification: labels read as lists (a JSON list, a separator, 0/1 columns), targets multi-hot,
average precision as scikit-learn computes it, thresholds chosen on val, and a run end to end (model.json's
thresholds, metrics, report, predict, export)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from job.config import DataConfig

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}


def mosaic_images(root: Path, n: int = 120, seed: int = 0) -> list[tuple[str, list[str]]]:
    """n 24x24 JPEGs, each a grey picture with a block of each colour it shows (none for about one in eight):
    (path relative to root, its colours)."""
    rng = np.random.default_rng(seed)
    rows = []
    (root / "images").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        shown = [c for c in COLOURS if rng.random() < 0.45]
        px = np.full((24, 24, 3), 128, np.uint8)
        cells = rng.permutation(4)
        for c, cell in zip(shown, cells):
            y, x = divmod(int(cell), 2)
            px[y * 12 : y * 12 + 12, x * 12 : x * 12 + 12] = COLOURS[c]
        px = np.clip(px.astype(int) + rng.integers(-10, 10, px.shape), 0, 255).astype(np.uint8)
        name = f"images/m{i:03d}.jpg"
        Image.fromarray(px).save(root / name, quality=95)
        rows.append((name, shown))
    return rows


def manifests(root: Path, rows: list[tuple[str, list[str]]]) -> dict[str, Path]:
    """The same labels four ways: JSONL lists, a CSV cell of a JSON list, a CSV of 'a|b' cells, CSV 0/1 columns."""
    out = {"jsonl": root / "labels.jsonl", "csv_json": root / "json.csv", "csv_sep": root / "sep.csv"}
    out["csv_flags"] = root / "flags.csv"
    out["jsonl"].write_text("".join(json.dumps({"path": p, "labels": c}) + "\n" for p, c in rows))
    for key, cellof in (("csv_json", json.dumps), ("csv_sep", "|".join)):
        with open(out[key], "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["path", "labels"])
            w.writerows([p, cellof(c)] for p, c in rows)
    with open(out["csv_flags"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", *COLOURS])
        w.writerows([p, *(int(c in shown) for c in COLOURS)] for p, shown in rows)
    return out


def test_list_labels_are_read_as_classes_not_as_one_class_per_combination(tmp_path):
    from job.data.manifest import load_manifest

    rows = mosaic_images(tmp_path)
    negatives = sum(1 for _, c in rows if not c)
    assert negatives > 0
    for key, path in manifests(tmp_path, rows).items():
        sep = "|" if key == "csv_sep" else None
        cfg = DataConfig(kind="manifest", path=str(path), label_column="labels", label_separator=sep, val_split=0.2)
        data = load_manifest(cfg, None, lambda _: None)
        assert data.classes == sorted(COLOURS), key
        assert data.multilabel and data.train.y.shape[1] == 3 and data.train.y.dtype == torch.float32
        every = torch.cat([data.train.y, data.val.y])
        assert len(every) == len(rows) and int((every.sum(1) == 0).sum()) == negatives  # the negatives are kept
        want = {c: sum(1 for _, shown in rows if c in shown) for c in COLOURS}
        assert dict(zip(data.classes, every.sum(0).long().tolist())) == want
        d = data.inventory.to_json()
        assert d["splits"]["train"]["images"] + d["splits"]["val"]["images"] == len(rows)
        assert {c: d["splits"]["train"]["per_class"][c] + d["splits"]["val"]["per_class"][c] for c in COLOURS} == want
        assert "multilabel" in data.describe()


def test_a_column_of_single_class_names_stays_multiclass(tmp_path):
    from job.data.manifest import load_manifest

    rows = mosaic_images(tmp_path, 40)
    table = tmp_path / "one.jsonl"
    table.write_text("".join(json.dumps({"path": p, "label": (c or ["none"])[0]}) + "\n" for p, c in rows))
    data = load_manifest(DataConfig(kind="manifest", path=str(table), val_split=0.2), None, lambda _: None)
    assert not data.multilabel and data.train.y.dtype == torch.int64


def test_list_labels_under_data_task_multiclass_are_refused_in_one_line(tmp_path):
    from job.data.manifest import load_manifest
    from job.errors import ConfigError

    rows = mosaic_images(tmp_path, 20)
    path = manifests(tmp_path, rows)["jsonl"]
    cfg = DataConfig(kind="manifest", path=str(path), label_column="labels", task="multiclass")
    with pytest.raises(ConfigError, match="data.task=multilabel"):
        load_manifest(cfg, None, lambda _: None)
