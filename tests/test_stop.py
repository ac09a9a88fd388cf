"""Stopping a run at a step the test chooses, whatever the machine's speed: a model that sends its own process
SIGTERM from the forward pass of a given training step (steps run eagerly, so the forward runs in Python each time).
The stop must land exactly there, commit, exit 75 and resume bit for bit; a signal in the last step ends a
finished run, and says so. Also the time limit (train.time_limit, --time-limit), which stops like SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch
from conftest import assert_same_run, invoke, metrics, pointer, run_job, sets

import job.run.train  # noqa: F401  # imported before the time limit's clock starts, as a process would have it
from job.config import load_config
from job.duration import format_duration, parse_duration
from job.errors import ConfigError
from job.group import distributed
from job.group.stop import ASKED, TIME_LIMIT, StopRequest, precedence, reason_of

SELF_STOPPING = """
import os, signal
from torch import nn

class Net(nn.Module):
    '''The Iris preset's 4-10-3 MLP, which sends its process SIGTERM (or $STOP_SIGNAL) in training step $STOP_AT_STEP
    of this process (counted from 1; unset: never), or when built with $STOP_WHEN_BUILT set.'''

    def __init__(self, num_classes):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 10), nn.ReLU(), nn.Linear(10, num_classes))
        self.steps = 0
        self.at = int(os.environ.get("STOP_AT_STEP", "0"))
        self.sig = getattr(signal, os.environ.get("STOP_SIGNAL", "SIGTERM"))
        if os.environ.get("STOP_WHEN_BUILT"):  # while the run sets up, before any training step
            os.kill(os.getpid(), self.sig)

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


def test_sigterm_in_a_chosen_step_commits_there_and_resumes_exactly(tmp_path, models):
    reference = run_job("train", *ARGS, "--output", str(tmp_path / "reference"), env=models)
    assert reference.returncode == 0, reference.stderr[-2000:]
    out = tmp_path / "stopped"
    stopped = run_job("train", *ARGS, "--output", str(out), env={**models, "STOP_AT_STEP": "45"})
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    assert "SIGTERM: stopping in epoch 2 at step 45; committing a checkpoint" in stopped.stderr
    assert f"stopped by SIGTERM in epoch 2 at step 45; checkpoint committed to {out}" in stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert pointer(out)["step"] == 45
    payload = torch.load(out / "checkpoints" / pointer(out)["file"], weights_only=True)
    assert payload["progress"]["epoch"] == 1 and payload["progress"]["epoch_step"] == 15
    again = run_job("train", *ARGS, "--output", str(out), env=models)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming iris from epoch 1, step 45 (15 steps into epoch 2)" in again.stderr
    assert again.stderr.rstrip().endswith(f"outputs in {out} (attempt 2: run.json)")
    assert_same_run(tmp_path / "reference", out)
    assert len(metrics(out)) == 4
    # run.json: both attempts, how each ended, and where each started and stopped
    attempts = json.loads((out / "run.json").read_text())["attempts"]
    assert [a["exit_code"] for a in attempts] == [75, 0]
    assert [(a["from"]["step"], a["to"]["step"]) for a in attempts] == [(0, 45), (45, 120)]
    for a in attempts:
        assert a["started"] <= a["ended"] and a["argv"][1:4] == ["train", "--device", "cpu"]
        assert a["versions"]["torch"] == torch.__version__ and a["world_size"] == 1
        assert a["devices"][0]["type"] == "cpu" and a["host"]


