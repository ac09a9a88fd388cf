"""Gradient accumulation: the gradients of a group of batches summed, weighted by each batch's share of the group's
samples, before one optimizer step."""

from __future__ import annotations

import torch


class Accumulator:
    """Gradient accumulation (train.accumulate_steps): the gradients of a group of batches summed, each batch's
    weighted by its share of the group's samples, so that the optimizer steps once on what one batch of all of them
    would have given. Works on the fresh gradients any kind of step leaves, so capture and AMP keep working (the
    loss scale of fp16 stays fixed within a group: the scaler updates at the optimizer step)."""

    def __init__(self, params: list[torch.Tensor], every: int) -> None:
        self.params, self.every = params, every
        self.sums: list[torch.Tensor] | None = None
        self.weight, self.last = 1.0, True

    def plan(self, loader, i: int) -> None:
        """Batch i of the loader's epoch comes next: its weight in its group, and whether it ends the group (the
        epoch's last batch ends the last group, however short)."""
        start = i - i % self.every
        end = min(start + self.every, len(loader))
        self.weight = loader.samples(i) / sum(loader.samples(j) for j in range(start, end))
        self.last = i == end - 1

    def add(self) -> bool:
        """Add the fresh gradients in `.grad` to the group's sum; at the group's last batch, put the sum in `.grad`
        for the optimizer and return True."""
        if self.sums is None:
            self.sums = [torch.zeros_like(p) for p in self.params]
        pairs = [(s, p.grad) for s, p in zip(self.sums, self.params) if p.grad is not None]
        if pairs:
            torch._foreach_add_([s for s, _ in pairs], [g for _, g in pairs], alpha=self.weight)
        if not self.last:
            return False
        for p, s in zip(self.params, self.sums):
            p.grad = s
        return True

    def reset(self) -> None:
        if self.sums is not None:
            torch._foreach_zero_(self.sums)

    def saved(self, epoch_step: int) -> dict:
        """Stopped inside a group of batches (after `epoch_step` of the epoch): the group's gradient sums so far, on
        the host, for a checkpoint (the same in every process: DDP has averaged each batch's); else nothing."""
        if self.sums is None or epoch_step % self.every == 0:
            return {}
        return {"accumulated": [t.detach().cpu() for t in self.sums]}

    def restore(self, sums: list[torch.Tensor] | None, device: torch.device) -> None:
        """A checkpoint's sums back on the device: the resumed run adds the rest of the group to them."""
        self.sums = [t.to(device) for t in sums] if sums is not None else None
