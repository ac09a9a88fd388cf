"""The platform a run is on and the group it implies, read once from the environment the platform set (`read`).

Each platform hands a process its place in its own variables, and the same names mean different things: WORLD_SIZE
counts processes under torchrun and Ray but machines (pods) on PyTorchJob and Vertex AI; Kubeflow Trainer v2 gives
its layout in PET_* variables that only torchrun reads; `srun -n 2` starts every process itself, a Kubernetes pod or
a Vertex AI replica one per machine. So each platform is read by its own function, as its own code sets them:

- places that start every process of the group themselves (`srun -n N`, torchrun, Ray Train): `Place.process`;
  the job joins as that process (torch's variables are set from the platform's where they are not, `adopt`);
- places that start one command per machine (Kubeflow Trainer, PyTorchJob, JobSet, Vertex AI, Cloud Batch,
  SkyPilot, `srun` with one task per machine): machines, this one's rank and where they meet; the job launches
  the processes of its machine (job/group/launch.py).

Two platforms' variables that disagree about the group, or a rank past its world: one line naming both, exit 2.
Kubernetes itself cannot run here: the operators' variables are tested as their code sets them, on 127.0.0.1.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from job.errors import ConfigError
from job.group.clouds import cloud_batch, colab, jobset, kubeflow, skypilot, vertex
from job.group.place import DEFAULT_PORT, Place, number, picked, torch_process, worker
from job.group.slurm import slurm


def read(env: Mapping[str, str] | None = None, group_ready: bool | None = None) -> Place:
    """The platform and the group this process is in. `group_ready`: a process group exists in this process already
    (None: look). Raises ConfigError (exit 2) for variables that cannot be read or that contradict each other."""
    env = dict(os.environ if env is None else env)
    if group_ready is None:
        group_ready = process_group_ready()
    if group_ready and any(k.startswith("RAY_") for k in env):
        return ray(env)  # Ray's group exists: it is the group, whatever the machines' own platform (Slurm) says
    found = [p for p in (reader(env) for reader in READERS) if p is not None]
    torch_place = torchrun(env)
    check_agree(found)
    place = found[0] if found else Place()
    if torch_place is not None:  # a worker: torch's variables are its place in the group
        place = Place(
            place.name or torch_place.name,
            place.nnodes,
            place.node_rank,
            torch_place.master_addr,
            torch_place.master_port,
            place.nproc_per_node,
            torch_place.process,
            False,
            None,
            place.variables | torch_place.variables,
        )
    return place


def process_group_ready() -> bool:
    """Whether torch.distributed's default group exists in this process (made by a platform that calls the job in
    process, Ray Train); torch not imported yet means no group."""
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def check_agree(found: list[Place]) -> None:
    """Two platforms' variables that place this process differently: one line naming both."""
    for other in found[1:]:
        a, b = found[0], other
        if group_of(a) != group_of(b) and group_of(a) is not None and group_of(b) is not None:
            raise ConfigError(
                f"the environment describes two different groups: {a.name} ({names(a)}) says {a.describe()}, "
                f"{b.name} ({names(b)}) says {b.describe()}; unset the variables of the platform this does not run "
                "on, or give --nnodes, --node-rank and --master-addr"
            )


def group_of(p: Place) -> tuple | None:
    if p.process is not None:
        return ("process", p.process.rank, p.process.world)
    if p.nnodes is None or p.nnodes <= 1 and p.node_rank == 0:
        return None  # says nothing about a group
    return ("machine", p.node_rank, p.nnodes)


def names(p: Place) -> str:
    shown = sorted(p.variables)[:3]
    return ", ".join(shown) + (", ..." if len(p.variables) > 3 else "")


# --- processes started by torchrun, by the job's own launcher, or by Ray Train


def torchrun(env: Mapping[str, str]) -> Place | None:
    if not worker(env):
        return None
    name = "torchrun" if "TORCHELASTIC_RUN_ID" in env and "JOB_LAUNCHER_PID" not in env else ""
    port = number(env, "MASTER_PORT", DEFAULT_PORT)
    return Place(
        name,
        None,
        0,
        env.get("MASTER_ADDR", "127.0.0.1"),
        port,
        None,
        torch_process(env),
        variables=picked(env, ("TORCHELASTIC_RUN_ID",)),
    )


def ray(env: Mapping[str, str]) -> Place:
    """A Ray Train worker calling the job in process (job.cli.app): Ray made the process group already and set
    torch's variables; the job joins that group and reports each evaluation to Ray (job/sinks/ray_report.py)."""
    return Place(
        "Ray Train",
        None,
        number(env, "NODE_RANK", 0),
        env.get("MASTER_ADDR", ""),
        None,
        None,
        torch_process(env, local_rank=0),
        joined=True,
        variables=picked(env, ("RAY_JOB_ID",)),
    )


READERS = (slurm, kubeflow, jobset, vertex, cloud_batch, skypilot, colab)


def adopt(place: Place, env: dict | None = None) -> None:
    """A process the platform started as one of a group (`srun -n N`): torch's variables set from the platform's,
    where they are not set, so that the process group is made from them (init_method env://)."""
    env = os.environ if env is None else env
    p = place.process
    if p is None or place.joined or worker(env):
        return
    torch_vars = {
        "RANK": p.rank,
        "WORLD_SIZE": p.world,
        "LOCAL_RANK": p.local_rank,
        "LOCAL_WORLD_SIZE": p.local_world,
        "GROUP_RANK": place.node_rank,
        "MASTER_ADDR": place.master_addr,
        "MASTER_PORT": place.master_port,
    }
    for k, v in torch_vars.items():
        env[k] = str(v)


_settled: Place | None = None


def settle(env: Mapping[str, str] | None = None) -> Place:
    """Read the platform for this command (`read`) and keep it as the process's answer (`current`)."""
    global _settled
    _settled = read(env)
    return _settled


def current() -> Place:
    """The platform this process settled on at its start (the command line), else read now."""
    return _settled if _settled is not None else read()
