"""The one retry policy: a call that the network or a busy store may fail for a moment is tried again after a delay
that doubles up to a cap, for a number of tries or until a deadline, and tried no more once its caller stops.

One function rather than a library (tenacity): its callers need a deadline that the call itself also reads (the
uploader bounds each request by what is left of it), a stop event that cuts a wait short, and the delays alone for a
thread that waits on an event of its own (the tracker, woken early by new points): a few lines here, a library's
callbacks and one more dependency there. A poll of a state (the lease's watch of a heartbeat, a sweep waiting on
another worker's trials) is not a retry: nothing failed, and it stays a poll."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


class Stopped(Exception):
    """The caller's stop event was set: no further try was made."""


@dataclass(frozen=True)
class Backoff:
    """Seconds between tries: `first` after the first failure, `factor` times more after each failure after it, never
    more than `most`."""

    first: float
    most: float
    factor: float = 2.0

    def delay(self, failures: int) -> float:
        """The wait after `failures` failures in a row (1 or more)."""
        return min(self.first * self.factor ** max(failures - 1, 0), self.most)


def retry(
    call: Callable[[], T],
    backoff: Backoff,
    *,
    tries: int | None = None,
    deadline: float | None = None,
    stop: threading.Event | None = None,
    fatal: tuple[type[BaseException], ...] = (),
) -> T:
    """call()'s result, tried again after each failure (any Exception but those of `fatal`, raised at once) once the
    backoff's delay has passed. The last failure is raised when `tries` calls have failed or the monotonic `deadline`
    has passed (the last wait is cut to what is left of it); Stopped when `stop` is set before a try or during a wait,
    or was set while a try failed."""
    failures = 0
    while True:
        if stop is not None and stop.is_set():
            raise Stopped
        try:
            return call()
        except fatal:
            raise
        except Exception as e:  # what a store's or a server's client raises: many types
            failures += 1
            if stop is not None and stop.is_set():
                raise Stopped from e
            left = None if deadline is None else deadline - time.monotonic()
            if (tries is not None and failures >= tries) or (left is not None and left <= 0):
                raise
            wait = backoff.delay(failures) if left is None else min(backoff.delay(failures), left)
        if stop is None:
            time.sleep(wait)
        elif stop.wait(wait):
            raise Stopped
