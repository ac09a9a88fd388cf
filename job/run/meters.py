"""Measures the loop keeps without waiting for the device: the seconds spent training, the training loss summed on
the device and read back by copies that land while the next steps run, and what the machine did in each log window
(step time, input wait, memory)."""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator

import torch

from job.group import distributed


def mark(cuda: bool):
    """A point in time without waiting for the device: on a GPU a CUDA event recorded in the stream (read once the
    device has passed it), else the host's clock."""
    if cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


class TrainClock:
    """Seconds spent in training epochs, excluding evaluations and checkpoints, and in test passes, without waiting
    for the device: on a GPU, CUDA events mark each stretch and are read only after the device has caught up."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.tests: list = []
        self.open = False

    @contextlib.contextmanager
    def testing(self) -> Iterator[None]:
        """A test pass: training's stretch ends, the test's is timed."""
        self.stop()
        self.tests.append(mark(self.cuda))
        yield
        self.tests.append(mark(self.cuda))

    def summary(self) -> dict[str, float | list[float]]:
        """train_seconds: in this process's training epochs; test_seconds: in its test passes; epoch_seconds: each
        stretch of training between evaluations and checkpoints (an epoch's, mostly): the first shows set-up costs
        paid inside it (kernel tuning, step capture)."""
        return {
            "train_seconds": round(self.seconds(), 4),
            "test_seconds": round(self.seconds(self.tests), 4),
            "epoch_seconds": [round(s, 4) for s in self.stretches()],
        }

    def start(self) -> None:
        if not self.open:
            self.marks.append(mark(self.cuda))
            self.open = True

    def stop(self) -> None:
        if self.open:
            self.marks.append(mark(self.cuda))
            self.open = False

    def seconds(self, marks: list | None = None) -> float:
        return sum(self.stretches(marks))

    def stretches(self, marks: list | None = None) -> list[float]:
        self.stop()
        marks = self.marks if marks is None else marks
        pairs = zip(marks[::2], marks[1::2])
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1000 for a, b in pairs]
        return [b - a for a, b in pairs]


GIB = 1024**3
PAGE = os.sysconf("SC_PAGE_SIZE")


class LossLog:
    """Training loss summed on the device: [sum over the current log window, sum since the last evaluation], and
    the window's system measures (SystemMeter).

    Every `every` steps the window sum is copied to pinned host memory without blocking; the value is
    handed out once the copy has landed, so logging costs no host sync.
    """

    def __init__(self, device: torch.device, every: int) -> None:
        self.device, self.every = device, every
        self.sums = torch.zeros(2, device=device)
        self.pending: deque = deque()
        self.system = SystemMeter(device)

    def state_dict(self) -> list[float]:
        """This process's loss sums (a run component saved per process: run/state.py)."""
        return self.sums.tolist()

    def load_state_dict(self, saved: dict) -> None:
        """This process's sums from every process's, by rank (a group of another size: their mean)."""
        self.sums.copy_(distributed.own(saved["by_rank"]))

    def close_window(self, step: int, lr: float, steps: int | None = None) -> None:
        """The window ending at `step` of `steps` steps (default: `every`; fewer when it began with an epoch or ends
        with one), its sum copied to the host without waiting."""
        host = torch.empty(1, pin_memory=self.device.type == "cuda")
        distributed.mean_(self.sums[:1])  # under torchrun: the group's window (nccl: queued, no host sync)
        host.copy_(self.sums[:1], non_blocking=True)
        end = mark(self.system.cuda)  # on a GPU, an event after the window's work: the copy has landed once it has
        self.sums[:1].zero_()  # in place: assigning a Python number would copy from the host and sync
        self.pending.append((step, lr, host, end, self.system.close(step, end), steps or self.every))

    def ready(self, wait: bool = False):
        """(step, mean loss, lr, system measures) of each window whose copy has landed (all of them with
        wait=True)."""
        while self.pending:
            step, lr, host, end, window, steps = self.pending[0]
            cuda = isinstance(end, torch.cuda.Event)
            if cuda and not wait and not end.query():
                return
            if cuda:
                end.synchronize()
            self.pending.popleft()
            yield step, host.item() / steps, lr, self.system.values(window, end)


class SystemMeter:
    """What the machine did in a log window, measured without waiting for the device: seconds per training step
    (host clock on a CPU; CUDA events on a GPU, read once they have passed), seconds a step waited for its batch (the
    host's clock around the loader), this process's resident memory, the GPU's peak memory allocated and reserved
    and, where nvidia-ml-py is installed, the GPU's utilisation. A window starts again when training resumes after an
    evaluation or a checkpoint, so that their time stays out of it."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.begin, self.first, self.waited, self.paused = None, 0, 0.0, True
        self.utilization = self.cuda

    def resume(self, step: int) -> None:
        """Training goes on at `step`: after a pause (or at the start) the window starts again from here."""
        if self.paused:
            self.begin, self.first, self.waited, self.paused = mark(self.cuda), step, 0.0, False

    def pause(self) -> None:
        """An evaluation or a checkpoint: its time stays out of the window."""
        self.paused = True

    def timed(self, batches: Iterable) -> Iterator:
        """The batches, with the time spent waiting for each one added to the window's."""
        it = iter(batches)
        while True:
            t = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            self.waited += time.perf_counter() - t
            yield item

    def close(self, step: int, end) -> tuple:
        """The window ending at `step`: what is known on the host now; the step time once `end` has passed."""
        steps = step - self.first
        values = {"data_wait_s": self.waited / max(steps, 1), "host_memory_gib": resident_bytes() / GIB}
        if self.cuda:
            values["gpu_memory_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / GIB
            values["gpu_memory_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / GIB
            torch.cuda.reset_peak_memory_stats(self.device)
            if self.utilization:
                try:
                    values["gpu_utilization"] = float(torch.cuda.utilization(self.device))
                except Exception:  # nvidia-ml-py missing, or no NVML on this machine: not measured
                    self.utilization = False
        window = (self.begin, steps, values)
        self.begin, self.first, self.waited = end, step, 0.0
        return window

    def values(self, window: tuple, end) -> dict[str, float]:
        begin, steps, values = window
        if begin is None or steps <= 0:
            return values
        seconds = begin.elapsed_time(end) / 1000 if self.cuda else end - begin
        return {"step_time_s": seconds / steps, **values}


def resident_bytes() -> int:
    """This process's resident memory now (Linux's /proc; elsewhere its peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
