"""Tables (a CSV file, or another format's table of feature columns, read into the same rows): numeric feature columns
and a named label column, features min-max scaled on the training split."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from job.data.dataset import Dataset, Split
from job.data.files import Log, Source, read_bytes, source
from job.data.formats import Format
from job.data.split import Roles
from job.errors import DataError, StorageError, one_line

BUNDLED_IRIS = "bundled iris.csv"
TEST_SHARE = 0.2  # data.test_split unset: the rows held out for testing


def row_names(numbers) -> list[str]:
    """Rows' names, by number in their table (0: the first row after the header): "row 1", ...; the val split's
    share is a hash of this name, and a report names the worst rows by it."""
    return [f"row {i + 1}" for i in numbers]


def load_table(cfg, cache: Path | None, log: Log) -> Dataset:
    """The table at cfg.path (or the bundled Iris), split as scikit-learn's train_test_split(test_size=
    cfg.test_split, random_state=cfg.split_seed) splits it unless cfg.test_path names a test table (the same rows, so
    a result compares with a scikit-learn script's); remote tables are kept in the folder `cache` (None: no cache)."""
    if cfg.path:
        header, rows = read_csv(cfg.path, cache, log)
    else:
        text = (resources.files("job.presets") / "iris.csv").read_text()
        header, rows = parse_csv(text, BUNDLED_IRIS)
    test = (cfg.test_path, *read_csv(cfg.test_path, cache, log)) if cfg.test_path else None
    return table_dataset(cfg, cfg.path or BUNDLED_IRIS, header, rows, test, "csv")


def table_dataset(
    cfg,
    name: str,
    header: list[str],
    rows: list[list[str]],
    test_table: tuple[str, list[str], list[list[str]]] | None,
    kind: str,
) -> Dataset:
    """A table's rows (cells as text) split and scaled as the module's doc says; `test_table`: (name, header, rows) of
    a test table of its own (data.test_path, or the test files of another format's table); `kind`: the reader, as
    the run's source names it."""
    x, labels = columns(header, rows, cfg.target, name)
    classes = class_order(labels)
    y = torch.tensor([classes.index(v) for v in labels])
    if test_table is not None:
        test_name, test_header, test_rows = test_table
        if test_header != header:
            raise DataError(f"{test_name}: columns differ from {name}: {test_header} vs {header}")
        tx, tlabels = columns(test_header, test_rows, cfg.target, test_name)
        unknown = sorted(set(tlabels) - set(classes))
        if unknown:
            raise DataError(f"{test_name}: labels not in the training table: {unknown[:5]}")
        train = Split(x, y, row_names(range(len(y))))
        test = Split(tx, torch.tensor([classes.index(v) for v in tlabels]), row_names(range(len(tlabels))))
    else:
        share = TEST_SHARE if cfg.test_split is None else cfg.test_split
        order = torch.from_numpy(np.random.RandomState(cfg.split_seed).permutation(len(y)))
        n_test = math.ceil(len(y) * share)
        if n_test >= len(y):
            raise DataError(f"{name}: {len(y)} rows are too few to hold out {share:.0%} for testing")
        test_idx, rows_of = order[:n_test], order[n_test:]
        train = Split(x[rows_of], y[rows_of], row_names(rows_of.tolist()))
        test = Split(x[test_idx], y[test_idx], row_names(test_idx.tolist())) if n_test else None
    val = None
    if cfg.val_split:
        role = Roles(cfg.split_seed, cfg.val_split, 0)
        held = torch.tensor([role(key) == "val" for key in train.names])
        if held.all() or not held.any():
            raise DataError(f"{name}: {len(held)} training rows are too few to hold out {cfg.val_split:.0%} for val")
        named = {h: [key for key, out in zip(train.names, held.tolist()) if out == h] for h in (True, False)}
        val = Split(train.x[held], train.y[held], named[True])
        train = Split(train.x[~held], train.y[~held], named[False])
    if test is None and val is None:
        raise DataError(f"{name}: nothing to evaluate on: data.test_split and data.val_split are both 0")
    low, high = train.x.min(0).values, train.x.max(0).values
    span = torch.where(high > low, high - low, torch.ones_like(high))
    for split in (train, val, test):
        if split is not None:
            split.x = (split.x - low) / span
    features = {
        "columns": [h for h in header if h != cfg.target],  # in the order the model takes them
        "target": cfg.target,
        "min": low.tolist(),
        "span": span.tolist(),  # x' = (x - min) / span, fitted on the training rows
    }
    return Dataset(train, test, classes, f"{kind} {name}", val=val, features=features)


def read_csv(url: str, cache: Path | None, log: Log) -> tuple[list[str], list[list[str]]]:
    try:
        raw = read_bytes(source(url, exists=False), cache, log)
    except FileNotFoundError:
        raise DataError(f"{url}: no such file") from None
    except IsADirectoryError:
        raise DataError(f"{url}: is a folder, expected a CSV file") from None
    except OSError as e:
        raise StorageError(f"{url}: cannot read: {one_line(e)}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise DataError(f"{url}: not a text CSV file (not UTF-8)") from None
    return parse_csv(text, url)


def parse_csv(text: str, name: str) -> tuple[list[str], list[list[str]]]:
    try:
        table = [row for row in csv.reader(io.StringIO(text)) if any(cell.strip() for cell in row)]
    except csv.Error as e:
        raise DataError(f"{name}: not a CSV table: {e}") from None
    if len(table) < 2:
        raise DataError(f"{name}: expected a header row and data rows, found {len(table)} row(s)")
    header = [h.strip() for h in table[0]]
    for i, row in enumerate(table[1:], start=2):
        if len(row) != len(header):
            raise DataError(f"{name} row {i}: {len(row)} fields, the header has {len(header)}")
    return header, table[1:]


def columns(header: list[str], rows: list[list[str]], target: str, name: str) -> tuple[torch.Tensor, list[str]]:
    """Features as float32 N x F (every column but the target) and the target column's values."""
    if target not in header:
        raise DataError(f"{name}: no column '{target}' for data.target (columns: {', '.join(header)})")
    t = header.index(target)
    features = [i for i in range(len(header)) if i != t]
    if not features:
        raise DataError(f"{name}: no feature columns besides '{target}'")
    values = []
    for r, row in enumerate(rows, start=2):
        try:
            values.append([float(row[i]) for i in features])
        except ValueError:
            bad = next(i for i in features if not _is_number(row[i]))
            raise DataError(f"{name} row {r}, column '{header[bad]}': not a number: {row[bad]!r}") from None
    return torch.tensor(values, dtype=torch.float32), [row[t].strip() for row in rows]


def class_order(labels: list[str]) -> list[str]:
    """Label values sorted numerically when they are all numbers, else as text."""
    unique = set(labels)
    if all(_is_number(v) for v in unique):
        return sorted(unique, key=float)
    return sorted(unique)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def load(cfg, cache: Path | None, log: Log, src: Source | None = None, started=None) -> Dataset:
    return load_table(cfg, cache, log)


def tables(url: str) -> Iterator[tuple[str, int, list[str], list[list[str]]]]:
    """The CSV table at `url`: its rows named url:<line>, from line 2 (the header is line 1)."""
    header, rows = parse_csv(read_bytes(source(url, exists=False), None, lambda _: None).decode("utf-8-sig"), url)
    yield f"{url}:", 2, header, rows


FORMAT = Format("csv", load, about="a CSV table of feature columns and a label column (data.target)", table=tables)
