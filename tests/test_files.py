"""Files named by name and paths relative to the file that names them (job/data/files.py): names holding `[`, `]`,
`*`, `?` and spaces are names, never patterns, for every reader (a folder, `job shard`, `evaluate --data`, a
manifest, `predict`), locally and in a bucket (the GCS server on loopback); a manifest's `../` rows are found beside
the manifest, wherever it lives, never in the working directory."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from conftest import invoke, sets, write_image_folder

from job.config import DataConfig
from job.data.manifest import load_manifest
from job.errors import DataError
from job.use.evaluate import evaluate_on

# Names a phone, a scanner or a person gives files, each a pattern to fsspec's glob (and a space).
ODD = ("scan[1].png", "a*b.png", "what?.png", "with space.png", "[x] y.png")


def odd_folder(root: Path) -> Path:
    """Class folders (train/ and test/) whose first images carry ODD's names, and a plain `scan1.png` beside
    `scan[1].png` (the file the pattern `scan[1].png` matches)."""
    write_image_folder(root, per_class=10, test_per_class=4)
    for split in ("train", "test"):
        for folder in sorted((root / split).iterdir()):
            files = sorted(folder.iterdir())
            for f, name in zip(files, ODD if split == "train" else ODD[:2]):
                f.rename(folder / name)
    first = root / "train" / "class0"
    (first / "scan1.png").write_bytes((first / "a*b.png").read_bytes())
    return root


def test_fetch_named_reads_names_as_names_and_says_why_one_is_missing(tmp_path, bucket):
    from job.data.files import fetch_named

    root = odd_folder(tmp_path / "imgs")
    local = [str(root / "train/class0" / n) for n in ODD] + [str(root / "train/class0/gone.png")]
    got = fetch_named(local)
    assert [g == (root / "train/class0" / n).read_bytes() for g, n in zip(got, ODD)] == [True] * len(ODD)
    assert isinstance(got[-1], FileNotFoundError)
    bucket.put_tree(root, "imgs")
    remote = [bucket.url(f"imgs/train/class0/{n}") for n in ODD] + [bucket.url("imgs/train/class0/gone.png")]
    got = fetch_named(remote + [f"file://{local[0]}"])
    assert got[: len(ODD)] == [(root / "train/class0" / n).read_bytes() for n in ODD]
    assert isinstance(got[len(ODD)], FileNotFoundError) and got[-1] == (root / "train/class0" / ODD[0]).read_bytes()


def test_a_path_is_resolved_beside_the_file_that_names_it():
    from job.data.files import beside

    assert beside("gs://b/tables/labels.csv", "../imgs/a b.png") == "gs://b/imgs/a b.png"
    assert beside("gs://b/tables/labels.csv", "./x/../y/[1].png") == "gs://b/tables/y/[1].png"
    assert beside("gs://b/tables/labels.csv", "/gcs/b/imgs/a.png") == "/gcs/b/imgs/a.png"  # a local path (a mount)
    assert beside("gs://b/labels.csv", ".") == "gs://b" and beside("gs://b/labels.csv", "a.png") == "gs://b/a.png"
    assert beside("gs://b/t/labels.csv", "s3://other/a.png") == "s3://other/a.png"
    assert beside("/data/tables/labels.csv", "../imgs/a.png") == "/data/imgs/a.png"
    assert beside("/data/tables/labels.csv", "/elsewhere/a.png") == "/elsewhere/a.png"
    assert beside("file:///data/tables/labels.csv", "../imgs/a.png") == "file:///data/imgs/a.png"
    assert beside("labels.csv", "imgs/./a.png") == "imgs/a.png"
    assert beside("tables/labels.csv", "../../a.png") == "../a.png"  # a local path may climb out of the cwd
    with pytest.raises(DataError, match="above the bucket"):
        beside("gs://b/labels.csv", "../a.png")


def test_a_folder_of_names_with_pattern_characters_trains_packs_evaluates_and_predicts(tmp_path, bucket):
    root = odd_folder(tmp_path / "imgs")
    total = sum(1 for p in root.rglob("*.png"))
    bucket.put_tree(root, "imgs")
    for src in (str(root), bucket.url("imgs")):
        out = tmp_path / f"run-{src.split(':')[0]}"
        over = sets(
            "data.kind=folder",
            f"data.path={src}",
            "train.epochs=1",
            "data.batch_size=8",
            "data.val_split=0.2",
            "data.image_size=32",
        )
        code, err = invoke(["train", "--device", "cpu", "--config", "cifar10", "--output", str(out), *over])
        assert code == 0 and "Traceback" not in err, err
        d = json.loads((out / "data.json").read_text())
        assert sum(s["images"] for s in d["splits"].values()) == total and not d["skipped"], d
    dst = tmp_path / "shards"
    code, err = invoke(["shard", bucket.url("imgs"), str(dst), "--samples-per-shard", "8"])
    assert code == 0, err
    index = json.loads((dst / "index.json").read_text())
    assert sum(s["images"] for s in index["inventory"]["splits"].values()) == total, index["inventory"]
    run = tmp_path / "run-gs"
    code, err = invoke(
        ["evaluate", "--model", str(run), "--data", bucket.url("imgs/test"), "--device", "cpu", "--json"]
    )
    assert code == 0 and "Traceback" not in err, err
    assert evaluate_on(str(run), bucket.url("imgs/test"), "cpu")["samples"] == sum(1 for _ in root.glob("test/*/*"))
    for inputs in ([bucket.url("imgs/train/class0")], [str(root / "train/class0" / n) for n in ODD]):
        p = tmp_path / "p.csv"
        code, err = invoke(["predict", "--model", str(run), *inputs, "--device", "cpu", "--output", str(p)])
        assert code == 0, err
        with open(p, newline="") as f:
            rows = {Path(r["path"]).name: r for r in csv.DictReader(f)}
        assert set(ODD) <= set(rows) and not any(r["error"] for r in rows.values()), rows


def odd_manifest(tmp_path: Path) -> tuple[Path, int]:
    """tables/labels.csv naming imgs/'s training images as `../imgs/...` (the odd names among them), and how many."""
    root = odd_folder(tmp_path / "imgs")
    (tmp_path / "tables").mkdir()
    table = tmp_path / "tables" / "labels.csv"
    rows = [(f"../imgs/{p.relative_to(root).as_posix()}", p.parent.name) for p in sorted(root.glob("train/*/*.png"))]
    with open(table, "w", newline="") as f:
        csv.writer(f).writerows([("path", "label"), *rows])
    return table, len(rows)


