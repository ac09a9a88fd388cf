"""`job predict`: a trained run's model labels new photos (real files: EXIF-turned JPEGs, PNG, a broken file and an
empty one) to CSV, JSONL and standard output, from and to gs:// (the GCS server on loopback), with the logits of the
run's own evaluation."""

from __future__ import annotations

import contextlib
import csv
import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import invoke, sets
from PIL import Image, ImageOps
from test_photos import photo_folder, saved, turned_jpeg


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(run folder, folder of new photos: 6 per class, half of them turned by EXIF, plus a broken and an empty file)."""
    root = tmp_path_factory.mktemp("predict")
    photos = photo_folder(root / "photos")
    over = sets(
        "data.kind=folder",
        f"data.path={photos}",
        "data.image_size=32",
        "data.val_split=0.3",
        "optim.name=adamw",
        "optim.lr=0.003",
        "train.epochs=4",
        "data.batch_size=16",
    )
    code, err = invoke(["train", "--device", "cpu", "--config", "cifar10", "--output", str(root / "run"), *over])
    assert code == 0, err
    new = root / "new"
    new.mkdir()
    for name in ("cats", "dogs", "owls"):
        for i, p in enumerate(sorted((photos / name).rglob("IMG_0*"))[:6]):
            img = ImageOps.exif_transpose(Image.open(p)).convert("RGB") if i % 2 else None  # upright, stored turned
            data = turned_jpeg(img, 8) if img is not None else p.read_bytes()
            (new / f"{name}_{i}.jpg").write_bytes(data)
    (new / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 cut")
    (new / "empty.png").write_bytes(b"")
    return root / "run", new


def rows_of(path: Path) -> dict[str, dict]:
    if path.suffix == ".jsonl":
        return {Path(r["path"]).name: r for r in map(json.loads, path.read_text().splitlines())}
    with open(path, newline="") as f:
        return {Path(r["path"]).name: r for r in csv.DictReader(f)}


def test_predict_labels_new_photos_to_csv_and_jsonl_with_an_error_row_per_bad_file(trained, tmp_path):
    run, new = trained
    code, err = invoke(
        ["predict", "--model", str(run), str(new), "--device", "cpu", "--output", str(tmp_path / "p.csv")]
    )
    assert code == 0, err
    rows = rows_of(tmp_path / "p.csv")
    assert len(rows) == 20 and "18 images labelled, 2 could not be read" in err
    from job.storage.sync import FILE_MODE

    assert (tmp_path / "p.csv").stat().st_mode & 0o777 == FILE_MODE  # as readable as any file the user makes
    assert (
        rows["broken.jpg"]["error"]
        and rows["empty.png"]["error"] == f"cannot decode image {new}/empty.png: an empty file"
    )
    right = sum(1 for n, r in rows.items() if not r["error"] and r["label"] == n.split("_")[0])
    assert right >= 16, rows  # turned photos included: read upright
    code, err = invoke(
        ["predict", "-m", str(run), f"{new}/*.jpg", "--device", "cpu", "--top-k", "3", "-o", str(tmp_path / "p.jsonl")]
    )
    assert code == 0, err
    lines = rows_of(tmp_path / "p.jsonl")
    assert len(lines) == 19 and all(len(r["top_k"]) == 3 for r in lines.values() if not r["error"])
    top = lines["cats_0.jpg"]["top_k"]
    assert top[0][0] == lines["cats_0.jpg"]["label"] and top[0][1] >= top[1][1] >= top[2][1]
    assert abs(sum(p for _, p in top) - 1) < 1e-4  # three classes: all of the probability


def test_predict_decoding_on_the_device_needs_a_cuda_device_and_says_so_in_one_line(trained, tmp_path):
    run, new = trained
    out = tmp_path / "p.csv"
    for decode, said in (
        ("device", "--decode device: decoding on the device needs a CUDA device; this runs on cpu"),
        ("gpu", "--decode gpu: expected auto, host or device"),
    ):
        code, err = invoke(["predict", "-m", str(run), str(new), "--device", "cpu", "--decode", decode, "-o", str(out)])
        assert code == 2 and said in err and "Traceback" not in err, err
        assert not out.exists()
    code, err = invoke(["predict", "-m", str(run), str(new), "--device", "cpu", "--decode", "host", "-o", str(out)])
    assert code == 0 and "18 images labelled" in err, err


def test_predict_gives_the_evaluations_probabilities(trained, tmp_path):
    """predict on the run's own val files: the same probabilities as the run's evaluation pipeline gives them, over
    the temperature the run fitted on val (model.json)."""
    from job.config import Config
    from job.data.folder import load_folder
    from job.data.loader import BatchLoader
    from job.recipe import build as recipe

    run, _ = trained
    ckpt = torch.load(run / "model.pt", weights_only=True)
    cfg = recipe.resolved(Config.model_validate(__import__("yaml").safe_load((run / "config.yaml").read_text())))
    data = load_folder(cfg.data, None, lambda _: None)
    val_files = json.loads((run / "data.json").read_text())["held_out"]["val"]
    r = recipe.build(cfg, torch.device("cpu"), data, pretrained=False, loaders=False)
    r.model.load_state_dict(ckpt)
    r.model.eval()
    loader = BatchLoader(data.val, 64, torch.device("cpu"), torch.device("cpu"), mean=r.feed.mean, std=r.feed.std)
    with torch.no_grad():
        t = json.loads((run / "model.json").read_text())["temperature"]
        expected = torch.softmax(torch.cat([r.model(b.x) for b in loader.batches()]) / t, 1)
    root = Path(cfg.data.path)
    code, err = invoke(
        ["predict", "-m", str(run), *[str(root / f) for f in sorted(val_files)], "--device", "cpu", "--top-k", "3"]
        + ["-o", str(tmp_path / "v.jsonl")]
    )
    assert code == 0, err
    got = [json.loads(line) for line in (tmp_path / "v.jsonl").read_text().splitlines()]
    classes = data.classes
    for row, want in zip(got, expected):
        probs = dict(row["top_k"])
        assert torch.allclose(torch.tensor([probs[c] for c in classes]), want, atol=1e-5)


def test_predict_from_and_to_a_bucket_and_nothing_readable_exits_3(trained, tmp_path, bucket):
    run, new = trained
    bucket.put_tree(new, "new")
    out = bucket.url("out/p.csv")
    code, err = invoke(["predict", "-m", str(run), bucket.url("new"), "--device", "cpu", "-o", out])
    assert code == 0, err
    local = tmp_path / "p.csv"
    bucket.fs.get(out.removeprefix("gs://"), str(local))
    assert len(rows_of(local)) == 20
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.jpg").write_bytes(b"")
    (bad / "b.png").write_bytes(saved(Image.new("RGB", (4, 4)), "PNG")[:30])
    code, err = invoke(["predict", "-m", str(run), str(bad), "--device", "cpu", "-o", str(tmp_path / "b.csv")])
    assert code == 3 and "no input could be read" in err and "Traceback" not in err
    assert len(rows_of(tmp_path / "b.csv")) == 2  # the rows are written all the same
    code, err = invoke(["predict", "-m", str(tmp_path / "nothing"), str(bad), "--device", "cpu"])
    assert code != 0 and "Traceback" not in err


def test_a_store_that_fails_beside_the_weights_is_one_line_and_exit_4(trained, bucket, gcs_server):
    """The store stops answering once it has given the model's weights and said model.json is there: reading
    model.json fails with a storage error, told in one line with exit 4, as reading a store anywhere else is."""
    from conftest import run_job
    from faultproxy import FaultProxy

    run, new = trained
    for name in ("model.pt", "model.json"):
        bucket.fs.put_file(str(run / name), f"{bucket.name}/run/{name}")
    with FaultProxy(gcs_server, kinds=("403",), down_after="run/model.json") as proxy:
        got = run_job("predict", "-m", bucket.url("run"), str(new), "--device", "cpu",
                      env={"STORAGE_EMULATOR_HOST": proxy.url})  # fmt: skip
        assert proxy.down  # the store went away at model.json, as meant
    assert got.returncode == 4, got.stderr[-3000:]
    assert "Traceback" not in got.stderr and len(got.stderr.strip().splitlines()) == 1, got.stderr[-3000:]
    assert got.stderr.startswith("error: cannot read the model") and "model.json" in got.stderr, got.stderr


@pytest.mark.parametrize("fmt", ["onnx", "pt2"])
def test_export_carries_labels_and_preprocessing_and_is_checked_with_its_runtime(trained, tmp_path, fmt):
    import numpy as np

    run, new = trained
    out = tmp_path / f"m.{fmt}"
    code, err = invoke(["export", "--model", str(run), "--format", fmt, "--output", str(out)])
    assert code == 0, err
    check = json.loads(Path(f"{out}.check.json").read_text())
    assert check["labels_agree"] and check["max_abs_logit_diff"] <= 1e-3 and check["images"] > 0
    card = json.loads((run / "model.json").read_text())
    x = np.random.default_rng(0).normal(size=(5, *card["input_shape"])).astype(np.float32)  # any batch size
    if fmt == "onnx":
        import onnxruntime as ort

        session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        meta = session.get_modelmeta().custom_metadata_map
        assert json.loads(meta["labels"]) == card["classes"]
        assert json.loads(meta["preprocessing"]) == card["preprocessing"]
        logits = session.run(None, {session.get_inputs()[0].name: x})[0]
        photos = sorted(new.glob("*_[01].jpg"))  # one stored upright and one turned by EXIF, of each class
        assert serving_snippet_labels(out, photos) == predicted_labels(run, photos)
    else:
        extra = {"labels.json": "", "preprocessing.json": ""}
        program = torch.export.load(str(out), extra_files=extra)
        assert json.loads(extra["labels.json"]) == card["classes"]
        assert json.loads(extra["preprocessing.json"]) == card["preprocessing"]
        logits = program.module()(torch.from_numpy(x)).detach().numpy()
    from job.use.bundle import load_predictor

    model = load_predictor(str(run), torch.device("cpu")).served()  # the logits over the temperature
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    assert logits.shape == (5, len(card["classes"])) and np.abs(logits - want).max() < 1e-3


def serving_snippet_labels(model: Path, photos: list[Path]) -> list[str]:
    """The labels that docs/photos.md's serving lines (onnxruntime, Pillow, numpy) give the photos, run as written."""
    import contextlib
    import io
    import re

    page = (Path(__file__).parents[1] / "docs" / "photos.md").read_text()
    code = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    assert '"runs/pets/model.onnx"' in code and '"cat.jpg"' in code
    labels = []
    for photo in photos:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(code.replace("runs/pets/model.onnx", str(model)).replace("cat.jpg", str(photo)), {})
        labels.append(out.getvalue().strip())
    return labels


