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

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from job.errors import ConfigError

DEFAULT_PORT = 29500  # torchrun's, for platforms that name the first node but no port
SLURM_PORT_BASE = 15000  # Slurm: the meeting port is this plus the job id's last four digits (Lightning's rule)


@dataclass(frozen=True)
class Process:
    """This process's place in a group whose every process the platform started: global rank of world, and its
    rank among local_world processes on its machine (node_rank of nnodes)."""

    rank: int
    world: int
    local_rank: int
    local_world: int


@dataclass(frozen=True)
class Place:
    """Where this process stands, as the platform's variables say. `name` '' on a machine of one's own; `nnodes`
    None where the platform does not say how many machines (JobSet, an Indexed Job: give --nnodes); `process` where
    the platform started this very process as one of a group; `variables`: what it was read from (run.json)."""

    name: str = ""
    nnodes: int | None = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    nproc_per_node: str | None = None  # the platform's processes per machine ("auto", "2"); None: not said
    process: Process | None = None
    joined: bool = False  # the platform made the process group already (Ray Train): join it, make none
    elastic: tuple[int, int] | None = None  # PyTorchJob's elastic policy: (min, max) machines, met at master_addr
    variables: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """The start-up line's account: 'Slurm job 41 step 0: process 1 of 2 (meeting at vm:15041)'."""
        who = self.name or "this machine"
        if self.process is not None:
            p = self.process
            where = "" if self.joined else f" (meeting at {self.master_addr}:{self.master_port})"
            return f"{who}: process {p.rank} of {p.world}{where}"
        if self.nnodes and self.nnodes > 1:
            return f"{who}: machine {self.node_rank} of {self.nnodes}"
        return who

    def record(self) -> dict:
        """run.json's account of the platform (an attempt's `platform`)."""
        group = {"nnodes": self.nnodes, "node_rank": self.node_rank}
        if self.process is not None:
            group |= {"rank": self.process.rank, "world_size": self.process.world}
        return {"name": self.name, "group": group, "variables": self.variables}


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


