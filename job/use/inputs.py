"""What `job predict`'s inputs name and their bytes: image files, folders (recursive), glob patterns (a file that
exists is a name, whatever its characters), .tar/.tar.gz archives, and the files of data formats
(job/data/formats.py: a table that names images, a file that holds them, each row's; a table's rows for a table's
model), local or at any URL; read a chunk at a time (each store's files fetched concurrently), a file that cannot be
read saying why; and images made into a model's inputs (export's check)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from job.data.augment import to_float
from job.data.decode import Decoder
from job.data.files import Read, fetch_named, is_archive, iter_archive, source
from job.data.files import why_unread as why
from job.data.formats import found as format_found
from job.data.formats import read_by_rows, table_found
from job.data.split import kind_of
from job.errors import DataError, StorageError
from job.storage.cloud import describe_storage_error, filesystem

if TYPE_CHECKING:
    from job.use.bundle import Predictor


def read_later(name: str) -> bool:
    """An input whose images are read as it is iterated (listed as (name, None)): an archive, a file of a format
    read row by row."""
    return is_archive(name) or read_by_rows(name) is not None


def listed(inputs: list[str]) -> list[tuple[str, str | None]]:
    """(name, url) of every image an input names: a file, a folder's images (recursive), a glob's; (archive, None)
    for an archive or a file of a format read row by row, read as it is iterated. Names are as given, or folder-
    relative under a folder."""
    found: list[tuple[str, str | None]] = []
    for item in inputs:
        fs, path = filesystem(item)
        try:
            if any(c in path for c in "*?[") and not fs.exists(path):  # a file named scan[1].png is a name
                matches = [p for p in sorted(fs.glob(path)) if not fs.isdir(p)]
                names = [given_form(item, fs, p) for p in matches]
                found += [(n, None if read_by_rows(n) is not None else n) for n in names]
                if not matches:
                    hint = " ([ and ] are a pattern's: [[] matches a [ itself)" if "[" in item else ""
                    raise DataError(f"{item}: no file matches{hint}")
            elif fs.isdir(path):
                root = path.rstrip("/") + "/"
                for p in sorted(fs.find(path)):
                    rel = p[len(root) :]
                    if kind_of(rel) == "image":
                        found.append((f"{item.rstrip('/')}/{rel}", fs.unstrip_protocol(p)))
                    elif read_later(rel) and not rel.startswith("."):  # shards, files read by row: as they come
                        found.append((f"{item.rstrip('/')}/{rel}", None))
            elif read_later(path):
                found.append((item, None))
            elif (names := format_found(item).names) is not None:  # a table of the paths of images
                found += names(item)
            elif fs.exists(path):
                found.append((item, item))
            else:
                raise DataError(f"{item}: no such file or folder")
        except (DataError, StorageError):
            raise
        except Exception as e:  # the stores' clients raise many types
            raise StorageError(f"cannot list {item}: {describe_storage_error(item, e)}") from None
    return found


def table_rows(inputs: list[str], columns: list[str]) -> Iterator[tuple[str, int, list[str]]]:
    """Every row of the tables (each read by the format of tables that holds it: job/data/formats.py), in order:
    its name (its table's prefix and number: url:line, url#row), its line or row, its values of `columns`."""
    for url in inputs:
        for prefix, first, header, table in table_found(url).table(url):
            yield from table_values(prefix, header, table, columns, first)


def table_values(
    prefix: str, header: list[str], table: list[list[str]], columns: list[str], first: int
) -> Iterator[tuple[str, int, list[str]]]:
    """A table's rows as table_rows gives them, numbered from `first` and named <prefix><number>."""
    missing = [c for c in columns if c not in header]
    if missing:
        url = prefix[:-1]
        raise DataError(f"{url}: no column {missing[0]!r} of the model's features ({', '.join(columns)})")
    at = [header.index(c) for c in columns]
    for n, row in enumerate(table, start=first):
        yield f"{prefix}{n}", n, [row[i] for i in at]


def given_form(pattern: str, fs, path: str) -> str:
    """A pattern's match named in the pattern's form: a URL for a store's, a relative path for a relative pattern's
    (fsspec's local glob answers absolute paths), else the path."""
    if "://" in pattern:
        return fs.unstrip_protocol(path)
    return path if pattern.startswith("/") else os.path.relpath(path)


def read(found: list[tuple[str, str | None]], chunk: int) -> Iterator[list[Read]]:
    """The inputs' bytes, `chunk` files at a time (each store's fetched concurrently: files.fetch_named); an
    archive's images as its members come. A file that cannot be read says why, and the rest go on."""
    pending: list[tuple[str, str]] = []

    def flush() -> list[Read]:
        got = fetch_named([url for _, url in pending])
        batch = [(name, b"", why(url, data)) if isinstance(data, Exception) else (name, data, "")
                 for (name, url), data in zip(pending, got)]  # fmt: skip
        pending.clear()
        return batch

    for name, url in found:
        if url is None and (by_rows := read_by_rows(name)) is not None:
            yield from by_rows.rows(name, chunk)
            continue
        if url is None:
            batch = []
            for member, data in iter_archive(source(name, exists=False)):
                if kind_of(member) == "image":
                    batch.append((f"{name}:{member}", data, ""))
                    if len(batch) == chunk:
                        yield batch
                        batch = []
            if batch:
                yield batch
            continue
        pending.append((name, url))
        if len(pending) == chunk:
            yield flush()
    if pending:
        yield flush()


def decode_inputs(p: Predictor, inputs: list[str], limit: int) -> tuple[torch.Tensor, list[bytes]] | None:
    """Up to `limit` of the inputs' images as the model's inputs (float, on the predictor's device), those that can
    be read, and their files' bytes in the same order; None when none can."""
    from job.data.decode import IGNORED, decoded

    decoder, kept, files, n = Decoder(0, p.pre, skip=True), [], [], 0
    for batch in read(listed(inputs), limit):
        marks = torch.zeros(len(batch), dtype=torch.int64)
        try:
            images = decoded(decoder.submit([(name, "", data) for name, data, _ in batch]), ("", ""), marks)
        except DataError:
            continue
        good = images[marks != IGNORED][: limit - n]
        files += [data for (_, data, _), mark in zip(batch, marks) if mark != IGNORED][: limit - n]
        kept.append(to_float(good.to(p.device), torch.contiguous_format, p.mean, p.std, p.view))
        n += len(good)
        if n >= limit:
            break
    return (torch.cat(kept), files) if kept else None
