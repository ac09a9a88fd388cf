"""What `job predict`'s inputs name and their bytes: image files, folders (recursive), glob patterns (a file that
exists is a name, whatever its characters), manifests (paths beside the manifest), .tar/.tar.gz archives, parquet
files (each row's image, read by job/data/parquet.py), and CSV or parquet tables' rows, local or at any URL; read a
chunk at a time (each store's files fetched concurrently), a file that cannot be read saying why; and images made
into a model's inputs (export's check)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from job.data.augment import to_float
from job.data.decode import Decoder
from job.data.files import fetch_named, is_archive, is_manifest, iter_archive, source
from job.data.parquet import SUFFIX as PARQUET
from job.data.parquet import is_parquet
from job.data.split import kind_of
from job.errors import DataError, StorageError, one_line
from job.storage.cloud import describe_storage_error, filesystem

if TYPE_CHECKING:
    from job.use.bundle import Predictor


def read_later(name: str) -> bool:
    """An input whose images are read as it is iterated (listed as (name, None)): an archive, a parquet file."""
    return is_archive(name) or name.lower().endswith(PARQUET)


def listed(inputs: list[str]) -> list[tuple[str, str | None]]:
    """(name, url) of every image an input names: a file, a folder's images (recursive), a glob's; (archive, None)
    for an archive or a parquet file, read as it is iterated. Names are as given, or folder-relative under a
    folder."""
    found: list[tuple[str, str | None]] = []
    for item in inputs:
        fs, path = filesystem(item)
        try:
            if any(c in path for c in "*?[") and not fs.exists(path):  # a file named scan[1].png is a name
                matches = [p for p in sorted(fs.glob(path)) if not fs.isdir(p)]
                names = [given_form(item, fs, p) for p in matches]
                found += [(n, None if n.lower().endswith(PARQUET) else n) for n in names]
                if not matches:
                    hint = " ([ and ] are a pattern's: [[] matches a [ itself)" if "[" in item else ""
                    raise DataError(f"{item}: no file matches{hint}")
            elif fs.isdir(path):
                root = path.rstrip("/") + "/"
                for p in sorted(fs.find(path)):
                    rel = p[len(root) :]
                    if kind_of(rel) == "image":
                        found.append((f"{item.rstrip('/')}/{rel}", fs.unstrip_protocol(p)))
                    elif read_later(rel) and not rel.startswith("."):  # shards, parquet files: each read as it comes
                        found.append((f"{item.rstrip('/')}/{rel}", None))
            elif read_later(path):
                found.append((item, None))
            elif is_manifest(path):
                found += manifest_paths(item)
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
    """Every row of the tables (CSV files; parquet files, folders of them), in order: its name (url:line, or a
    parquet file's url#row), its line or row, its values of `columns`."""
    from job.data.files import read_bytes
    from job.data.tabular import parse_csv

    for url in inputs:
        if is_parquet(url):
            for name, _ in listed([url]):
                header, table = parquet_table(name)
                yield from table_values(name, header, table, columns, 0, "#")
            continue
        header, table = parse_csv(read_bytes(source(url, exists=False), None, lambda _: None).decode("utf-8-sig"), url)
        yield from table_values(url, header, table, columns, 2, ":")


def table_values(
    url: str, header: list[str], table: list[list[str]], columns: list[str], first: int, mark: str
) -> Iterator[tuple[str, int, list[str]]]:
    """A table's rows as table_rows gives them, numbered from `first` and named url<mark><number>."""
    missing = [c for c in columns if c not in header]
    if missing:
        raise DataError(f"{url}: no column {missing[0]!r} of the model's features ({', '.join(columns)})")
    at = [header.index(c) for c in columns]
    for n, row in enumerate(table, start=first):
        yield f"{url}{mark}{n}", n, [row[i] for i in at]


def parquet_table(url: str) -> tuple[list[str], list[list[str]]]:
    """A parquet file's columns and its rows, cells as text (job/data/parquet.py reads them as it reads a table)."""
    from job.data.parquet import huggingface_features, open_file, read_error, table_cells

    f = open_file(source(url, exists=False))
    try:
        table = f.read()
    except Exception as e:  # pyarrow's errors and the stores'
        raise read_error(url, e) from None
    return table.column_names, table_cells(table, huggingface_features(f.schema_arrow))


def parquet_reads(url: str, chunk: int) -> Iterator[list[Read]]:
    """Each row's image of a parquet file, `chunk` rows at a time, in order: named by its image's path where the row
    has one (read beside the file), else url#row; a row with no image says so."""
    from job.data.files import beside
    from job.data.parquet import NEITHER, huggingface_features, image_cells, image_column, open_file

    f = open_file(source(url, exists=False))
    image = image_column(url, f.schema_arrow, huggingface_features(f.schema_arrow), "path")
    if image is None:
        raise DataError(f"{url}: no image column (a table of feature columns: a table's model predicts its rows)")
    pending: list[tuple[str, bytes | None, str | None]] = []  # name, bytes, or where they are to be fetched

    def flush() -> list[Read]:
        got = iter(fetch_named([at for _, _, at in pending if at]))
        batch = []
        for name, data, at in pending:
            fetched = next(got) if at else data
            if isinstance(fetched, Exception):
                batch.append((name, b"", why(at, fetched)))
            else:
                batch.append((name, fetched or b"", "" if fetched else NEITHER))
        pending.clear()
        return batch

    for n, (data, path) in enumerate(image_cells(f, image, url)):
        pending.append((path or f"{url}#{n}", data, beside(url, path) if path and not data else None))
        if len(pending) == chunk:
            yield flush()
    if pending:
        yield flush()


def given_form(pattern: str, fs, path: str) -> str:
    """A pattern's match named in the pattern's form: a URL for a store's, a relative path for a relative pattern's
    (fsspec's local glob answers absolute paths), else the path."""
    if "://" in pattern:
        return fs.unstrip_protocol(path)
    return path if pattern.startswith("/") else os.path.relpath(path)


def manifest_paths(url: str) -> list[tuple[str, str]]:
    """(path as written, its URL) of a manifest's rows: its `path` column, beside the manifest (files.beside)."""
    from job.data.files import beside, read_bytes
    from job.data.manifest import read_rows

    rows = read_rows(url, read_bytes(source(url, exists=False), None, lambda _: None))
    if rows and "path" not in rows[0]:
        raise DataError(f"{url}: no column 'path' (columns: {', '.join(rows[0])})")
    paths = [str(r["path"]).strip() for r in rows if r.get("path")]
    return [(p, beside(url, p)) for p in paths]


Read = tuple[str, bytes, str]  # an input's name, its bytes, and why it could not be read ("" when it was)


GONE = "not found (moved or removed since it was listed?)"


def why(url: str, error: Exception) -> str:
    """A row's words for a file that could not be read."""
    if isinstance(error, FileNotFoundError):
        return GONE
    if "://" not in url or url.startswith("file://"):
        return f"cannot read it: {one_line(error)}"
    return describe_storage_error(url, error)


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
        if url is None and name.lower().endswith(PARQUET):
            yield from parquet_reads(name, chunk)
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
