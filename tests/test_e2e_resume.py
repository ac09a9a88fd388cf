"""Never lose work: real processes killed (SIGKILL) or stopped (SIGTERM) at random moments, then resumed with the
same command; the result must equal a run that never stopped, bit for bit on the CPU."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import fsspec
import pytest
import torch
from conftest import ROOT, run_job, sets
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

TIMING_KEYS = {"samples_per_s", "wall_s"}


@pytest.fixture(params=["local"])
def output_url(request, tmp_path):
    """Where runs are written: a parameter, so the same checks run against other storage."""
    return lambda name: str(tmp_path / name)


def start(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(
        [sys.executable, "-m", "job", "train", *args],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def weights(url: str) -> dict:
    with fsspec.open(f"{url}/model.pt", "rb") as f:
        return torch.load(f, weights_only=True)


def metrics(url: str) -> list[dict]:
    with fsspec.open(f"{url}/metrics.jsonl", "r") as f:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in f if line.strip()]


def train_losses(url: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(f"{url}/tensorboard")  # reads every event file, honouring purge markers
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("train/loss")]


def assert_same_run(a: str, b: str) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert metrics(a) == metrics(b)
    assert train_losses(a) == train_losses(b)


def test_sigkill_at_random_moments_then_resume_equals_uninterrupted(output_url):
    args = [
        "--device",
        "cpu",
        *sets(
            "train.epochs=6000", "train.checkpoint_every_epochs=200", "train.eval_every_epochs=500", "train.keep_last=2"
        ),
    ]
    t0 = time.time()
    reference = run_job("train", *args, "--output", output_url("reference"))
    assert reference.returncode == 0, reference.stderr[-2000:]
    whole = time.time() - t0
    out = output_url("killed")
    rng = random.Random(1234)
    kills, resumed_from = 0, set()
    for attempt in range(8):
        proc = start([*args, "--output", out])
        # Attempts die at a random moment: in start-up, training, a commit, or (the later ones) the final writes.
        share = rng.uniform(0.25, 0.6) if attempt < 5 else rng.uniform(0.25, 1.0)
        try:
            proc.wait(timeout=share * whole if attempt < 7 else 300)
        except subprocess.TimeoutExpired:
            proc.kill()
            kills += 1
        _, err = proc.communicate()
        resumed_from |= {line for line in err.splitlines() if line.startswith("resuming")}
        if proc.returncode == 0:
            break
        assert proc.returncode == -signal.SIGKILL, err[-2000:]
    assert proc.returncode == 0, err[-2000:]
    assert kills >= 4 and len(resumed_from) >= 2, (kills, resumed_from)
    assert_same_run(output_url("reference"), out)
    leftovers = [n for n in os.listdir(f"{out}/checkpoints") if n.startswith(".")]
    assert not leftovers


def test_sigterm_mid_epoch_commits_and_resumes_exactly(output_url):
    args = [
        "--device",
        "cpu",
        *sets(
            "data.batch_size=4",
            "train.epochs=400",
            "train.eval_every_epochs=50",
            "train.checkpoint_every_epochs=100",
            "train.log_every_steps=50",
        ),
    ]
    reference = run_job("train", *args, "--output", output_url("reference"))
    assert reference.returncode == 0, reference.stderr[-2000:]
    out = output_url("stopped")
    proc = start([*args, "--output", out])
    deadline = time.time() + 60
    while time.time() < deadline and not os.path.exists(f"{out}/metrics.jsonl"):
        time.sleep(0.05)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    sent = time.time()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err[-2000:]
    assert time.time() - sent < 20  # the default grace period
    assert "Traceback" not in err and "run the same command again" in err
    with fsspec.open(f"{out}/checkpoints/latest.json") as f:
        pointer = json.load(f)
    with fsspec.open(f"{out}/checkpoints/{pointer['file']}", "rb") as f:
        payload = torch.load(f, weights_only=True)
    assert 0 < payload["progress"]["epoch_step"] < 30, "expected a checkpoint in the middle of an epoch"
    again = run_job("train", *args, "--output", out)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"from epoch {pointer['epoch']}, step {pointer['step']}" in again.stderr
    assert_same_run(output_url("reference"), out)


def test_damaged_newest_checkpoint_falls_back_end_to_end(output_url):
    out = output_url("run")
    args = ["--device", "cpu", "--set", "train.eval_every_epochs=100", "--set", "train.checkpoint_every_epochs=100"]
    first = run_job("train", *args, "--set", "train.epochs=300", "--output", out)
    assert first.returncode == 0, first.stderr[-2000:]
    with fsspec.open(f"{out}/checkpoints/e00300-s0000000300.pt", "rb") as f:
        data = bytearray(f.read())
    data[len(data) // 3] ^= 0x55
    with fsspec.open(f"{out}/checkpoints/e00300-s0000000300.pt", "wb") as f:
        f.write(bytes(data))
    resumed = run_job("train", *args, "--set", "train.epochs=400", "--output", out)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "sha256 differs from its manifest" in resumed.stderr
    assert "resuming iris from epoch 200, step 200" in resumed.stderr
    reference = run_job("train", *args, "--set", "train.epochs=400", "--output", output_url("reference"))
    assert reference.returncode == 0
    assert_same_run(output_url("reference"), out)