def test_a_manifests_parent_relative_rows_are_read_beside_it_locally_and_in_a_bucket(tmp_path, bucket):
    """The working directory (this checkout) holds no imgs/: a row read against it would be missing."""
    table, n = odd_manifest(tmp_path)
    bucket.put_tree(tmp_path / "imgs", "imgs")
    bucket.put_tree(tmp_path / "tables", "tables")
    for url in (str(table), bucket.url("tables/labels.csv")):
        data = load_manifest(DataConfig(kind="manifest", path=url, val_split=0.2), None, lambda _: None)
        counted = len(data.train) + len(data.val)
        assert counted == n and not data.inventory.skipped, (url, data.inventory.skipped)
        dst = table.parent.parent / f"shards-{url.split(':')[0]}"
        code, err = invoke(["shard", url, str(dst), "--val-split", "0.2"])
        assert code == 0, err
        index = json.loads((dst / "index.json").read_text())
        assert (
            sum(s["images"] for s in index["inventory"]["splits"].values()) == n and not index["inventory"]["skipped"]
        )
    run = tmp_path / "run"
    over = sets(
        "data.kind=manifest",
        f"data.path={bucket.url('tables/labels.csv')}",
        "train.epochs=1",
        "data.image_size=32",
        "data.val_split=0.2",
    )
    code, err = invoke(["train", "--device", "cpu", "--config", "cifar10", "--output", str(run), *over])
    assert code == 0, err
    assert evaluate_on(str(run), str(table), "cpu")["samples"] == n
    p = tmp_path / "p.csv"
    code, err = invoke(
        ["predict", "--model", str(run), bucket.url("tables/labels.csv"), "--device", "cpu", "-o", str(p)]
    )
    assert code == 0 and f"{n} images labelled" in err, err


