"""A data set held in memory: its splits as tensors, its classes, where it came from and why it is held; and its
streamed counterpart, shards read as the run trains (StreamData)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from job.data.placement import HELD, Streaming
from job.data.split import Inventory

if TYPE_CHECKING:
    from job.data.shard_sets import ShardSet


@dataclass
class Split:
    """One split: x is uint8 N x C x H x W for images or float32 N x F for tables; y is int64 N (class indexes), or
    float32 N x classes of 0 and 1 (multi-label)."""

    x: torch.Tensor
    y: torch.Tensor
    names: list[str] | None = None  # each sample's file, where it has one (a report names the worst)

    def __len__(self) -> int:
        return len(self.y)


@dataclass
class Dataset:
    """The splits in memory: train is learned from, val is what the run chooses on, test is only reported (val or
    test may be absent, not both)."""

    train: Split
    test: Split | None
    classes: list[str]
    source: str
    streaming: Streaming = HELD  # held in memory, and why (a StreamData is read as the run trains)
    val: Split | None = None
    inventory: Inventory | None = None  # the run's data.json: counts, held-out files, skipped files
    features: dict | None = None  # a table's feature columns, in order, and its scaler (model.json records them)
    streamed = False

    def split(self, name: str) -> Split | None:
        return {"train": self.train, "val": self.val, "test": self.test}[name]

    def samples(self, split: str) -> int:
        held = self.split(split)
        return len(held) if held is not None else 0

    @property
    def evaluated_on(self) -> str:
        """The split each evaluation reports and the run chooses on: val, or test when there is no val."""
        return "val" if self.val is not None else "test"

    @property
    def multilabel(self) -> bool:
        """Any number of classes an image (multi-hot targets), not one."""
        return self.train.y.dim() == 2

    @property
    def is_image(self) -> bool:
        return self.train.x.dtype == torch.uint8

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train.x.shape[1:])

    def describe(self) -> str:
        shape = "x".join(str(s) for s in self.input_shape)
        held = " / ".join(f"{self.samples(s)} {s}" for s in ("train", "val", "test") if self.split(s) is not None)
        task = "multilabel: any number of the " if self.multilabel else ""
        return f"{self.source}: {held}, {task}{len(self.classes)} classes, inputs {shape}"


@dataclass
class StreamData:
    """A shard data set read as the run trains: what the recipe needs to know before reading it."""

    shards: ShardSet
    classes: list[str]
    input_shape: tuple[int, ...]
    source: str
    streaming: Streaming
    is_image: bool = True
    multilabel: bool = False  # any number of classes a sample, as multi-hot targets
    streamed = True
    features = None  # images

    @property
    def inventory(self) -> Inventory | None:
        """The split as `job shard` recorded it in the index, or as held out of train/ by key (open_shards); none
        for shards from other tools that hold their own val/ and test/."""
        saved = self.shards.inventory
        return Inventory.from_json(saved) if saved is not None else None

    def samples(self, split: str) -> int:
        return self.shards.samples(split)

    def describe(self) -> str:
        shape = "x".join(str(s) for s in self.input_shape)
        held = " / ".join(f"{self.samples(s)} {s}" for s in ("train", "val", "test") if self.samples(s))
        task = "multilabel: any number of the " if self.multilabel else ""
        return f"{self.source}: {held}, {task}{len(self.classes)} classes, inputs {shape}"
