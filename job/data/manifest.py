"""data.kind manifest: a CSV or JSONL file of image paths and labels (Kaggle's train.csv, a labelling tool's export),
its images read like a folder's (job/data/folder.py: one decoding, bad files skipped and named).

Columns: data.path_column (paths relative to the manifest's folder, or URLs), data.label_column (class names, or
class indexes when every label is an integer: the classes are then ordered by number), and data.split_column when
the file has it (train, val or valid, test; an empty cell is train). Multi-label (data.task): the label column holds
a JSON list of class names (or text split at data.label_separator), or the CSV has, instead of a label column, one
0/1 column a class; an empty list is an image with none of them. Rows with no split of their own are held out
for val and test by a hash of their path as written (job/data/split.py), as a folder's files are.

Images under the manifest's folder are read through the folder reader's fetch and cache (one listing, concurrent
requests, a local copy of remote data); others, by URL, many at once from each store (no cache). `job shard` and
data.placement=stream pack the same images, classes and splits into shards (job/data/pack.py), reading them one
at a time (Images).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from job.data.dataset import Dataset
from job.data.files import FETCH_CHUNK, Log, Source, beside, fetch_named, read_bytes, read_entries, source
from job.data.folder import check_files, held
from job.data.formats import Format
from job.data.items import Columns, Listed
from job.data.preprocess import Preprocess
from job.data.split import SPLIT_FOLDERS, Files, HoldOut, across_classes, label_names
from job.errors import ConfigError, DataError, StorageError
from job.storage.cloud import describe_storage_error

SUFFIXES = (".csv", ".jsonl", ".ndjson")
COLUMNS_HINT = (
    "set data.path_column, data.label_column and data.split_column (job shard: --path-column, --label-column, "
    "--split-column)"
)


def load_manifest(
    cfg,
    cache: Path | None,
    log: Log,
    classes: list[str] | None = None,
    pre: Preprocess | None = None,
    src: Source | None = None,
) -> Dataset:
    """The manifest's images in memory, split; `classes`: a trained model's (its images are scored, not trained on:
    every row is read, with no split required); `src`: cfg.path resolved, where the caller has."""
    url = cfg.path
    raw = read_bytes(src or source(url, exists=False), cache, log)
    files, labels = manifest_files(url, raw, Columns.of(cfg), HoldOut.of(cfg))
    scoring = classes is not None
    if classes is None:
        classes = class_order(labels, {c for _, label in files.roles["train"] for c in label_names(label)})
        check_files(files, classes, url)
    elif unknown := sorted(set(labels) - set(classes)):
        raise DataError(f"{url}: labels the model does not know: {', '.join(unknown[:5])}")
    content, skipped = fetched(url, [p for r in files.roles.values() for p, _ in r], cache, log)
    if skipped and not cfg.skip_bad_samples:
        raise DataError(f"{url}: {skipped[0]['path']}: {skipped[0]['reason']} (data.skip_bad_samples is false)")
    for role in files.roles:  # a file that is not there is skipped and named, like one that cannot be decoded
        files.roles[role] = [(p, c) for p, c in files.roles[role] if p in content]
    return held(files, content.__getitem__, classes, cfg, url, f"manifest {url}", log, skipped, scoring, pre)


def manifest_files(url: str, raw: bytes, columns: Columns, hold: HoldOut) -> tuple[Files, list[str]]:
    """The manifest's rows as (path, label) per split, rows with no split of their own held out by a hash of their
    path as written; and every row's label (each of them, for multi-label rows). Multi-label (files.multilabel) when
    columns.task says so or the labels are lists (a JSON list, cells split at columns.separator, or 0/1 columns): a
    row's label is then the tuple of its class names, sorted, () for an image with none."""
    task, separator = columns.task, columns.separator
    rows = read_rows(url, raw)
    flags = flag_columns(rows, columns) if rows and columns.label not in rows[0] and task != "multiclass" else []
    check_columns(url, rows, columns if not flags else replace(columns, label=columns.path))
    if flags:
        values = [tuple(c for c in flags if cell(row, c) == "1") for row in rows]
    else:
        values = [label_value(row.get(columns.label), separator) for row in rows]
    listed = bool(flags) or separator is not None or any(isinstance(v, tuple) for v in values)
    multilabel = task == "multilabel" or listed
    if multilabel and task == "multiclass":
        n = next(n for n, v in enumerate(values, start=1) if isinstance(v, tuple))
        raise ConfigError(f"{url} row {n}: a list of labels, and data.task is multiclass: set data.task=multilabel")
    files, labels = Files(multilabel=multilabel), []
    role_of = hold.roles()
    for n, (row, value) in enumerate(zip(rows, values), start=1):
        path = cell(row, columns.path).removeprefix("./")
        label = value if not multilabel or isinstance(value, tuple) else ((value,) if value else ())
        if not path or (not multilabel and not label):
            raise DataError(f"{url} row {n}: no {columns.path if not path else columns.label}")
        written = cell(row, columns.split).lower()
        role = SPLIT_FOLDERS.get(written) if written else "train"
        if role is None:
            raise DataError(f"{url} row {n}: split '{written}': expected train, val or test")
        if not written:
            role = role_of(path)
            if role != "train":
                files.held_out[role].append(path)
        files.roles[role].append((path, label))
        labels.extend(label_names(label))
    return files, labels


