"""group/platforms.py: each platform's variables read as its own code sets them (Slurm's srun tasks and batch script,
Kubeflow Trainer v2's TrainJob pods, the training-operator's PyTorchJob pods, Indexed Jobs, Ray Train's workers),
the group each implies, and variables that contradict each other refused in one line (exit 2). The real engines
run in tests/test_engines.py; two "machines" on loopback with each Kubernetes operator's variables in
tests/test_launch.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from conftest import run_job
from typer.main import get_command

from job.cli import app
from job.errors import ConfigError
from job.group.launch import Launch, launch_plan, processes
from job.group.place import Process
from job.group.platforms import adopt, read
from job.group.slurm import hostlist, tasks_per_node

# A task of `srun -n 2` on one machine (what Slurm 22.05 set here, less the ids of its sockets)
SRUN = {
    "SLURM_JOB_ID": "23304",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "0",
    "SLURM_NNODES": "1",
    "SLURM_NTASKS": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_NODELIST": "vm",
    "SLURM_JOB_NODELIST": "vm",
    "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_TASKS_PER_NODE": "2",
}
# The batch script of `sbatch --ntasks=2`: SLURM_PROCID 0 and SLURM_NTASKS 2 as in a task, but no step
BATCH = {k: v for k, v in SRUN.items() if "STEP" not in k} | {"SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
# Kubeflow Trainer v2's torch plugin, node 1 of 2 (PET_NODE_RANK from the pod's completion index annotation)
TRAINJOB = {
    "PET_NNODES": "2",
    "PET_NPROC_PER_NODE": "auto",
    "PET_NODE_RANK": "1",
    "PET_MASTER_PORT": "29500",
    "PET_MASTER_ADDR": "mnist-node-0-0.mnist",
    "JOB_COMPLETION_INDEX": "1",
    "HOSTNAME": "mnist-node-0-1",
}
# The training-operator 1.9's PyTorchJob, Worker 0 of a Master and 2 Workers (RANK = index + 1, WORLD_SIZE = pods)
PYTORCHJOB = {
    "MASTER_ADDR": "mnist-master-0",
    "MASTER_PORT": "23456",
    "PET_MASTER_ADDR": "mnist-master-0",
    "PET_MASTER_PORT": "23456",
    "WORLD_SIZE": "3",
    "RANK": "1",
    "PET_NODE_RANK": "1",
    "PET_NNODES": "3",
    "PET_NPROC_PER_NODE": "auto",
    "PYTHONUNBUFFERED": "1",
}


def plan(env, nproc_per_node="", **flags):
    args = {"nnodes": None, "node_rank": None, "master_addr": None, "master_port": None} | flags
    return launch_plan(nproc_per_node, **args, device="cpu", env=env)


def test_a_pytorchjobs_pods_are_pytorchjob_machines_not_vertex_ai():
    place = read(PYTORCHJOB, group_ready=False)
    assert place.name == "PyTorchJob (Kubeflow training-operator)"
    assert (place.nnodes, place.node_rank, place.master_addr, place.master_port) == (3, 1, "mnist-master-0", 23456)
    assert plan(PYTORCHJOB) == Launch(1, 3, 1, "mnist-master-0", 23456, place.name)
    # nprocPerNode 4: the operator counts WORLD_SIZE as pods x 4
    four = PYTORCHJOB | {"PET_NPROC_PER_NODE": "4", "WORLD_SIZE": "12"}
    assert plan(four) == Launch(4, 3, 1, "mnist-master-0", 23456, place.name)


def test_volcanos_pods_count_machines_as_vertex_ais_do():
    env = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2", "VC_TASK_INDEX": "1"}
    assert plan(env) == Launch(1, 3, 2, "job-master-0", 23456, "Volcano")


def test_a_trainjobs_pods_meet_at_the_first_node_in_their_own_machines():
    place = read(TRAINJOB, group_ready=False)
    assert place.name == "Kubeflow Trainer (TrainJob)" and "pytorchjob" not in place.name.lower()
    assert plan(TRAINJOB) == Launch(1, 2, 1, "mnist-node-0-0.mnist", 29500, place.name)  # auto on a CPU: 1
    assert plan(TRAINJOB | {"PET_NPROC_PER_NODE": "3"}).nproc_per_node == 3
    assert plan(TRAINJOB, nproc_per_node="2", master_port=7) == Launch(2, 2, 1, "mnist-node-0-0.mnist", 7, place.name)


def test_pytorchjobs_elastic_policy_meets_at_its_rendezvous_endpoint_between_min_and_max():
    elastic = {"PET_NNODES": "1:3", "PET_RDZV_ENDPOINT": "mnist-worker-0:29400", "PET_RDZV_BACKEND": "c10d"}
    env = {k: v for k, v in PYTORCHJOB.items() if k not in ("MASTER_ADDR", "PET_MASTER_ADDR")} | elastic
    assert plan(env) == Launch(1, 3, 1, "mnist-worker-0", 29400, "PyTorchJob (Kubeflow training-operator)", 1)


def test_srun_tasks_are_the_processes_of_one_group_meeting_on_the_first_host():
    place = read(SRUN, group_ready=False)
    assert place.name == "Slurm job 23304 step 0" and place.process == Process(1, 2, 1, 2)
    assert (place.master_addr, place.master_port) == ("vm", 15000 + 3304)  # the job id's last four digits
    assert plan(SRUN) is None  # no launcher: each task trains as its rank
    env = dict(SRUN)
    adopt(place, env)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "vm",
        "MASTER_PORT": "18304",
    }
    assert read(env, group_ready=False).process == Process(1, 2, 1, 2)  # read again as a worker: the same place
    assert read(SRUN | {"MASTER_PORT": "1234"}, group_ready=False).master_port == 1234  # the user's port wins


def test_the_batch_script_is_one_process_and_one_task_per_machine_launches_the_machines_processes():
    assert read(BATCH, group_ready=False).process is None and plan(BATCH) is None
    assert plan(BATCH, nproc_per_node="2") == Launch(2)
    per_machine = SRUN | {
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "1",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    }
    assert plan(per_machine, nproc_per_node="4") == Launch(4, 2, 1, "gpu07", 18304, "Slurm job 23304 step 0")
    with pytest.raises(ConfigError, match=re.escape("drop --nproc-per-node, or start one task per machine")):
        plan(SRUN, nproc_per_node="2")


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("vm", ["vm"]),
        ("node[01-03,7]", ["node01", "node02", "node03", "node7"]),
        ("gpu-a[1-2],cpu3,x[9-10]", ["gpu-a1", "gpu-a2", "cpu3", "x9", "x10"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ],
)
def test_slurm_host_lists_expand_in_python(text, hosts):
    assert hostlist(text) == hosts


def test_slurm_tasks_per_node_expand():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1] and tasks_per_node("4") == [4]


def test_an_indexed_job_gives_the_rank_and_the_first_pods_name_and_nnodes_the_size():
    env = {"JOB_COMPLETION_INDEX": "3", "HOSTNAME": "train-workers-0-3"}
    place = read(env, group_ready=False)
    assert place.name == "Kubernetes Indexed Job" and place.nnodes is None and place.node_rank == 3
    assert place.master_addr.split(".")[0] == "train-workers-0-0"
    assert plan(env) is None  # how many machines: --nnodes
    got = plan(env, nnodes=4)
    assert (got.nnodes, got.node_rank, got.master_addr.split(".")[0]) == (4, 3, "train-workers-0-0")


def test_ray_trains_worker_joins_the_group_ray_made():
    env = {
        "RAY_RAYLET_PID": "7117",
        "RAY_JOB_ID": "01000000",
        "MASTER_ADDR": "192.0.2.2",
        "MASTER_PORT": "52071",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "NODE_RANK": "0",
        "RANK": "1",
        "WORLD_SIZE": "2",
    }
    place = read(env, group_ready=True)
    assert place.name == "Ray Train" and place.joined and place.process == Process(1, 2, 1, 2)
    assert plan(env, nproc_per_node="2") is None  # never a launcher inside Ray's worker
    assert read(env, group_ready=False).name != "Ray Train"  # no group made: torch's variables alone
    # Ray on Slurm: the Ray node's srun step (one task per machine) is not the training group
    on_slurm = env | {k: v for k, v in SRUN.items() if k.startswith("SLURM_")} | {"SLURM_STEP_NUM_TASKS": "3"}
    assert read(on_slurm, group_ready=True).process == Process(1, 2, 1, 2)


CONTRADICTIONS = [
    (SRUN | TRAINJOB, "the environment describes two different groups: Slurm job 23304 step 0"),
    (SRUN | {"SLURM_PROCID": "2"}, "SLURM_PROCID=2 is past the group: expected 0 to 1 for SLURM_STEP_NUM_TASKS=2"),
    (PYTORCHJOB | {"WORLD_SIZE": "5"}, "PyTorchJob's variables disagree: WORLD_SIZE=5 RANK=1 but PET_NNODES=3"),
    (TRAINJOB | {"PET_NODE_RANK": "2"}, "PET_NODE_RANK=2 is past the group: expected 0 to 1 for PET_NNODES=2"),
    (
        {"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "n[1-x]", "SLURM_STEP_NUM_TASKS": "2"},
        "SLURM_JOB_NODELIST: cannot read the range [1-x]",
    ),
]


@pytest.mark.parametrize(("env", "needle"), CONTRADICTIONS)
def test_variables_that_contradict_each_other_are_one_line_and_exit_2(env, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        read(env, group_ready=False)
    done = run_job("train", "--device", "cpu", env=env, timeout=120)
    assert done.returncode == 2, done.stderr[-1000:]
    assert needle in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_both_groups_are_named_in_the_contradiction():
    with pytest.raises(ConfigError) as e:
        read(SRUN | TRAINJOB, group_ready=False)
    said = str(e.value)
    assert "process 1 of 2" in said and "Kubeflow Trainer (TrainJob)" in said and "machine 1 of 2" in said


# ---- the manifests of docs/distributed.md: the variables their operators set give the group the page promises

DOCS = Path(__file__).resolve().parents[1] / "docs" / "distributed.md"


def fenced(language: str) -> list[str]:
    """The page's fenced code blocks in `language`, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", DOCS.read_text(), flags=re.S | re.M)


