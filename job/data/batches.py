"""The one loader contract every caller uses (training, evaluation, bench, find-batch-size), and how a batch
reaches the training device.

A loader gives the batches of an epoch from a step on, says how many there are, and saves and restores its place
in an epoch. Each batch carries its own loss weight and its sample counts, so padding travels with the batch: a
process whose data ran out before the group's feeds a batch of weight 0 that no caller can count.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

# The label of a streamed sample that could not be decoded (its image is zeros): cross-entropy's ignore_index, so
# the loss leaves it out, and evaluations never count it. The batch keeps its shape and the epoch its order.
IGNORED = -100


@dataclass(frozen=True)
class Batch:
    """One step's inputs and labels on the training device, this process's part of the group's batch."""

    x: torch.Tensor
    y: torch.Tensor
    weight: float  # this process's mean loss is multiplied by it so that DDP's mean over processes is the batch's
    samples: int  # samples of the step over the whole group
    own: int  # this process's samples that count (0: padding, fed only to keep the group in step)
    names: tuple[str, ...] = ()  # the own samples' files (or shard:key) in an unshuffled pass; () where not named


class Loader(Protocol):
    """Batches of one split for one process of a group (rank of world)."""

    batch_size: int  # the group's batch
    n: int  # samples in the split, over the whole group
    device: torch.device  # where its batches are

    def __len__(self) -> int:
        """Steps in an epoch: the same in every process of a group."""

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator[Batch]:
        """The epoch's batches from step `start` on (start > 0: after resume_at, or from a loader whose place is
        a function of the step alone)."""

    def samples(self, i: int) -> int:
        """Samples of step i over the whole group (what gradient accumulation weighs a step by)."""

    def position(self) -> dict:
        """This process's place after the last batch given, as plain values a checkpoint keeps."""

    def resume_at(self, epoch: int, step: int, places: list[dict]) -> None:
        """Continue at step `step` of `epoch` from the places every process of the group saved there (by rank);
        CheckpointError when they cannot serve this group."""


def move(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor to the device without making the host wait: through page-locked memory to a GPU (the copy
    then overlaps the step before it); a tensor already there, or a CPU run, costs nothing."""
    if x.device == device or device.type == "cpu":
        return x
    if x.is_cuda:  # made on another stream (the device decoder's): its memory is now in use on this one too
        x.record_stream(torch.cuda.current_stream(x.device))
        return x.to(device, non_blocking=True)
    if device.type == "cuda" and not x.is_pinned():
        x = x.pin_memory()
    return x.to(device, non_blocking=True)
