"""Stopping on request: SIGTERM (preemption, `docker stop`) or SIGINT makes the loop stop after the current step
and commit a checkpoint; a second SIGINT stops at once; a grace period bounds the wait."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from job.errors import Interrupted
from job.report import say


class StopRequest:
    """SIGTERM or SIGINT asks the loop to stop after the current step and commit a checkpoint. If that takes
    longer than the grace period the process exits 75 anyway, leaving the previous commit as the one to resume
    (commits are atomic, so stopping in the middle of one is safe). A second SIGINT stops at once."""

    def __init__(self, grace_seconds: float, exits_after: bool = False) -> None:
        self.grace_seconds = grace_seconds
        self.exits_after = exits_after  # the command line: the process ends when the block does
        self.signal: int | None = None  # the signal the loop acts on
        self.received: int | None = None  # the signal this process was sent
        self.combine: Callable[[int], int] | None = None  # in a process group: every process's signal, combined
        self._previous: dict[int, Any] = {}
        self._timer: threading.Timer | None = None

    def __enter__(self) -> StopRequest:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, handler in self._previous.items():
            # A process leaving with the checkpoint committed, to exit 75: a further SIGTERM (torchrun ends a group's
            # other processes as soon as one exits) must not turn that exit into a kill.
            stopping = self.exits_after and sig == signal.SIGTERM and kind is not None and issubclass(kind, Interrupted)
            signal.signal(sig, signal.SIG_IGN if stopping else handler)

    def share(self, combine: Callable[[int], int]) -> None:
        """Join a group of processes (torchrun): from now on the loop acts on a signal at sync() only, where every
        process learns whether any of them was sent one, so all stop at the same step."""
        self.combine = combine
        self.signal = None

    def sync(self) -> None:
        """At a point every process of the group reaches together (alone: nothing to do, signals act at once)."""
        if self.combine is not None and self.signal is None:
            sig = self.combine(self.received or 0)
            if sig:
                self.signal = sig
                self._start_grace()

    def _handle(self, sig: int, frame) -> None:
        if self.received is not None:
            if sig == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.received = sig
        if self.combine is None:
            self.signal = sig
        self._start_grace()
        say(f"{signal.Signals(sig).name}: finishing the current step, then checkpointing")

    def _start_grace(self) -> None:
        if self._timer is None:
            self._timer = threading.Timer(self.grace_seconds, self._expire)
            self._timer.daemon = True
            self._timer.start()

    def _expire(self) -> None:
        say(
            f"the {self.grace_seconds:g} s grace period ran out before the checkpoint was committed; exiting, "
            "the previous checkpoint stands: run the same command again to continue"
        )
        os._exit(75)
