"""What a run chooses its model on (train.choose_on): the chosen epoch, model.pt, keep_best, early stopping and
resume follow the named val metric, in its direction (loss lowest, the rest highest)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import torch
from conftest import invoke, metrics, run_job, sets


def noisy_table(path: Path) -> Path:
    """240 rows of 8 features and 3 classes that overlap, 15% of labels redrawn: a wide MLP overfits it, so its val
    loss is lowest at another epoch than its val accuracy is highest."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 240)
    x = rng.normal(0, 1, (240, 8))
    x[:, 0] += y * 1.0
    x[:, 1] -= y * 0.7
    y = np.where(rng.random(240) < 0.15, rng.integers(0, 3, 240), y)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*(f"f{i}" for i in range(8)), "kind"])
        w.writerows([*(f"{v:.4f}" for v in row), "abc"[k]] for row, k in zip(x, y))
    return path


def noisy_run(tmp_path: Path, out: Path, *extra: str) -> tuple[int, str]:
    table = tmp_path / "noisy.csv"
    if not table.exists():
        noisy_table(table)
    over = sets(
        f"data.path={table}",
        "data.target=kind",
        "data.val_split=0.3",
        "data.test_split=0",  # job evaluate then scores the val split
        "data.batch_size=32",
        "model.hidden=[128]",
        "optim.name=adamw",
        "optim.lr=0.01",
        "train.eval_every_epochs=5",
        "train.checkpoint_every_epochs=5",
        *extra,
    )
    return invoke(["train", "--device", "cpu", "--output", str(out), *over])


def evaluations(out: Path) -> list[dict]:
    return [r for r in metrics(str(out)) if "train_loss" in r]


def test_a_run_chosen_on_val_loss_keeps_the_weights_of_its_lowest_val_loss_and_stops_on_it(tmp_path):
    """model.pt is the evaluation of the lowest val loss (job evaluate of it gives that record's val_loss), not the
    best accuracy's, whose epoch differs here; keep_best keeps that epoch's checkpoint; early stopping counts the
    evaluations since the val loss was lowest."""
    out = tmp_path / "run"
    extra = ("train.choose_on=val_loss", "train.epochs=60", "train.early_stopping_patience=3")
    code, err = noisy_run(tmp_path, out, *extra, "train.keep_best=true", "train.keep_last=1")
    assert code == 0, err
    records = evaluations(out)
    lowest = min(records, key=lambda r: r["val_loss"])
    most_accurate = max(records, key=lambda r: (r["val_accuracy"], -r["val_loss"]))
    assert lowest["epoch"] != most_accurate["epoch"]  # the case this test is about
    got = run_job("evaluate", "--model", str(out), "--device", "cpu", "--json")
    assert got.returncode == 0, got.stderr
    evaluated = json.loads(got.stdout)
    assert evaluated["split"] == "val" and abs(evaluated["val_loss"] - lowest["val_loss"]) < 1e-6
    assert records[-1]["epoch"] == lowest["epoch"] + 3 * 5  # three evaluations without a lower val loss
    assert "early stopping: val loss has not improved in 3 evaluations" in err, err
    assert f"best val loss {lowest['val_loss']:.4f} (epoch {lowest['epoch']}), its weights in model.pt" in err, err
    kept = sorted(p.name for p in (out / "checkpoints").glob("*.pt"))
    assert any(name.startswith(f"e{lowest['epoch']:05d}-") for name in kept), kept
    card = json.loads((out / "model.json").read_text())
    assert card["metrics"]["best_val_loss"] == lowest["val_loss"]


