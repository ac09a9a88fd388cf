"""Stopping on request: SIGTERM (preemption, `docker stop`), SIGINT, SIGUSR1 (Slurm's warning signal, `#SBATCH
--signal=USR1@90`) or the run's time limit makes the loop stop after the current step and commit a checkpoint; a
second SIGINT stops at once; a grace period bounds the wait."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from job.console import say
from job.duration import format_duration
from job.errors import Cancelled, ConfigError, Interrupted, JobError

# The reasons a run stops for itself, integers beside the signal numbers (no signal handled here has these numbers).
TIME_LIMIT = 1  # its train.time_limit
ASKED = 3  # its caller, for a reason in words (a sweep's pruner)
# A group combines every process's reason in one reduction of one integer, the highest winning. A reason travels as
# its precedence: the run's own reasons below every signal, so a real signal is the one named when both came.
OWN = (TIME_LIMIT, ASKED)
SIGNALS = (signal.SIGTERM, signal.SIGINT, *([signal.SIGUSR1] if hasattr(signal, "SIGUSR1") else []))


class StopAtOnce(BaseException):  # a BaseException: the readers' `except Exception` wrap store errors
    """A signal that ends an at_once block: it passes through the data readers, which turn a store's exceptions
    into one line of their own, and at_once turns it into the run's error (unstarted)."""

    def __init__(self, sig: int) -> None:
        super().__init__(sig)
        self.signal = sig


