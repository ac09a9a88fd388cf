"""A data set held in memory: its splits as tensors, its classes, where it came from and why it is held."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from job.data.placement import HELD, Streaming


@dataclass
class Split:
    """One split: x is uint8 N x C x H x W for images or float32 N x F for tables; y is int64 N."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return len(self.y)


@dataclass
class Dataset:
    train: Split
    test: Split
    classes: list[str]
    source: str
    streaming: Streaming = HELD  # held in memory, and why (a StreamData is read as the run trains)
    streamed = False

    def samples(self, split: str) -> int:
        return len(self.train if split == "train" else self.test)

    @property
    def is_image(self) -> bool:
        return self.train.x.dtype == torch.uint8

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train.x.shape[1:])

    def describe(self) -> str:
        shape = "x".join(str(s) for s in self.input_shape)
        return (
            f"{self.source}: {len(self.train)} train / {len(self.test)} test, "
            f"{len(self.classes)} classes, inputs {shape}"
        )
