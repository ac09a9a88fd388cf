"""End to end, as a user runs it: `python -m job ...` in a fresh process, outputs read back and checked."""

import json

import fsspec
import pytest
import torch
import yaml
from conftest import run_job, sets, tar_folder, write_cifar_batches, write_image_folder
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

TIMING_KEYS = {"samples_per_s", "wall_s"}


def scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list] = {}
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(path))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_layout(run_dir) -> dict:
    for name in ("config.yaml", "metrics.jsonl", "model.pt", "curves.png", "checkpoints/latest.json"):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pointer = json.loads((run_dir / "checkpoints/latest.json").read_text())
    ckpt = torch.load(run_dir / "checkpoints" / pointer["file"], weights_only=True)
    weights = torch.load(run_dir / "model.pt", weights_only=True)
    assert all(torch.equal(weights[k], ckpt["model"][k]) for k in weights)
    yaml.safe_load((run_dir / "config.yaml").read_text())
    return pointer


def test_default_run_in_an_empty_folder(tmp_path):
    """The README's first command: the Iris preset on the bundled data, offline, on the CPU."""
    result = run_job("train", "--device", "cpu", cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    run_dir = tmp_path / "runs" / "iris"
    pointer = check_layout(run_dir)
    assert pointer["epoch"] == 20000
    records = metrics(run_dir)
    assert len(records) == 20 and records[-1]["epoch"] == 20000 and records[-1]["test_accuracy"] >= 0.9
    tb = scalars(run_dir)
    assert {"train/loss", "train/lr", "train/throughput", "test/loss", "test/accuracy"} <= set(tb)
    assert [s for s, _ in tb["train/loss"]] == list(range(200, 20001, 200))
    assert tb["train/loss"][-1][1] < tb["train/loss"][0][1] / 3
    assert tb["test/accuracy"][-1] == (20000, pytest.approx(records[-1]["test_accuracy"]))
    # the HPARAMS tab's metric columns: the final metrics the hparams summary declares, logged as scalars
    assert tb["hparam/final_accuracy"] == [(20000, pytest.approx(records[-1]["test_accuracy"]))]
    assert tb["hparam/best_accuracy"] == [(20000, pytest.approx(max(r["test_accuracy"] for r in records)))]
    assert "done: 20000 epochs" in result.stderr and "runs/iris" in result.stderr
    # What the machine did in each window: a step's time, the part of it spent waiting for the batch, memory.
    step_time, wait = dict(tb["system/step_time_s"]), dict(tb["system/data_wait_s"])
    assert list(step_time) == list(wait) == list(range(200, 20001, 200))
    assert all(0 < wait[s] < step_time[s] < 1 for s in step_time)
    assert all(0.05 < gib < 64 for _, gib in tb["system/host_memory_gib"])
    assert not any(tag.startswith("system/gpu") for tag in tb)  # no GPU, no GPU measures


def test_cifar_python_layout_and_image_folder_train(tmp_path):
    batches = write_cifar_batches(tmp_path / "cifar-10-batches-py", n_train=200, n_test=100)
    archive = tar_folder(batches, tmp_path / "cifar-10-python.tar.gz", "cifar-10-batches-py")
    folder = write_image_folder(tmp_path / "images", n_classes=4, per_class=30, size=32, fmt="jpg")
    for name, data in (("py", archive), ("folder", folder)):
        kind = "cifar10" if name == "py" else "folder"
        result = run_job(
            "train",
            "--config",
            "cifar10",
            "--set",
            f"data.kind={kind}",
            "--set",
            f"data.path={data}",
            "--set",
            "train.epochs=3",
            "--set",
            "data.batch_size=16",
            "--set",
            "optim.lr=0.05",
            "--set",
            "data.random_crop_padding=2",
            "--set",
            "data.random_hflip=true",
            "--device",
            "cpu",
            "--output",
            str(tmp_path / name),
        )
        assert result.returncode == 0, result.stderr[-2000:]
        check_layout(tmp_path / name)
        records = metrics(tmp_path / name)
        assert [r["epoch"] for r in records] == [1, 2, 3]
        chance = 1 / (10 if name == "py" else 4)
        assert records[-1]["test_accuracy"] > 2 * chance, records


def test_real_cifar_images_learn(tmp_path, real_cifar_subset):
    """400 real CIFAR-10 JPEGs, 100 to test on: with momentum and normalised inputs the tutorials' CNN gets well
    above chance in 8 epochs (0.29-0.38 over seeds 0-2, from about 0.2 after the first), its training loss from
    2.3 to near 1."""
    result = run_job(
        "train",
        "--config",
        "cifar10",
        "--device",
        "cpu",
        "--output",
        str(tmp_path / "run"),
        *sets(
            "data.kind=folder",
            f"data.path={real_cifar_subset}",
            "data.batch_size=32",
            "data.normalize=true",
            "optim.lr=0.02",
            "optim.momentum=0.9",
            "train.epochs=8",
            "train.log_every_steps=4",
        ),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    records = metrics(tmp_path / "run")
    assert [r["epoch"] for r in records] == list(range(1, 9))
    first, last = records[0]["test_accuracy"], records[-1]["test_accuracy"]
    chance = 1 / 10
    assert last >= 2 * chance and last > first, records
    tb = scalars(tmp_path / "run")
    assert tb["test/accuracy"][-1][1] == pytest.approx(last)
    losses = [v for _, v in tb["train/loss"]]
    assert len(losses) >= 20 and losses[-1] < 0.75 * losses[0], losses
    assert records[-1]["train_loss"] < 0.75 * records[0]["train_loss"], records


def test_resume_continues_and_matches_an_uninterrupted_run(tmp_path):
    common = ["train", "--device", "cpu", "--set", "train.checkpoint_every_epochs=500"]
    straight = run_job(*common, "--set", "train.epochs=3000", "--output", str(tmp_path / "a"))
    assert straight.returncode == 0, straight.stderr[-2000:]
    first = run_job(*common, "--set", "train.epochs=2000", "--output", str(tmp_path / "b"))
    assert first.returncode == 0, first.stderr[-2000:]
    second = run_job(*common, "--set", "train.epochs=3000", "--output", str(tmp_path / "b"))
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resuming iris from epoch 2000, step 2000" in second.stderr
    wa = torch.load(tmp_path / "a/model.pt", weights_only=True)
    wb = torch.load(tmp_path / "b/model.pt", weights_only=True)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rs]  # noqa: E731
    assert strip(metrics(tmp_path / "a")) == strip(metrics(tmp_path / "b"))
    losses_a = [v for _, v in scalars(tmp_path / "a")["train/loss"]]
    tb_b = scalars(tmp_path / "b")
    assert sorted(set(s for s, _ in tb_b["train/loss"])) == list(range(200, 3001, 200))
    assert [v for _, v in sorted(dict(tb_b["train/loss"]).items())] == losses_a
    never = run_job(*common, "--output", str(tmp_path / "b"), "--resume", "never")
    assert never.returncode == 2 and "already holds a run" in never.stderr
    changed = run_job(*common, "--set", "model.hidden=[20]", "--output", str(tmp_path / "b"))
    assert changed.returncode == 2 and "model.hidden" in changed.stderr


def test_evaluate_a_saved_run(tmp_path):
    run_dir = tmp_path / "run"
    trained = run_job("train", "--device", "cpu", "--set", "train.epochs=1000", "--output", str(run_dir))
    assert trained.returncode == 0, trained.stderr[-2000:]
    last = metrics(run_dir)[-1]
    for target in (
        run_dir,
        run_dir / "checkpoints" / json.loads((run_dir / "checkpoints/latest.json").read_text())["file"],
    ):
        result = run_job("evaluate", "--checkpoint", str(target), "--json", "--device", "cpu")
        assert result.returncode == 0, result.stderr[-2000:]
        got = json.loads(result.stdout)
        assert got["test_accuracy"] == pytest.approx(last["test_accuracy"])
        assert got["test_loss"] == pytest.approx(last["test_loss"], rel=1e-5)
        assert got["epoch"] == 1000
        assert got["run_json"] == str(run_dir / "run.json") and got["attempts"] == 1  # the run's record, found
    # model.pt, the documented final weights: evaluated with the run's config beside it, or the one given
    for extra in ([], ["--config", str(run_dir / "config.yaml")]):
        result = run_job("evaluate", "--checkpoint", str(run_dir / "model.pt"), *extra, "--json", "--device", "cpu")
        assert result.returncode == 0, result.stderr[-2000:]
        got = json.loads(result.stdout)
        assert got["test_accuracy"] == pytest.approx(last["test_accuracy"]) and got["epoch"] is None
        assert got["run_json"] == str(run_dir / "run.json")
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights/model.pt").write_bytes((run_dir / "model.pt").read_bytes())
    alone = run_job("evaluate", "--checkpoint", str(tmp_path / "weights/model.pt"), "--device", "cpu")
    assert alone.returncode == 5 and "no config beside it: pass --config" in alone.stderr
    (tmp_path / "weights/model.json").write_bytes((run_dir / "model.json").read_bytes())  # as a registry holds it
    carded = run_job("evaluate", "--checkpoint", str(tmp_path / "weights/model.pt"), "--json", "--device", "cpu")
    assert carded.returncode == 0, carded.stderr[-2000:]
    assert json.loads(carded.stdout)["test_accuracy"] == pytest.approx(last["test_accuracy"])


def test_outputs_to_memory_url_in_process():
    from job.config import load_config
    from job.run.train import run

    summary = run(
        load_config("iris", ["train.epochs=400", "train.eval_every_epochs=200"]),
        "memory://bucket/runs/iris",
        "cpu",
    )
    fs = fsspec.filesystem("memory")
    names = {p.rsplit("/", 1)[-1] for p in fs.find("/bucket/runs/iris")}
    assert {"config.yaml", "metrics.jsonl", "model.pt", "curves.png", "latest.json"} <= names
    assert any(n.startswith("events.out.tfevents") for n in names)
    lines = fs.cat_file("/bucket/runs/iris/metrics.jsonl").decode().splitlines()
    assert len(lines) == 2 and json.loads(lines[-1])["test_accuracy"] == summary["final_accuracy"]


def test_user_model_from_pythonpath(tmp_path):
    (tmp_path / "usermodels.py").write_text(
        "from torch import nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self, num_classes, width=8):\n"
        "        super().__init__()\n"
        "        self.net = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, num_classes))\n"
        "    def forward(self, x):\n"
        "        return self.net(x)\n"
    )
    result = run_job(
        "train",
        "--device",
        "cpu",
        "--set",
        "model.name=usermodels:Net",
        "--set",
        "model.kwargs.width=12",
        "--set",
        "train.epochs=200",
        "--set",
        "train.eval_every_epochs=100",
        "--output",
        str(tmp_path / "run"),
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    weights = torch.load(tmp_path / "run/model.pt", weights_only=True)
    assert weights["net.0.weight"].shape == (12, 4)


@pytest.mark.parametrize(
    "args, code, needle",
    [
        (["--set", "train.no_such_key=1"], 2, "train.no_such_key: unknown key"),
        (["--set", "train.epochs=many"], 2, "train.epochs: input should be a valid integer"),
        (["--config", "no-such-preset"], 2, "not a preset"),
        (["--device", "tpu"], 2, "--device tpu"),
        (["--set", "data.path=/nonexistent/table.csv"], 3, "no such file"),
        (["--output", "/proc/version/run"], 4, "cannot write the output folder"),
    ],
)
def test_user_errors_are_one_line_with_their_exit_code(tmp_path, args, code, needle):
    result = run_job("train", "--device", "cpu", *args, cwd=tmp_path)
    assert result.returncode == code, result.stderr
    assert needle in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_an_iris_run_imports_only_what_it_uses(tmp_path):
    """Start-up is most of a short CPU run, so a run on a table imports only what it uses: no torchvision (its release
    is read from its version file), no HEIF decoder, ONNX, gcsfs, MLflow client or matplotlib at all (the report's
    pictures are drawn with Pillow: job/sinks/pictures.py). Python's own import log
    (PYTHONPROFILEIMPORTTIME, written to stderr in order with the run's lines) tells what was imported and when."""
    out = tmp_path / "run"
    logged = {"PYTHONPROFILEIMPORTTIME": "1"}
    done = run_job("train", *sets("train.epochs=1"), "--device", "cpu", "--output", str(out), env=logged)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    imported = [(i, line.rsplit("|", 1)[1].strip()) for i, line in enumerate(lines) if line.startswith("import time:")]
    assert len(imported) > 100 and any(name == "torch" for _, name in imported)  # the log is there, in full
    tops = {name.split(".")[0] for _, name in imported}
    assert not (unused := tops & {"torchvision", "pillow_heif", "onnx", "gcsfs", "mlflow", "matplotlib"}), unused
    assert "step: fp32; eager (a CPU step runs eagerly)" in done.stderr
    assert (out / "curves.png").is_file() and (out / "report/test/confusion.png").is_file()
