"""Slurm: its variables read as srun and a batch script set them (one task per process or one per machine), its
compressed host lists and task counts expanded, and a job asked to requeue itself on the signal before its end."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Mapping

from job.errors import ConfigError
from job.group.place import Place, Process, number, picked, within

SLURM_PORT_BASE = 15000  # Slurm: the meeting port is this plus the job id's last four digits (Lightning's rule)


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
