"""`train --nproc-per-node N`: the job starts its workers through PyTorch's elastic agent and ends with their exit
code. Real processes throughout: the launcher is signalled from outside, a worker is killed, a worker's user error
is passed on, and torchrun in front of the job still works."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import free_port, job_env, run_job, scalars, sets, start_job, weights
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from job.errors import ConfigError
from job.group.launch import Launch, group_exit_code, launch_plan

TWO = ["train", "--device", "cpu", "--nproc-per-node", "2"]

KILLER = """
import os, signal
from torch import nn

class Net(nn.Module):
    '''The Iris MLP; in the process of rank $KILL_RANK, SIGKILL in its training step $KILL_AT_STEP.'''

    def __init__(self, num_classes):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 10), nn.ReLU(), nn.Linear(10, num_classes))
        self.steps = 0
        self.mine = os.environ.get("RANK") == os.environ.get("KILL_RANK")

    def forward(self, x):
        if self.training:
            self.steps += 1
            if self.mine and self.steps == int(os.environ["KILL_AT_STEP"]):
                os.kill(os.getpid(), signal.SIGKILL)
        return self.net(x)
"""


GATE = """
import os, time
from pathlib import Path
from torch import nn

class Net(nn.Module):
    '''The Iris MLP that, at training step $GATE_AT_STEP, says so in $GATE.<rank> and waits until $GATE exists.'''

    def __init__(self, num_classes):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 10), nn.ReLU(), nn.Linear(10, num_classes))
        self.steps = 0

    def forward(self, x):
        if self.training:
            self.steps += 1
            gate = Path(os.environ["GATE"])
            if self.steps == int(os.environ["GATE_AT_STEP"]) and not gate.exists():
                Path(f"{gate}.{os.environ.get('RANK', '0')}").touch()
                while not gate.exists():
                    time.sleep(0.05)
        return self.net(x)
