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


def test_average_precision_is_scikit_learns_with_ties_and_thresholds_are_best_f1():
    from sklearn.metrics import average_precision_score, f1_score

    from job.recipe.multilabel import scored

    rng = np.random.default_rng(1)
    y = (rng.random((300, 4)) < [0.1, 0.3, 0.5, 0.02]).astype(int)
    p = np.clip(y * 0.3 + rng.random((300, 4)) * 0.7, 0, 1).astype(np.float32)
    p[:50, 1] = np.round(p[:50, 1], 1)  # ties, which scikit-learn counts as one cut
    s = scored(y, p, 0.0)
    for i in range(4):
        assert abs(s.ap[i] - average_precision_score(y[:, i], p[:, i])) < 1e-12
        best = max(f1_score(y[:, i], p[:, i] >= c) for c in np.unique(p[:, i]))
        assert abs(f1_score(y[:, i], p[:, i] > s.thresholds[i]) - best) < 1e-12 and 0 < s.thresholds[i] < 1
    assert abs(s.accuracy - np.mean([average_precision_score(y[:, i], p[:, i]) for i in range(4)])) < 1e-12
    pred = p > np.asarray(s.thresholds)
    assert abs(s.micro_f1 - f1_score(y, pred, average="micro")) < 1e-12
    assert abs(s.macro_f1 - f1_score(y, pred, average="macro")) < 1e-12
    assert s.exact_match == float((pred == y).all(1).mean())
    none = scored(np.zeros((5, 1)), np.linspace(0, 1, 5)[:, None], 0.0)  # no positive: none predicted, left out
    assert none.thresholds[0] > 1.0 - 1e-9 or (np.linspace(0, 1, 5) <= none.thresholds[0]).all()


def multilabel_run(tmp_path: Path, out: Path, *extra: str) -> tuple[int, str, Path]:
    from conftest import invoke, sets

    data = tmp_path / "mosaics"
    if not (data / "labels.jsonl").exists():
        manifests(data, mosaic_images(data, 160))
    over = sets(
        "data.kind=manifest",
        f"data.path={data / 'labels.jsonl'}",
        "data.label_column=labels",
        "data.image_size=32",
        "data.val_split=0.25",
        "data.test_split=0.15",
        "optim.name=adamw",
        "optim.lr=0.003",
        "train.epochs=4",
        "data.batch_size=16",
        *extra,
    )
    code, err = invoke(["train", "--device", "cpu", "--config", "cifar10", "--output", str(out), *over])
    return code, err, data


