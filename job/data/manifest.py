"""data.kind manifest: a CSV or JSONL file of image paths and labels (Kaggle's train.csv, a labelling tool's export),
its images read like a folder's (job/data/folder.py: one decoding, bad files skipped and named).

Columns: data.path_column (paths relative to the manifest's folder, or URLs), data.label_column (class names, or
class indexes when every label is an integer: the classes are then ordered by number), and data.split_column when
the file has it (train, val or valid, test; an empty cell is train). Rows with no split of their own are held out
for val and test by a hash of their path as written (job/data/split.py), as a folder's files are.

Images under the manifest's folder are read through the folder reader's fetch and cache (one listing, concurrent
requests, a local copy of remote data); others, by URL, one request each.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from job.cloud import describe_storage_error, filesystem
from job.data.dataset import Dataset
from job.data.files import Log, fetch, read_bytes, read_entries
from job.data.folder import check_files, held
from job.data.split import SPLIT_FOLDERS, Files, HoldOut, Roles
from job.errors import DataError, StorageError


def load_manifest(cfg, cache: Path | None, log: Log, classes: list[str] | None = None) -> Dataset:
    """The manifest's images in memory, split; `classes`: a trained model's (its images are scored, not trained on:
    every row is read, with no split required)."""
    url = cfg.path
    rows = read_rows(url, read_bytes(url, cache, log))
    if not rows:
        raise DataError(f"{url}: no rows")
    for column in (cfg.path_column, cfg.label_column):
        if column not in rows[0]:
            raise DataError(
                f"{url}: no column '{column}' (columns: {', '.join(rows[0])}); set data.path_column and "
                "data.label_column"
            )
    files, labels = Files(), []
    hold = HoldOut.of(cfg)
    role_of = Roles(hold.seed, hold.val, hold.test)
    for n, row in enumerate(rows, start=1):
        path, label = cell(row, cfg.path_column).removeprefix("./"), cell(row, cfg.label_column)
        if not path or not label:
            raise DataError(f"{url} row {n}: no {cfg.path_column if not path else cfg.label_column}")
        written = cell(row, cfg.split_column).lower()
        role = SPLIT_FOLDERS.get(written) if written else "train"
        if role is None:
            raise DataError(f"{url} row {n}: split '{written}': expected train, val or test")
        if not written:
            role = role_of(path)
            if role != "train":
                files.held_out[role].append(path)
        files.roles[role].append((path, label))
        labels.append(label)
    scoring = classes is not None
    if classes is None:
        classes = class_order(labels, {label for _, label in files.roles["train"]})
        check_files(files, classes, url)
    elif unknown := sorted(set(labels) - set(classes)):
        raise DataError(f"{url}: labels the model does not know: {', '.join(unknown[:5])}")
    content, skipped = fetched(url, [p for r in files.roles.values() for p, _ in r], cache, log)
    for role in files.roles:  # a file that is not there is skipped and named, like one that cannot be decoded
        files.roles[role] = [(p, c) for p, c in files.roles[role] if p in content]
    return held(files, content.__getitem__, classes, cfg, url, f"manifest {url}", log, skipped, scoring=scoring)


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
    base = url.rsplit("/", 1)[0] if "/" in url else "."
    inside = {p for p in paths if "://" not in p and not p.startswith(("/", "../"))}
    content: dict[str, bytes] = {}
    if inside:
        content.update(read_entries(base, lambda name: name in inside, cache, log))
    for p in sorted(set(paths) - inside):
        fs, path = filesystem(p)
        try:
            content[p] = fetch(fs, [path], p)[0] if fs.exists(path) else None
        except StorageError:
            raise
        except Exception as e:  # the stores' clients raise many types
            raise StorageError(f"cannot read {p}: {describe_storage_error(p, e)}") from None
    missing = sorted({p for p in paths if content.get(p) is None})
    if len(missing) == len(set(paths)):
        raise DataError(f"{url}: none of its {len(missing)} image paths exists (e.g. {missing[0]}; relative to {base})")
    return {p: b for p, b in content.items() if b is not None}, [{"path": p, "reason": "no such file"} for p in missing]
