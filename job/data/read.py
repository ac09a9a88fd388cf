"""Which reader reads a config's data, and whether it is streamed: the one entry to job/data/ for a run. Each reader
is imported when used (a table needs no image decoder)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from job.data.dataset import Dataset
from job.data.files import Source, source
from job.data.placement import HELD, Streaming, decide_streaming, decoded_size, stored_from
from job.errors import ConfigError, DataError


def load_data(cfg, cache: Path, log: Callable[[str], None], started: Streaming | None = None) -> Dataset:
    """Read the data set the config names into memory, or open its shards to stream. `cfg` is the config's data
    section; remote data are kept in the folder `cache` (unless cfg.cache is off); `log` prints one line for the
    user; `started`: whether the run being resumed streamed (job/data/placement.py keeps it)."""
    kept = cache if cfg.cache else None
    if cfg.placement == "stream" and cfg.kind in ("csv", "cifar10"):
        raise ConfigError(
            f"data.placement=stream: streams image folders, archives of one, manifests, parquet and shards; {cfg.kind} "
            "data "
            "are read into memory (data.placement auto)"
        )
    choice, given, src = HELD, cfg, None
    if cfg.kind in ("folder", "manifest", "parquet"):
        src = source(cfg.path)  # resolved once: the placement estimate, the packer and the reader take it
        if cfg.kind == "folder":
            choice = folder_streaming(cfg, src, log, started)
        elif cfg.kind == "parquet":
            choice = parquet_streaming(cfg, src, log, started)
        else:
            choice = manifest_streaming(cfg, log, started)
        if choice.streamed:
            from job.data.manifest import Columns
            from job.data.pack import packed_for_streaming
            from job.data.split import HoldOut

            hold, columns = HoldOut.of(cfg), Columns.of(cfg)
            parquet = cfg.kind == "parquet"
            # A run that started streaming before packs said how they hold their images: the pack of that version.
            pixels = started is None or not started.streamed or started.stored is not None
            packed = packed_for_streaming(src, cache, log, hold, columns, cfg.skip_bad_samples, parquet, pixels)
            cfg = cfg.model_copy(update={"kind": "shards", "path": packed})
            cfg = cfg.model_copy(update={"placement": "stream"})
    if cfg.kind == "csv":  # each reader imported when used: a table needs no image decoder
        from job.data.tabular import load_table

        data = load_table(cfg, kept, log)
    elif cfg.kind == "manifest":
        from job.data.manifest import load_manifest

        data = load_manifest(cfg, kept, log, src=src)
    elif cfg.kind == "parquet":
        from job.data.parquet import load_parquet

        data = load_parquet(cfg, kept, log, src=src)
    elif cfg.kind == "cifar10":
        from job.data.cifar10 import load_cifar10

        data = load_cifar10(cfg, kept, log)
    elif cfg.kind == "shards":
        from job.data.stream import load_shards

        data = load_shards(cfg, kept, log, None if choice.streamed else started)
        choice = choice if choice.streamed else data.streaming  # a folder packed to stream: why it streams
        if given.kind != "shards":  # packed to stream: named as the user named it, with how its pack holds images
            data.source = f"{given.kind} {given.path} (packed in {cfg.path})"
            choice = replace(choice, stored=stored_from(data.shards.stored)) if data.streamed else choice
        if data.streamed:
            data.streaming = choice
            check_task(given, data)
            return data  # nothing read yet (open_shards has checked both splits have shards)
    else:
        from job.data.folder import load_folder

        data = load_folder(cfg, kept, log, src)
    for name in ("train", "val", "test"):
        if data.split(name) is not None and data.samples(name) == 0:
            raise DataError(f"{data.source}: the {name} split is empty")
    data.streaming = choice
    check_task(given, data)
    return data


def found_kind(cfg) -> str:
    """data.kind as the run reads it: csv (the default, and the default preset's) whose data.path is a .parquet file,
    a folder of them holding no images, or the hub's data/<split>-*.parquet layout reads as parquet (a CSV reader
    cannot read them, and parquet reads a table of feature columns as csv does); any other kind is the user's."""
    if cfg.kind != "csv" or not cfg.path or cfg.path.lower().endswith((".csv", ".tsv")):
        return cfg.kind
    from job.data.parquet import is_parquet

    return "parquet" if is_parquet(cfg.path) else cfg.kind


def check_task(cfg, data) -> None:
    """data.task, when set, is what the labels are: lists (multilabel) or one class a sample (multiclass)."""
    if cfg.task == "multilabel" and not data.multilabel:
        raise ConfigError(
            f"data.task=multilabel: {data.source} gives one class a sample; multi-label labels are lists (a JSON list "
            "in data.label_column, data.label_separator, 0/1 columns, or parquet's Sequence(ClassLabel))"
        )
    if cfg.task == "multiclass" and data.multilabel:
        raise ConfigError(f"data.task=multiclass: {data.source} gives lists of labels: set data.task=multilabel")


def folder_streaming(cfg, src: Source, log: Callable[[str], None], started: Streaming | None) -> Streaming:
    """Whether an image folder is packed into shards and streamed (job/data/placement.py decides; auto says so)."""

    def decoded() -> int:
        return decoded_size(src, cfg.resize_size or cfg.image_size)

    return decide_streaming(cfg.placement, decoded, cfg.device_share, started, log, cfg.path)


def manifest_streaming(cfg, log: Callable[[str], None], started: Streaming | None) -> Streaming:
    """Whether a manifest's images are packed into shards and streamed: when data.placement says stream, or a run
    resumed under auto started so. Auto otherwise holds them (the manifest reader fetches them whole)."""
    if cfg.placement == "auto" and (started is None or not started.streamed):
        return HELD
    return decide_streaming(cfg.placement, lambda: 0, cfg.device_share, started, log, cfg.path)


def parquet_streaming(cfg, src: Source, log: Callable[[str], None], started: Streaming | None) -> Streaming:
    """Whether parquet rows' images are packed into shards and streamed, as an image folder's are (auto: when decoded
    they would not fit; the rows counted from the files' footers). A table of features is always held."""
    from job.data.parquet import decoded_size as parquet_decoded

    def decoded() -> int:
        return parquet_decoded(src, cfg.resize_size or cfg.image_size)

    return decide_streaming(cfg.placement, decoded, cfg.device_share, started, log, cfg.path)
