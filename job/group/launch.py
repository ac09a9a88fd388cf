"""`train --nproc-per-node N`: the job starts its own worker processes through PyTorch's elastic agent (what torchrun
runs), one command on every node, and ends with the workers' exit code, so a platform's retry rule on 75 works with
no wrapper (torchrun itself turns a worker's 75 into 1).

Signals: the workers run in sessions of their own (the agent starts them so), so a SIGTERM or Ctrl-C reaching the
job's process is passed on to each of them here; each commits a checkpoint and exits 75, and the job exits 75. The
agent's own signal handling is turned off: it would stop the workers and lose their exit codes. A worker that dies
makes the agent stop the others at once; the job names it in one line. The job's process that dies (SIGKILL, the
OOM killer) takes its workers with it (end_with_launcher): neither the agent nor torchrun does that, and workers in
sessions of their own would otherwise train on beside the next attempt.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace

import psutil

from job.console import say
from job.errors import ConfigError, JobError, one_line
from job.group import platforms, slurm
from job.group.env import cpus, die_with_parent
from job.group.place import DEFAULT_PORT, Place, number, worker

FORWARDED = (signal.SIGTERM, signal.SIGINT, *([signal.SIGUSR1] if hasattr(signal, "SIGUSR1") else []))


LAUNCHER = "JOB_LAUNCHER_PID"  # set for the workers: the pid of the job's process that started them


@dataclass
class Launch:
    """Where this node's workers join: nproc_per_node of them, on node node_rank of nnodes, meeting at
    master_addr:master_port (the first node's address; one node: this machine, a free port). `source`: the platform
    whose variables gave the machines, when no flag did."""

    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    source: str = ""
    min_nnodes: int = 0  # an elastic group (PyTorchJob's elasticPolicy): it starts with this many machines or more

    def describe(self) -> str:
        one = "process" if self.nproc_per_node == 1 else "processes"
        if self.nnodes == 1:
            return f"{self.nproc_per_node} {one}"
        where = f"meeting at {self.master_addr}:{self.master_port}" + (f"; {self.source}" if self.source else "")
        return f"{self.nproc_per_node} {one} on node {self.node_rank} of {self.nnodes} ({where})"


def launch_plan(
    nproc_per_node: str,
    nnodes: int | None,
    node_rank: int | None,
    master_addr: str | None,
    master_port: int | None,
    device: str,
    place: Place | None = None,
    env: dict[str, str] | None = None,
) -> Launch | None:
    """What `train` launches: the flags, and for what they leave out, the platform's place (group/platforms.py); None
    when this process should train by itself (no --nproc-per-node and one machine), or as one process of a group a
    platform started (torchrun, `srun -n N`, Ray Train)."""
    env = os.environ if env is None else env
    place = platforms.read(env) if place is None else place
    if place.process is not None:
        if place.joined or is_worker(env) or not nproc_per_node or nnodes is not None:
            return None
        if place.process.local_world > 1:
            raise ConfigError(
                f"--nproc-per-node with {place.name} starting {place.process.local_world} processes on this machine: "
                "each task is already one process of the group; drop --nproc-per-node, or start one task per machine "
                "(srun --ntasks-per-node=1)"
            )
        place = replace(place, process=None)  # one task per machine: this task starts the machine's processes
    machines = place.nnodes if place.nnodes and place.nnodes > 1 else None
    if not nproc_per_node and not (nnodes or 0) > 1 and not machines:
        return None
    if machines and nnodes is None:  # one machine meets on itself, whatever the platform calls it
        nnodes, node_rank = machines, place.node_rank if node_rank is None else node_rank
        master_addr, master_port = master_addr or place.master_addr, master_port or place.master_port
    elif place.nnodes is None and place.name and (nnodes or 0) > 1:  # the platform says where, --nnodes how many
        node_rank = place.node_rank if node_rank is None else node_rank
        master_addr, master_port = master_addr or place.master_addr, master_port or place.master_port
    nnodes, node_rank = nnodes or 1, node_rank or 0
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ConfigError(f"--node-rank {node_rank}: expected 0 to {nnodes - 1} for {nnodes} machines (--nnodes)")
    setting = nproc_per_node or platform_processes(place.nproc_per_node)
    source = place.name if nnodes > 1 and (machines == nnodes or place.nnodes is None) else ""
    port = master_port or (DEFAULT_PORT if nnodes > 1 else 0)
    elastic = place.elastic if machines == nnodes and place.elastic else None
    return Launch(
        processes(setting, device),
        nnodes,
        node_rank,
        master_addr or "127.0.0.1",
        port,
        source,
        elastic[0] if elastic else 0,
    )


def platform_processes(said: str | None) -> str:
    """--nproc-per-node from a platform's count: a number, or auto (Kubeflow's cpu and gpu mean the same here)."""
    if said and said.isdigit() and int(said) > 0:
        return said
    return "auto"


def processes(setting: str, device: str = "auto") -> int:
    """--nproc-per-node: a number, or auto (the GPUs present, 1 without or with --device cpu)."""
    if setting == "auto":
        import torch

        return 1 if device == "cpu" else max(1, torch.cuda.device_count())
    try:
        n = int(setting)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"--nproc-per-node: expected a positive number or auto, got {setting!r}")
    return n


def is_worker(env: dict[str, str] | None = None) -> bool:
    """Whether this process is already a worker of a group (started by this job's launcher or by torchrun)."""
    return worker(os.environ if env is None else env)


def launch(plan: Launch, options: dict[str, str | bool], overrides: list[str]) -> int:
    """Run `python -m job train` with the options and --set overrides in plan.nproc_per_node processes on this node
    until they end; returns the exit code the job ends with: 0, 75 when they stopped with a checkpoint, the first
    worker's user-error code, 130 for a cancel, else 1 (a worker that crashed or died, named in one line)."""
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    elastic = plan.min_nnodes > 0
    config = LaunchConfig(
        min_nodes=plan.min_nnodes or plan.nnodes,
        max_nodes=plan.nnodes,
        nproc_per_node=plan.nproc_per_node,
        run_id=meeting_id() if plan.nnodes > 1 else uuid.uuid4().hex,
        rdzv_backend="static" if plan.nnodes > 1 and not elastic else "c10d",
        rdzv_endpoint=f"{plan.master_addr}:{plan.master_port}",
        rdzv_configs=(
            {"timeout": meeting_timeout()}
            if elastic
            else {"rank": plan.node_rank, "timeout": meeting_timeout()}
            if plan.nnodes > 1
            else {}
        ),
        max_restarts=0,  # a failed worker ends the attempt; the same command continues from the checkpoint
        monitor_interval=0.1,
        signals_to_handle="",  # the job forwards signals itself (module docstring)
    )
    if "OMP_NUM_THREADS" not in os.environ and plan.nproc_per_node > 1:  # as torchrun does: no oversubscribed cores
        os.environ["OMP_NUM_THREADS"] = str(max(1, cpus() // plan.nproc_per_node))
    say(f"launching {plan.describe()}")
    os.environ[LAUNCHER] = str(os.getpid())  # the agent starts the workers from this thread (end_with_launcher)
    with quiet_agent(), forwarding_signals() as received:
        try:
            elastic_launch(config, sys.executable)("-m", "job", "train", *worker_args(options, overrides))
        except ChildFailedError as e:
            code = group_exit_code(e.failures)
            usr1 = getattr(signal, "SIGUSR1", None) in received  # Slurm's warning: the job asks for its requeue
            if code == 75 and plan.node_rank == 0 and usr1 and (said := slurm.requeue(say=say)):
                say(said)
            return code
        except (DistError, RendezvousError) as e:  # only the meeting talks to other machines outside the workers
            raise JobError(
                f"the machines did not meet within {config.rdzv_configs.get('timeout', 900)} s at "
                f"{plan.master_addr}:{plan.master_port} ({one_line(e)[:160]}): start all {plan.nnodes} with the same "
                "--nnodes, --master-addr and --master-port and each its own --node-rank (JOB_RDZV_TIMEOUT sets the "
                "wait); the run is as it was, so run the same command again once they can reach each other"
            ) from None
    return 0


def end_with_launcher() -> None:
    """In a worker of this job's launcher: end the moment the launcher does. On Linux the kernel sends the signal
    (PR_SET_PDEATHSIG: when the thread that started this process ends, and the agent starts workers from the main
    thread), then a look at the parent closes the gap before it was set; elsewhere a thread watches the parent.

    SIGKILL, not the SIGTERM path (stop after the step, commit, exit 75): with the launcher gone nobody takes the
    75 and the platform or the user starts the run again at once, which a group still committing would meet as a
    second writer, and a launcher that died of the OOM killer leaves a machine short of memory. Nothing committed
    is lost: a checkpoint is its payload, then its manifest, then the pointer, each written whole by a rename
    (sync.write_atomic) or sent as one object, so a process killed at any moment leaves the pointer naming the
    previous complete checkpoint, the one the next attempt resumes from, as after a kill of the whole group."""
    launcher = int(os.environ.get(LAUNCHER, "0") or 0)
    if not launcher or not is_worker():
        return
    if die_with_parent():
        if os.getppid() != launcher:  # it died before the kernel was told
            os.kill(os.getpid(), signal.SIGKILL)
        return

    def watch() -> None:
        while os.getppid() == launcher:
            threading.Event().wait(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="job-launcher-watch", daemon=True).start()


def meeting_id() -> str:
    """The name the machines of a group meet under: JOB_RDZV_ID, else PyTorchJob's PET_RDZV_ID, else job."""
    return os.environ.get("JOB_RDZV_ID") or os.environ.get("PET_RDZV_ID") or "job"


def meeting_timeout() -> int:
    """Seconds the machines of a group wait for each other at the meeting point: JOB_RDZV_TIMEOUT, else 900."""
    seconds = number(dict(os.environ), "JOB_RDZV_TIMEOUT", 900)
    if seconds <= 0:
        raise ConfigError(f"JOB_RDZV_TIMEOUT={seconds}: expected a positive number of seconds")
    return seconds


def worker_args(options: dict[str, str | bool], overrides: list[str]) -> list[str]:
    """The command line of a worker: the options given (a flag when True, left out when empty or False)."""
    args: list[str] = []
    for name, value in options.items():
        if value is True:
            args.append(name)
        elif value:
            args += [name, str(value)]
    return args + [a for item in overrides for a in ("--set", item)]


def group_exit_code(failures: dict) -> int:
    """The exit code of a group some of whose workers failed (rank -> ProcessFailure)."""
    codes = {f.exitcode for f in failures.values()}
    if codes == {75}:
        return 75  # every worker stopped with the checkpoint committed
    first = min(failures.values(), key=cause_first)
    known = {cls.exit_code for cls in (JobError, *JobError.__subclasses__())} - {1}
    if first.exitcode in known:
        return first.exitcode  # the worker printed its one line
    rank = next(r for r, f in failures.items() if f is first)
    if first.exitcode < 0:
        try:
            cause = f"was killed by {signal.Signals(-first.exitcode).name}"
        except ValueError:  # a signal number Python has no name for (real-time signals)
            cause = f"was killed by signal {-first.exitcode}"
    else:
        cause = f"failed with exit code {first.exitcode} (its output above says why)"
    print(f"error: worker {rank} (pid {first.pid}) {cause}; the other workers were stopped", file=sys.stderr)
    return 1


def cause_first(failure) -> tuple:
    """The order in which failures are taken as the group's cause: the earliest (the agent stamps them to the second
    as it sees them), and within a second a death by a signal the agent did not send (it sends SIGTERM), then a user
    error, then exit 1, which is also what a worker exits with when a peer vanished under a collective."""
    code = failure.exitcode
    kind = 3 if code == -signal.SIGTERM else 0 if code < 0 else 2 if code == 1 else 1
    return failure.timestamp, kind, failure.local_rank


@contextlib.contextmanager
def forwarding_signals() -> Iterator[set[int]]:
    """SIGTERM, SIGINT and SIGUSR1 to this process go on to every worker (this process's children); the block gets
    the set of those that came."""
    received: set[int] = set()

    def forward(signum, frame) -> None:
        received.add(signum)
        for pid in children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def children() -> list[int]:
    """The pids of this process's children (psutil: Linux, macOS and Windows alike)."""
    return [p.pid for p in psutil.Process().children()]


@contextlib.contextmanager
def quiet_agent() -> Iterator[None]:
    """The agent's log lines (its start, each worker's exit) kept off the console: the workers and the job say what
    happened, in the job's words."""
    logger = logging.getLogger("torch.distributed.elastic")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