def test_a_multilabel_run_chooses_on_val_map_writes_thresholds_and_predict_and_export_follow_them(tmp_path):
    from conftest import invoke, metrics
    from sklearn.metrics import average_precision_score

    out = tmp_path / "run"
    code, err, data = multilabel_run(tmp_path, out)
    assert code == 0, err
    start = err.split("\nepoch ")[0]
    assert "multilabel" in start
    card = json.loads((out / "model.json").read_text())
    classes = card["classes"]
    assert classes == sorted(COLOURS) and card["task"] == "multilabel"
    t = [card["thresholds"][c] for c in classes]
    assert all(0 < v < 1 for v in t)
    rows = metrics(str(out))
    evals = [r for r in rows if "train_loss" in r]
    assert evals and all({"val_micro_f1", "val_macro_f1", "val_exact_match", "val_loss"} <= set(r) for r in evals)
    assert "test_map" in rows[-1] and "best val mAP" in err
    best = max(evals, key=lambda r: r["val_map"])
    d = json.loads((out / "data.json").read_text())
    held = d["held_out"]["val"]
    # predict on the val files: its label sets are its probabilities over the thresholds, and scikit-learn's AP on
    # them is the job's per-class val AP (report/val/classes.csv) and its best val mAP (model.pt is that model)
    vals = tmp_path / "val.jsonl"
    vals.write_text("".join(json.dumps({"path": str(data / p)}) + "\n" for p in held))
    pred = tmp_path / "pv.jsonl"
    code, err = invoke(["predict", "--model", str(out), "--device", "cpu", str(vals), "--output", str(pred)])
    assert code == 0, err
    got = {Path(r["path"]).name: r for r in map(json.loads, pred.read_text().splitlines())}
    truth = {
        Path(p).name: set(c)
        for p, c in (json.loads(x).values() for x in (data / "labels.jsonl").read_text().splitlines())
    }
    names = sorted(Path(p).name for p in held)
    p = np.array([[got[n]["probabilities"][c] for c in classes] for n in names])
    y = np.array([[c in truth[n] for c in classes] for n in names], dtype=int)
    for n, row in zip(names, p):
        assert set(got[n]["labels"]) == {c for c, v, th in zip(classes, row, t) if v > th}
    as_csv = tmp_path / "pv.csv"
    code, err = invoke(["predict", "--model", str(out), "--device", "cpu", str(vals), "--output", str(as_csv)])
    assert code == 0, err
    with open(as_csv, newline="") as f:
        table = {Path(r["path"]).name: r for r in csv.DictReader(f)}
    assert all(set(filter(None, table[n]["labels"].split("|"))) == set(got[n]["labels"]) for n in names)
    assert all(abs(float(table[n][c]) - got[n]["probabilities"][c]) < 1e-6 for n in names for c in classes)
    with open(out / "report" / "val" / "classes.csv", newline="") as f:
        table = {r["class"]: float(r["ap"]) for r in csv.DictReader(f)}
    ap = [average_precision_score(y[:, i], p[:, i]) for i in range(len(classes))]
    assert max(abs(table[c] - a) for c, a in zip(classes, ap)) < 1e-6
    assert abs(float(np.mean(ap)) - best["val_map"]) < 1e-6
    assert (out / "report" / "val" / "pr_curves.png").read_bytes()[:4] == b"\x89PNG"
    # export: the sigmoid inside, the thresholds in the metadata, checked against the model
    onnx_out = tmp_path / "m.onnx"
    code, err = invoke(["export", "--model", str(out), "--format", "onnx", "--output", str(onnx_out)])
    assert code == 0, err
    import onnx

    meta = {e.key: e.value for e in onnx.load(str(onnx_out)).metadata_props}
    assert json.loads(meta["labels"]) == classes and json.loads(meta["thresholds"]) == card["thresholds"]
    assert json.loads(meta["task"]) == "multilabel"
    # evaluate on a multilabel run
    code, err = invoke(["evaluate", "--checkpoint", str(out), "--report", str(tmp_path / "rep")])
    assert code == 0, err
    assert (tmp_path / "rep" / "test" / "classes.csv").read_text().startswith("class,ap,")
    code, err = invoke(["evaluate", "--model", str(out), "--data", str(data / "labels.jsonl"), "--device", "cpu"])
    assert code == 0, err
    # shards of one class an image, the same classes: the other kind of labels, in one line
    rows = [json.loads(x) for x in (data / "labels.jsonl").read_text().splitlines()]
    single = data / "single.jsonl"
    single.write_text(
        "".join(json.dumps({"path": r["path"], "label": r["labels"][0]}) + "\n" for r in rows if r["labels"])
    )
    code, err = invoke(["shard", str(single), str(tmp_path / "single-shards")])
    assert code == 0, err
    code, err = invoke(["evaluate", "--model", str(out), "--data", str(tmp_path / "single-shards"), "--device", "cpu"])
    assert code == 3 and "was trained on lists of labels (multi-label)" in err and "Traceback" not in err, err


def test_balanced_class_weights_weigh_each_class_positives_by_its_negatives(tmp_path):
    from job.data.manifest import load_manifest
    from job.recipe.build import MultiLabelLoss, positive_weights

    rows = mosaic_images(tmp_path, 60)
    path = manifests(tmp_path, rows)["jsonl"]
    data = load_manifest(DataConfig(kind="manifest", path=str(path), label_column="labels"), None, lambda _: None)
    y = data.train.y
    want = (len(y) - y.sum(0)) / y.sum(0)
    assert torch.allclose(positive_weights(data), want)
    logits = torch.randn(len(y), 3)
    plain = torch.nn.BCEWithLogitsLoss(pos_weight=want)(logits, y)
    assert torch.allclose(MultiLabelLoss(want)(logits, y), plain)
    ignored = torch.cat([y, torch.full((2, 3), -100.0)])  # a streamed sample that could not be decoded: left out
    assert torch.allclose(MultiLabelLoss(want)(torch.cat([logits, torch.randn(2, 3)]), ignored), plain)


