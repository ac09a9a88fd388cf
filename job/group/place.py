"""A process's place in a group, as a platform gives it (`Place`, `Process`), and the reading of environment variables
every platform's reader shares: whole numbers, ranks within their count, the variables that name a platform, and
torch's own variables (LOCAL_RANK and the rest) that torchrun, the job's launcher and Ray set."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from job.errors import ConfigError

DEFAULT_PORT = 29500  # torchrun's, for platforms that name the first node but no port


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


def picked_only(env: Mapping[str, str], name: str, keys) -> Place | None:
    """A platform known by its ids alone: named, no group."""
    variables = picked(env, keys)
    return Place(name, variables=variables) if variables else None


def worker(env: Mapping[str, str]) -> bool:
    """Whether torch's variables describe this very process (torchrun, the job's launcher, Ray: LOCAL_RANK set)."""
    return env.get("LOCAL_RANK") is not None


def torch_process(env: Mapping[str, str], local_rank: int | None = None) -> Process:
    """This process's place as torch's own variables give it (torchrun, the job's launcher and Ray set them);
    `local_rank`: LOCAL_RANK's default where it may be unset (a Ray worker: 0, as it was read before)."""
    rank, world = number(env, "RANK", 0), number(env, "WORLD_SIZE", 1)
    within("RANK", rank, world, "WORLD_SIZE")
    return Process(rank, world, number(env, "LOCAL_RANK", local_rank), number(env, "LOCAL_WORLD_SIZE", 1))
