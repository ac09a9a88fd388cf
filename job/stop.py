"""Stopping on request: SIGTERM (preemption, `docker stop`) or SIGINT makes the loop stop after the current step
and commit a checkpoint; a second SIGINT stops at once; a grace period bounds the wait."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any

from job.report import say


class StopRequest:
    """SIGTERM or SIGINT asks the loop to stop after the current step and commit a checkpoint. If that takes
    longer than the grace period the process exits 75 anyway, leaving the previous commit as the one to resume
    (commits are atomic, so stopping in the middle of one is safe). A second SIGINT stops at once."""

    def __init__(self, grace_seconds: float) -> None:
        self.grace_seconds = grace_seconds
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}
        self._timer: threading.Timer | None = None

    def __enter__(self) -> StopRequest:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, sig: int, frame) -> None:
        if self.signal is not None:
            if sig == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.signal = sig
        self._timer = threading.Timer(self.grace_seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()
        say(f"{signal.Signals(sig).name}: finishing the current step, then checkpointing")

    def _expire(self) -> None:
        say(
            f"the {self.grace_seconds:g} s grace period ran out before the checkpoint was committed; exiting, "
            "the previous checkpoint stands: run the same command again to continue"
        )
        os._exit(75)
