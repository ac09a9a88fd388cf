"""data.kind parquet: the Hugging Face hub's layout written by the `datasets` package itself (Image and ClassLabel
features, data/<split>-00000-of-00001.parquet), read from a folder and from a bucket alike; images by path beside the
file; a table of features read as a CSV table is; and bad input named in one line."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import encode, invoke, pattern_images, sets
from PIL import Image

from job.config import DataConfig
from job.data.parquet import load_parquet, split_of
from job.errors import DataError

NAMES = ["cat", "dog", "fox"]
FEATURES = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=NAMES)})


def pictures(per_class: int, seed: int) -> tuple[list[Image.Image], list[int]]:
    images, labels = pattern_images(len(NAMES), per_class, 16, seed)
    return [Image.fromarray(img.transpose(1, 2, 0)) for img in images], labels


def hub_dataset(root: Path, splits: dict[str, int] | None = None) -> Path:
    """root/data/<split>-00000-of-00001.parquet, written by datasets.Dataset.to_parquet; `splits`: images per class."""
    for i, (split, per_class) in enumerate((splits or {"train": 12, "validation": 3, "test": 4}).items()):
        images, labels = pictures(per_class, seed=i)
        ds = datasets.Dataset.from_dict({"image": images, "label": labels}, features=FEATURES)
        (root / "data").mkdir(parents=True, exist_ok=True)
        ds.to_parquet(str(root / "data" / f"{split}-00000-of-00001.parquet"))
    return root


def counts(data) -> dict:
    return {s: data.inventory.counts[s] for s in ("train", "val", "test")}


def test_split_from_file_names():
    assert split_of("data/train-00000-of-00004.parquet") == "train"
    assert split_of("data/validation-00000-of-00001.parquet") == "val"
    assert split_of("plain_text/test-00000-of-00001.parquet") == "test"
    assert split_of("default/train/0000.parquet") == "train"
    assert split_of("data/unsupervised-00000-of-00001.parquet") is None


def test_the_hub_layout_reads_classes_splits_and_pixels(tmp_path):
    root = hub_dataset(tmp_path / "ds")
    data = load_parquet(DataConfig(kind="parquet", path=str(root)), None, print)
    assert data.classes == NAMES
    assert counts(data) == {s: {c: n for c in NAMES} for s, n in (("train", 12), ("val", 3), ("test", 4))}
    images, labels = pictures(4, seed=2)
    assert data.test.names == [f"data/test-00000-of-00001.parquet:{i}" for i in range(12)]  # rows in order
    for i in (0, 11):
        assert np.array_equal(data.test.x[i].numpy().transpose(1, 2, 0), np.asarray(images[i]))
    assert data.test.y.tolist() == labels


def test_no_val_file_holds_val_out_by_the_row_key_hash(tmp_path):
    root = hub_dataset(tmp_path / "ds", {"train": 30, "test": 4})
    cfg = DataConfig(kind="parquet", path=str(root), val_split=0.2)
    data = load_parquet(cfg, None, print)
    from job.data.split import Roles

    role = Roles(42, 0.2, 0.0)
    keys = [f"data/train-00000-of-00001.parquet:{i}" for i in range(90)]
    assert sorted(data.val.names) == sorted(k for k in keys if role(k) == "val")
    assert sorted(data.inventory.held_out["val"]) == sorted(data.val.names)
    assert 0 < len(data.val) < 40


def test_trains_from_a_folder_and_from_a_bucket_alike(tmp_path, bucket):
    root = hub_dataset(tmp_path / "ds")
    bucket.put_tree(root, "ds")
    seen = []
    for where, out in ((str(root), tmp_path / "local"), (bucket.url("ds"), tmp_path / "remote")):
        over = sets("data.kind=parquet", f"data.path={where}", "model.name=cifar_cnn", "train.epochs=1",
                    "data.batch_size=8", "data.image_size=32")  # fmt: skip
        code, err = invoke(["train", "--output", str(out), "--device", "cpu", *over])
        assert code == 0, err
        seen.append(json.loads((out / "data.json").read_text()))
    for record in seen:
        assert record["classes"] == NAMES
        assert record["splits"]["train"]["images"] == 36 and record["splits"]["test"]["images"] == 12
    assert seen[0]["splits"] == seen[1]["splits"]
    code, err = invoke(["evaluate", "--checkpoint", str(tmp_path / "local"), "--device", "cpu", "--data", str(root)])
    assert code == 0, err


def test_images_by_path_beside_the_file_and_a_struct_with_neither_is_skipped(tmp_path):
    images, labels = pattern_images(2, 6, 16, 0)
    (tmp_path / "pics").mkdir()
    structs = []
    for i, img in enumerate(images):
        (tmp_path / "pics" / f"{i}.png").write_bytes(encode(img))
        structs.append({"bytes": None, "path": f"pics/{i}.png"})
    structs[3] = {"bytes": None, "path": None}
    table = pa.table({"image": structs, "label": [["a", "b"][k] for k in labels]})
    pq.write_table(table, tmp_path / "train.parquet")
    logged: list[str] = []
    cfg = DataConfig(kind="parquet", path=str(tmp_path / "train.parquet"), val_split=0.3)
    data = load_parquet(cfg, None, logged.append)
    assert data.classes == ["a", "b"]
    assert data.inventory.skipped == [
        {"path": "train.parquet:3", "reason": "an image struct with neither bytes nor path"}
    ]
    assert any("train.parquet:3" in line for line in logged)
    assert len(data.train) + len(data.val) == 11
    with pytest.raises(DataError, match="neither bytes nor path"):
        load_parquet(cfg.model_copy(update={"skip_bad_samples": False}), None, print)


def test_a_table_of_features_reads_as_a_csv_table(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 3))
    y = (x[:, 0] > 0).astype(int)
    ds = datasets.Dataset.from_dict(
        {"a": x[:, 0], "b": x[:, 1], "c": x[:, 2], "label": y},
        features=datasets.Features({k: datasets.Value("float64") for k in "abc"}
                                   | {"label": datasets.ClassLabel(names=["low", "high"])}),
    )  # fmt: skip
    (tmp_path / "data").mkdir()
    ds.to_parquet(str(tmp_path / "data" / "train-00000-of-00001.parquet"))
    cfg = DataConfig(kind="parquet", path=str(tmp_path), target="label", val_split=0.0)
    data = load_parquet(cfg, None, print)
    assert data.classes == ["high", "low"]
    assert data.features["columns"] == ["a", "b", "c"]
    assert len(data.train) + len(data.test) == 60


def bad(tmp_path: Path, *over: str) -> str:
    code, err = invoke(["train", "--output", str(tmp_path / "run"), "--device", "cpu", *sets(*over)])
    assert code == 3, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_parquet_file_cut_short_is_named(tmp_path):
    root = hub_dataset(tmp_path / "ds")
    f = root / "data" / "validation-00000-of-00001.parquet"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    line = bad(tmp_path, "data.kind=parquet", f"data.path={root}")
    assert "validation-00000-of-00001.parquet" in line and "cut short" in line


def test_a_label_not_in_the_class_label_names_is_named(tmp_path):
    images, _ = pictures(2, 0)
    table = pa.table({"image": [{"bytes": encode(np.asarray(i).transpose(2, 0, 1)), "path": None} for i in images],
                      "label": [0, 1, 2, 7, 0, 1]})  # fmt: skip
    meta = {"info": {"features": {"image": {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": NAMES}}}}
    table = table.replace_schema_metadata({"huggingface": json.dumps(meta)})
    pq.write_table(table, tmp_path / "train.parquet")
    line = bad(tmp_path, "data.kind=parquet", f"data.path={tmp_path / 'train.parquet'}")
    assert "row 3" in line and "7" in line and "ClassLabel" in line


def label_lists(path: Path, labels: list[list[int]]) -> Path:
    """A parquet file of Sequence(ClassLabel) labels, written by the `datasets` package."""
    images, _ = pictures(len(labels), 0)
    ds = datasets.Dataset.from_dict(
        {"image": images[: len(labels)], "labels": labels},
        features=datasets.Features(
            {"image": datasets.Image(), "labels": datasets.Sequence(datasets.ClassLabel(names=NAMES))}
        ),
    )
    ds.to_parquet(str(path))
    return path


def test_a_sequence_of_class_labels_is_read_as_multilabel_targets(tmp_path):
    labels = [[0, 1], [2], [], [1, 2, 0], [1]] * 4
    f = label_lists(tmp_path / "train.parquet", labels)
    data = load_parquet(DataConfig(kind="parquet", path=str(f), label_column="labels", val_split=0.3), None, print)
    assert data.classes == NAMES and data.multilabel
    every = torch.cat([data.train.y, data.val.y])
    assert len(every) == len(labels) and int((every.sum(1) == 0).sum()) == 4  # images with no label are kept
    assert every.sum(0).long().tolist() == [sum(1 for row in labels if k in row) for k in range(3)]
    d = data.inventory.to_json()["splits"]
    assert d["train"]["images"] + d["val"]["images"] == len(labels)


def test_a_label_list_with_an_index_not_in_the_class_label_names_is_named(tmp_path):
    images, _ = pictures(2, 0)
    table = pa.table({"image": [{"bytes": encode(np.asarray(i).transpose(2, 0, 1)), "path": None} for i in images],
                      "labels": [[0], [1, 2], [], [7, 0], [0], [1]]})  # fmt: skip
    seq = {"_type": "Sequence", "feature": {"_type": "ClassLabel", "names": NAMES}}
    meta = {"info": {"features": {"image": {"_type": "Image"}, "labels": seq}}}
    table = table.replace_schema_metadata({"huggingface": json.dumps(meta)})
    pq.write_table(table, tmp_path / "train.parquet")
    line = bad(tmp_path, "data.kind=parquet", f"data.path={tmp_path / 'train.parquet'}", "data.label_column=labels")
    assert "row 3" in line and "7" in line and "ClassLabel" in line


def killed_and_resumed(tmp_path: Path, args: list[str]) -> str:
    """A run of `args` SIGKILLed after its first commit (tmp_path/killed), resumed to two epochs past it, and the
    same run never stopped (tmp_path/reference): the same run. The killed attempt's console."""
    import signal
    import time

    from conftest import assert_same_run, pointer, run_job, start_job

    out = tmp_path / "killed"
    proc = start_job("train", *args, "--set", "train.epochs=100000000", "--output", str(out))
    deadline = time.time() + 300
    while not (out / "checkpoints" / "latest.json").is_file() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended by itself"
    proc.kill()
    _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err[-2000:]
    end = f"train.epochs={pointer(str(out))['epoch'] + 2}"
    final = run_job("train", *args, "--set", end, "--output", str(out))
    assert final.returncode == 0 and "resuming" in final.stderr, final.stderr[-2000:]
    reference = run_job("train", *args, "--set", end, "--output", str(tmp_path / "reference"))
    assert reference.returncode == 0, reference.stderr[-2000:]
    assert_same_run(str(tmp_path / "reference"), str(out))
    return err


