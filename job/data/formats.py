"""The formats a data set comes in, and the one protocol each implements: a format is one module that ends with
`FORMAT = Format(...)`, named here (KNOWN) or added with `register`. Train (job/data/read.py), `job shard`
(job/data/pack.py), predict (job/use/inputs.py), `evaluate --data` (job/use/evaluate.py) and export's check
(job/use/export.py) ask this registry for a format and call what it implements; none of them names one.

What a format implements, each optional but `load`:
- load: the run's data set (in memory, or opened to stream),
- holds: whether a URL given to a command (evaluate --data, predict, job shard) holds this format's data,
- items: its items listed with their keys, labels and splits, then their bytes (what packing into shards reads),
  with `listed` (what a pack of it is keyed by) and `decoded_size` (what placement auto weighs),
- scored: labelled images a trained model is scored on (`evaluate --data`),
- rows / names: predict's inputs (each item's bytes a chunk at a time; or the images a file names),
- table: a table's header and rows (predict with a table's model; a format with one may stand in for the default),
- held_out: the run's held-out images, for export's check.

This module imports no format: each is imported when it is asked for (a table needs no image decoder).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

# The formats that ship, by data.kind, each in its module (imported when asked for).
KNOWN = {
    "csv": "job.data.tabular",
    "cifar10": "job.data.cifar10",
    "folder": "job.data.folder",
    "manifest": "job.data.manifest",
    "parquet": "job.data.parquet",
    "shards": "job.data.stream",
}
DEFAULT = "csv"  # data.kind when the config names none: a table (the bundled Iris when data.path is empty too)
UNCLAIMED = "folder"  # what a URL no format holds is read as: image folders, or an archive of one
REGISTERED: dict[str, Format] = {}  # formats added by `register`, by name


class Items(Protocol):
    """A data set's items as packing reads them: iterated, each (key, bytes), a chunk at a time; then sorted()
    gives each kept item's label and split (`kept`: the keys whose bytes decoded), the classes in order, and the
    items that were not there (each {"path": key, "reason": why})."""

    def __iter__(self) -> Iterator[tuple[str, bytes]]: ...

    def sorted(self, kept: list[str]) -> tuple[Any, list[str], list[dict[str, str]]]: ...


@dataclass(frozen=True)
class Format:
    """One data format: its name (data.kind) and what it implements (the module's docstring lists each)."""

    name: str
    load: Callable[..., Any]  # (cfg, cache, log, src, started) -> Dataset (or StreamData)
    about: str = ""  # one line, for help texts: what it reads
    holds: Callable[[str], bool] | None = None
    items: Callable[..., Items] | None = None  # (src, hold, columns, log) -> Items
    listed: Callable[..., dict[str, dict]] | None = None  # (src, columns) -> path -> info
    decoded_size: Callable[..., int] | None = None  # (src, held size) -> bytes; None: auto holds it in memory
    columns: bool = False  # what it reads depends on data.path_column and the like (a pack records them)
    streams: bool = False  # its data are shards the stream reader reads as they are
    scored: Callable[..., Any] | None = None  # (cfg, log, classes, pre) -> Dataset
    suffixes: tuple[str, ...] = ()  # names of files whose items predict reads with `rows`
    rows: Callable[[str, int], Iterator[list[tuple[str, bytes, str]]]] | None = None
    names: Callable[[str], list[tuple[str, str]]] | None = None  # url -> (path as written, its URL) of its images
    table: Callable[[str], tuple[list[str], list[list[str]]]] | None = None
    held_out: Callable[[Any, int], list[str]] | None = None  # (cfg, limit) -> the URLs of held-out images


def register(fmt: Format) -> Format:
    """Add a format (or replace one of the same name): data.kind NAME reads with it from now on."""
    REGISTERED[fmt.name] = fmt
    return fmt


def names() -> list[str]:
    """Every data.kind a config may name."""
    return [*KNOWN, *(n for n in REGISTERED if n not in KNOWN)]


def format_named(name: str) -> Format:
    """The format data.kind NAME reads with."""
    if name in REGISTERED:
        return REGISTERED[name]
    if name not in KNOWN:
        raise KeyError(name)
    return importlib.import_module(KNOWN[name]).FORMAT


def every() -> Iterable[Format]:
    return (format_named(n) for n in names())


def found(url: str) -> Format:
    """The format of data a command is given by URL (evaluate --data, job shard): the first that holds it, else the
    one that reads what none claims."""
    return next((f for f in every() if f.holds is not None and f.holds(url)), format_named(UNCLAIMED))


def table_found(url: str) -> Format:
    """The format of a table given by URL: one that reads tables and holds it, else the default's."""
    return next((f for f in every() if f.table is not None and f.holds is not None and f.holds(url)),
                format_named(DEFAULT))  # fmt: skip


def read_by_rows(name: str) -> Format | None:
    """The format whose files predict reads item by item (named by suffix), or None."""
    low = name.lower()
    return next((f for f in every() if f.rows is not None and f.suffixes and low.endswith(f.suffixes)), None)