class StopRequest:
    """SIGTERM, SIGINT or the time limit asks the loop to stop after the current step and commit a checkpoint. If
    that takes longer than the grace period the process exits 75 anyway, leaving the previous commit as the one to
    resume (commits are atomic, so stopping in the middle of one is safe). A second SIGINT stops at once.

    The handler only records the signal: the loop says what it does about it, once it knows (a signal that lands
    in the last step ends a finished run, not an interrupted one), and printing from a handler is not safe."""

    def __init__(self, grace_seconds: float, exits_after: bool = False) -> None:
        self.grace_seconds = grace_seconds
        self.exits_after = exits_after  # the command line: the process ends when the block does
        self.signal: int | None = None  # the reason the loop acts on: a signal number, or TIME_LIMIT
        self.received: int | None = None  # the reason this process has: a signal it was sent, or its time limit
        # In a process group: starts the reduction of every process's reason, returning what waits for its result.
        self.combine: Callable[[int], Callable[[], int]] | None = None
        self._pending: Callable[[], int] | None = None  # the reduction started after the previous step
        self.time_limit: float | None = None  # seconds, counted from when this request was made
        self.asked = ""  # why the caller asked to stop (ASKED), in words
        self.started = time.monotonic()
        self._signalled = False
        self._at_once = False  # a signal ends the process at once (reading the data: nothing to save)
        self._previous: dict[int, Any] = {}
        self._timer: threading.Timer | None = None
        self._limit_timer: threading.Timer | None = None
        # The time limit's thread and the main thread (signals, share) both record reasons. Re-entrant: a signal
        # handler runs in the main thread, possibly while it holds the lock.
        self._lock = threading.RLock()

    def __enter__(self) -> StopRequest:
        for sig in SIGNALS:
            with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, kind, value, traceback) -> None:
        self.cancel()
        for sig, handler in self._previous.items():
            # A process leaving with the checkpoint committed, to exit 75: a further SIGTERM (torchrun ends a group's
            # other processes as soon as one exits) must not turn that exit into a kill.
            stopping = self.exits_after and sig == signal.SIGTERM and kind is not None and issubclass(kind, Interrupted)
            signal.signal(sig, signal.SIG_IGN if stopping else handler)

    @contextlib.contextmanager
    def at_once(self):
        """A block before training that a signal ends at once, with unstarted()'s error: reading the data can take
        minutes, and nothing is written or saved yet. The time limit still waits for the block's end."""
        if self.received not in (None, TIME_LIMIT):
            raise self.unstarted(self.received)
        self._at_once = True
        try:
            yield
        except StopAtOnce as e:
            raise self.unstarted(e.signal) from None
        finally:
            self._at_once = False

    def unstarted(self, reason: int | None = None) -> JobError:
        """The error that ends a run stopped before training began (by default for the reason the loop acts on)."""
        reason = self.signal if reason is None else reason
        said = self.describe(reason)
        if reason == TIME_LIMIT:  # the next attempt would set up as long: a setting to change, not a retry
            return ConfigError(f"{said} ran out before training began: allow more with train.time_limit")
        if reason == signal.SIGINT:  # the user's Ctrl-C: nothing to continue, and 75 would promise a checkpoint
            return Cancelled(f"stopped by {said} before training began; nothing was saved")
        return Interrupted(f"stopped by {said} before training began: run the same command again to start")

    def limit(self, seconds: float | None) -> None:
        """Stop, as on SIGTERM, once `seconds` have passed since this request was made (None: no limit)."""
        with self._lock:
            if self._limit_timer is not None:
                self._limit_timer.cancel()
            self.time_limit, self._limit_timer = seconds, None
            if seconds is not None:
                left = seconds - (time.monotonic() - self.started)
                self._limit_timer = threading.Timer(max(left, 0.0), self._note, (TIME_LIMIT,))
                self._limit_timer.daemon = True
                self._limit_timer.start()

    def ask(self, why: str | None) -> None:
        """Stop, as on SIGTERM, for the reason `why` names (None: nothing to stop for). The loop acts on it after the
        current step: asked at an evaluation, the run commits that evaluation's step and stops."""
        if why:
            with self._lock:
                self.asked = self.asked or why
            self._note(ASKED)

    def finishing(self) -> None:
        """The training is over and the results are being written: a time limit or a request has nothing left to stop
        (a signal keeps its grace period, as the machine may be going away)."""
        with self._lock:
            if self._limit_timer is not None:
                self._limit_timer.cancel()
            if self.received in OWN and self._timer is not None:
                self._timer.cancel()

    def cancel(self) -> None:
        """No more timers: the block is over."""
        with self._lock:
            for timer in (self._timer, self._limit_timer):
                if timer is not None:
                    timer.cancel()

    def describe(self, reason: int | None = None) -> str:
        """A reason in words ('SIGTERM', 'the time limit (2h)'); by default the one the loop acts on."""
        reason = self.signal if reason is None else reason
        if reason == TIME_LIMIT:
            return f"the time limit ({format_duration(self.time_limit or 0)})"
        if reason == ASKED:  # a group's other processes learn that one was asked, not why
            return self.asked or "a stop request"
        return signal.Signals(reason).name if reason else "nothing"

    def share(self, combine: Callable[[int], Callable[[], int]]) -> None:
        """Join a group of processes (torchrun): from now on the loop acts on a signal only once every process has
        learnt whether any of them was sent one (sync, or step), so all stop at the same step."""
        with self._lock:
            self.combine = combine
            self.signal = None

    def sync(self) -> None:
        """At a point every process of the group reaches together, wait for the group's answer (alone: nothing to do,
        signals act at once)."""
        self.settle()
        if self.combine is not None and self.signal is None:
            self._agree(reason_of(self.combine(precedence(self.received))()))

    def step(self) -> None:
        """After each training step of a group: read the reduction started after the previous step (done by now, as
        a step outlasts a reduction of one integer) and start the next, so a stop is acted on one step after it came
        and no step waits for the others any longer than it does already."""
        if self.combine is None or self.signal is not None:
            return
        self.settle()
        if self.signal is None:
            self._pending = self.combine(precedence(self.received))

    def settle(self) -> None:
        """Wait for the reduction under way, if one is (at an epoch's end: no reduction outlives the loop)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._agree(reason_of(pending()))

    def _agree(self, reason: int) -> None:
        if reason:
            with self._lock:
                self.signal = reason
                self._start_grace()

    def _handle(self, sig: int, frame) -> None:
        if self._signalled and sig == signal.SIGINT:
            raise KeyboardInterrupt
        self._signalled = True
        if self._at_once:  # no grace period: the block ends now, and the process with it
            self._at_once = False
            with self._lock:
                self.received = self.received or sig
                self.signal = self.signal or sig
            raise StopAtOnce(sig)
        self._note(sig)

    def _note(self, reason: int) -> None:
        """A signal (in the main thread), the time limit (in its timer's thread) or the caller's request: the first one
        counts. In a group the grace period of the run's own reasons starts once the group agrees to stop (sync), which
        may be many steps later; a signal's starts now, as the machine may be going away."""
        with self._lock:
            if self.received is not None:
                return
            self.received = reason
            if self.combine is None:
                self.signal = reason
            if self.combine is None or reason not in OWN:
                self._start_grace()

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


def precedence(reason: int | None) -> int:
    """The integer a group's reduction carries for a reason (0: none): the run's own reasons below every signal."""
    if not reason:
        return 0
    return OWN.index(reason) + 1 if reason in OWN else reason + len(OWN)


def reason_of(combined: int) -> int:
    """The reason a group's reduction agreed on, from its precedence."""
    if not combined:
        return 0
    return OWN[combined - 1] if combined <= len(OWN) else combined - len(OWN)
