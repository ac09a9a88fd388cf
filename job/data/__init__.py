"""Data sets: readers for CSV tables, CIFAR-10, image folders and shards, all through fsspec; held in memory as
tensors (Dataset) or, larger than memory, streamed from shards (job/data/stream.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from job.data.placement import HELD, Streaming, decide_streaming
from job.errors import ConfigError, DataError


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


def load_data(cfg, cache: Path, log: Callable[[str], None], started: Streaming | None = None) -> Dataset:
    """Read the data set the config names into memory, or open its shards to stream. `cfg` is the config's data
    section; remote data are kept in the folder `cache` (unless cfg.cache is off); `log` prints one line for the
    user; `started`: whether the run being resumed streamed (job/data/placement.py keeps it)."""
    kept = cache if cfg.cache else None
    if cfg.placement == "stream" and cfg.kind in ("csv", "cifar10"):
        raise ConfigError(
            f"data.placement=stream: streams image folders, archives of one and shards; {cfg.kind} data are read "
            "into memory (data.placement auto)"
        )
    choice = HELD
    if cfg.kind == "folder":
        choice = folder_streaming(cfg, log, started)
        if choice.streamed:
            from job.data.pack import packed_for_streaming

            cfg = cfg.model_copy(update={"kind": "shards", "path": packed_for_streaming(cfg.path, cache, log)})
            cfg = cfg.model_copy(update={"placement": "stream"})
    if cfg.kind == "csv":  # each reader imported when used: a table needs no image decoder
        from job.data.tabular import load_table

        data = load_table(cfg, kept, log)
    elif cfg.kind == "cifar10":
        from job.data.cifar10 import load_cifar10

        data = load_cifar10(cfg, kept, log)
    elif cfg.kind == "shards":
        from job.data.stream import load_shards

        data = load_shards(cfg, kept, log, None if choice.streamed else started)
        choice = choice if choice.streamed else data.streaming  # a folder packed to stream: why it streams
        if data.streamed:
            data.streaming = choice
            return data  # nothing read yet (open_shards has checked both splits have shards)
    else:
        from job.data.folder import load_folder

        data = load_folder(cfg, kept, log)
    for name, split in (("train", data.train), ("test", data.test)):
        if len(split) == 0:
            raise DataError(f"{data.source}: the {name} split is empty")
    data.streaming = choice
    return data


def folder_streaming(cfg, log: Callable[[str], None], started: Streaming | None) -> Streaming:
    """Whether an image folder is packed into shards and streamed (job/data/placement.py decides; auto says so)."""

    def decoded() -> int:
        from job.data.pack import decoded_size

        return decoded_size(cfg.path, cfg.resize_size or cfg.image_size)

    choice = decide_streaming(cfg.placement, decoded, cfg.device_share, started, log)
    if cfg.placement == "auto" and choice.streamed:
        log(f"data: {cfg.path}: {choice.reason}: streaming it")
    return choice
