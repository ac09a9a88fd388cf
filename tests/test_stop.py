"""Stopping a run at a step the test chooses, whatever the machine's speed: a model that sends its own process
SIGTERM from the forward pass of a given training step (steps run eagerly, so the forward runs in Python each time).
The stop must land exactly there, commit, exit 75 and resume bit for bit; a signal in the last step ends a
finished run, and says so. Also the time limit (train.time_limit, --time-limit), which stops like SIGTERM."""

from __future__ import annotations

import json
import signal
import time

import pytest
import torch
from conftest import invoke, run_job, sets

from job.stop import TIME_LIMIT, StopRequest

SELF_STOPPING = """
import os, signal
from torch import nn

class Net(nn.Module):
    '''The Iris preset's 4-10-3 MLP, which sends its process SIGTERM (or $STOP_SIGNAL) in training step $STOP_AT_STEP
    of this process (counted from 1; unset: never).'''

    def __init__(self, num_classes):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 10), nn.ReLU(), nn.Linear(10, num_classes))
        self.steps = 0
        self.at = int(os.environ.get("STOP_AT_STEP", "0"))
        self.sig = getattr(signal, os.environ.get("STOP_SIGNAL", "SIGTERM"))

    def forward(self, x):
        if self.training and self.at:  # the job's shape and FLOPs probes run in eval mode
            self.steps += 1
            if self.steps == self.at:
                os.kill(os.getpid(), self.sig)
        return self.net(x)
"""

# 120 Iris training rows in batches of 4: 30 steps an epoch.
ARGS = [
    "--device",
    "cpu",
    *sets(
        "model.name=selfstop:Net",
        "data.batch_size=4",
        "train.step_capture=off",
        "train.epochs=4",
        "train.eval_every_epochs=1",
        "train.checkpoint_every_epochs=2",
        "train.log_every_steps=10",
    ),
]


@pytest.fixture
def models(tmp_path) -> dict:
    (tmp_path / "selfstop.py").write_text(SELF_STOPPING)
    return {"PYTHONPATH": str(tmp_path)}


def pointer(run) -> dict:
    return json.loads((run / "checkpoints/latest.json").read_text())


def same_run(a, b) -> None:
    wa, wb = (torch.load(r / "model.pt", weights_only=True) for r in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    ma, mb = ([strip_timing(line) for line in (r / "metrics.jsonl").read_text().splitlines()] for r in (a, b))
    assert ma == mb and len(ma) == 4


def strip_timing(line: str) -> dict:
    return {k: v for k, v in json.loads(line).items() if k not in ("samples_per_s", "wall_s")}


def test_sigterm_in_a_chosen_step_commits_there_and_resumes_exactly(tmp_path, models):
    reference = run_job("train", *ARGS, "--output", str(tmp_path / "reference"), env=models)
    assert reference.returncode == 0, reference.stderr[-2000:]
    out = tmp_path / "stopped"
    stopped = run_job("train", *ARGS, "--output", str(out), env={**models, "STOP_AT_STEP": "45"})
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    assert "SIGTERM: stopping at epoch 1, step 45; committing a checkpoint" in stopped.stderr
    assert f"stopped by SIGTERM at epoch 1, step 45; checkpoint committed to {out}" in stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert pointer(out)["step"] == 45
    payload = torch.load(out / "checkpoints" / pointer(out)["file"], weights_only=True)
    assert payload["progress"]["epoch"] == 1 and payload["progress"]["epoch_step"] == 15
    again = run_job("train", *ARGS, "--output", str(out), env=models)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming iris from epoch 1, step 45" in again.stderr
    same_run(tmp_path / "reference", out)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_in_the_last_step_ends_a_finished_run_and_says_so(tmp_path, models, sig):
    out = tmp_path / "run"
    done = run_job("train", *ARGS, "--output", str(out), env={**models, "STOP_AT_STEP": "120", "STOP_SIGNAL": sig})
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{sig} came as the run was ending: it finished, there is nothing to continue" in done.stderr
    assert "checkpointing" not in done.stderr and "stopping" not in done.stderr, done.stderr
    assert "done: 4 epochs, 120 steps" in done.stderr
    assert pointer(out)["step"] == 120 and (out / "model.pt").is_file()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4


def test_time_limit_commits_and_exits_75_then_the_run_continues(tmp_path):
    """In this process (torch already imported, so setting up takes well under the limit on any machine) a run
    far too long to finish meets a 3-second limit; it stops like SIGTERM, and the same command continues it."""
    out = tmp_path / "run"
    long = ["train", "--device", "cpu", *sets("train.epochs=100000000", "train.checkpoint_every_epochs=1000000")]
    began = time.monotonic()
    code, err = invoke([*long, "--time-limit", "3s", "--output", str(out)])
    took = time.monotonic() - began
    assert code == 75, err[-2000:]
    assert took >= 3 and "Traceback" not in err
    step = pointer(out)["step"]
    assert step > 0 and f"the time limit (3s): stopping at epoch {step}, step {step}" in err
    assert f"stopped by the time limit (3s) at epoch {step}, step {step}; checkpoint committed" in err
    # The next attempt, with another limit (a resumed run may change it) and the run's real length.
    end = step + 200
    code, err = invoke([*long, *sets(f"train.epochs={end}", "train.time_limit=1h"), "--output", str(out)])
    assert code == 0 and f"resuming iris from epoch {step}, step {step}" in err, err[-2000:]
    code, err = invoke([*long, *sets(f"train.epochs={end}"), "--output", str(tmp_path / "reference")])
    assert code == 0, err[-2000:]
    ref, got = (torch.load(r / "model.pt", weights_only=True) for r in (tmp_path / "reference", out))
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_time_limit_reached_while_setting_up_says_so():
    stop = StopRequest(grace_seconds=20)
    stop.limit(0.05)
    time.sleep(0.3)
    assert stop.signal == stop.received == TIME_LIMIT
    assert stop.describe() == "the time limit (0.05s)"
    stop.limit(None)


def test_signals_and_their_order(tmp_path):
    with StopRequest(grace_seconds=20) as stop:
        signal.raise_signal(signal.SIGTERM)
        assert stop.signal == signal.SIGTERM and stop.describe() == "SIGTERM"
        signal.raise_signal(signal.SIGTERM)  # a second SIGTERM changes nothing
        assert stop.signal == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):  # a SIGINT after it stops at once
            signal.raise_signal(signal.SIGINT)
