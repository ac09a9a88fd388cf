"""Splitting `job predict`'s work into parts: a Cloud Batch task array's tasks times --nproc-per-node's processes,
each taking every n-th input (files or a table's rows), each process with its share of the CPUs and its device."""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch

from job.errors import ConfigError

T = TypeVar("T")


PART = "JOB_PREDICT_PART"  # "i/n": the part of the inputs one of --nproc-per-node's processes takes


def part() -> tuple[int, int]:
    """(index, count) of the inputs' parts this process predicts: a Cloud Batch task array's task
    (BATCH_TASK_INDEX of BATCH_TASK_COUNT), times --nproc-per-node's processes on each; (0, 1): all of them."""
    task, tasks = int(os.environ.get("BATCH_TASK_INDEX", 0)), int(os.environ.get("BATCH_TASK_COUNT", 1))
    local, per_task = (int(v) for v in os.environ.get(PART, "0/1").split("/"))
    if not (0 <= task < tasks and 0 <= local < per_task):
        raise ConfigError(f"predict: task {task} of {tasks}, process {local} of {per_task}: not a part")
    return task * per_task + local, tasks * per_task


def share(inputs: Iterable[T], index: int, count: int) -> Iterator[T]:
    """Part `index` of `count` of the inputs (files or a table's rows): every count-th from its own, so the parts
    together take each input once; an iterator's items are taken as they come."""
    return itertools.islice(inputs, index, None, count)


def spread(argv: list[str], nproc: int) -> int:
    """--nproc-per-node: this command again in `nproc` processes, each predicting its part (the option is read
    only where PART is unset) with its share of the CPUs; the worst exit code, a process ended by a signal counting
    128 + its number, as a shell says it. They run in sessions of their own, as training's workers do, and a SIGTERM
    or Ctrl-C to this process goes on to each (launch.forwarding_signals): a preempted predict stops whole."""
    import subprocess

    from job.group.env import cpu_share
    from job.group.launch import forwarding_signals

    env = {**os.environ, "LOCAL_WORLD_SIZE": str(nproc)}  # env.cpu_share's count: decoding takes the share
    env.setdefault("OMP_NUM_THREADS", str(cpu_share(nproc)))  # and so does the model, as torchrun sets it
    with forwarding_signals():
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "job", *argv], env={**env, PART: f"{i}/{nproc}"}, start_new_session=True
            )
            for i in range(nproc)
        ]
        codes = [proc.wait() for proc in procs]
    return max(128 - code if code < 0 else code for code in codes)


def part_device(name: str) -> torch.device:
    """The device a part predicts on: as asked; with auto, one of --nproc-per-node's processes takes the GPU of its
    own index (of those there are)."""
    from job.group.env import pick_device

    local = int(os.environ.get(PART, "0/1").split("/")[0])
    if name == "auto" and PART in os.environ and torch.cuda.is_available():
        return torch.device("cuda", local % torch.cuda.device_count())
    return pick_device(name)