def test_a_run_preempted_five_times_shows_six_attempts(tmp_path, models):
    """Each attempt stops itself in its tenth step: 75 five times over the 60 steps of two epochs, then the sixth
    attempt's tenth step is the run's last, which ends it (exit 0). A start that fails, and the finished run run
    again, are no attempts."""
    args = [*ARGS, *sets("train.epochs=2")]
    out = tmp_path / "run"
    codes = [run_job("train", *args, "--output", str(out), env={**models, "STOP_AT_STEP": "10"}).returncode]
    while codes[-1] == 75 and len(codes) < 8:
        if len(codes) == 2:
            bad = run_job("train", *args, "--set", "optim.lr=0.5", "--output", str(out), env=models)
            assert bad.returncode == 2, bad.stderr[-2000:]  # another learning rate: refused before training
        codes.append(run_job("train", *args, "--output", str(out), env={**models, "STOP_AT_STEP": "10"}).returncode)
    assert codes == [75, 75, 75, 75, 75, 0]
    assert run_job("train", *args, "--output", str(out), env=models).returncode == 0  # complete: nothing to do
    attempts = json.loads((out / "run.json").read_text())["attempts"]
    assert [a["exit_code"] for a in attempts] == codes
    assert [a["to"]["step"] for a in attempts] == [10, 20, 30, 40, 50, 60]
    assert all(a["from"] == b["to"] for a, b in zip(attempts[1:], attempts))


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
    """In this process (the job's modules imported already, so setting up takes a fraction of the limit on any
    machine) a run far too long to finish meets a 6-second limit; it stops like SIGTERM, and the same command
    continues it."""
    out = tmp_path / "run"
    long = ["train", "--device", "cpu", *sets("train.epochs=100000000", "train.checkpoint_every_epochs=1000000")]
    began = time.monotonic()
    code, err = invoke([*long, "--time-limit", "6s", "--output", str(out)])
    took = time.monotonic() - began
    assert code == 75, err[-2000:]
    assert took >= 6 and "Traceback" not in err
    step = pointer(out)["step"]
    assert step > 0 and f"the time limit (6s): stopping after epoch {step} at step {step}" in err
    assert f"stopped by the time limit (6s) after epoch {step} at step {step}; checkpoint committed" in err
    # The next attempt, with another limit (a resumed run may change it) and the run's real length.
    end = step + 200
    code, err = invoke([*long, *sets(f"train.epochs={end}", "train.time_limit=1h"), "--output", str(out)])
    assert code == 0 and f"resuming iris from epoch {step}, step {step}" in err, err[-2000:]
    code, err = invoke([*long, *sets(f"train.epochs={end}"), "--output", str(tmp_path / "reference")])
    assert code == 0, err[-2000:]
    ref, got = (torch.load(r / "model.pt", weights_only=True) for r in (tmp_path / "reference", out))
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_time_limit_reached_while_setting_up_is_a_setting_to_change(tmp_path):
    """Every attempt would set up as long again: exit 2 and the key to raise, not 75 and a retry."""
    code, err = invoke(["train", "--device", "cpu", "--time-limit", "0.001", "--output", str(tmp_path / "run")])
    assert code == 2, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last == "error: the time limit (0.001s) ran out before training began: allow more with train.time_limit"
    with StopRequest(grace_seconds=20) as stop:
        stop.limit(0.05)
        time.sleep(0.3)
        assert stop.signal == stop.received == TIME_LIMIT and stop.describe() == "the time limit (0.05s)"


@pytest.mark.parametrize(
    "given, message",
    [
        ("11:30", "--time-limit: expected seconds or a duration such as 45m, 11h30m, 2d, got '11:30'"),
        ("0", "train.time_limit: input should be greater than 0"),
        ("soon", "--time-limit: expected seconds or a duration"),
    ],
)
def test_a_bad_time_limit_is_one_line_and_exit_2(tmp_path, given, message):
    code, err = invoke(["train", "--device", "cpu", "--time-limit", given, "--output", str(tmp_path / "run")])
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_durations_read_and_written_as_people_type_them():
    assert [parse_duration(t) for t in ("90", "90s", "45m", "1h30m", "11h30m", "2d", "1.5h", " 2h 5m ")] == [
        90,
        90,
        2700,
        5400,
        41400,
        172800,
        5400,
        7500,
    ]
    assert [format_duration(s) for s in (0.5, 45, 90, 7200, 41400, 90061)] == [
        "0.5s",
        "45s",
        "1m30s",
        "2h",
        "11h30m",
        "1d1h1m1s",
    ]
    for bad in ("", "h", "1x", "1h1h", "-5m", "m30"):
        with pytest.raises(ValueError):
            parse_duration(bad)
    for bad in ("true", "inf", "nan", "-1", "1e12"):
        with pytest.raises(ConfigError, match="train.time_limit"):
            load_config("iris", [f"train.time_limit={bad}"])
    assert load_config("iris", ["train.time_limit=11h30m"]).train.time_limit == 41400
    assert load_config("iris").train.time_limit is None