def predicted_labels(run: Path, photos: list[Path]) -> list[str]:
    """`job predict`'s labels of the photos, in order."""
    out = run.parent / "snippet.csv"
    code, err = invoke(["predict", "--model", str(run), *map(str, photos), "--device", "cpu", "-o", str(out)])
    assert code == 0, err
    return [r["label"] for r in csv.DictReader(out.open(newline=""))]


DRIFTING = """
import torch
from torch import nn


class Drift(nn.Module):
    \"\"\"Adds how many times it was called to its logits: an export traces one call, eager calls go on counting.\"\"\"

    def __init__(self, num_classes):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.net(x) + self.calls
"""


def train_own_model(run: Path, tmp_path: Path, monkeypatch, source: str, name: str, out: Path) -> None:
    """A model class of the user's own (`source`, importable as `name`) trained a little on the fixture's photos."""
    (tmp_path / f"{name.split(':')[0]}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    photos = yaml.safe_load((run / "config.yaml").read_text())["data"]["path"]
    over = sets("data.kind=folder", f"data.path={photos}", "data.image_size=32", f"model.name={name}")
    over += sets("train.epochs=1", "data.val_split=0.3")
    code, err = invoke(["train", "--device", "cpu", "--config", "cifar10", "--output", str(out), *over])
    assert code == 0, err


def test_an_export_that_differs_from_the_model_is_refused_and_not_written(trained, tmp_path, monkeypatch):
    run, new = trained
    train_own_model(run, tmp_path, monkeypatch, DRIFTING, "drifting:Drift", tmp_path / "d")
    out = tmp_path / "d.pt2"
    code, err = invoke(["export", "-m", str(tmp_path / "d"), "-f", "pt2", "-o", str(out), "--check-images", str(new)])
    assert code == 1 and "differs from the model" in err and "not written" in err and "Traceback" not in err
    assert not out.exists() and not Path(f"{out}.check.json").exists()


def test_predict_split_over_processes_and_task_array_tasks_reads_each_file_once(trained, tmp_path):
    from conftest import run_job

    run, new = trained
    every = {p.name for p in new.iterdir()}

    def names(paths: list[Path]) -> list[str]:
        return [n for p in paths for n in rows_of_part(p)]

    done = run_job(
        "predict", "-m", str(run), str(new), "--device", "cpu", "--nproc-per-node", "2", "-o", str(tmp_path / "p.csv")
    )
    assert done.returncode == 0, done.stderr[-2000:]
    parts = sorted(tmp_path.glob("p.csv.part-*-of-2"))
    seen = names(parts)
    assert len(parts) == 2 and sorted(seen) == sorted(every)  # none twice, none missing
    tasks = []
    for i in range(2):
        env = {"BATCH_TASK_INDEX": str(i), "BATCH_TASK_COUNT": "2"}
        done = run_job("predict", "-m", str(run), str(new), "--device", "cpu", "-o", str(tmp_path / "t.jsonl"), env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        tasks.append(tmp_path / f"t.jsonl.part-{i}-of-2")
    assert sorted(names(tasks)) == sorted(every)


def test_a_table_split_over_processes_and_task_array_tasks_predicts_each_row_once(tmp_path):
    """Rows are split into parts as images are: two tables, over 2 processes and over 2 tasks, every row once."""
    from importlib import resources

    from conftest import run_job

    model = tmp_path / "iris"
    code, err = invoke(
        ["train", "--device", "cpu", "--config", "iris", "--output", str(model), *sets("train.epochs=5")]
    )
    assert code == 0, err
    lines = (resources.files("job.presets") / "iris.csv").read_text().splitlines()
    tables = [tmp_path / "a.csv", tmp_path / "b.csv"]
    tables[0].write_text("\n".join(lines[:80]) + "\n")
    tables[1].write_text("\n".join(lines[:1] + lines[80:]) + "\n")
    every = [f"{t}:{n}" for t, count in ((tables[0], 79), (tables[1], len(lines) - 80)) for n in range(2, count + 2)]

    def paths(parts: list[Path]) -> list[str]:
        return [r["path"] for p in parts for r in csv.DictReader(p.open(newline=""))]

    args = ["predict", "-m", str(model), *map(str, tables), "--device", "cpu"]
    done = run_job(*args, "--nproc-per-node", "2", "-o", str(tmp_path / "p.csv"))
    assert done.returncode == 0, done.stderr[-2000:]
    parts = sorted(tmp_path.glob("p.csv.part-*-of-2"))
    assert len(parts) == 2 and sorted(paths(parts)) == sorted(every)  # none twice, none missing
    for i in range(2):
        env = {"BATCH_TASK_INDEX": str(i), "BATCH_TASK_COUNT": "2"}
        done = run_job(*args, "-o", str(tmp_path / "t.csv"), env=env)
        assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(paths(sorted(tmp_path.glob("t.csv.part-*-of-2")))) == sorted(every)


def test_predict_processes_each_take_their_share_of_the_cpus(trained, tmp_path):
    """--nproc-per-node's processes decode and compute with their share of the CPUs, not each with all of them."""
    import os

    from conftest import run_job

    from job.data.decode import auto_workers
    from job.group.env import cpu_share

    run, new = trained
    done = run_job(
        "predict", "-m", str(run), str(new), "--device", "cpu", "--nproc-per-node", "2", "-o", str(tmp_path / "p.csv")
    )
    assert done.returncode == 0, done.stderr[-2000:]
    share = cpu_share(2)
    threads = os.environ.get("OMP_NUM_THREADS") or share  # a setting of the user's own is kept
    workers = auto_workers("auto", "cpu", share)
    decoding = f"decoding in {workers} process{'es' if workers != 1 else ''}" if workers else "decoding in it"
    for i in (0, 1):
        line = f"writing {tmp_path}/p.csv.part-{i}-of-2 on {threads} CPU thread{'s' if int(threads) != 1 else ''}, "
        assert line + decoding in done.stderr, done.stderr[-2000:]
    bare = run_job("predict", "-m", str(run), str(new), "--device", "cpu", "--nproc-per-node", "2")
    assert bare.returncode == 2 and bare.stderr.count("give --output") == 1, bare.stderr  # said once, not per process


def test_a_sigterm_to_predict_over_processes_stops_every_one(trained, tmp_path):
    """A preempted predict (SIGTERM to the process started, as a platform sends it) stops its processes too: here each
    waits on an input that never comes (a named pipe held open), and the signal ends them all."""
    import os
    import signal
    import time

    import psutil
    from conftest import start_job

    run, _ = trained
    pipes = [tmp_path / "a.png", tmp_path / "b.png"]
    for pipe in pipes:
        os.mkfifo(pipe)
    proc = start_job("predict", "-m", str(run), *map(str, pipes), "--device", "cpu", "--nproc-per-node", "2",
                     "-o", str(tmp_path / "p.csv"))  # fmt: skip
    held, deadline = {}, time.time() + 300
    while len(held) < 2 and time.time() < deadline and proc.poll() is None:  # until each process reads its pipe
        for pipe in pipes:
            with contextlib.suppress(OSError):  # ENXIO while nobody reads it
                held.setdefault(pipe, os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
        time.sleep(0.05)
    children = psutil.Process(proc.pid).children()
    try:
        assert len(held) == 2 and len(children) == 2, proc.stderr.read() if proc.poll() is not None else held
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        _, alive = psutil.wait_procs(children, timeout=60)  # what holds the pipes' other ends is gone
        assert not alive, alive
        assert proc.returncode == 128 + signal.SIGTERM, proc.stderr.read()[-2000:]
    finally:
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        for fd in held.values():
            os.close(fd)


def rows_of_part(path: Path) -> list[str]:
    if ".jsonl" in path.name:
        return [Path(json.loads(line)["path"]).name for line in path.read_text().splitlines()]
    with open(path, newline="") as f:
        return [Path(r["path"]).name for r in csv.DictReader(f)]


@pytest.mark.parametrize("preset", ["iris", "cifar10", "cifar10-fast", "finetune", "photos"])
def test_model_json_of_every_preset(preset):
    """What model.json says of each preset's model: the class count, and the preprocessing its evaluation applies
    (finetune: the weights' 232 px short side and 224 px centre, ImageNet's mean and std)."""
    from job.config import load_config
    from job.recipe import build as recipe
    from job.use import bundle

    cfg = recipe.resolved(load_config(preset))
    classes = [f"c{i}" for i in range(3)]
    if preset == "iris":
        features = {"columns": ["a", "b", "c", "d"], "target": "species", "min": [0] * 4, "span": [1] * 4}
        card = bundle.describe(cfg, classes, (4,), (None, None), features, {"best_accuracy": 1.0})
        assert card["features"]["columns"] == ["a", "b", "c", "d"] and "preprocessing" not in card
        return
    w = __import__("job.recipe.weights", fromlist=["resolve"]).resolve(cfg.model.name, cfg.model.weights)
    stats = (torch.tensor(w.mean), torch.tensor(w.std)) if w is not None else (torch.zeros(3), torch.ones(3))
    card = bundle.describe(cfg, classes, (3, 32, 32), stats, None, {})
    pre = card["preprocessing"]
    assert card["model"] == {"name": cfg.model.name, "kwargs": dict(cfg.model.kwargs), "num_classes": 3}
    assert pre["exif_orientation"] and pre["mode"] == "RGB" and pre["layout"] == "NCHW" and pre["scale"] == 1 / 255
    if preset in ("finetune", "photos"):
        assert pre["resize"] == {"short_side": 232} and pre["crop"] == {"center": [224, 224]}
        assert pre["mean"] == pytest.approx([0.485, 0.456, 0.406])
        assert pre["std"] == pytest.approx([0.229, 0.224, 0.225])
    else:
        assert pre["resize"] is None and pre["crop"] is None  # CIFAR's 32 px images as they are
    json.dumps(card)  # written as JSON


def test_evaluate_takes_the_model_forms_of_predict_and_any_labelled_data(trained, tmp_path):
    run, new = trained
    photos = Path(yaml.safe_load((run / "config.yaml").read_text())["data"]["path"])
    code, err = invoke(["evaluate", "--model", str(run), "--data", str(photos), "--device", "cpu", "--json"])
    assert code == 0, err
    table = tmp_path / "labels.csv"
    with open(table, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "label"])
        for name in ("cats", "dogs", "owls"):
            for p in sorted((photos / name).rglob("IMG_0*"))[:5]:
                w.writerow([p.as_posix(), name])
    from job.use.evaluate import evaluate_on

    scored = evaluate_on(str(run), str(photos), "cpu")
    assert scored["split"] == "all" and scored["samples"] == 90 and scored["all_accuracy"] > 0.8
    listed = evaluate_on(str(run / "model.pt"), str(table), "cpu")
    assert listed["samples"] == 15
    unknown = tmp_path / "other"
    (unknown / "ferrets").mkdir(parents=True)
    (unknown / "ferrets" / "a.jpg").write_bytes(next((photos / "cats").rglob("IMG_0*")).read_bytes())
    code, err = invoke(["evaluate", "--model", str(run), "--data", str(unknown), "--device", "cpu"])
    assert code == 3 and "ferrets" in err and "Traceback" not in err


def test_predict_reads_a_manifest_and_a_folder_of_shards(trained, tmp_path):
    run, new = trained
    table = tmp_path / "new.csv"
    table.write_text("path\n" + "".join(f"{p}\n" for p in sorted(new.glob("*_*.jpg"))))
    code, err = invoke(["predict", "-m", str(run), str(table), "--device", "cpu", "-o", str(tmp_path / "m.csv")])
    assert code == 0, err
    assert len(rows_of(tmp_path / "m.csv")) == 18
    photos = Path(yaml.safe_load((run / "config.yaml").read_text())["data"]["path"])
    code, err = invoke(["shard", str(photos), str(tmp_path / "shards"), "--samples-per-shard", "20"])
    assert code == 0, err
    code, err = invoke(
        ["predict", "-m", str(run), str(tmp_path / "shards"), "--device", "cpu", "-o", str(tmp_path / "s.csv")]
    )
    assert code == 0, err
    with open(tmp_path / "s.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 90 and all(r["label"] and ".tar:" in r["path"] for r in rows)


def test_predict_a_table_with_a_csv_model(tmp_path):
    from importlib import resources

    out = tmp_path / "iris"
    code, err = invoke(
        ["train", "--device", "cpu", "--config", "iris", "--output", str(out), *sets("train.epochs=4000")]
    )
    assert code == 0, err
    table = tmp_path / "flowers.csv"
    text = (resources.files("job.presets") / "iris.csv").read_text()
    lines = text.splitlines()
    header = lines[0].split(",")
    shuffled = [header[::-1]] + [line.split(",")[::-1] for line in lines[1:]]  # columns in another order
    shuffled.append(["setosa", "x"] + ["1"] * (len(header) - 2))  # a feature that is not a number
    table.write_text("".join(",".join(r) + "\n" for r in shuffled))
    code, err = invoke(["predict", "-m", str(out), str(table), "--device", "cpu", "-o", str(tmp_path / "p.csv")])
    assert code == 0, err
    with open(tmp_path / "p.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    truth = [line.split(",")[header.index("species")] for line in lines[1:]]
    right = sum(1 for r, t in zip(rows, truth) if r["label"] == t)
    assert len(rows) == 151 and rows[-1]["error"] and right >= 135
    code, err = invoke(["export", "-m", str(out), "-f", "onnx", "-o", str(tmp_path / "i.onnx")])
    assert code == 2 and "table's model" in err and "Traceback" not in err


def test_evaluate_on_shards_and_export_checks_a_test_folder_by_default(tmp_path):
    from conftest import write_image_folder

    from job.use.evaluate import evaluate_on

    src = write_image_folder(tmp_path / "imgs", n_classes=3, per_class=12, size=32, test_per_class=4)
    run = tmp_path / "run"
    over = sets("data.kind=folder", f"data.path={src}", "model.name=mlp", "train.epochs=2")  # cifar10: val_split 0
    code, err = invoke(["train", "--device", "cpu", "--config", "cifar10", "--output", str(run), *over])
    assert code == 0, err
    assert invoke(["shard", str(src), str(tmp_path / "sh"), "--val-split", "0"])[0] == 0
    scored = evaluate_on(str(run), str(tmp_path / "sh"), "cpu")
    assert scored["split"] == "test" and scored["samples"] == 12
    code, err = invoke(["export", "-m", str(run), "-f", "pt2", "-o", str(tmp_path / "m.pt2")])
    assert code == 0, err
    assert json.loads((tmp_path / "m.pt2.check.json").read_text())["images"] == 12  # the test/ folder's images


def test_a_file_gone_since_it_was_listed_gets_its_own_error_row(tmp_path, bucket):
    """A file removed between listing and reading, on a local disk or in a bucket: its row says it is not found
    (not "an empty file"), and the files beside it are read."""
    from conftest import encode, pattern_images

    from job.use.inputs import read

    images, _ = pattern_images(1, 2, 16)
    (tmp_path / "a.png").write_bytes(encode(images[0]))
    bucket.fs.pipe_file(bucket.url("gone/b.png").removeprefix("gs://"), encode(images[1]))
    for missing in (str(tmp_path / "gone.png"), bucket.url("gone/missing.png")):
        rows = [row for batch in read([("a.png", str(tmp_path / "a.png")), ("gone.png", missing)], 8) for row in batch]
        assert [(name, bool(data), why) for name, data, why in rows[:1]] == [("a.png", True, "")]
        assert rows[1][2].startswith("not found"), rows[1]
    got = [row for batch in read([("b.png", bucket.url("gone/b.png"))], 8) for row in batch]
    assert got[0][1] == encode(images[1]) and got[0][2] == ""


def test_a_remote_file_named_like_a_pattern_is_read(tmp_path, bucket):
    """Brackets and stars in a file's name are the name, not a pattern to expand."""
    from job.use.inputs import read

    for name in ("scan[001].png", "a*b.png"):
        bucket.fs.pipe_file(bucket.url(f"odd/{name}").removeprefix("gs://"), name.encode())
    rows = [row for batch in read([("x", bucket.url("odd/scan[001].png")), ("y", bucket.url("odd/a*b.png"))], 8)
            for row in batch]  # fmt: skip
    assert rows == [("x", b"scan[001].png", ""), ("y", b"a*b.png", "")]


@pytest.mark.parametrize("preset", ["cifar10", "cifar10-fast"])
def test_a_model_trained_at_its_datas_own_size_labels_photos_of_any_size_in_one_batch(tmp_path, preset):
    """A run that fixed no image size (CIFAR-10's 32 px images as they are): model.json records the size the model
    was trained at, and predict (and evaluate) bring every photo to it, whatever its size, mixed in one batch (before:
    the CNN stopped with a traceback, cifar10-fast scored a photo at its full size, an odd size failed its whole
    batch)."""
    from conftest import pattern_images, run_job, write_cifar_batches

    data = write_cifar_batches(tmp_path / "c10")
    over = sets(f"data.path={data}", "train.epochs=1", "data.batch_size=20", "data.eval_batch_size=20")
    code, err = invoke(["train", "--device", "cpu", "--config", preset, "--output", str(tmp_path / "run"), *over])
    assert code == 0, err
    pre = json.loads((tmp_path / "run" / "model.json").read_text())["preprocessing"]
    assert pre["input_size"] == [32, 32] and pre["held"] == [32, 32] and pre["box"] == "centre"
    photos = tmp_path / "photos"
    photos.mkdir()
    images, _ = pattern_images(1, 4, 96, 0)
    for i, (w, h) in enumerate(((640, 427), (32, 32), (90, 300), (33, 31))):
        img = Image.fromarray(images[i].transpose(1, 2, 0)).resize((w, h))
        img.save(photos / f"p{i}.{'jpg' if i % 2 == 0 else 'png'}")
    (photos / "turned.jpg").write_bytes(turned_jpeg(Image.fromarray(images[0].transpose(1, 2, 0)), 6))
    out = tmp_path / "p.csv"
    done = run_job("predict", "--model", str(tmp_path / "run"), str(photos), "--device", "cpu", "--output", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = rows_of(out)
    assert len(rows) == 5 and all(r["label"] and not r["error"] for r in rows.values()), rows
    labelled = tmp_path / "labelled"
    for i, p in enumerate(sorted(photos.iterdir())):  # evaluate brings them to it too
        (labelled / ("cat", "dog")[i % 2]).mkdir(parents=True, exist_ok=True)
        (labelled / ("cat", "dog")[i % 2] / p.name).write_bytes(p.read_bytes())
    from job.use.evaluate import evaluate_on

    assert evaluate_on(str(tmp_path / "run"), str(labelled), "cpu")["samples"] == 5


CONFIDENT = """
from torch import nn


class Confident(nn.Module):
    \"\"\"Logits in the hundreds of thousands: float32 rounds them to a hundredth, whatever runs them.\"\"\"

    def __init__(self, num_classes):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))

    def forward(self, x):
        return self.net(x) * 1e5
"""


def test_export_of_a_confident_model_is_checked_relative_to_its_logits_and_by_model_jsons_recipe(
    trained, tmp_path, monkeypatch
):
    """Logits scaled by 1e5 differ by float32's rounding between runtimes: the check's tolerance is relative to the
    logits' size (an absolute 1e-4 refused the model), the labels still all agree. The check also makes the inputs
    from the files by model.json's recipe with Pillow alone: a model.json that does not say what predict does is
    refused."""
    import shutil

    run, new = trained
    train_own_model(run, tmp_path, monkeypatch, CONFIDENT, "confident:Confident", tmp_path / "c")
    code, err = invoke(["export", "-m", str(tmp_path / "c"), "-f", "onnx", "-o", str(tmp_path / "c.onnx")])
    assert code == 0, err
    check = json.loads((tmp_path / "c.onnx.check.json").read_text())
    assert check["labels_agree"] and check["recipe_labels_agree"] and check["recipe_checked"]
    assert check["max_abs_logit_diff"] <= check["tolerance"] and check["tolerance"] > 1e-4
    wrong = tmp_path / "wrong"
    shutil.copytree(run, wrong)
    card = json.loads((wrong / "model.json").read_text())
    card["preprocessing"]["held"] = [16, 16]  # not what predict does: the recipe's inputs differ from the model's
    card["preprocessing"]["crop"] = {"center": [32, 32]}
    (wrong / "model.json").write_text(json.dumps(card))
    code, err = invoke(["export", "-m", str(wrong), "-f", "onnx", "-o", str(tmp_path / "w.onnx")])
    assert code == 1 and "model.json's preprocessing" in err and "not written" in err, err
    assert not (tmp_path / "w.onnx").exists()


def test_export_checks_held_out_images_of_every_class(tmp_path):
    """The check's images are taken from every class in turn, not the first in sorted order (the first classes')."""
    from conftest import write_image_folder

    from job.use.export import held_out_images

    root = write_image_folder(tmp_path / "imgs", n_classes=3, per_class=20, size=8)
    config = {"data": {"kind": "folder", "path": str(root), "val_split": 0.5}}
    chosen = held_out_images(str(tmp_path), config, limit=6)
    assert len(chosen) == 6 and len({Path(p).parent.name for p in chosen}) == 3, chosen


def test_predict_into_a_pipe_that_is_closed_early_ends_quietly(trained):
    """`job predict ... | head -1`: the reader leaving is no fault; exit 0, nothing on stderr."""
    import subprocess
    import sys

    from conftest import job_env

    run, new = trained
    cmd = [sys.executable, "-m", "job", "predict", "-m", str(run), str(new), "--device", "cpu"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=job_env())
    assert proc.stdout.readline().startswith(b"path,label")
    proc.stdout.close()  # as head -1 does once it has its line
    err = proc.stderr.read().decode()
    assert proc.wait(120) == 0 and "Error" not in err and "Traceback" not in err, err