def test_streamed_from_a_bucket_packs_the_rows_and_a_sigkill_resumes_exactly(tmp_path, bucket):
    """data.placement=stream: the rows packed into shards a row group at a time, with the classes and counts the
    held read gives, their small images kept decoded (an epoch decodes nothing); a run killed after its first commit
    and resumed from the pack of pixels equals one that never stopped."""
    root = hub_dataset(tmp_path / "ds", {"train": 20, "validation": 3, "test": 4})
    bucket.put_tree(root, "ds")
    args = ["--device", "cpu", *sets("data.kind=parquet", f"data.path={bucket.url('ds')}", "data.placement=stream",
            "data.workers=0", "data.image_size=32", "data.batch_size=8", "model.name=cifar_cnn",
            "train.checkpoint_every_epochs=1")]  # fmt: skip
    out = tmp_path / "killed"
    err = killed_and_resumed(tmp_path, args)
    assert "packing it into shards" in err and "streamed, images of at most 256 pixels kept decoded in its pack" in err
    record = json.loads((out / "data.json").read_text())
    held = load_parquet(DataConfig(kind="parquet", path=str(root)), None, print)
    assert record["classes"] == NAMES
    assert {s: v["per_class"] for s, v in record["splits"].items()} == counts(held)


def test_sequence_class_labels_stream_and_a_sigkill_resumes_exactly(tmp_path):
    """Multi-label parquet streamed (data.placement=stream): packed with each sample's 0/1 targets, the counts of
    the held read; a run killed after its first commit and resumed equals one that never stopped, thresholds too."""
    rng = np.random.default_rng(3)
    labels = [sorted(int(k) for k in np.flatnonzero(rng.random(3) < 0.4)) for _ in range(60)]
    f = label_lists(tmp_path / "ds" / "train.parquet", labels)
    args = ["--device", "cpu", *sets("data.kind=parquet", f"data.path={f}", "data.placement=stream",
            "data.label_column=labels", "data.val_split=0.3", "data.workers=0", "data.image_size=32",
            "data.batch_size=8", "model.name=cifar_cnn", "train.checkpoint_every_epochs=1")]  # fmt: skip
    out = tmp_path / "killed"
    assert "multilabel" in killed_and_resumed(tmp_path, args).split("\nepoch ")[0]
    a, b = (json.loads((tmp_path / r / "model.json").read_text()) for r in ("reference", "killed"))
    assert a["thresholds"] == b["thresholds"] and set(a["thresholds"]) == set(NAMES)
    record = json.loads((out / "data.json").read_text())
    held = load_parquet(
        DataConfig(kind="parquet", path=str(f), label_column="labels", val_split=0.3, test_split=0.2), None, print
    )  # the default preset (iris) holds test_split 0.2 out
    assert {s: v["per_class"] for s, v in record["splits"].items()} == held.inventory.counts
    assert sum(v["images"] for v in record["splits"].values()) == len(labels)