def test_loss_sums_saved_per_process_resume_as_each_process_had_them():
    """Alone, a checkpoint's single row is this process's; rows saved by a group of another size give their mean,
    as the group's reductions would; a flat list (checkpoints written before rows) is taken as it is."""
    rows = torch.tensor([[1.0, 2.0], [3.0, 5.0]])
    assert torch.equal(distributed.own(rows[:1].tolist()), rows[0])
    assert torch.equal(distributed.own(rows.tolist()), torch.tensor([2.0, 3.5]))
    assert torch.equal(distributed.own([4.0, 6.0]), torch.tensor([4.0, 6.0]))
    assert torch.equal(distributed.gather(torch.tensor([1.0, 2.0])), torch.tensor([[1.0, 2.0]]))


def test_signals_and_their_order(tmp_path):
    with StopRequest(grace_seconds=20) as stop:
        signal.raise_signal(signal.SIGTERM)
        assert stop.signal == signal.SIGTERM and stop.describe() == "SIGTERM"
        signal.raise_signal(signal.SIGTERM)  # a second SIGTERM changes nothing
        assert stop.signal == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):  # a SIGINT after it stops at once
            signal.raise_signal(signal.SIGINT)


def timers_alive(before: set[threading.Thread]) -> list[threading.Thread]:
    """Timer threads started since `before` that still run once any cancelled one has had a moment to end."""
    timers = [t for t in threading.enumerate() if isinstance(t, threading.Timer) and t not in before]
    for t in timers:
        t.join(1)
    return [t for t in timers if t.is_alive()]


def test_stop_request_alone_limit_describe_cancel_and_sync():
    """A process of its own (no group): the time limit stops it like a signal and names itself, sync() leaves the
    reason as it is, a limit taken back never fires, and cancel() ends the grace period's timer."""
    before = set(threading.enumerate())
    with StopRequest(grace_seconds=30) as stop:
        assert stop.signal is None and stop.describe() == "nothing"
        stop.sync()
        assert stop.signal is None  # alone, with nothing received: nothing to stop for
        stop.limit(0.2)
        stop.limit(None)  # taken back before it fires
        time.sleep(0.5)
        assert stop.signal is None and stop.time_limit is None

    assert not timers_alive(before)
    with StopRequest(grace_seconds=30) as stop:
        stop.limit(0.5)  # counted from when the request was made
        deadline = time.monotonic() + 10
        while stop.signal is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stop.signal == stop.received == TIME_LIMIT
        assert time.monotonic() - stop.started >= 0.5
        assert stop.describe() == "the time limit (0.5s)" and stop.describe(signal.SIGINT) == "SIGINT"
        stop.sync()
        assert stop.signal == TIME_LIMIT
        assert timers_alive(before)  # the grace period runs: 30 s, then the process would exit 75
        stop.cancel()
        assert not timers_alive(before)


def test_a_stop_asked_for_a_reason_names_it_and_a_signal_outranks_it_in_a_group():
    """stop.ask(why): alone, the loop acts on it at once and describes it in the caller's words; nothing asked, nothing
    happens. In a group's reduction the run's own reasons rank below every signal, and come back as themselves."""
    with StopRequest(grace_seconds=30) as stop:
        stop.ask(None)
        assert stop.signal is None and stop.received is None
        stop.ask("the sweep's pruner (median, at step 300)")
        assert stop.signal == stop.received == ASKED
        assert stop.describe() == "the sweep's pruner (median, at step 300)"
        stop.finishing()  # a request has nothing left to stop once the results are being written: no grace period
        stop.cancel()
    handled = [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1]
    assert max(precedence(r) for r in (ASKED, TIME_LIMIT)) < min(precedence(s) for s in handled)
    assert precedence(ASKED) > precedence(TIME_LIMIT) > precedence(None) == 0
    assert [reason_of(precedence(r)) for r in (0, TIME_LIMIT, ASKED, *handled)] == [0, TIME_LIMIT, ASKED, *handled]

    with StopRequest(grace_seconds=30) as stop:  # a group of one whose reduction also saw another's SIGTERM
        stop.share(lambda received: lambda: max(received, precedence(signal.SIGTERM)))
        stop.ask("the sweep's pruner (median, at step 300)")
        assert stop.signal is None  # in a group: acted on once the processes agree
        stop.sync()
        assert stop.signal == signal.SIGTERM and stop.describe() == "SIGTERM"
        stop.cancel()