def label_value(value, separator: str | None) -> str | tuple[str, ...]:
    """A manifest cell's label: its class names as a sorted tuple when it holds a list (a JSON list, in a JSONL
    value or a CSV cell, or text split at `separator`), else its text."""
    if isinstance(value, list):
        return tuple(sorted({str(v).strip() for v in value} - {""}))
    text = "" if value is None else str(value).strip()
    if separator is not None:
        return tuple(sorted({part.strip() for part in text.split(separator)} - {""}))
    if text.startswith("["):
        try:
            listed = json.loads(text)
        except ValueError:
            return text
        if isinstance(listed, list):
            return label_value(listed, None)
    return text


def flag_columns(rows: list[dict], columns: Columns) -> list[str]:
    """The columns of 0/1 cells (one a class: 1 when the image shows it), when there are two or more of them and no
    other columns besides the path and split."""
    others = [c for c in rows[0] if c not in (columns.path, columns.split)]
    if len(others) < 2 or not all(cell(row, c) in ("0", "1") for row in rows for c in others):
        return []
    return others


def check_columns(url: str, rows: list[dict], columns: Columns) -> None:
    """Rows to read, with the columns named (the split column may be absent, unless given another name than the
    default's)."""
    if not rows:
        raise DataError(f"{url}: no rows")
    named = (columns.path, columns.label) + ((columns.split,) if columns.split != Columns().split else ())
    for column in named:
        if column not in rows[0]:
            raise DataError(f"{url}: no column '{column}' (columns: {', '.join(rows[0])}); {COLUMNS_HINT}")


def cell(row: dict, column: str) -> str:
    """A row's value as text ('' when absent; a JSON 0 is "0", not absent)."""
    value = row.get(column)
    return "" if value is None else str(value).strip()


