"""job/retry.py: the one retry policy (its delays, its tries, its deadline, its stop) on real calls and real time."""

from __future__ import annotations

import threading
import time

import pytest

from job.retry import Backoff, Stopped, retry


class Flaky:
    """A call that fails `failures` times (OSError), then returns "done"; it records when it was called."""

    def __init__(self, failures: int, error: type[Exception] = OSError) -> None:
        self.failures, self.error, self.at = failures, error, []

    def __call__(self) -> str:
        self.at.append(time.monotonic())
        if len(self.at) <= self.failures:
            raise self.error(f"failure {len(self.at)}")
        return "done"


def test_delays_double_from_the_first_up_to_the_most():
    assert [Backoff(0.2, 5.0).delay(n) for n in range(1, 8)] == pytest.approx([0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0])
    assert [Backoff(2.0, 60.0).delay(n) for n in (1, 5, 6)] == [2.0, 32.0, 60.0]
    assert Backoff(1.0, 1.0).delay(3) == 1.0


def test_a_call_that_fails_a_few_times_is_tried_again_after_each_delay():
    call = Flaky(2)
    assert retry(call, Backoff(0.05, 1.0), tries=3) == "done"
    gaps = [b - a for a, b in zip(call.at, call.at[1:])]
    assert len(gaps) == 2 and gaps[0] >= 0.05 and gaps[1] >= 0.1


def test_the_last_failure_is_raised_once_the_tries_are_spent():
    call = Flaky(5)
    with pytest.raises(OSError, match="failure 3"):
        retry(call, Backoff(0.01, 0.01), tries=3)
    assert len(call.at) == 3


def test_a_fatal_error_is_raised_at_its_first_try():
    call = Flaky(5, FileNotFoundError)
    with pytest.raises(FileNotFoundError):
        retry(call, Backoff(0.01, 0.01), tries=3, fatal=(FileNotFoundError, PermissionError))
    assert len(call.at) == 1


def test_a_deadline_bounds_the_tries_and_cuts_the_last_wait_short():
    call = Flaky(100)
    start = time.monotonic()
    with pytest.raises(OSError):
        retry(call, Backoff(0.1, 10.0), deadline=start + 0.5)
    took = time.monotonic() - start
    assert 0.5 <= took < 1.0  # tries at 0, 0.1, 0.3, then a wait of 0.2 (not 0.4) and the last try at the deadline
    assert len(call.at) == 4


def test_a_stop_cuts_the_wait_short_and_no_try_follows():
    stop, call = threading.Event(), Flaky(100)
    threading.Timer(0.2, stop.set).start()
    start = time.monotonic()
    with pytest.raises(Stopped):
        retry(call, Backoff(5.0, 5.0), stop=stop)
    assert time.monotonic() - start < 2 and len(call.at) == 1
    with pytest.raises(Stopped):  # stopped before it begins: not tried at all
        retry(call, Backoff(5.0, 5.0), stop=stop)
    assert len(call.at) == 1


def test_a_call_that_succeeds_is_called_once():
    call = Flaky(0)
    assert retry(call, Backoff(1.0, 1.0), tries=1) == "done" and len(call.at) == 1