@pytest.mark.parametrize(("sig", "code", "says"), [("SIGINT", 130, "nothing was saved"), ("SIGTERM", 75, "start")])
def test_a_signal_while_setting_up_exits_with_the_code_that_matches(tmp_path, models, sig, code, says):
    """Exit 75 promises that the same command continues: right for a preemption (SIGTERM) before the first step,
    which a retry starts again. A Ctrl-C there is the user stopping a run that saved nothing: 130, and it says so."""
    out = tmp_path / "run"
    env = {**models, "STOP_WHEN_BUILT": "1", "STOP_SIGNAL": sig}
    stopped = run_job("train", *ARGS, "--output", str(out), env=env)
    assert stopped.returncode == code, stopped.stderr[-2000:]
    last = stopped.stderr.strip().splitlines()[-1]
    assert f"stopped by {sig} before training began" in last and says in last and "Traceback" not in stopped.stderr
    assert not out.exists()  # nothing written, no folder left


def test_in_a_group_a_signal_is_acted_on_one_step_later_by_every_process():
    """Each step reads the reduction started after the step before it and starts the next: a signal that came
    during a step stops the loop after the following one, whatever the log window. A group of one here (its
    reduction is its own reason); tests/test_distributed.py runs two real processes."""
    started = []

    def combine(received: int):
        started.append(received)
        return lambda: received

    with StopRequest(grace_seconds=30) as stop:
        stop.share(combine)
        stop.step()
        stop.step()
        os.kill(os.getpid(), signal.SIGTERM)  # during the third step
        assert stop.received == signal.SIGTERM and stop.signal is None
        stop.step()  # the reduction started before the signal: nothing yet
        assert stop.signal is None
        stop.step()
        assert stop.signal == signal.SIGTERM
        stop.step()  # once agreed, nothing more is started
        stop.settle()
        stop.cancel()
    assert started == [0, 0, precedence(signal.SIGTERM)]


@pytest.mark.parametrize(("sig", "code"), [("SIGINT", 130), ("SIGTERM", 75)])
def test_a_signal_while_the_data_is_read_stops_at_once(tmp_path, sig, code):
    """Reading a folder can take minutes: a signal then ends the run at once, not when the read is over. The folder
    holds a named pipe that the reader blocks on until this test writes to it (it never does): the signal is sent
    once the reader has opened it, the state, not a time."""
    from conftest import start_job, write_image_folder

    root = write_image_folder(tmp_path / "imgs", per_class=4)
    pipe = root / "train" / "class2" / "zzz.png"  # read last, after every real image
    os.mkfifo(pipe)
    out = tmp_path / "run"
    args = ["train", "--device", "cpu", "--config", "cifar10", "--output", str(out)]
    proc = start_job(*args, *sets("data.kind=folder", f"data.path={root}", "data.image_size=32"))
    writer, deadline = None, time.monotonic() + 300
    try:
        while writer is None:  # opening the write end succeeds once the reader holds the read end
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "late"
            try:
                writer = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                time.sleep(0.05)
        proc.send_signal(getattr(signal, sig))
        err = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
        if writer is not None:
            os.close(writer)
    assert proc.returncode == code, err[-2000:]
    assert f"stopped by {sig} before training began" in err.strip().splitlines()[-1] and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("after", [0.2, 0.6, 1.2, 2.0, 3.0])
def test_ctrl_c_at_any_moment_of_starting_is_one_line_and_its_code(tmp_path, after):
    """Ctrl-C a moment after `python -m job train` starts, wherever that lands on this machine (importing torch,
    reading the config, setting up, or training): exit 130 (nothing saved) or 75 (a checkpoint committed), one
    line, no traceback, and no claim of a second interrupt."""
    import subprocess
    import sys

    from conftest import job_env

    proc = subprocess.Popen(
        [sys.executable, "-m", "job", "train", "--output", str(tmp_path / "run")],
        env=job_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(after)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode in (75, 130, 0), err[-3000:]
    assert "Traceback" not in err and "second interrupt" not in err, err[-3000:]
    if proc.returncode == 130:
        assert len([line for line in err.splitlines() if "stopped" in line]) == 1, err