def test_a_manifest_of_json_lists_streams_with_its_counts(tmp_path):
    out = tmp_path / "run"
    code, err, data = multilabel_run(tmp_path, out, "data.placement=stream", "train.epochs=1")
    assert code == 0, err
    assert "multilabel" in err.split("\nepoch ")[0] and "packing it into shards" in err
    d = json.loads((out / "data.json").read_text())
    rows = [json.loads(x) for x in (data / "labels.jsonl").read_text().splitlines()]
    assert sum(s["images"] for s in d["splits"].values()) == len(rows)
    per = {c: sum(s["per_class"][c] for s in d["splits"].values()) for c in COLOURS}
    assert per == {c: sum(c in r["labels"] for r in rows) for c in COLOURS}
    assert set(json.loads((out / "model.json").read_text())["thresholds"]) == set(COLOURS)


def test_a_streamed_manifest_reads_its_labels_as_the_held_one_does_and_repacks_for_another_separator(tmp_path):
    """data.placement=stream packs a manifest with data.label_separator and data.task as the held read takes them
    (the same multi-label counts), and a changed separator or task is another pack."""
    from job.data.manifest import load_manifest
    from job.data.read import load_data

    rows = mosaic_images(tmp_path, 40)
    table = manifests(tmp_path, rows)["csv_sep"]
    cfg = DataConfig(kind="manifest", path=str(table), label_column="labels", label_separator="|", val_split=0.2)
    held = load_manifest(cfg, None, lambda _: None)
    streamed = load_data(cfg.model_copy(update={"placement": "stream"}), tmp_path / "cache", lambda _: None)
    assert streamed.multilabel and streamed.classes == held.classes == sorted(COLOURS)
    assert streamed.inventory.to_json()["splits"] == held.inventory.to_json()["splits"]
    flags = cfg.model_copy(update={"path": str(table.with_name("flags.csv")), "placement": "stream"})
    assert (
        load_data(flags, tmp_path / "cache", print).inventory.to_json()["splits"]
        == (streamed.inventory.to_json()["splits"])
    )  # 0/1 columns, no label column
    other = load_data(cfg.model_copy(update={"placement": "stream", "label_separator": ";"}), tmp_path / "cache", print)
    assert other.source != streamed.source and other.classes != streamed.classes  # "red|green" is one name with ";"
    single = tmp_path / "one.jsonl"
    single.write_text("".join(json.dumps({"path": p, "label": (c or ["none"])[0]}) + "\n" for p, c in rows))
    one = DataConfig(kind="manifest", path=str(single), val_split=0.2, placement="stream")
    assert not load_data(one, tmp_path / "cache", print).multilabel
    listed = load_data(one.model_copy(update={"task": "multilabel"}), tmp_path / "cache", print)
    assert (
        listed.multilabel
        and listed.inventory.to_json()["splits"]
        == (load_manifest(one.model_copy(update={"task": "multilabel"}), None, print).inventory.to_json()["splits"])
    )


def predicted(tmp_path: Path, out: Path, data: Path, files: list[str], name: str) -> tuple[np.ndarray, np.ndarray]:
    """`job predict` of the run's model.pt on `files` (paths relative to the data folder): each file's probabilities
    and its 0/1 targets, in class order."""
    from conftest import invoke

    listed = tmp_path / f"{name}.jsonl"
    listed.write_text("".join(json.dumps({"path": str(data / p)}) + "\n" for p in files))
    pred = tmp_path / f"{name}-predicted.jsonl"
    code, err = invoke(["predict", "--model", str(out), "--device", "cpu", str(listed), "--output", str(pred)])
    assert code == 0, err
    got = {Path(r["path"]).name: r for r in map(json.loads, pred.read_text().splitlines())}
    truth = {Path(r["path"]).name: set(r["labels"]) for r in map(json.loads, (data / "labels.jsonl").open())}
    names = [Path(p).name for p in files]
    classes = sorted(COLOURS)
    p = np.array([[got[n]["probabilities"][c] for c in classes] for n in names])
    y = np.array([[c in truth[n] for c in classes] for n in names], dtype=int)
    return p, y


