"""Items a format lists before it reads them (the rows of a table of images): their keys, labels and splits known
first, then their bytes; those whose bytes are not there or cannot be decoded are dropped from the splits and
named. A format's `items` (job/data/formats.py) hands packing one of these. Columns: which of a table's columns
name them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from job.data.split import Files

SHOWN = 3  # bad files named on the console (a run's data.json lists every one)


def report_skipped(skipped: list[dict[str, str]], log) -> None:
    """The first few items skipped named, and how many in all."""
    for s in skipped[:SHOWN]:
        log(f"data: skipped {s['path']}: {s['reason']}")
    if len(skipped) > SHOWN:
        log(f"data: skipped {len(skipped)} files that cannot be decoded in all")


@dataclass(frozen=True)
class Columns:
    """Which columns of a table of images hold an image's path, its label and (when there is one) its split, and how its
    labels are read (data.label_separator, data.task): the whole of what a pack of it depends on besides the split,
    so a pack's key and index.json hold it."""

    path: str = "path"
    label: str = "label"
    split: str = "split"
    separator: str | None = None
    task: str = "auto"

    @classmethod
    def of(cls, cfg) -> Columns:
        return cls(cfg.path_column, cfg.label_column, cfg.split_column, cfg.label_separator, cfg.task)


class Images(Protocol):
    """(key, bytes) of each item, iterated; after the pass, `missing()` names the items that were not there."""

    def __iter__(self) -> Iterator[tuple[str, bytes]]: ...

    def missing(self) -> list[dict[str, str]]: ...


class Listed:
    """Items whose keys, labels and splits (`files`) and classes are known before their bytes (`images`) are read."""

    def __init__(self, images: Images, files: Files, classes: list[str]) -> None:
        self.images, self.files, self.classes = images, files, classes

    def __iter__(self) -> Iterator[tuple[str, bytes]]:
        return iter(self.images)

    def sorted(self, kept: list[str]) -> tuple[Files, list[str], list[dict[str, str]]]:
        there = set(kept)
        files = self.files
        files.roles = {role: [(p, c) for p, c in items if p in there] for role, items in files.roles.items()}
        files.held_out = {role: [p for p in names if p in there] for role, names in files.held_out.items()}
        return files, self.classes, self.images.missing()