def manifest(kind: str) -> dict:
    (doc,) = [d for d in map(yaml.safe_load, fenced("yaml")) if d.get("kind") == kind]
    return doc


def train_options(args: list[str]) -> dict:
    """The options `python -m job train ARGS` parses to (click's own parsing of the command line)."""
    assert args[0] == "train", args
    ctx = get_command(app).commands["train"].make_context("train", list(args[1:]))
    return ctx.params


def planned(options: dict, env: dict) -> Launch | None:
    names = ("nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port", "device")
    return launch_plan(*(options[n] for n in names), env=env)


def test_the_trainjob_in_the_docs_is_one_group_of_its_nodes():
    doc = manifest("TrainJob")
    name, trainer = doc["metadata"]["name"], doc["spec"]["trainer"]
    assert trainer["command"][:3] == ["python", "-m", "job"]  # no torchrun: the job reads PET_* itself
    options = train_options(trainer["command"][3:])
    nodes = trainer["numNodes"]
    for node in range(nodes):  # the torch plugin's variables, as Kubeflow Trainer sets them on each node's pod
        env = {
            "PET_NNODES": str(nodes),
            "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
            "PET_NODE_RANK": str(node),
            "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
            "PET_MASTER_PORT": "29500",
            "JOB_COMPLETION_INDEX": str(node),
        }
        got = planned(options, env)
        assert got == Launch(
            trainer["numProcPerNode"], nodes, node, f"{name}-node-0-0.{name}", 29500, "Kubeflow Trainer (TrainJob)"
        )


