"""Data-parallel training through torchrun with real processes (gloo on the CPU): two processes equal one with the
same global batch, outputs are written once, a killed group resumes exactly, one preempted rank stops them all with
75, a different number of processes continues a run, and a fault on one rank ends every rank with its line."""

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import job_env, metrics, run_job, sets, weights, write_cifar_batches


def torchrun_args(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "job"]


def torchrun(*args: str, nproc: int = 2, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node N -m job ARGS`, as a user runs it (a free port per run); `env`: more
    variables (PYTHONPATH is added to the checkout's)."""
    extra = dict(env or {})
    full_env = {**job_env(extra.pop("PYTHONPATH", "")), **extra}
    return subprocess.run(
        [*torchrun_args(nproc=nproc), *args], capture_output=True, text=True, timeout=timeout, env=full_env
    )


def start_torchrun(*args: str, nproc: int = 2) -> subprocess.Popen:
    """torchrun in the background, in a session of its own so the whole group can be killed."""
    return subprocess.Popen(
        [*torchrun_args(nproc=nproc), *args],
        env=job_env(),
        text=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def assert_close_runs(a: Path, b: Path) -> None:
    """Same weights within float tolerance (the reductions add in another order), the same evaluations."""
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    bad = {k: (wa[k] - wb[k]).abs().max().item() for k in wa if not torch.allclose(wa[k], wb[k], rtol=1e-4, atol=1e-5)}
    assert not bad, bad
    ma, mb = metrics(a), metrics(b)
    assert [(r["epoch"], r["step"]) for r in ma] == [(r["epoch"], r["step"]) for r in mb]
    for ra, rb in zip(ma, mb):
        assert ra["test_accuracy"] == pytest.approx(rb["test_accuracy"], abs=1e-6)
        assert ra["test_loss"] == pytest.approx(rb["test_loss"], rel=1e-4, abs=1e-5)
        scores = {k for k in ra if k.startswith("test_") and k not in ("test_accuracy", "test_loss")}
        assert scores >= {"test_macro_f1", "test_weighted_f1"} and scores == {k for k in rb if k in scores}
        assert {k: ra[k] for k in scores} == pytest.approx({k: rb[k] for k in scores}, abs=1e-6)  # F1 and the rest
        assert ra["train_loss"] == pytest.approx(rb["train_loss"], rel=1e-4, abs=1e-5)


def assert_written_once(run: Path, checkpoints: int) -> None:
    events = glob.glob(str(run / "tensorboard" / "**" / "events.out.tfevents.*"), recursive=True)
    assert len(events) == 1, events
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert len([n for n in names if n.endswith(".pt")]) == checkpoints and "latest.json" in names, names
    assert not [n for n in names if n.startswith(".")], names


def committed(run: Path) -> dict | None:
    try:
        return json.loads((run / "checkpoints" / "latest.json").read_text())
    except (FileNotFoundError, ValueError):
        return None


def wait_for_commit(run: Path, proc: subprocess.Popen, after_step: int = -1, timeout: float = 120) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        pointer = committed(run)
        if pointer is not None and pointer["step"] > after_step:
            return pointer
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint committed in {run}: {proc.stderr.read()[-2000:] if proc.poll() else ''}")


def workers(torchrun_pid: int) -> dict[int, int]:
    """{rank: pid} of torchrun's worker processes, read from /proc."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid != torchrun_pid:
                continue
            env = dict(kv.split("=", 1) for kv in (stat.parent / "environ").read_text().split("\0") if "=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = int(stat.parent.name)
    return found


IRIS = ["--config", "iris", "--device", "cpu"]


@pytest.mark.parametrize(
    "overrides",
    [
        ("train.epochs=300", "train.eval_every_epochs=100", "train.checkpoint_every_epochs=150"),  # full batch, 60 each
        ("data.batch_size=25", "train.epochs=20", "train.log_every_steps=7", "train.checkpoint_every_epochs=10"),
    ],
    ids=["full-batch", "uneven-25"],
)
def test_two_processes_equal_one_with_the_same_global_batch(tmp_path, overrides):
    """Batches of 25 split 12/13 over two processes: their loss weights keep the gradient the global batch's."""
    one = run_job("train", *IRIS, *sets(*overrides), "--output", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-2000:]
    two = torchrun("train", *IRIS, *sets(*overrides), "--output", str(tmp_path / "two"))
    assert two.returncode == 0, two.stderr[-3000:]
    assert_close_runs(tmp_path / "one", tmp_path / "two")
    assert_written_once(tmp_path / "two", checkpoints=2)
    assert two.stderr.count("done:") == 1 and two.stderr.count("model mlp") == 1  # only rank 0 talks
    assert "Traceback" not in two.stderr


def test_cifar10_subset_two_processes_equal_one(tmp_path):
    data = write_cifar_batches(tmp_path / "cifar-10-batches-py", n_train=300, n_test=100)
    args = [
        "--config",
        "cifar10",
        "--device",
        "cpu",
        *sets(
            f"data.path={data}",
            "data.batch_size=32",
            "data.eval_batch_size=64",
            "data.random_crop_padding=2",
            "data.random_hflip=true",
            "train.epochs=2",
            "train.log_every_steps=4",
            "train.precision=fp32",  # auto would be bf16 on a CPU with AMX, which rounds each process's slice alone
        ),
    ]
    one = run_job("train", *args, "--output", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-2000:]
    two = torchrun("train", *args, "--output", str(tmp_path / "two"))
    assert two.returncode == 0, two.stderr[-3000:]
    assert_close_runs(tmp_path / "one", tmp_path / "two")
    assert_written_once(tmp_path / "two", checkpoints=2)
    assert len(metrics(tmp_path / "two")) == 2


# The interrupted runs are set to train far longer than any machine gets through while the test interrupts them;
# the attempt that finishes sets train.epochs (a resumed run may change it) to a length past the last commit, and
# the reference is an uninterrupted run of that length.
RESUMABLE = [
    *IRIS,
    *sets(
        "data.batch_size=25",
        "train.eval_every_epochs=20",
        "train.checkpoint_every_epochs=20",
        "train.log_every_steps=10",
    ),
]
FOREVER = ("--set", "train.epochs=100000000")


@pytest.fixture(scope="module")
def reference_two(tmp_path_factory):
    """An uninterrupted two-process run of RESUMABLE for `epochs` epochs (one run per length)."""
    runs: dict[int, Path] = {}

    def run(epochs: int) -> Path:
        if epochs not in runs:
            out = tmp_path_factory.mktemp("reference") / "run"
            done = torchrun("train", *RESUMABLE, "--set", f"train.epochs={epochs}", "--output", str(out))
            assert done.returncode == 0, done.stderr[-3000:]
            runs[epochs] = out
        return runs[epochs]

    return run


def finish_and_compare(out: Path, pointer: dict, reference_two) -> None:
    """The same command, with a length past the stop, continues exactly where the run stopped and ends as an
    uninterrupted run of that length does, bit for bit (same processes, same order of additions)."""
    epochs = (pointer["epoch"] // 100 + 1) * 100
    again = torchrun("train", *RESUMABLE, "--set", f"train.epochs={epochs}", "--output", str(out))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming iris from epoch {pointer['epoch']}, step {pointer['step']}" in again.stderr
    reference = reference_two(epochs)
    wa, wb = weights(reference), weights(out)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert metrics(reference) == metrics(out)


def test_sigkill_of_the_whole_group_then_resume_equals_uninterrupted(tmp_path, reference_two):
    out = tmp_path / "killed"
    proc = start_torchrun("train", *RESUMABLE, *FOREVER, "--output", str(out))
    wait_for_commit(out, proc)
    ranks = workers(proc.pid)
    time.sleep(0.3)  # somewhere after the first commit: mid-step, mid-reduction or mid-commit
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)  # torchrun puts each worker in a session of its own: kill them too
    for pid in ranks.values():
        os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    pointer = committed(out)
    assert pointer is not None
    finish_and_compare(out, pointer, reference_two)


def test_sigterm_to_one_worker_stops_all_with_75_and_resumes_exactly(tmp_path, reference_two):
    out = tmp_path / "stopped"
    proc = start_torchrun("train", *RESUMABLE, *FOREVER, "--output", str(out))
    first = wait_for_commit(out, proc)
    ranks = workers(proc.pid)
    assert sorted(ranks) == [0, 1], ranks
    os.kill(ranks[1], signal.SIGTERM)  # one preempted process, not torchrun
    sent = time.time()
    _, err = proc.communicate(timeout=60)
    assert time.time() - sent < 20, "the group did not stop within the grace period"
    # torchrun exits 1 when any worker exits non-zero; it names each worker's exit code.
    assert proc.returncode == 1, err[-3000:]
    assert err.count("exitcode  : 75") == 2, err[-3000:]
    assert "stopped by SIGTERM" in err and "run the same command again" in err
    pointer = committed(out)
    assert pointer["step"] > first["step"]
    finish_and_compare(out, pointer, reference_two)


def test_resume_with_another_number_of_processes_continues_the_same_run(tmp_path):
    """The global batch and its order do not depend on the number of processes: a run checkpointed by two
    processes continues in one, and ends where a one-process run ends (within float tolerance)."""
    args = [*IRIS, *sets("data.batch_size=25", "train.eval_every_epochs=20", "train.checkpoint_every_epochs=20")]
    one = run_job("train", *args, "--set", "train.epochs=60", "--output", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-2000:]
    first = torchrun("train", *args, "--set", "train.epochs=40", "--output", str(tmp_path / "mixed"))
    assert first.returncode == 0, first.stderr[-3000:]
    then = run_job("train", *args, "--set", "train.epochs=60", "--output", str(tmp_path / "mixed"))
    assert then.returncode == 0, then.stderr[-2000:]
    assert "resuming iris from epoch 40, step 200" in then.stderr
    assert_close_runs(tmp_path / "one", tmp_path / "mixed")


def assert_fault_ended_group(run: subprocess.CompletedProcess, line: str, code: int) -> None:
    """A fault every rank meets ends the group with its line and exit code. Each rank that reaches the fault prints
    the line; torchrun stops the others once the first has exited, so a late rank may print nothing: the line at
    least once, no other error from the job, the first failure's code, torchrun's own 1."""
    errors = [x for x in run.stderr.splitlines() if x.startswith("error: ")]
    assert errors and all(line in x for x in errors), run.stderr[-3000:]
    assert f"exitcode  : {code}" in run.stderr, run.stderr[-3000:]
    assert run.returncode == 1  # torchrun's own code for any failed worker
    assert "/job/" not in run.stderr, run.stderr[-3000:]  # torchrun prints its own traceback; the job's none


def test_faults_end_the_group_with_their_line_and_code(tmp_path):
    bad = torchrun("train", *IRIS, "--set", "train.epochs=ten", "--output", str(tmp_path / "bad"), timeout=120)
    assert_fault_ended_group(bad, "train.epochs: input should be a valid integer", 2)
    # Found by rank 0 alone (the checkpoint to resume from), raised on every rank as the same error.
    missing = torchrun("train", *IRIS, "--resume", str(tmp_path / "nothing.pt"), "--output", str(tmp_path / "m"))
    assert_fault_ended_group(missing, "nothing.pt: no such checkpoint", 5)
    odd = torchrun("train", *IRIS, *sets("data.batch_size=119"), "--output", str(tmp_path / "odd"))
    assert_fault_ended_group(odd, "a training batch of 1 samples cannot be split over 2 processes", 2)


def test_a_resume_refused_by_rank_0_ends_every_rank_with_its_line(tmp_path):
    """Rank 0 alone checks the checkpoint against the run (settings changed since): every rank ends with its error."""
    out = str(tmp_path / "run")
    first = run_job("train", *IRIS, "--set", "train.epochs=1", "--output", out)
    assert first.returncode == 0, first.stderr[-2000:]
    changed = torchrun("train", *IRIS, *sets("train.epochs=2", "optim.lr=0.5"), "--output", out)
    assert_fault_ended_group(changed, "cannot resume: the checkpoint was trained with other settings", 2)


@pytest.mark.gpu
def test_nccl_on_one_gpu_equals_a_plain_run(tmp_path):
    """Sanity of the nccl path where there is a GPU: torchrun with one process (DDP over nccl) equals a plain run."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU for the nccl backend (this machine has none)")
    args = ["--config", "iris", "--device", "cuda", *sets("train.epochs=300", "train.eval_every_epochs=100")]
    one = run_job("train", *args, "--output", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-2000:]
    ddp = torchrun("train", *args, "--output", str(tmp_path / "ddp"), nproc=1)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert "cuda:0" in ddp.stderr
    assert_close_runs(tmp_path / "one", tmp_path / "ddp")
    assert_written_once(tmp_path / "ddp", checkpoints=1)


def test_a_sigterm_is_acted_on_at_the_next_steps_not_the_next_log_window(tmp_path):
    """Under a group the processes agree on a stop at every step (a reduction started after one step and read after
    the next), so a SIGTERM commits within a step or two even when the log window is longer than the grace period
    lasts: here no log window ever closes, and the grace period is 20 s."""
    out = tmp_path / "run"
    window = sets("train.log_every_steps=100000000", "train.grace_seconds=20")
    proc = start_torchrun("train", *RESUMABLE, *FOREVER, *window, "--output", str(out))
    first = wait_for_commit(out, proc)
    ranks = workers(proc.pid)
    os.kill(ranks[1], signal.SIGTERM)
    sent = time.time()
    _, err = proc.communicate(timeout=60)
    assert time.time() - sent < 15, err[-3000:]
    assert "grace period ran out" not in err, err[-3000:]
    assert err.count("exitcode  : 75") == 2, err[-3000:]
    assert "stopped by SIGTERM" in err, err[-3000:]
    assert committed(out)["step"] > first["step"]


DROPPING = """
import os, signal
from torch import nn

class Net(nn.Module):
    '''An Iris MLP with dropout, which sends its own process SIGTERM in training step $STOP_AT_STEP of rank 1.'''

    def __init__(self, num_classes):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, num_classes))
        self.steps, self.at = 0, int(os.environ.get("STOP_AT_STEP", "0")) if os.environ["RANK"] == "1" else 0

    def forward(self, x):
        if self.training and self.at:
            self.steps += 1
            if self.steps == self.at:
                os.kill(os.getpid(), signal.SIGTERM)
        return self.net(x)
"""


def test_each_process_draws_its_own_randomness_and_resumes_it_exactly(tmp_path):
    """Dropout masks are drawn from a stream of each process's own, seeded from (seed, rank): a checkpoint holds
    every process's RNG state, they differ, and a group stopped mid-epoch resumes each process's own stream, ending
    bit for bit as a group that never stopped."""
    (tmp_path / "dropping.py").write_text(DROPPING)
    env = {"PYTHONPATH": str(tmp_path)}
    args = [
        *IRIS,
        *sets("model.name=dropping:Net", "train.step_capture=off", "data.batch_size=25", "train.epochs=8"),
        *sets("train.eval_every_epochs=2", "train.checkpoint_every_epochs=2"),
    ]
    reference = torchrun("train", *args, "--output", str(tmp_path / "reference"), env=env)
    assert reference.returncode == 0, reference.stderr[-3000:]
    payload = torch.load(tmp_path / "reference" / "checkpoints" / committed(tmp_path / "reference")["file"])
    own = payload["rng"]["by_rank"]  # a component kept per process (job/run/state.py)
    assert len(own) == 2 and not torch.equal(own[0]["torch"], own[1]["torch"])

    out = tmp_path / "stopped"
    stopped = torchrun("train", *args, "--output", str(out), env={**env, "STOP_AT_STEP": "17"})
    assert stopped.returncode == 1 and stopped.stderr.count("exitcode  : 75") == 2, stopped.stderr[-3000:]
    assert committed(out)["step"] in (17, 18)  # acted on one step after the signal, in epoch 4 of 5 steps each
    again = torchrun("train", *args, "--output", str(out), env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    wa, wb = weights(tmp_path / "reference"), weights(out)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert metrics(tmp_path / "reference") == metrics(out)


def test_a_frozen_backbone_keeps_its_batch_norm_statistics_through_sync_batchnorm():
    """model.freeze_backbone holds its batch norms in evaluation by a hook; a group on GPUs converts them to
    SyncBatchNorm, which must keep it (forced here on a CPU: frozen layers never synchronise)."""
    from torch import nn

    from job.group import distributed
    from job.recipe.weights import freeze_backbone

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    model[1].running_mean.fill_(0.5)
    freeze_backbone(model, ["4"])
    before = model[1].running_mean.clone()
    synced = distributed.sync_batchnorm(model)
    assert isinstance(synced[1], nn.SyncBatchNorm)
    synced.train()
    synced(torch.randn(8, 3, 8, 8))
    assert torch.equal(synced[1].running_mean, before) and int(synced[1].num_batches_tracked) == 0


BN_NET = """
from torch import nn


class BnNet(nn.Sequential):
    def __init__(self, num_classes: int = 3) -> None:
        super().__init__(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, num_classes))
"""


def test_train_ema_of_batch_norm_on_two_cpu_processes_resumes_exactly(tmp_path):
    """Batch norm on CPU processes is not synchronised: each process's statistics follow its own batches. The
    average of train.ema evaluated, checkpointed and resumed is rank 0's on every process, so a run continued from
    its checkpoint ends as one that never stopped."""
    (tmp_path / "bnnet.py").write_text(BN_NET)
    env = {"PYTHONPATH": str(tmp_path)}
    args = [*IRIS, *sets("model.name=bnnet:BnNet", "train.ema=0.9", "data.batch_size=20", "data.val_split=0.2")]
    args += sets("train.eval_every_epochs=2", "train.checkpoint_every_epochs=2")
    whole = torchrun("train", *args, "--set", "train.epochs=6", "--output", str(tmp_path / "whole"), env=env)
    assert whole.returncode == 0, whole.stderr[-3000:]
    part = torchrun("train", *args, "--set", "train.epochs=2", "--output", str(tmp_path / "parts"), env=env)
    assert part.returncode == 0, part.stderr[-3000:]
    rest = torchrun("train", *args, "--set", "train.epochs=6", "--output", str(tmp_path / "parts"), env=env)
    assert rest.returncode == 0 and "resuming iris from epoch 2" in rest.stderr, rest.stderr[-3000:]
    wa, wb = weights(tmp_path / "whole"), weights(tmp_path / "parts")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert metrics(tmp_path / "whole") == metrics(tmp_path / "parts")