def number(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    """A whole number >= 0 from the environment variable `name` (default when unset)."""
    value = env.get(name, "").strip()
    if not value and default is not None:
        return default
    if not value.isdigit():
        raise ConfigError(f"{name}={env.get(name, '')!r}: expected a whole number")
    return int(value)


def within(name: str, rank: int, count: int, count_name: str) -> None:
    if not 0 <= rank < count:
        raise ConfigError(f"{name}={rank} is past the group: expected 0 to {count - 1} for {count_name}={count}")


def picked(env: Mapping[str, str], keys) -> dict[str, str]:
    return {k: env[k] for k in keys if env.get(k) not in (None, "")}


# --- Slurm


def slurm(env: Mapping[str, str]) -> Place | None:
    """A Slurm job (SLURM_JOB_ID). In a step of `srun -n N` (SLURM_STEP_ID set) with more than one task, each task is
    one process of the group: rank SLURM_PROCID of SLURM_STEP_NUM_TASKS, SLURM_LOCALID on machine SLURM_NODEID of
    SLURM_STEP_NUM_NODES; they meet on the first host of SLURM_STEP_NODELIST at 15000 + the job id's last four digits
    (MASTER_PORT where set). With one task per machine the step's machines are the group's (`--nproc-per-node`
    starts the processes). The batch script itself (no step) is one process on the first machine."""
    if "SLURM_JOB_ID" not in env:
        return None
    keys = [
        "SLURM_JOB_ID",
        "SLURM_STEP_ID",
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "SLURM_NODEID",
        "SLURM_STEP_NUM_TASKS",
        "SLURM_STEP_NUM_NODES",
        "SLURM_STEP_NODELIST",
        "SLURM_STEP_TASKS_PER_NODE",
        "SLURM_RESTART_COUNT",
    ]
    job = env["SLURM_JOB_ID"].strip()
    name = f"Slurm job {job}"
    variables = picked(env, keys)
    if "SLURM_STEP_ID" not in env:  # the batch script, or a shell of salloc: not a task of a step
        return Place(name, variables=variables)
    name += f" step {env['SLURM_STEP_ID']}"
    tasks, nodes = number(env, "SLURM_STEP_NUM_TASKS", 1), number(env, "SLURM_STEP_NUM_NODES", 1)
    rank, node = number(env, "SLURM_PROCID", 0), number(env, "SLURM_NODEID", 0)
    within("SLURM_PROCID", rank, tasks, "SLURM_STEP_NUM_TASKS")
    within("SLURM_NODEID", node, nodes, "SLURM_STEP_NUM_NODES")
    hosts = hostlist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1")
    port = number(env, "MASTER_PORT", SLURM_PORT_BASE + number(env, "SLURM_JOB_ID") % 10000)
    if tasks == 1:
        return Place(name, nodes, node, hosts[0], port if nodes > 1 else None, variables=variables)
    per_node = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", str(tasks)))
    local_world = per_node[node] if node < len(per_node) else 1
    local = number(env, "SLURM_LOCALID", 0)
    within("SLURM_LOCALID", local, local_world, "tasks on this machine")
    return Place(
        name,
        nodes,
        node,
        hosts[0],
        port,
        str(local_world),
        Process(rank, tasks, local, local_world),
        variables=variables,
    )


def hostlist(text: str) -> list[str]:
    """Slurm's compressed host list, expanded: 'gpu[01-03,7],cpu-a[1-2]b' -> gpu01 gpu02 gpu03 gpu07 cpu-a1b
    cpu-a2b (in Python: `scontrol show hostnames` may be missing where the job runs)."""
    hosts: list[str] = []
    for item in top_level_split(text.strip()):
        hosts += expand(item)
    if not hosts:
        raise ConfigError(f"SLURM_JOB_NODELIST={text!r}: names no host")
    return hosts


def top_level_split(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += c == "["
        depth -= c == "]"
        if c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [i for i in items if i]


def expand(item: str) -> list[str]:
    m = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", item)
    if not m:
        return [item]
    prefix, ranges, rest = m.groups()
    out = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or high and not high.isdigit():
            raise ConfigError(f"SLURM_JOB_NODELIST: cannot read the range [{ranges}] in {item!r}")
        for n in range(int(low), int(high or low) + 1):
            out += [f"{prefix}{n:0{len(low)}d}{tail}" for tail in expand(rest)]
    return out


def tasks_per_node(text: str) -> list[int]:
    """SLURM_STEP_TASKS_PER_NODE, '2(x3),1' -> [2, 2, 2, 1]."""
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE={text!r}: expected counts such as 2(x3),1")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def requeue(env: Mapping[str, str] | None = None, say: Callable[[str], None] | None = None) -> str:
    """Ask Slurm to requeue this batch job (`scontrol requeue`), once its checkpoint is committed after Slurm's
    warning signal: the requeued job runs the same command, which continues. Returns what happened, for the last
    line ('' off Slurm or outside a batch job). `say` is told first: Slurm ends a running job's processes when it
    requeues it, at times before the call returns."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID", "").strip()
    if not job or env.get("SLURM_JOB_NAME") == "interactive":
        return ""
    if say is not None:
        say(f"asking Slurm to requeue job {job}: it continues when it starts again")
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"Slurm could not be asked to requeue job {job} ({type(e).__name__}): resubmit it to continue"
    if done.returncode != 0:
        why = " ".join((done.stderr or done.stdout).split())[:160]
        return f"Slurm refused to requeue job {job} ({why}): resubmit it (sbatch --requeue allows it) to continue"
    return f"asked Slurm to requeue job {job}: it continues when it starts again"


# --- Kubernetes: Kubeflow Trainer v2, the training-operator's PyTorchJob, JobSet and Indexed Jobs

PET = (
    "PET_NNODES",
    "PET_NPROC_PER_NODE",
    "PET_NODE_RANK",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
    "PET_RDZV_ENDPOINT",
    "PET_RDZV_BACKEND",
    "PET_MAX_RESTARTS",
)


def kubeflow(env: Mapping[str, str]) -> Place | None:
    """PET_* variables, which torchrun reads, as the Kubeflow operators set them on every pod: Kubeflow Trainer v2's
    TrainJob (its pods belong to a JobSet's Indexed Job: JOB_COMPLETION_INDEX) or the
    training-operator's PyTorchJob (a Master and Workers: MASTER_ADDR, WORLD_SIZE counting pods, RANK the pod's).
    PET_NNODES 'min:max' with PET_RDZV_ENDPOINT: PyTorchJob's elastic policy. Trainer v2 meets at PET_MASTER_ADDR
    (`<trainjob>-node-0-0.<trainjob>`, port 29500), PyTorchJob at its master pod (port 23456 by default)."""
    if "PET_NNODES" not in env and "PET_NODE_RANK" not in env:
        return None
    # Trainer v2's pods are a JobSet's Indexed Job's (JOB_COMPLETION_INDEX) and get no WORLD_SIZE; PyTorchJob's pods
    # get WORLD_SIZE and RANK, which torchrun shadows in its workers
    trainer = "JOB_COMPLETION_INDEX" in env or not worker(env) and "WORLD_SIZE" not in env
    name = "Kubeflow Trainer (TrainJob)" if trainer else "PyTorchJob (Kubeflow training-operator)"
    variables = picked(
        env, PET + (("JOB_COMPLETION_INDEX",) if trainer else ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"))
    )
    nodes_text = env.get("PET_NNODES", "1").strip()
    elastic = None
    if ":" in nodes_text:
        low, _, high = nodes_text.partition(":")
        if not (low.isdigit() and high.isdigit() and 0 < int(low) <= int(high)):
            raise ConfigError(f"PET_NNODES={nodes_text!r}: expected a number of machines, or min:max")
        elastic, nodes = (int(low), int(high)), int(high)
    else:
        nodes = number(env, "PET_NNODES", 1)
    rank = number(env, "PET_NODE_RANK", number(env, "JOB_COMPLETION_INDEX", 0) if trainer else number(env, "RANK", 0))
    if elastic is None:
        within("PET_NODE_RANK", rank, nodes, "PET_NNODES")
    endpoint = env.get("PET_RDZV_ENDPOINT", "") if elastic else ""
    addr = endpoint.rpartition(":")[0] if endpoint else env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR")
    port_name = "PET_MASTER_PORT" if "PET_MASTER_PORT" in env else "MASTER_PORT"
    port = (
        int(endpoint.rpartition(":")[2])
        if endpoint.rpartition(":")[2].isdigit()
        else number(env, port_name, DEFAULT_PORT)
    )
    if not addr:
        raise ConfigError(f"{name}: PET_NNODES={nodes_text} but no PET_MASTER_ADDR names the first machine")
    if not trainer and not worker(env) and "WORLD_SIZE" in env and elastic is None:
        # the operator counts pods in WORLD_SIZE and gives the pod's index in RANK: both must say what PET_* say
        pods, pod = number(env, "WORLD_SIZE"), number(env, "RANK", rank)
        per = env.get("PET_NPROC_PER_NODE", "auto")
        if pod != rank or pods not in (nodes, nodes * int(per) if per.isdigit() else nodes):
            raise ConfigError(
                f"PyTorchJob's variables disagree: WORLD_SIZE={pods} RANK={pod} but PET_NNODES={nodes_text} "
                f"PET_NODE_RANK={rank}: set one layout (docs/distributed.md)"
            )
    return Place(
        name, nodes, rank, addr, port, env.get("PET_NPROC_PER_NODE") or None, elastic=elastic, variables=variables
    )


def jobset(env: Mapping[str, str]) -> Place | None:
    """A pod of an Indexed Job (JOB_COMPLETION_INDEX, which Kubernetes sets; a JobSet's Jobs are Indexed Jobs): this
    machine's rank is its completion index, and the machines meet on the pod of index 0, named as the headless
    service names pods: this pod's host name with its index made 0 (`<jobset>-<job>-0-3` -> `<jobset>-<job>-0-0`,
    `<job>-3` -> `<job>-0`), in this pod's domain. Neither says how many machines there are: --nnodes does."""
    if "JOB_COMPLETION_INDEX" not in env:
        return None
    rank = number(env, "JOB_COMPLETION_INDEX")
    host = env.get("HOSTNAME", "")
    base, _, index = host.rpartition("-")
    addr = "127.0.0.1"
    if base and index == str(rank):
        addr = f"{base}-0"
        domain = pod_domain(host)
        addr += f".{domain}" if domain else ""
    return Place(
        "Kubernetes Indexed Job",
        None,
        rank,
        addr,
        DEFAULT_PORT,
        variables=picked(env, ("JOB_COMPLETION_INDEX", "HOSTNAME")),
    )


def pod_domain(host: str) -> str:
    """The domain of this pod's name in its headless service (`<subdomain>.<namespace>.svc...`), '' where the
    name has none (no subdomain set)."""
    import socket

    try:
        full = socket.getfqdn(host)
    except OSError:
        return ""
    return full[len(host) + 1 :] if full.startswith(host + ".") else ""


# --- Google Cloud and SkyPilot


def skypilot(env: Mapping[str, str]) -> Place | None:
    if "SKYPILOT_NODE_RANK" not in env:
        return picked_only(env, "SkyPilot", ("SKYPILOT_TASK_ID",))
    ips = env.get("SKYPILOT_NODE_IPS", "").split()
    nodes = number(env, "SKYPILOT_NUM_NODES", len(ips) or 1)
    gpus = number(env, "SKYPILOT_NUM_GPUS_PER_NODE", 0)
    rank = number(env, "SKYPILOT_NODE_RANK")
    variables = picked(env, ("SKYPILOT_TASK_ID", "SKYPILOT_NODE_RANK", "SKYPILOT_NUM_NODES"))
    return Place(
        "SkyPilot", nodes, rank, ips[0] if ips else "127.0.0.1", None, str(gpus) if gpus else None, variables=variables
    )


def cloud_batch(env: Mapping[str, str]) -> Place | None:
    """Cloud Batch: a task group with requireHostsFile (BATCH_HOSTS_FILE) is a group of machines; tasks alone
    (BATCH_TASK_INDEX) are named, each its own run or part."""
    keys = ("BATCH_TASK_INDEX", "BATCH_TASK_COUNT", "BATCH_TASK_RETRY_ATTEMPT", "BATCH_HOSTS_FILE")
    if "BATCH_HOSTS_FILE" not in env:
        return picked_only(env, "Cloud Batch", keys)
    try:
        with open(env["BATCH_HOSTS_FILE"]) as f:
            hosts = f.read().split()
    except OSError as e:
        raise ConfigError(f"BATCH_HOSTS_FILE={env['BATCH_HOSTS_FILE']}: cannot read it: {e.strerror}") from None
    if not hosts:
        raise ConfigError(f"BATCH_HOSTS_FILE={env['BATCH_HOSTS_FILE']}: lists no hosts")
    rank = number(env, "BATCH_TASK_INDEX", 0)
    within("BATCH_TASK_INDEX", rank, len(hosts), "hosts in BATCH_HOSTS_FILE")
    return Place("Cloud Batch", len(hosts), rank, hosts[0], variables=picked(env, keys))


def vertex(env: Mapping[str, str]) -> Place | None:
    """Vertex AI: CLUSTER_SPEC ({"cluster": {"workerpool0": ["host:port"], ...}, "task": {"type": "workerpool1",
    "index": 0}}: the machines in pool order, workerpool0's first being the first node; MASTER_ADDR and MASTER_PORT,
    where Vertex sets them, name it too), or MASTER_ADDR with WORLD_SIZE and RANK counting machines where no other
    platform (and no torchrun) set them (Volcano's pytorch plugin sets them so too: VC_TASK_INDEX names it); its
    job and trial ids alone name it."""
    keys = ("CLOUD_ML_JOB_ID", "CLOUD_ML_TRIAL_ID")
    if "CLUSTER_SPEC" in env:
        try:
            spec = json.loads(env["CLUSTER_SPEC"])
            pools = sorted((k for k in spec["cluster"] if k.startswith("workerpool")), key=lambda k: int(k[10:]))
            hosts = [h for k in pools for h in spec["cluster"][k]]
            task = spec["task"]
            rank = sum(len(spec["cluster"][k]) for k in pools[: pools.index(task["type"])]) + int(task["index"])
            first, _, port = hosts[0].rpartition(":")
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise ConfigError(f"CLUSTER_SPEC: not Vertex AI's cluster description ({type(e).__name__}: {e})") from None
        within("CLUSTER_SPEC's task", rank, len(hosts), "machines in it")
        addr = env.get("MASTER_ADDR") or first
        port_n = number(env, "MASTER_PORT", int(port) if port.isdigit() else DEFAULT_PORT)
        return Place("Vertex AI", len(hosts), rank, addr, port_n, variables=picked(env, keys))
    bare = all(k in env for k in ("MASTER_ADDR", "WORLD_SIZE", "RANK"))
    others = "SLURM_JOB_ID" in env or "RAY_RAYLET_PID" in env or any(k.startswith("PET_") for k in env)
    if bare and not worker(env) and not others:  # (an sbatch script may export them for its own use)
        nodes, rank = number(env, "WORLD_SIZE"), number(env, "RANK")
        within("RANK", rank, nodes, "WORLD_SIZE")
        port = number(env, "MASTER_PORT", DEFAULT_PORT)
        volcano = "VC_TASK_INDEX" in env or "VK_TASK_INDEX" in env  # Volcano's pytorch plugin counts pods alike
        name = "Volcano" if volcano and not any(k in env for k in keys) else "Vertex AI"
        return Place(
            name,
            nodes,
            rank,
            env["MASTER_ADDR"],
            port,
            variables=picked(env, (*keys, "MASTER_ADDR", "WORLD_SIZE", "RANK", "VC_TASK_INDEX", "VK_TASK_INDEX")),
        )
    return picked_only(env, "Vertex AI", keys)


def colab(env: Mapping[str, str]) -> Place | None:
    return picked_only(env, "Colab", ("COLAB_RELEASE_TAG", "COLAB_GPU"))


def picked_only(env: Mapping[str, str], name: str, keys) -> Place | None:
    """A platform known by its ids alone: named, no group."""
    variables = picked(env, keys)
    return Place(name, variables=variables) if variables else None


# --- processes started by torchrun, by the job's own launcher, or by Ray Train


def worker(env: Mapping[str, str]) -> bool:
    """Whether torch's variables describe this very process (torchrun, the job's launcher, Ray: LOCAL_RANK set)."""
    return env.get("LOCAL_RANK") is not None


def torch_process(env: Mapping[str, str], local_rank: int | None = None) -> Process:
    """This process's place as torch's own variables give it (torchrun, the job's launcher and Ray set them);
    `local_rank`: LOCAL_RANK's default where it may be unset (a Ray worker: 0, as it was read before)."""
    rank, world = number(env, "RANK", 0), number(env, "WORLD_SIZE", 1)
    within("RANK", rank, world, "WORLD_SIZE")
    return Process(rank, world, number(env, "LOCAL_RANK", local_rank), number(env, "LOCAL_WORLD_SIZE", 1))


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