def test_with_no_val_split_thresholds_stay_at_one_half_and_nothing_is_fitted_on_test(tmp_path):
    """data.val_split=0: no threshold is the best cut on the test split. model.json's, the report's and the
    evaluations' test F1 and exact match are at 0.5, and the end line says so."""
    from sklearn.metrics import f1_score

    out = tmp_path / "run"
    code, err, data = multilabel_run(tmp_path, out, "data.val_split=0", "data.test_split=0.3", "train.epochs=2")
    assert code == 0, err
    card = json.loads((out / "model.json").read_text())
    assert card["thresholds"] == {c: 0.5 for c in sorted(COLOURS)}
    last = [r for r in metrics_of(out) if "train_loss" in r][-1]
    held = json.loads((out / "data.json").read_text())["held_out"]["test"]
    p, y = predicted(tmp_path, out, data, held, "test")  # model.pt: the final weights, which the last evaluation had
    assert abs(last["test_micro_f1"] - f1_score(y, p > 0.5, average="micro")) < 1e-9
    assert abs(last["test_exact_match"] - float(((p > 0.5) == y).all(1).mean())) < 1e-9
    with open(out / "report" / "test" / "classes.csv", newline="") as f:
        assert {float(r["threshold"]) for r in csv.DictReader(f)} == {0.5}
    end = err.strip().splitlines()[-1]
    assert "thresholds 0.5" in end, end
    ckpt = torch.load(sorted((out / "checkpoints").glob("*.pt"))[-1], weights_only=True)
    assert set(ckpt["model_json"]["thresholds"].values()) == {0.5}


def test_thresholds_are_those_of_the_evaluation_whose_weights_model_pt_and_each_checkpoint_hold(tmp_path):
    """Chosen on val micro F1: model.json's thresholds are each class's best-F1 cut on val of model.pt's own
    probabilities, and model.pt at them scores the chosen evaluation's val micro F1; a checkpoint of a later epoch
    holds its own weights' thresholds, not the chosen model's."""
    from sklearn.metrics import f1_score

    from job.recipe.multilabel import best_threshold

    out = tmp_path / "run"
    over = ("train.choose_on=val_micro_f1", "train.epochs=4", "optim.lr=0.01")
    code, err, data = multilabel_run(tmp_path, out, *over)
    assert code == 0, err
    evals = [r for r in metrics_of(out) if "train_loss" in r]
    chosen = max(evals, key=lambda r: r["val_micro_f1"])
    assert chosen["epoch"] != evals[-1]["epoch"]  # the case this test is about: model.pt is not the final model
    held = json.loads((out / "data.json").read_text())["held_out"]["val"]
    classes = sorted(COLOURS)

    def thresholds_fit(model: Path, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        p, y = predicted(tmp_path, model, data, held, name)
        return np.array([best_threshold(y[:, i], p[:, i]) for i in range(len(classes))]), p, y

    card = json.loads((out / "model.json").read_text())
    t = np.array([card["thresholds"][c] for c in classes])
    want, p, y = thresholds_fit(out, "val")
    assert np.allclose(t, want, atol=1e-5)
    assert abs(f1_score(y, p > t, average="micro") - chosen["val_micro_f1"]) < 1e-6
    last = torch.load(sorted((out / "checkpoints").glob("*.pt"))[-1], weights_only=True)
    assert last["progress"]["epoch"] == evals[-1]["epoch"]
    alone = tmp_path / "last"  # the checkpoint's weights as a model folder of their own
    alone.mkdir()
    torch.save(last["model"], alone / "model.pt")
    (alone / "model.json").write_text(json.dumps(last["model_json"]))
    (alone / "config.yaml").write_text((out / "config.yaml").read_text())
    own, _, _ = thresholds_fit(alone, "last")
    got = np.array([last["model_json"]["thresholds"][c] for c in classes])
    assert np.allclose(got, own, atol=1e-5) and not np.allclose(got, t, atol=1e-5)


def metrics_of(out: Path) -> list[dict]:
    from conftest import metrics

    return metrics(str(out))