def read_rows(url: str, raw: bytes) -> list[dict]:
    """The rows of a CSV (with a header) or JSONL (one object a line) file, by its suffix."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise DataError(f"{url}: not a text file (not UTF-8)") from None
    if url.lower().endswith((".jsonl", ".ndjson")):
        rows = []
        for n, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(dict(json.loads(line)))
                except (ValueError, TypeError):
                    raise DataError(f"{url} line {n}: not a JSON object") from None
        return rows
    try:
        return [r for r in csv.DictReader(io.StringIO(text)) if any((v or "").strip() for v in r.values())]
    except csv.Error as e:
        raise DataError(f"{url}: not a CSV table: {e}") from None


def class_order(labels: list[str], trained: set[str]) -> list[str]:
    """The classes with training images: by number when every label is an integer (indexes), else by name."""
    if all(label.lstrip("-").isdigit() for label in labels):
        return sorted(trained, key=int)
    return sorted(trained)


def fetched(url: str, paths: list[str], cache: Path | None, log: Log) -> tuple[dict[str, bytes], list[dict]]:
    """Each path's bytes (paths relative to the manifest's folder, or URLs); those not found, as skipped files."""
    images = Images(url, paths, cache, log)
    content = dict(images)
    return content, images.missing()


class Images:
    """(path, bytes) of the images a manifest names, handed out one at a time. Each path is resolved beside the
    manifest (files.beside: `../` included, never against the working directory); those under the manifest's
    folder are read through the folder reader (one listing, concurrent requests, the cache), others by URL, each
    store's many at once (files.fetch_named). After the pass, `missing()` names the paths that are not there; none
    there at all is an error."""

    def __init__(self, url: str, paths: list[str], cache: Path | None, log: Log) -> None:
        self.url, self.paths, self.cache, self.log = url, set(paths), cache, log
        self.where: dict[str, str] = {}
        self.unplaced: dict[str, str] = {}  # a path that names no place (climbs above its bucket): why
        for p in self.paths:
            try:
                self.where[p] = beside(url, p)
            except DataError as e:
                self.unplaced[p] = str(e)
        self.paths -= self.unplaced.keys()
        self.base = beside(url, ".")
        self.found: set[str] = set()

    def __iter__(self) -> Iterator[tuple[str, bytes]]:
        inside: dict[str, list[str]] = {}  # a name under the manifest's folder -> the paths written for it
        outside = []
        for p in sorted(self.paths):
            name = self.under_base(self.where[p])
            if name is None:
                outside.append(p)
            else:
                inside.setdefault(name, []).append(p)
        if inside:
            for name, data in read_entries(source(self.base), inside.__contains__, self.cache, self.log):
                for p in inside[name]:
                    self.found.add(p)
                    yield p, data
        for start in range(0, len(outside), FETCH_CHUNK):
            yield from self.by_url(outside[start : start + FETCH_CHUNK])
        if self.paths and not self.found:
            n, first = len(self.paths), min(self.paths)
            raise DataError(
                f"{self.url}: none of its {n} image paths exists (e.g. {self.where[first]}, written {first})"
            )

    def under_base(self, where: str) -> str | None:
        """A resolved path's name under the manifest's folder, or None when it lies elsewhere."""
        if self.base == ".":
            return None if where.startswith(("../", "/")) or "://" in where else where
        prefix = self.base.rstrip("/") + "/"
        return where[len(prefix) :] if where.startswith(prefix) else None

    def by_url(self, paths: list[str]) -> Iterator[tuple[str, bytes]]:
        """Images outside the manifest's folder, each store's fetched concurrently in one call; one that is not
        there is left for missing()."""
        for p, data in zip(paths, fetch_named([self.where[p] for p in paths])):
            if isinstance(data, FileNotFoundError):
                continue
            if isinstance(data, Exception):
                url = self.where[p]
                raise StorageError(f"cannot read {url}: {describe_storage_error(url, data)}")
            self.found.add(p)
            yield p, data

    def missing(self) -> list[dict[str, str]]:
        gone = [{"path": p, "reason": "no such file"} for p in self.paths - self.found]
        return sorted(gone + [{"path": p, "reason": why} for p, why in self.unplaced.items()], key=lambda s: s["path"])


def is_manifest(path: str) -> bool:
    """A table of image paths and labels, by its suffix."""
    return path.lower().endswith(SUFFIXES)


def load(cfg, cache: Path | None, log: Log, src: Source | None = None, started=None) -> Dataset:
    return load_manifest(cfg, cache, log, src=src)


def scored(cfg, log: Log, classes: list[str], pre: Preprocess) -> Dataset:
    return load_manifest(cfg, None, log, classes, pre)


def items(src: Source, hold: HoldOut, columns: Columns, log: Log) -> Listed:
    """The rows' images, in the classes and splits the rows give, named and checked before any image is read; an
    image a row names that is not there is skipped and named, as one that cannot be decoded is."""
    url = src.url
    files, labels = manifest_files(url, read_bytes(src, None, log), columns, hold)  # columns: labels' separator, task
    classes = class_order(labels, {c for _, label in files.roles["train"] for c in label_names(label)})
    check_files(files, classes, url)
    return Listed(Images(url, [p for role in files.roles.values() for p, _ in role], None, log), files, classes)


def listed(src: Source, columns: Columns) -> dict[str, dict]:
    """The manifest and the images under its folder that its rows name (one listing): path -> info. Images it names
    by URL elsewhere are not watched: a change to one is not seen."""
    fs, path, url = src.fs, src.path, src.url
    folder = path.rsplit("/", 1)[0]
    try:  # read as the pack reads it: a misspelt column or a bad label named before any pack of SRC is touched
        files, _ = manifest_files(url, fs.cat_file(path), columns, HoldOut())
        paths = {fs._strip_protocol(beside(url, p)) for role in files.roles.values() for p, _ in role}
        return {path: fs.info(path)} | {p: i for p, i in fs.find(folder, detail=True).items() if p in paths}
    except (DataError, ConfigError):
        raise
    except Exception as e:  # the stores' clients raise many types
        raise StorageError(f"cannot list the data: {describe_storage_error(url, e)}") from None


def named_images(url: str) -> list[tuple[str, str]]:
    """(path as written, its URL) of the rows' images: the `path` column, beside the manifest (files.beside)."""
    rows = read_rows(url, read_bytes(source(url, exists=False), None, lambda _: None))
    if rows and "path" not in rows[0]:
        raise DataError(f"{url}: no column 'path' (columns: {', '.join(rows[0])})")
    paths = [str(r["path"]).strip() for r in rows if r.get("path")]
    return [(p, beside(url, p)) for p in paths]


def held_out(cfg, limit: int) -> list[str]:
    """Up to `limit` of the val (else test) rows' images, split as the run split them, each resolved beside the
    manifest; none held out: []."""
    raw = read_bytes(source(cfg.path), None, lambda _: None)  # there, or named
    files, _ = manifest_files(cfg.path, raw, Columns.of(cfg), HoldOut.of(cfg))
    return [beside(cfg.path, p) for p in across_classes(files.roles["val"] or files.roles["test"], limit)]


FORMAT = Format(
    "manifest",
    load,
    about="a CSV or JSONL file of image paths and labels",
    holds=is_manifest,
    items=items,
    listed=listed,
    columns=True,
    scored=scored,
    names=named_images,
    held_out=held_out,
)
