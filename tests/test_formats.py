"""job/data/formats.py: a data format added in one file (here, one module written to tmp, as a user's would be) trains,
streams, shards, predicts and evaluates through the registry, with no other module knowing its name; and the
registry knows the formats that ship."""

from __future__ import annotations

import base64
import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest
from conftest import encode, invoke, pattern_images, sets

from job.data import formats

# A whole format: a JSON file of base64 PNGs by split, {"train": [[key, class, png], ...], "test": [...]}.
TOY_MODULE = """
import base64
import json

from job.data.files import source
from job.data.folder import check_files, held
from job.data.formats import Format
from job.data.items import Listed
from job.data.split import Files

SUFFIX = ".toy.json"


def read(url):
    src = source(url)
    data = json.loads(src.fs.cat_file(src.path))
    files, content = Files(), {}
    for split, rows in data.items():
        for key, label, png in rows:
            files.roles[split].append((key, label))
            content[key] = base64.b64decode(png)
    return files, content, sorted({c for _, c in files.roles["train"]})


class Images:
    def __init__(self, content):
        self.content = content

    def __iter__(self):
        return iter(self.content.items())

    def missing(self):
        return []


def load(cfg, cache, log, src=None, started=None):
    files, content, classes = read(cfg.path)
    check_files(files, classes, cfg.path)
    return held(files, content.__getitem__, classes, cfg, cfg.path, f"toy {cfg.path}", log)


def scored(cfg, log, classes, pre):
    files, content, _ = read(cfg.path)
    return held(files, content.__getitem__, classes, cfg, cfg.path, f"toy {cfg.path}", log, scoring=True, pre=pre)


def items(src, hold, columns, log):
    files, content, classes = read(src.url)
    check_files(files, classes, src.url)
    return Listed(Images(content), files, classes)


def rows(url, chunk):
    _, content, _ = read(url)
    named = [(f"{url}#{key}", data, "") for key, data in content.items()]
    for start in range(0, len(named), chunk):
        yield named[start : start + chunk]


FORMAT = Format(
    "toy",
    load,
    about="a JSON file of base64 PNGs by split",
    holds=lambda url: url.endswith(SUFFIX),
    items=items,
    listed=lambda src, columns: {src.path: src.fs.info(src.path)},
    scored=scored,
    suffixes=(SUFFIX,),
    rows=rows,
)
"""


@pytest.fixture
def toy(tmp_path: Path):
    """The toy format's module, written to a file and registered; unregistered after the test."""
    path = tmp_path / "toy_format.py"
    path.write_text(TOY_MODULE)
    spec = importlib.util.spec_from_file_location("toy_format", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["toy_format"] = module
    spec.loader.exec_module(module)
    formats.register(module.FORMAT)
    yield module
    formats.REGISTERED.pop("toy", None)
    sys.modules.pop("toy_format", None)


def test_the_formats_that_ship_are_registered_each_by_its_own_module():
    assert formats.names()[:6] == ["csv", "cifar10", "folder", "manifest", "parquet", "shards"]
    for name in formats.names():
        fmt = formats.format_named(name)
        assert fmt.name == name and callable(fmt.load)
    assert formats.found("x/train.jsonl").name == "manifest" and formats.found("nowhere/").name == "folder"


def test_an_unknown_data_kind_is_one_line(tmp_path):
    code, err = invoke(["train", "--output", str(tmp_path / "r"), *sets("data.kind=toy")])
    assert code == 2 and "data.kind: expected one of" in err and "Traceback" not in err


def balanced(path: Path, seed: int) -> Path:
    """A toy file whose splits each hold both classes."""
    images, labels = pattern_images(2, 24, 16, seed)
    names, rows = ["lo", "hi"], {"train": [], "val": [], "test": []}
    for i, (img, label) in enumerate(zip(images, labels)):
        split = ("train", "train", "train", "train", "val", "test")[i % 6]
        rows[split].append([f"s{i:03d}", names[label], base64.b64encode(encode(img)).decode()])
    path.write_text(json.dumps(rows))
    return path


def test_a_format_added_in_one_file_trains_streams_shards_predicts_and_evaluates(tmp_path, toy):
    data = balanced(tmp_path / "pics.toy.json", seed=0)
    over = ("model.name=cifar_cnn", "train.epochs=1", "data.batch_size=8", "data.image_size=32")
    run = tmp_path / "run"
    code, err = invoke(["train", "--output", str(run), "--device", "cpu",
                        *sets("data.kind=toy", f"data.path={data}", *over)])  # fmt: skip
    assert code == 0, err
    record = json.loads((run / "data.json").read_text())
    assert record["classes"] == ["hi", "lo"]
    assert {s: record["splits"][s]["images"] for s in ("train", "val", "test")} == {"train": 32, "val": 8, "test": 8}

    streamed = tmp_path / "streamed"
    code, err = invoke(["train", "--output", str(streamed), "--device", "cpu",
                        *sets("data.kind=toy", f"data.path={data}", "data.placement=stream", *over)])  # fmt: skip
    assert code == 0, err
    assert "packing it into shards" in err or "from its shards" in err, err
    assert json.loads((streamed / "data.json").read_text())["classes"] == ["hi", "lo"]

    dst = tmp_path / "shards"
    code, err = invoke(["shard", str(data), str(dst)])
    assert code == 0, err
    index = json.loads((dst / "index.json").read_text())
    assert index["classes"] == ["hi", "lo"]
    assert {s: sum(e["nsamples"] for e in index["splits"][s]) for s in ("train", "val", "test")} == {
        "train": 32,
        "val": 8,
        "test": 8,
    }
    code, err = invoke(["train", "--output", str(tmp_path / "from-shards"), "--device", "cpu",
                        *sets("data.kind=shards", f"data.path={dst}", *over)])  # fmt: skip
    assert code == 0, err

    out = tmp_path / "predicted.csv"
    code, err = invoke(["predict", "--model", str(run), str(data), "--device", "cpu", "--output", str(out)])
    assert code == 0, err
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 48 and not any(r["error"] for r in rows)
    assert rows[0]["path"] == f"{data}#s000" and {r["label"] for r in rows} <= {"hi", "lo"}

    report = tmp_path / "report"
    code, err = invoke(["evaluate", "--checkpoint", str(run), "--device", "cpu", "--data", str(data),
                        "--report", str(report)])  # fmt: skip
    assert code == 0, err
    assert (report / "test" / "classes.csv").is_file()


def test_a_format_without_items_cannot_be_packed(tmp_path, toy):
    formats.register(formats.Format("toy", toy.load, holds=toy.FORMAT.holds))
    data = balanced(tmp_path / "pics.toy.json", seed=1)
    code, err = invoke(["shard", str(data), str(tmp_path / "shards")])
    assert code == 2 and "data.kind toy cannot be packed into shards" in err and "Traceback" not in err