def test_data_task_multilabel_on_one_class_labels_is_one_line(tmp_path):
    root = hub_dataset(tmp_path / "ds", {"train": 4, "test": 2})
    over = sets("data.kind=parquet", f"data.path={root}", "data.task=multilabel")
    code, err = invoke(["train", "--output", str(tmp_path / "run"), "--device", "cpu", *over])
    last = err.strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in err and last.startswith("error: data.task=multilabel"), err


def test_data_kind_is_found_from_parquet_files_in_a_bucket_and_in_one_file(tmp_path, bucket):
    """No data.kind given (the default preset's csv): a bucket's hub layout and one local .parquet table are read as
    parquet, config.yaml records it and the start-up says so; a kind the user names otherwise is kept."""
    root = hub_dataset(tmp_path / "ds", {"train": 6, "test": 2})
    bucket.put_tree(root, "ds")
    over = sets(f"data.path={bucket.url('ds')}", "model.name=cifar_cnn", "train.epochs=1", "data.batch_size=8",
                "data.image_size=32")  # fmt: skip
    code, err = invoke(["train", "--output", str(tmp_path / "images"), "--device", "cpu", *over])
    assert code == 0, err
    assert "data.kind parquet, found from the files" in err
    assert "kind: parquet" in (tmp_path / "images" / "config.yaml").read_text()
    assert json.loads((tmp_path / "images" / "data.json").read_text())["classes"] == NAMES
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 2))
    pq.write_table(pa.table({"a": x[:, 0], "b": x[:, 1], "species": np.where(x[:, 0] > 0, "hi", "lo")}),
                   tmp_path / "table.parquet")  # fmt: skip
    over = sets(f"data.path={tmp_path / 'table.parquet'}", "train.epochs=2")
    code, err = invoke(["train", "--output", str(tmp_path / "table"), "--device", "cpu", *over])
    assert code == 0, err
    assert "data.kind parquet, found from the files" in err
    assert json.loads((tmp_path / "table" / "model.json").read_text())["classes"] == ["hi", "lo"]
    code, err = invoke(["train", "--output", str(tmp_path / "folder"), "--device", "cpu",
                        *sets("data.kind=folder", f"data.path={root}", "train.epochs=1")])  # fmt: skip
    assert code == 3 and "found from the files" not in err, err