def test_a_manifest_whose_rows_are_all_missing_names_where_it_looked(tmp_path):
    table = tmp_path / "tables" / "labels.csv"
    table.parent.mkdir()
    table.write_text("path,label,split\n../imgs/a.png,x,train\n../imgs/b.png,y,train\n../imgs/c.png,x,val\n")
    with pytest.raises(DataError, match=f"e.g. {tmp_path}/imgs/a.png"):
        load_manifest(DataConfig(kind="manifest", path=str(table), val_split=0.2), None, lambda _: None)


def test_a_manifest_at_a_buckets_root_reads_its_folder_and_names_a_row_that_climbs_out(tmp_path, bucket):
    root = odd_folder(tmp_path / "imgs")
    bucket.put_tree(root, "imgs")
    rows = [(f"imgs/{p.relative_to(root).as_posix()}", p.parent.name) for p in sorted(root.glob("train/*/*.png"))]
    table = "path,label\n" + "".join(f"{p},{c}\n" for p, c in rows) + "../outside.png,class0\n"
    bucket.fs.pipe_file(f"{bucket.name}/labels.csv", table.encode())
    lines: list[str] = []
    cfg = DataConfig(kind="manifest", path=bucket.url("labels.csv"), val_split=0.2)
    data = load_manifest(cfg, tmp_path / "cache", lines.append)
    assert len(data.train) + len(data.val) == len(rows)
    assert [(s["path"], "above the bucket" in s["reason"]) for s in data.inventory.skipped] == [
        ("../outside.png", True)
    ]
    assert any(f"files of {bucket.url()} " in line for line in lines), lines  # the folder reader's one fetch, cached


def test_predicts_inputs_are_named_in_the_form_given(tmp_path, monkeypatch):
    """A glob's matches come back as the pattern was written (relative, absolute or a URL, never file://), and a
    file whose name holds pattern characters is that file when it exists."""
    from job.use.inputs import listed

    root = odd_folder(tmp_path / "imgs")
    monkeypatch.chdir(tmp_path)
    names = [n for n, _ in listed(["imgs/train/class0/*.png"])]
    assert "imgs/train/class0/scan1.png" in names and all(not n.startswith(("/", "file:")) for n in names), names
    names = [n for n, _ in listed([f"{root}/train/class0/a*b.png", "imgs/train/class0/scan[1].png"])]
    assert names == [f"{root}/train/class0/a*b.png", "imgs/train/class0/scan[1].png"], names


def test_evaluate_of_a_run_whose_relative_data_path_is_not_found_from_here_is_one_line(tmp_path, monkeypatch):
    """A run trained with data.path ../imgs from one folder, evaluated from another: its data is not where the path
    says from here; one line naming the path and the way on (exit 3), never a traceback."""
    odd_folder(tmp_path / "imgs")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    over = sets("data.kind=folder", "data.path=../imgs", "train.epochs=1", "data.image_size=32")
    code, err = invoke(["train", "--device", "cpu", "--config", "cifar10", "--output", "../run", *over])
    assert code == 0, err
    monkeypatch.chdir(tmp_path)
    code, err = invoke(["evaluate", "--checkpoint", "run", "--device", "cpu"])
    assert code == 3 and "Traceback" not in err and "data.path ../imgs" in err and "--data" in err, err


def test_export_of_a_manifests_run_is_checked_on_its_held_out_rows(tmp_path):
    table, n = odd_manifest(tmp_path)
    run = tmp_path / "run"
    over = sets(
        "data.kind=manifest", f"data.path={table}", "train.epochs=1", "data.image_size=32", "data.val_split=0.3"
    )
    code, err = invoke(["train", "--device", "cpu", "--config", "cifar10", "--output", str(run), *over])
    assert code == 0, err
    code, err = invoke(["export", "--model", str(run), "--format", "onnx"])
    assert code == 0, err
    check = json.loads((run / "model.onnx.check.json").read_text())
    assert check["labels_agree"] and 0 < check["images"] < n, check
