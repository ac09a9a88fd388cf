"""The console: one line for the user, from the process that speaks for a group."""

from __future__ import annotations

import os
import sys


def follower() -> str:
    """This process's rank under torchrun when it is not rank 0; '' for rank 0 and outside torchrun."""
    rank = os.environ.get("RANK", "0") if os.environ.get("LOCAL_RANK") is not None else "0"
    return "" if rank == "0" else rank


def say(message: str) -> None:
    """One line for the user on the console; under torchrun from rank 0 only (each rank its errors: cli/faults.py)."""
    if not follower():
        print(message, file=sys.stderr, flush=True)


def say_own(message: str) -> None:
    """A line only this process can say (what its own part of the data held), from every rank of a group, each
    marked with its rank."""
    rank = follower()
    print(f"rank {rank}: {message}" if rank else message, file=sys.stderr, flush=True)
