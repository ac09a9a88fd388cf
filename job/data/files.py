"""Reading data files through fsspec: what a URL points at, whole files, folders and tar archives in one stream."""

from __future__ import annotations

import tarfile
from collections.abc import Iterator

import fsspec
from fsspec.core import url_to_fs

from job.errors import DataError, StorageError, one_line

ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def resolve(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and path of a data URL that must exist."""
    try:
        fs, path = url_to_fs(url)
        if not fs.exists(path):
            raise DataError(f"{url}: no such file or folder")
    except (ValueError, ImportError) as e:
        raise DataError(f"{url}: not a usable URL: {one_line(e)}") from None
    except OSError as e:
        raise StorageError(f"{url}: cannot read: {one_line(e)}") from None
    return fs, path


def is_archive(path: str) -> bool:
    return path.lower().endswith(ARCHIVE_SUFFIXES)


def iter_archive(url: str) -> Iterator[tuple[str, bytes]]:
    """(member name, bytes) of each regular file of a .tar or .tar.gz, read in one pass (no seeks: fine on gs://)."""
    try:
        with fsspec.open(url, "rb") as f, tarfile.open(fileobj=f, mode="r|*") as tar:
            for member in tar:
                if member.isfile():
                    data = tar.extractfile(member)
                    yield member.name, data.read() if data else b""
    except (tarfile.TarError, EOFError, OSError) as e:
        if isinstance(e, (FileNotFoundError, PermissionError)):
            raise StorageError(f"{url}: cannot read: {one_line(e)}") from None
        raise DataError(f"{url}: not a readable tar archive (truncated or corrupt?): {one_line(e)}") from None


def read_files(fs: fsspec.AbstractFileSystem, paths: list[str], url: str) -> dict[str, bytes]:
    """Contents of many files; remote filesystems fetch them concurrently in one call."""
    if not paths:
        return {}
    try:
        return fs.cat(paths, on_error="raise")
    except OSError as e:
        raise StorageError(f"{url}: cannot read: {one_line(e)}") from None
