"""Vertex AI hyperparameter tuning, the service's own way: a trial is `job train` with `--<parameterId>=<value>`
appended (config overrides), and it reports its metric in cloudml-hypertune's file. Real `python -m job` processes,
the metric file read back and compared with metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import run_job, sets

from job.sinks.hypertune import metric_file, metric_line

QUICK = ["--device", "cpu", "--config", "iris", *sets("data.val_split=0.2", "train.epochs=300")]
EVERY_100 = sets("train.eval_every_epochs=100")


def tuning(tmp_path: Path, trial: str = "7") -> dict:
    """The environment Vertex AI gives a tuning trial, its metric file in tmp_path."""
    return {"CLOUD_ML_TRIAL_ID": trial, "CLOUD_ML_HP_METRIC_FILE": str(tmp_path / "hpt" / "output.metrics")}


def lines(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "hpt" / "output.metrics").read_text().splitlines()]


def val_accuracies(run: Path) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["val_accuracy"] for r in records if "val_accuracy" in r]


def test_a_trial_started_as_vertex_starts_one_takes_its_values_and_reports_each_evaluation(tmp_path):
    run = tmp_path / "V"
    done = run_job(
        "train", *QUICK, *EVERY_100, "--output", str(run), "--optim.lr=0.05", "--optim__momentum", "0.5",
        env=tuning(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert (cfg["optim"]["lr"], cfg["optim"]["momentum"]) == (0.05, 0.5)
    got = lines(tmp_path)
    want = val_accuracies(run)
    assert len(want) == 4  # three evaluations, and the chosen model's value in the test record at the end
    assert [float(line["val_accuracy"]) for line in got] == want
    assert all(line["trial"] == "7" and isinstance(line["timestamp"], float) for line in got)
    assert [line["global_step"] for line in got] == ["100", "200", "300", "300"]  # full batch: a step an epoch


def test_the_metric_tag_is_a_setting(tmp_path):
    run = tmp_path / "loss"
    done = run_job("train", *QUICK, "--output", str(run), "--track.hp_metric_tag=val_loss", env=tuning(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [float(line["val_loss"]) for line in lines(tmp_path)] == [r["val_loss"] for r in records if "val_loss" in r]


def test_the_file_is_written_only_under_vertex_tuning():
    assert metric_file({}) is None and metric_file({"CLOUD_ML_TRIAL_ID": ""}) is None
    assert metric_file({"CLOUD_ML_TRIAL_ID": "3"}) == "/tmp/hypertune/output.metrics"
    assert metric_file({"CLOUD_ML_HP_METRIC_FILE": "/x/m"}) == "/x/m"


def test_a_metric_the_run_never_writes_is_refused_at_the_start(tmp_path):
    # without a val split every evaluation reports test_*: val_accuracy is never written
    done = run_job(
        "train", "--device", "cpu", "--output", str(tmp_path / "run"), *sets("train.epochs=300"), env=tuning(tmp_path)
    )
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert "track.hp_metric_tag val_accuracy" in line and "test_accuracy" in line and "val_loss" not in line
    assert not (tmp_path / "hpt").exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("arg", ["--no.such.key=1", "--no__such__key=1", "--optim.lrr=0.1"])
def test_an_unknown_id_is_refused_in_one_line_and_nothing_is_written(tmp_path, arg):
    run = tmp_path / "bad"
    done = run_job("train", *QUICK, "--output", str(run), arg, env=tuning(tmp_path))
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"error: {arg}: names no config key (") and "Traceback" not in done.stderr
    assert not run.exists() and not (tmp_path / "hpt").exists()
    if arg == "--optim.lrr=0.1":
        assert "(closest: optim.lr," in line


def test_a_bad_value_is_refused_as_set_refuses_it(tmp_path):
    run = tmp_path / "bad"
    done = run_job("train", *QUICK, "--output", str(run), "--optim__lr", "fast", env=tuning(tmp_path))
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert "optim.lr" in line and "'fast'" in line
    assert not run.exists()


@pytest.mark.parametrize(
    "args, says",
    [
        (["--outptu", "x"], "No such option: --outptu (Possible options: --output)"),
        (["--optim.lr"], "--optim.lr: expected a value"),
        (["stray"], "unexpected extra argument(s) (stray)"),
    ],
)
def test_other_extra_arguments_are_refused_as_before(tmp_path, args, says):
    done = run_job("train", *QUICK, "--output", str(tmp_path / "run"), *args)
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()


def test_vertex_values_apply_after_set(tmp_path):
    run = tmp_path / "run"
    done = run_job("train", *QUICK, *sets("optim.lr=0.2", "train.epochs=1"), "--output", str(run), "--optim.lr=0.05")
    assert done.returncode == 0, done.stderr[-2000:]
    assert yaml.safe_load((run / "config.yaml").read_text())["optim"]["lr"] == 0.05


def test_the_help_says_how_vertex_arguments_are_taken():
    done = run_job("train", "--help")
    assert "--optim__lr" in done.stdout


def test_two_processes_write_each_line_once(tmp_path):
    run = tmp_path / "two"
    done = run_job(
        "train", *QUICK, *EVERY_100, "--nproc-per-node", "2", "--output", str(run), "--optim__lr=0.05",
        env=tuning(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert yaml.safe_load((run / "config.yaml").read_text())["optim"]["lr"] == 0.05
    got = lines(tmp_path)
    assert [float(line["val_accuracy"]) for line in got] == val_accuracies(run)
    assert [line["global_step"] for line in got] == ["100", "200", "300", "300"]


def test_a_line_holds_what_cloudml_hypertune_writes():
    line = json.loads(metric_line("val_accuracy", 0.1 + 0.2, 40, "3", 1525851440.25))
    want = {"val_accuracy": "0.30000000000000004", "global_step": "40", "timestamp": 1525851440.25, "trial": "3"}
    assert line == want and float(line["val_accuracy"]) == 0.1 + 0.2