def predicted(tmp_path: Path, run: Path, *inputs: str) -> list[dict]:
    out = tmp_path / f"p{len(list(tmp_path.glob('p*.csv')))}.csv"
    code, err = invoke(["predict", "--model", str(run), *inputs, "--device", "cpu", "--output", str(out)])
    assert code == 0, err
    import csv

    with open(out, newline="") as f:
        return list(csv.DictReader(f))


def test_predict_labels_each_rows_image_of_a_parquet_file_folder_or_bucket_and_a_tables_rows(tmp_path, bucket):
    """predict on parquet: every row's image, named <file>#<row> (or by its image's path), with the probabilities the
    same picture as a PNG file gets, from a folder, one file and a bucket alike; a struct with neither bytes nor path
    gets its error row; a parquet table's rows predicted with a table's model as a CSV's are."""
    root = hub_dataset(tmp_path / "ds", {"train": 6, "test": 2})
    run = tmp_path / "run"
    over = sets(
        f"data.path={root}", "model.name=cifar_cnn", "train.epochs=1", "data.batch_size=8", "data.image_size=32"
    )
    code, err = invoke(["train", "--output", str(run), "--device", "cpu", *over])
    assert code == 0, err
    test = root / "data" / "test-00000-of-00001.parquet"
    rows = predicted(tmp_path, run, str(root))
    assert len(rows) == 24 and not any(r["error"] for r in rows)
    assert sum(r["path"].startswith(f"{test}#") for r in rows) == 6
    images, _ = pictures(2, seed=1)
    pngs = []
    for i in (0, 5):
        pngs.append(tmp_path / f"t{i}.png")
        images[i].save(pngs[-1])
    by_file = {Path(r["path"]).name: r for r in predicted(tmp_path, run, *map(str, pngs))}
    bucket.put_tree(root, "ds")
    for given in (str(test), bucket.url("ds/data/test-00000-of-00001.parquet")):
        rows = {r["path"]: r for r in predicted(tmp_path, run, given)}
        assert list(rows) == [f"{given}#{i}" for i in range(6)]
        for i in (0, 5):
            assert rows[f"{given}#{i}"]["label"] == by_file[f"t{i}.png"]["label"]
            assert float(rows[f"{given}#{i}"]["probability"]) == pytest.approx(
                float(by_file[f"t{i}.png"]["probability"])
            )
    code, err = invoke(["evaluate", "--checkpoint", str(run), "--device", "cpu", "--data", bucket.url("ds")])
    assert code == 0, err
    (tmp_path / "pics").mkdir()
    structs = []
    for png in pngs:
        (tmp_path / "pics" / png.name).write_bytes(png.read_bytes())
        structs.append({"bytes": None, "path": f"pics/{png.name}"})
    structs.append({"bytes": None, "path": None})
    pq.write_table(pa.table({"image": structs}), tmp_path / "paths.parquet")
    rows = predicted(tmp_path, run, str(tmp_path / "paths.parquet"))
    assert [r["path"] for r in rows] == ["pics/t0.png", "pics/t5.png", f"{tmp_path / 'paths.parquet'}#2"]
    assert [r["label"] for r in rows[:2]] == [by_file["t0.png"]["label"], by_file["t5.png"]["label"]]
    assert "neither bytes nor path" in rows[2]["error"]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 2))
    pq.write_table(pa.table({"a": x[:, 0], "b": x[:, 1], "species": np.where(x[:, 0] > 0, "hi", "lo")}),
                   tmp_path / "table.parquet")  # fmt: skip
    code, err = invoke(["train", "--output", str(tmp_path / "tab"), "--device", "cpu",
                        *sets(f"data.path={tmp_path / 'table.parquet'}", "train.epochs=50")])  # fmt: skip
    assert code == 0, err
    (tmp_path / "table.csv").write_text("b,a\n" + "".join(f"{b},{a}\n" for a, b in x.tolist()))
    as_parquet = predicted(tmp_path, tmp_path / "tab", str(tmp_path / "table.parquet"))
    as_csv = predicted(tmp_path, tmp_path / "tab", str(tmp_path / "table.csv"))
    assert [r["path"] for r in as_parquet] == [f"{tmp_path / 'table.parquet'}#{i}" for i in range(40)]
    assert [(r["label"], r["probability"]) for r in as_parquet] == [(r["label"], r["probability"]) for r in as_csv]