def test_the_jobset_in_the_docs_is_one_group_meeting_on_its_first_pod():
    doc = manifest("JobSet")
    js, (replicated,) = doc["metadata"]["name"], doc["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    assert replicated["replicas"] == 1 and job["completionMode"] == "Indexed"
    (container,) = job["template"]["spec"]["containers"]
    options = train_options(container["args"])
    for pod in range(job["completions"]):  # what Kubernetes sets on a JobSet's pod: its index and host name
        env = {"JOB_COMPLETION_INDEX": str(pod), "HOSTNAME": f"{js}-{replicated['name']}-0-{pod}"}
        got = planned(options, env)
        assert (got.nnodes, got.node_rank, got.source) == (job["completions"], pod, "Kubernetes Indexed Job")
        assert got.master_addr.split(".")[0] == f"{js}-{replicated['name']}-0-0"
        assert got.nproc_per_node == processes("auto")


def test_job_info_names_the_platform_and_the_group_or_what_is_wrong():
    done = run_job("info", env=SRUN, timeout=120)
    assert done.returncode == 0, done.stderr[-1000:]
    assert "platform: Slurm job 23304 step 0: process 1 of 2 (meeting at vm:18304)" in done.stdout
    bad = run_job("info", "--json", env=PYTORCHJOB | {"WORLD_SIZE": "5"}, timeout=120)
    assert bad.returncode == 0 and "PyTorchJob's variables disagree" in json.loads(bad.stdout)["platform"]["error"]


def test_the_requeue_is_said_before_slurm_is_asked_since_a_requeue_may_end_the_process_at_once(tmp_path):
    """`scontrol requeue` on a running job makes Slurm end the job's processes, possibly before the call returns:
    what the job says of its requeue is said before it asks (the checkpoint is committed and run.json written by
    then). Here an `scontrol` that ends its caller, as Slurm may, stands in for the race a loaded cluster shows."""
    import os
    import subprocess
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nkill -9 $PPID\nsleep 5\n")
    (bin_dir / "scontrol").chmod(0o755)
    code = (
        "import sys; from job.group import slurm; from job.console import say; "
        "print(slurm.requeue({'SLURM_JOB_ID': '41', 'SLURM_JOB_NAME': 'train'}, say), file=sys.stderr)"
    )
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == -9
    assert "asking Slurm to requeue job 41" in done.stderr