"""


def attempts(run: Path) -> list[dict]:
    return json.loads((run / "run.json").read_text())["attempts"]


def test_two_processes_train_and_write_the_run_once(tmp_path):
    out = tmp_path / "two"
    done = run_job(*TWO, *sets("train.epochs=600", "train.eval_every_epochs=200"), "--output", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "launching 2 processes" in done.stderr and done.stderr.count("done: 600 epochs") == 1
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [200, 400, 600]
    [attempt] = attempts(out)
    assert attempt["exit_code"] == 0 and attempt["world_size"] == 2
    one = run_job("train", "--device", "cpu", *sets("train.epochs=600"), "--output", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-2000:]
    a, b = weights(str(out)), weights(str(tmp_path / "one"))
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5) for k in a)  # the same maths as one process


def test_sigterm_to_the_job_exits_75_and_the_run_continues(tmp_path):
    out = tmp_path / "cut"
    args = [*TWO, *sets("train.log_every_steps=100"), "--output", str(out)]
    proc = start_job(*args, "--set", "train.epochs=60000")
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "checkpoints" / "latest.json").exists() and proc.poll() is None:
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    proc.send_signal(signal.SIGTERM)  # the job's own process: its workers are in sessions of their own
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 75, err[-2000:]
    assert err.count("stopped by SIGTERM") == 1 and "Traceback" not in err
    stopped = json.loads((out / "checkpoints" / "latest.json").read_text())
    again = run_job(*args, "--set", f"train.epochs={stopped['epoch'] + 500}")  # a shorter test than the 60,000
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resuming iris from epoch {stopped['epoch']}" in again.stderr
    assert [(a["exit_code"], a["world_size"]) for a in attempts(out)] == [(75, 2), (0, 2)]
    assert scalars(str(out), "system/step_time_s") and scalars(str(out), "system/host_memory_gib")


def test_a_worker_that_dies_stops_the_group_and_is_named(tmp_path):
    (tmp_path / "killer.py").write_text(KILLER)
    env = {"PYTHONPATH": str(tmp_path), "KILL_RANK": "1", "KILL_AT_STEP": "300"}
    args = [*TWO, *sets("model.name=killer:Net", "train.epochs=100000"), "--output", str(tmp_path / "run")]
    started = time.time()
    done = run_job(*args, env=env, timeout=180)
    assert done.returncode == 1, done.stderr[-2000:]
    assert (
        "error: worker 1 (pid " in done.stderr
        and "was killed by SIGKILL; the other workers were stopped" in done.stderr
    )
    assert time.time() - started < 120  # not the 100,000 epochs: the group was stopped


def test_a_workers_user_error_is_the_jobs_exit_code(tmp_path):
    missing = tmp_path / "nowhere.csv"
    done = run_job(*TWO, *sets(f"data.path={missing}"), "--output", str(tmp_path / "run"))
    assert done.returncode == 3, done.stderr[-2000:]
    assert f"data.path {missing}: no such file" in done.stderr and "Traceback" not in done.stderr
    bad = run_job(*TWO, *sets("train.epochs=-1"), "--output", str(tmp_path / "run"))
    assert bad.returncode == 2 and "launching" not in bad.stderr  # refused once, before any worker starts


def test_under_torchrun_the_job_is_a_worker_and_launches_nothing(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "job", *TWO]
    out = tmp_path / "run"
    done = subprocess.run(
        [*cmd, *sets("train.epochs=300"), "--output", str(out)], capture_output=True, text=True, env=job_env()
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "launching" not in done.stderr and attempts(out)[0]["world_size"] == 1


@pytest.mark.parametrize(
    ("codes", "expected"),
    [
        ({0: 75, 1: 75}, 75),  # every worker committed and stopped
        ({0: 3, 1: 75}, 3),  # the first failure is a user error: its code
        ({1: 2}, 2),
        ({0: 130}, 130),
        ({1: 7}, 1),  # a crash
    ],
)
def test_the_group_exit_code_is_the_workers(codes, expected, capsys):
    failures = {r: ProcessFailure(local_rank=r, pid=100, exitcode=c, error_file="") for r, c in codes.items()}
    assert group_exit_code(failures) == expected
    said = capsys.readouterr().err
    assert ("error: worker 1 (pid 100) failed with exit code 7" in said) == (expected == 1)


def test_a_worker_killed_is_the_cause_not_the_peer_that_lost_it(capsys):
    # In the same second the agent sees rank 1 killed and rank 0 exit 1 (its collective lost the peer).
    failures = {r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=c, error_file="") for r, c in [(0, 1), (1, -9)]}
    for f in failures.values():
        f.timestamp = 1000
    assert group_exit_code(failures) == 1
    assert "error: worker 1 (pid 101) was killed by SIGKILL" in capsys.readouterr().err


def test_launch_describes_its_group():
    assert Launch(2).describe() == "2 processes"
    assert Launch(4, 2, 1, "10.0.0.2", 29500).describe() == "4 processes on node 1 of 2 (meeting at 10.0.0.2:29500)"


# ---- cluster conventions: the platform's variables, set by hand, two machines simulated on loopback ----


def platform_env(name: str, node: int, port: int, tmp_path: Path) -> tuple[dict, list[str]]:
    """The variables a platform sets on machine `node` of two (both this machine), and the flags still needed."""
    if name == "SkyPilot":  # no port among its variables: --master-port
        ips = "127.0.0.1\n127.0.0.1"
        env = {"SKYPILOT_NODE_RANK": str(node), "SKYPILOT_NODE_IPS": ips, "SKYPILOT_NUM_NODES": "2"}
        return env | {"SKYPILOT_NUM_GPUS_PER_NODE": "0"}, ["--master-port", str(port)]
    if name == "Cloud Batch":
        hosts = tmp_path / "hosts"
        hosts.write_text("127.0.0.1\n127.0.0.1\n")
        return {"BATCH_HOSTS_FILE": str(hosts), "BATCH_TASK_INDEX": str(node)}, ["--master-port", str(port)]
    if name.startswith("Kubeflow Trainer"):  # as the TrainJob's torch plugin sets them (no WORLD_SIZE, no RANK)
        pet = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(node), "PET_MASTER_PORT": str(port)}
        return pet | {"PET_MASTER_ADDR": "127.0.0.1", "JOB_COMPLETION_INDEX": str(node)}, []
    if name.startswith("PyTorchJob"):  # the training-operator 1.9: WORLD_SIZE counts pods, RANK is the pod's
        pet = {
            "PET_NNODES": "2",
            "PET_NPROC_PER_NODE": "auto",
            "PET_NODE_RANK": str(node),
            "PET_MASTER_PORT": str(port),
        }
        both = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(node)}
        return pet | both | {"PET_MASTER_ADDR": "127.0.0.1", "PYTHONUNBUFFERED": "1"}, []
    if name == "Kubernetes Indexed Job":  # the index alone: how many machines and where they meet are flags
        env = {"JOB_COMPLETION_INDEX": str(node), "HOSTNAME": f"train-{node}"}
        return env, ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    pools = {"workerpool0": [f"127.0.0.1:{port}"], "workerpool1": ["127.0.0.1:2222"]}
    spec = {"cluster": pools, "task": {"type": f"workerpool{node}", "index": 0}}
    return {"CLUSTER_SPEC": json.dumps(spec)}, []


KUBEFLOW = ["Kubeflow Trainer (TrainJob)", "PyTorchJob (Kubeflow training-operator)", "Kubernetes Indexed Job"]


@pytest.mark.parametrize("name", ["SkyPilot", "Cloud Batch", "Vertex AI", *KUBEFLOW])
def test_a_platforms_two_machines_train_as_one_group(name, tmp_path):
    port = free_port()
    out = tmp_path / "run"  # one folder for both: a shared disk, written by rank 0 alone
    cmd = ["train", "--device", "cpu", *sets("train.epochs=300", "train.eval_every_epochs=100"), "--output", str(out)]
    nodes = []
    for node in (1, 0):
        env, flags = platform_env(name, node, port, tmp_path)
        nodes.append(
            subprocess.Popen(
                [sys.executable, "-m", "job", *cmd, *flags],
                env={**job_env(), **env},
                text=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        )
    errs = [p.communicate(timeout=240)[1] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], errs
    assert f"launching 1 process on node 1 of 2 (meeting at 127.0.0.1:{port}; {name})" in errs[0]
    assert "done: 300 epochs" in errs[1] and "done:" not in errs[0]  # rank 0 says it, once
    assert [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [100, 200, 300]
    assert [a["world_size"] for a in attempts(out)] == [2]
    assert attempts(out)[-1]["platform"]["name"] == name


def plan_of(env, *flags, **kwargs):
    args = {"nproc_per_node": "", "nnodes": None, "node_rank": None, "master_addr": None, "master_port": None}
    return launch_plan(**(args | kwargs), device="cpu", env=env)


def test_the_platforms_variables_give_the_machines_and_flags_win(tmp_path):
    sky = {"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n10.0.0.7", "SKYPILOT_NUM_NODES": "3"}
    assert plan_of(sky | {"SKYPILOT_NUM_GPUS_PER_NODE": "4"}) == Launch(4, 3, 1, "10.0.0.5", 29500, "SkyPilot")
    assert plan_of(sky, nnodes=2, node_rank=0, master_addr="h", master_port=7) == Launch(1, 2, 0, "h", 7, "")
    assert plan_of(sky, nproc_per_node="2", master_port=9) == Launch(2, 3, 1, "10.0.0.5", 9, "SkyPilot")
    pools = {"workerpool0": ["m:1234"], "workerpool1": ["a:2222", "b:2222"], "workerpool2": ["c:2222"]}
    spec = {"CLUSTER_SPEC": json.dumps({"cluster": pools, "task": {"type": "workerpool1", "index": 1}})}
    assert plan_of(spec) == Launch(1, 4, 2, "m", 1234, "Vertex AI")
    vertex = {"MASTER_ADDR": "m", "MASTER_PORT": "5", "WORLD_SIZE": "2", "RANK": "1"}
    assert plan_of(vertex) == Launch(1, 2, 1, "m", 5, "Vertex AI")
    assert plan_of({**vertex, "WORLD_SIZE": "1", "RANK": "0"}) is None  # one machine: trains by itself
    assert plan_of({}) is None and plan_of({}, nproc_per_node="2") == Launch(2)
    assert plan_of({**sky, "LOCAL_RANK": "0"}) is None  # a worker already


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"SKYPILOT_NODE_RANK": "x"}, "SKYPILOT_NODE_RANK='x': expected a whole number"),
        ({"BATCH_HOSTS_FILE": "/nonexistent/hosts"}, "BATCH_HOSTS_FILE=/nonexistent/hosts: cannot read it"),
        ({"CLUSTER_SPEC": "{not json"}, "CLUSTER_SPEC: not Vertex AI's cluster description"),
        ({"SKYPILOT_NODE_RANK": "3", "SKYPILOT_NUM_NODES": "2"}, "--node-rank 3: expected 0 to 1 for 2 machines"),
    ],
)
def test_unreadable_platform_variables_are_one_line(env, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        plan_of(env)
    done = run_job("train", "--device", "cpu", env=env)
    assert done.returncode == 2 and needle in done.stderr and "Traceback" not in done.stderr


def test_throughput_counts_every_process_samples(tmp_path):
    # samples/s is samples_since_eval over the window: a checkpoint between evaluations holds the count so far, which
    # must be the global batch's (120 Iris rows an epoch), not one process's slice of it.
    out = tmp_path / "run"
    epochs = sets("train.epochs=2", "train.eval_every_epochs=2", "train.checkpoint_every_epochs=1")
    done = run_job(*TWO, *epochs, "--output", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    progress = [torch.load(p, weights_only=True)["progress"] for p in (out / "checkpoints").glob("*.pt")]
    assert {p["epoch"]: p["samples_since_eval"] for p in progress}[1] == 120


def test_one_machine_on_a_platform_meets_on_this_machine():
    # A single Vertex AI replica names itself by a host name that may not resolve here: one machine never meets there.
    spec = {"cluster": {"workerpool0": ["workerpool0-0:2222"]}, "task": {"type": "workerpool0", "index": 0}}
    assert plan_of({"CLUSTER_SPEC": json.dumps(spec)}, nproc_per_node="2") == Launch(2)
    sky = {"SKYPILOT_NODE_RANK": "0", "SKYPILOT_NODE_IPS": "10.0.0.5", "SKYPILOT_NUM_NODES": "1"}
    assert plan_of(sky | {"SKYPILOT_NUM_GPUS_PER_NODE": "4"}, nproc_per_node="auto") == Launch(1)  # --device cpu


@pytest.mark.parametrize("node_rank", ["0", "1"])
def test_a_machine_that_never_comes_is_one_line_after_the_meeting_timeout(tmp_path, node_rank):
    """One of two machines started alone: the first waits at the meeting point, the second for it, each for
    JOB_RDZV_TIMEOUT seconds; then one line saying the group did not meet and how to fix it, exit 1, no trace."""
    port = str(free_port())
    alone = ["--nnodes", "2", "--node-rank", node_rank, "--master-addr", "127.0.0.1", "--master-port", port]
    got = run_job(*TWO[:-1], "1", *alone, "--output", str(tmp_path / "run"), env={"JOB_RDZV_TIMEOUT": "3"}, timeout=60)
    assert got.returncode == 1, got.stderr[-2000:]
    assert "Traceback" not in got.stderr, got.stderr[-2000:]
    last = got.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the machines did not meet within 3 s at 127.0.0.1:" + port), last
    assert "--node-rank" in last and "JOB_RDZV_TIMEOUT" in last
    assert not (tmp_path / "run").exists()


def wait_for(what, why: str, proc: subprocess.Popen, deadline_s: float = 180) -> None:
    """Poll until `what()` holds while `proc` runs."""
    deadline = time.time() + deadline_s
    while not what():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.time() < deadline, f"timed out waiting for {why}"
        time.sleep(0.1)


def test_the_launcher_killed_takes_its_workers_and_the_same_command_resumes(tmp_path):
    out = tmp_path / "run"
    args = [*TWO, *sets("train.log_every_steps=100"), "--output", str(out)]
    launcher = start_job(*args, "--set", "train.epochs=60000")
    workers: list[psutil.Process] = []
    try:
        wait_for(lambda: (out / "checkpoints" / "latest.json").exists(), "a checkpoint", launcher)
        workers = psutil.Process(launcher.pid).children(recursive=True)
        assert len([w for w in workers if "train" in w.cmdline()]) == 2
        launcher.kill()  # SIGKILL: the launcher says nothing, its workers learn of it from the kernel
        launcher.wait()
        _, alive = psutil.wait_procs(workers, timeout=120)
        assert not alive, f"left behind: {[(p.pid, p.cmdline()) for p in alive]}"
    finally:
        for p in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    stopped = json.loads((out / "checkpoints" / "latest.json").read_text())
    again = run_job(*args, "--set", f"train.epochs={stopped['epoch'] + 300}")  # a shorter test than the 60,000
    assert again.returncode == 0, again.stderr[-2000:]
    assert "taking the run folder over from host" in again.stderr and "has ended" in again.stderr
    assert f"resuming iris from epoch {stopped['epoch']}" in again.stderr
    assert not (out / "lease.json").exists()  # let go at the end


LIVE_FILES = ("lease.json", ".alive")  # the live run's own heartbeats, which it rewrites as it runs


def test_the_same_command_beside_a_live_run_is_refused_and_the_live_run_ends_unharmed(tmp_path):
    (tmp_path / "gate.py").write_text(GATE)
    gate = tmp_path / "gate"
    out = tmp_path / "run"
    env = {"PYTHONPATH": str(tmp_path), "GATE": str(gate), "GATE_AT_STEP": "50"}
    args = [*sets("model.name=gate:Net", "train.epochs=100", "train.eval_every_epochs=10"), "--output", str(out)]
    live = start_job(*TWO, *args, env={**env, "PYTHONPATH": f"{tmp_path}:{job_env()['PYTHONPATH']}"})
    try:
        wait_for(lambda: all(Path(f"{gate}.{r}").exists() for r in (0, 1)), "the live run at its gate", live)
        files = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name not in LIVE_FILES}
        holder = json.loads((out / "lease.json").read_text())
        for command in (TWO, TWO[:3]):  # a group is refused by its launcher, a process alone as it opens the run
            refused = run_job(*command, *args, env=env, timeout=180)
            assert refused.returncode == 4, refused.stderr[-2000:]
            [line] = refused.stderr.strip().splitlines()[-1:]
            assert line.startswith(f"error: {out} is being written by another run (host {holder['host']}, pid ")
            assert f"pid {holder['pid']}, heartbeat " in line and "launching" not in refused.stderr
        assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name not in LIVE_FILES} == files
        assert json.loads((out / "lease.json").read_text())["token"] == holder["token"]
        gate.touch()
        _, err = live.communicate(timeout=300)
    finally:
        gate.touch()
        if live.poll() is None:
            live.kill()
    assert live.returncode == 0, err[-2000:]
    epochs = [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert epochs == list(range(10, 101, 10))  # one history
    assert [a["exit_code"] for a in attempts(out)] == [0]
    assert json.loads((out / "checkpoints" / "latest.json").read_text())["epoch"] == 100
    assert not (out / "lease.json").exists()


def test_a_pytorchjobs_elastic_policy_meets_its_machines_at_the_rendezvous_endpoint(tmp_path):
    """PET_NNODES min:max and PET_RDZV_ENDPOINT (the training-operator's elasticPolicy): a c10d meeting, one group."""
    port, out = free_port(), tmp_path / "run"
    elastic = {"PET_NNODES": "2:2", "PET_RDZV_ENDPOINT": f"127.0.0.1:{port}", "PET_RDZV_BACKEND": "c10d"}
    cmd = ["train", "--device", "cpu", *sets("train.epochs=300", "train.eval_every_epochs=100"), "--output", str(out)]
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "job", *cmd],
            env={**job_env(), **elastic, "PET_NPROC_PER_NODE": "auto", "WORLD_SIZE": "2", "RANK": str(node)},
            text=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for node in (1, 0)
    ]
    errs = [p.communicate(timeout=240)[1] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], errs
    assert [a["world_size"] for a in attempts(out)] == [2]
    assert attempts(out)[-1]["platform"]["name"] == "PyTorchJob (Kubeflow training-operator)"
