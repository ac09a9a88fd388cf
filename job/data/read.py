"""Which format reads a config's data (job/data/formats.py), and whether it is streamed: the one entry to job/data/
for a run. Each format is imported when used (a table needs no image decoder)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from job.data.dataset import Dataset
from job.data.files import Source, source
from job.data.formats import DEFAULT, Format, every, format_named, table_found
from job.data.items import Columns
from job.data.placement import HELD, Streaming, decide_streaming, stored_from
from job.data.split import HoldOut
from job.errors import ConfigError, DataError


def load_data(cfg, cache: Path, log: Callable[[str], None], started: Streaming | None = None) -> Dataset:
    """Read the data set the config names into memory, or open its shards to stream, through its format
    (job/data/formats.py). `cfg` is the config's data section; remote data are kept in the folder `cache` (unless
    cfg.cache is off); `log` prints one line for the user; `started`: whether the run being resumed streamed
    (job/data/placement.py keeps it)."""
    kept = cache if cfg.cache else None
    fmt = format_named(cfg.kind)
    if cfg.placement == "stream" and fmt.items is None and not fmt.streams:
        streamed = ", ".join(f.name for f in every() if f.items is not None or f.streams)
        raise ConfigError(
            f"data.placement=stream: streams the data kinds {streamed}; {cfg.kind} data are read into memory "
            "(data.placement auto)"
        )
    choice, given, src = HELD, cfg, None
    if fmt.items is not None:
        src = source(cfg.path)  # resolved once: the placement estimate, the packer and the reader take it
        choice = streaming(fmt, cfg, src, log, started)
        if choice.streamed:
            from job.data.pack import packed_for_streaming

            hold, columns = HoldOut.of(cfg), Columns.of(cfg)
            # A run that started streaming before packs said how they hold their images: the pack of that version.
            pixels = started is None or not started.streamed or started.stored is not None
            packed = packed_for_streaming(src, cache, log, hold, columns, cfg.skip_bad_samples, fmt, pixels)
            fmt = stream_format()
            cfg = cfg.model_copy(update={"kind": fmt.name, "path": packed, "placement": "stream"})
    data = fmt.load(cfg, kept, log, src=src, started=None if choice.streamed else started)
    if fmt.streams:
        choice = choice if choice.streamed else data.streaming  # packed to stream: why it streams
        if given.kind != cfg.kind:  # packed to stream: named as the user named it, with how its pack holds images
            data.source = f"{given.kind} {given.path} (packed in {cfg.path})"
            choice = replace(choice, stored=stored_from(data.shards.stored)) if data.streamed else choice
        if data.streamed:
            data.streaming = choice
            check_task(given, data)
            return data  # nothing read yet (open_shards has checked both splits have shards)
    for name in ("train", "val", "test"):
        if data.split(name) is not None and data.samples(name) == 0:
            raise DataError(f"{data.source}: the {name} split is empty")
    data.streaming = choice
    check_task(given, data)
    return data


def stream_format() -> Format:
    """The format a pack made to stream is read with."""
    return next(f for f in every() if f.streams)


def found_kind(cfg) -> str:
    """data.kind as the run reads it: the default (the default preset's) whose data.path is not a .csv or .tsv file
    reads with another format of tables that holds it (a CSV reader cannot read it); any other kind is the
    user's."""
    if cfg.kind != DEFAULT or not cfg.path or cfg.path.lower().endswith((".csv", ".tsv")):
        return cfg.kind
    return table_found(cfg.path).name


def check_task(cfg, data) -> None:
    """data.task, when set, is what the labels are: lists (multilabel) or one class a sample (multiclass)."""
    if cfg.task == "multilabel" and not data.multilabel:
        raise ConfigError(
            f"data.task=multilabel: {data.source} gives one class a sample; multi-label labels are lists (a JSON list "
            "in data.label_column, data.label_separator, 0/1 columns, or a Sequence(ClassLabel) column)"
        )
    if cfg.task == "multiclass" and data.multilabel:
        raise ConfigError(f"data.task=multiclass: {data.source} gives lists of labels: set data.task=multilabel")


def streaming(fmt: Format, cfg, src: Source, log: Callable[[str], None], started: Streaming | None) -> Streaming:
    """Whether a format's items are packed into shards and streamed (job/data/placement.py decides; auto: when
    decoded they would not fit). A format that cannot weigh its items decoded is held under auto, unless the run
    resumed started streaming (a table of images by path: its reader fetches them whole)."""
    if fmt.decoded_size is None:
        if cfg.placement == "auto" and (started is None or not started.streamed):
            return HELD
        return decide_streaming(cfg.placement, lambda: 0, cfg.device_share, started, log, cfg.path)

    def decoded() -> int:
        return fmt.decoded_size(src, cfg.resize_size or cfg.image_size)

    return decide_streaming(cfg.placement, decoded, cfg.device_share, started, log, cfg.path)
