"""Measures the loop keeps without waiting for the device: the seconds spent training, and the training loss
summed on the device and read back by copies that land while the next steps run."""

from __future__ import annotations

import time
from collections import deque

import torch

from job import distributed


class TrainClock:
    """Seconds spent in training epochs, excluding evaluations and checkpoints, without waiting for the device:
    on a GPU, CUDA events mark each stretch of epochs and are read only after the device has caught up."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.open = False

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        if not self.open:
            self.marks.append(self.mark())
            self.open = True

    def stop(self) -> None:
        if self.open:
            self.marks.append(self.mark())
            self.open = False

    def seconds(self) -> float:
        self.stop()
        pairs = zip(self.marks[::2], self.marks[1::2])
        if self.cuda:
            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in pairs) / 1000
        return sum(b - a for a, b in pairs)


class LossLog:
    """Training loss summed on the device: [sum over the current log window, sum since the last evaluation].

    Every `every` steps the window sum is copied to pinned host memory without blocking; the value is
    handed out once the copy has landed, so logging costs no host sync.
    """

    def __init__(self, device: torch.device, every: int) -> None:
        self.device, self.every = device, every
        self.sums = torch.zeros(2, device=device)
        self.pending: deque = deque()

    def close_window(self, step: int, lr: float) -> None:
        host = torch.empty(1, pin_memory=self.device.type == "cuda")
        distributed.mean_(self.sums[:1])  # under torchrun: the group's window (nccl: queued, no host sync)
        host.copy_(self.sums[:1], non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self.sums[:1].zero_()  # in place: assigning a Python number would copy from the host and sync
        self.pending.append((step, lr, host, event))

    def ready(self, wait: bool = False):
        """(step, mean loss, lr) of each window whose copy has landed (all of them with wait=True)."""
        while self.pending:
            step, lr, host, event = self.pending[0]
            if event is not None and not wait and not event.query():
                return
            if event is not None:
                event.synchronize()
            self.pending.popleft()
            yield step, host.item() / self.every, lr