def test_a_run_chosen_on_val_loss_resumes_to_the_same_choice(tmp_path):
    """Stopped after its lowest val loss and continued with more epochs, a run stops and chooses exactly as one that
    ran through: the chooser's state (its metric, best value, weights, evaluations since) is in its checkpoints."""
    extra = ("train.choose_on=val_loss", "train.early_stopping_patience=3")
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    code, err = noisy_run(tmp_path, whole, *extra, "train.epochs=60")
    assert code == 0, err
    lowest = min(evaluations(whole), key=lambda r: r["val_loss"])["epoch"]
    code, err = noisy_run(tmp_path, parts, *extra, f"train.epochs={lowest + 5}")  # ends past it: model.pt chosen
    assert code == 0, err
    changed = noisy_run(
        tmp_path, parts, "train.choose_on=val_macro_f1", "train.early_stopping_patience=3", "train.epochs=60"
    )
    assert changed[0] == 2 and "train.choose_on" in changed[1] and "Traceback" not in changed[1], changed[1]
    code, err = noisy_run(tmp_path, parts, *extra, "train.epochs=60")
    assert code == 0, err
    assert "resuming" in err and "early stopping: val loss" in err, err
    assert [r["val_loss"] for r in evaluations(parts)] == [r["val_loss"] for r in evaluations(whole)]
    a = torch.load(whole / "model.pt", weights_only=True)
    b = torch.load(parts / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_what_a_run_may_choose_on_is_checked_in_one_line(tmp_path):
    """A name no evaluation writes, a multi-label score on one-label data, and a val metric without a val split:
    exit 2, one line naming what may be chosen."""
    code, err = noisy_run(tmp_path, tmp_path / "a", "train.choose_on=val_acc")
    assert code == 2 and "train.choose_on" in err and "val_loss" in err and "val_macro_f1" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    code, err = noisy_run(tmp_path, tmp_path / "b", "train.choose_on=val_map", "train.epochs=1")
    assert code == 2 and "train.choose_on" in err and "val_accuracy" in err and "Traceback" not in err, err
    assert "val_top5" not in err.splitlines()[-1], err  # 3 classes: no top-5 written
    code, err = noisy_run(
        tmp_path,
        tmp_path / "c",
        "train.choose_on=val_loss",
        "data.val_split=0",
        "data.test_split=0.2",
        "train.epochs=1",
    )
    assert code == 2 and "train.choose_on" in err and "val split" in err and "Traceback" not in err, err
    code, err = noisy_run(tmp_path, tmp_path / "d", "train.choose_on=val_accuracy", "train.epochs=5")
    assert code == 0, err  # the default, named


def test_choosing_on_loss_takes_the_lowest_never_a_nan_and_counts_only_a_fall_of_min_delta():
    """In-process, the Chooser alone: val_loss is better lower; a NaN is never chosen; early_stopping_min_delta asks
    for a fall of that much; a multi-label checkpoint's thresholds are its own evaluation's, after a restore too."""
    from job.config import TrainConfig
    from job.run.choose import Chooser
    from job.run.progress import Progress

    t = TrainConfig(choose_on="val_loss", early_stopping_patience=2, early_stopping_min_delta=0.05)
    model, state = torch.nn.Linear(2, 3), Progress()
    chooser = Chooser(t, "val", multilabel=True, written=["train_loss", "val_loss", "val_map"])
    reasons = []
    for epoch, loss in enumerate([float("nan"), 0.9, 0.5, 0.47, 0.6], start=1):
        state.epoch = epoch
        with torch.no_grad():
            model.weight.fill_(epoch)
        reasons.append(chooser.judge(state, loss, loss, model, None, [epoch / 10] * 3))
        if epoch == 4:
            payload = {"progress": {"best_epoch": state.best_epoch, "epoch": 4, "epoch_step": 0}} | chooser.saved(state)
    assert state.best_epoch == 3 and state.best_accuracy == 0.5 and float(chooser.weights["weight"][0, 0]) == 3
    assert reasons[:4] == ["", "", "", ""]
    assert (
        reasons[4]
        == "early stopping: val loss has not improved by more than 0.05 in 2 evaluations (best 0.5000 at epoch 3)"
    )
    assert chooser.model_thresholds(3) == [0.3] * 3  # model.pt's: the chosen evaluation's
    again = Chooser(t, "val", multilabel=True)
    again.restore(payload, model)
    assert again.model_thresholds(3, Progress(epoch=4, best_epoch=3)) == [0.4] * 3  # the checkpoint's own weights'
    assert again.model_thresholds(3) == [0.3] * 3
    assert Chooser(TrainConfig(), "test", multilabel=True).model_thresholds(2) == [0.5, 0.5]  # none fitted on test


def test_a_run_begun_on_auto_continues_when_named_what_auto_chose(tmp_path):
    """A checkpoint from before train.choose_on (or begun on auto) and a sweep's trial that now names val_accuracy:
    the same choice, so the run continues; another metric is refused."""
    out = tmp_path / "run"
    assert noisy_run(tmp_path, out, "train.epochs=2")[0] == 0
    code, err = noisy_run(tmp_path, out, "train.epochs=3", "train.choose_on=val_accuracy")
    assert code == 0 and "resuming" in err, err
    code, err = noisy_run(tmp_path, out, "train.epochs=4", "train.choose_on=val_loss")
    assert code == 2 and "train.choose_on" in err, err
