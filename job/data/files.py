"""Reading data through fsspec: what a URL points at, tar archives in one stream, folders of many small files
fetched concurrently, and a local cache of remote data. A data URL is resolved here, once where its read begins
(source: a Source), and handed down as it is; the other modules of job/data/ reach a store through it.

Remote data are read once: a file or archive is copied into the cache under a key made of its URL, its
object generation (or etag, or mtime) and size; a folder's files are fetched concurrently and kept as one
uncompressed tar keyed by the listing (names, generations, sizes), so a second run lists the folder and reads
one local file instead of sending a request per object. A gs:// archive is read through a Cloud Storage FUSE
mount when there is one (Vertex AI mounts buckets at /gcs); folders are not, as FUSE opens files one by one.

The readers take the cache folder (None: no cache) and a `log` that prints one line for the user; they know
nothing of the run's output storage or its console.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import posixpath
import tarfile
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem

from job.data.split import kind_of
from job.errors import DataError, StorageError, one_line
from job.storage.cloud import describe_storage_error, fetch_concurrency, filesystem, fuse_path

ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")
FETCH_CHUNK = 2000  # files fetched concurrently per request batch (and held in memory at once)
VERSION_KEYS = ("generation", "etag", "md5Hash", "ETag", "mtime", "LastModified", "created")

Log = Callable[[str], None]  # prints one line for the user


@dataclass(frozen=True)
class Source:
    """A data URL resolved once, where a read of it begins: its filesystem, its path there, and its Cloud Storage
    FUSE path when its bucket is mounted. The readers, the packer and the placement estimate take it rather than
    resolving the URL again; files that a source names (a manifest's rows) are sources of their own."""

    url: str
    fs: fsspec.AbstractFileSystem
    path: str
    mounted: str | None = None

    def within(self, path: str) -> Source:
        """A file under this source's path, in its store (a file of a folder): no second resolution."""
        inside = self.mounted and path.startswith(self.path)
        mounted = self.mounted.rstrip("/") + path[len(self.path) :] if inside else None
        return Source(self.fs.unstrip_protocol(path), self.fs, path, mounted)


def source(url: str, exists: bool = True) -> Source:
    """The Source of a data URL; `exists`: it must be there (a DataError where it is not)."""
    fs, path = filesystem(url)
    if exists:
        try:
            there = fs.exists(path)
        except Exception as e:  # the stores' clients raise many types
            raise StorageError(f"cannot read the data: {describe_storage_error(url, e)}") from None
        if not there:
            raise DataError(f"{url}: no such file or folder")
    return Source(url, fs, path, fuse_path(url))


def local_source(path: str) -> Source:
    """A Source of a file on this machine (a cached copy, a FUSE path)."""
    return Source(path, LocalFileSystem(), path)


def is_archive(path: str) -> bool:
    return path.lower().endswith(ARCHIVE_SUFFIXES)


def read_entries(
    src: Source, keep: Callable[[str], bool], cache: Path | None, log: Log, maxdepth: int | None = None
) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of each file of an archive or folder whose name `keep` accepts; names are relative to the
    folder (or as stored in the archive). Remote data are kept in the folder `cache` unless it is None."""
    if is_archive(src.path):
        return ((name, data) for name, data in iter_archive(local_file(src, cache, log)) if keep(name))
    return folder_entries(src, keep, cache, log, maxdepth)


def images_listed(src: Source) -> dict[str, dict]:
    """The images of a folder (by their suffixes, at any depth), or the archive itself: path -> info."""
    fs, path = src.fs, src.path
    try:
        if is_archive(path):
            return {path: fs.info(path)}
        root = path.rstrip("/") + "/"
        found = fs.find(path, detail=True).items()
        return {p: i for p, i in found if kind_of(p[len(root) :]) == "image"}
    except Exception as e:  # the stores' clients raise many types
        raise StorageError(f"cannot list the data: {describe_storage_error(src.url, e)}") from None


def local_file(src: Source, cache: Path | None, log: Log) -> Source:
    """Where to read one file from: its FUSE mount path, a local copy of a remote object in the folder `cache`
    (None: no cache), or the source itself."""
    url, fs, path = src.url, src.fs, src.path
    if src.mounted and os.path.isfile(src.mounted):
        log(f"data: reading {url} through the Cloud Storage FUSE mount {src.mounted}")
        return local_source(src.mounted)
    if isinstance(fs, LocalFileSystem) or cache is None:
        return src
    try:
        info = fs.info(path)
    except Exception as e:
        raise StorageError(f"cannot read the data: {describe_storage_error(url, e)}") from None
    version = next((str(info[k]) for k in VERSION_KEYS if info.get(k)), None)
    if version is None:  # nothing tells a changed object from the old one: do not cache
        return src
    key = hashlib.sha256(f"{url}\n{version}\n{info.get('size')}".encode()).hexdigest()[:32]
    target = cache / key / path.rstrip("/").rsplit("/", 1)[-1]
    if target.is_file() and target.stat().st_size == info.get("size"):
        log(f"data: {url} from the local cache ({target.parent})")
        return local_source(str(target))
    if not writable(target.parent):
        return src
    t0 = time.perf_counter()
    partial = target.with_name(f".{target.name}.{os.getpid()}.part")
    try:
        fs.get_file(path, str(partial))
        os.replace(partial, target)
    except Exception as e:
        partial.unlink(missing_ok=True)
        raise StorageError(f"cannot download the data: {describe_storage_error(url, e)}") from None
    log(f"data: downloaded {url} ({target.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f} s, cached")
    return local_source(str(target))


def folder_entries(
    src: Source, keep: Callable[[str], bool], cache: Path | None, log: Log, maxdepth: int | None
) -> Iterator[tuple[str, bytes]]:
    url, fs, path = src.url, src.fs, src.path
    root = path.rstrip("/") + "/"
    try:
        listing = fs.find(path, maxdepth=maxdepth, detail=True)
    except Exception as e:
        raise StorageError(f"cannot list the data: {describe_storage_error(url, e)}") from None
    wanted = {p[len(root) :]: info for p, info in listing.items() if p.startswith(root) and keep(p[len(root) :])}
    names = sorted(wanted)
    versions = [next((str(wanted[n][k]) for k in VERSION_KEYS if wanted[n].get(k)), None) for n in names]
    listing = "\n".join(f"{n} {v} {wanted[n].get('size')}" for n, v in zip(names, versions))
    key = hashlib.sha256(f"{url}\n{listing}".encode()).hexdigest()[:32]
    target = cache / key / "files.tar" if cache is not None else None
    # No cache for local folders, when turned off, or when a changed object could not be told from the old one.
    cacheable = target is not None and names and not isinstance(fs, LocalFileSystem) and None not in versions
    if not (cacheable and writable(target.parent)):
        yield from fetch_all(fs, root, names, url)
        return
    if not target.is_file():
        t0 = time.perf_counter()
        partial = target.with_name(f".files.{os.getpid()}.part")
        try:
            with tarfile.open(partial, "w") as tar:
                for name, data in fetch_all(fs, root, names, url):
                    member = tarfile.TarInfo(name)
                    member.size = len(data)
                    tar.addfile(member, io.BytesIO(data))
            os.replace(partial, target)
        except OSError as e:
            raise StorageError(f"cannot write the data cache in {target.parent}: {one_line(e)}") from None
        finally:
            partial.unlink(missing_ok=True)
        mb = target.stat().st_size / 1e6
        log(f"data: fetched {len(names)} files of {url} ({mb:.1f} MB) in {time.perf_counter() - t0:.1f} s, cached")
    else:
        log(f"data: {len(names)} files of {url} from the local cache ({target.parent})")
    yield from iter_archive(local_source(str(target)))


def writable(folder: Path) -> bool:
    """Whether the cache can use a folder (made if need be); a read-only or full home means no cache, not a failure."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return os.access(folder, os.W_OK)
    except OSError:
        return False


def fetch_all(fs, root: str, names: list[str], url: str) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of each file root + name, fetched FETCH_CHUNK at a time (concurrently within a chunk); a file
    that cannot be read (gone since it was listed) stops the read, named."""
    for start in range(0, len(names), FETCH_CHUNK):
        chunk = names[start : start + FETCH_CHUNK]
        for name, data in zip(chunk, cat_many(fs, [root + n for n in chunk], url)):
            if isinstance(data, BaseException):
                raise StorageError(f"cannot read {url.rstrip('/')}/{name}: {describe_storage_error(url, data)}")
            yield name, data


def cat_many(fs, paths: list[str], url: str) -> list[bytes | Exception]:
    """Contents of many files of one store, in order: each file's bytes, or the error reading it gave
    (FileNotFoundError when it is not there). A name is a name: `[`, `]`, `*`, `?` are characters of it (fsspec's
    cat expands them as patterns; cat_ranges reads each path as given). Remote stores read them concurrently."""
    if not paths:
        return []
    if isinstance(fs, LocalFileSystem):  # read directly: fsspec's per-path work costs more than the read
        return [read_local(p) for p in paths]
    try:
        return fs.cat_ranges(paths, None, None, on_error="return", **fetch_concurrency(url))
    except Exception as e:  # the call itself failed (no such bucket, no credentials): the stores raise many types
        raise StorageError(f"cannot read the data: {describe_storage_error(url, e)}") from None


def fetch_named(urls: list[str]) -> list[bytes | Exception]:
    """Contents of many files named by URL or local path, in order: each one's bytes, or the error reading it gave
    (FileNotFoundError when it is not there). Local files are read directly (fsspec's per-path work costs more than
    the read); each store's files are fetched concurrently in one call (cat_many: names as they are)."""
    out: list[bytes | Exception] = [b""] * len(urls)
    stores: dict[int, tuple[fsspec.AbstractFileSystem, list[int], list[str]]] = {}
    for i, url in enumerate(urls):
        if "://" not in url or url.startswith("file://"):
            out[i] = read_local(url.removeprefix("file://"))
            continue
        fs, path = filesystem(url)
        at = stores.setdefault(id(fs), (fs, [], []))
        at[1].append(i)
        at[2].append(path)
    for fs, at, paths in stores.values():
        for i, data in zip(at, cat_many(fs, paths, urls[at[0]])):
            out[i] = data
    return out


Read = tuple[str, bytes, str]  # an input's name, its bytes, and why it could not be read ("" when it was)
GONE = "not found (moved or removed since it was listed?)"


def why_unread(url: str, error: Exception) -> str:
    """A row's words for a file that could not be read."""
    if isinstance(error, FileNotFoundError):
        return GONE
    if "://" not in url or url.startswith("file://"):
        return f"cannot read it: {one_line(error)}"
    return describe_storage_error(url, error)


def held_or_fetched(
    cells: Iterable[tuple[str, bytes | None, str | None]], chunk: int, none: str
) -> Iterator[list[Read]]:
    """Named items, each with its bytes or the URL they are fetched from, `chunk` at a time (each store's fetched
    concurrently): (name, bytes, why not); an item with neither is `none`'s reason."""
    pending: list[tuple[str, bytes | None, str | None]] = []

    def flush() -> list[Read]:
        got = iter(fetch_named([at for _, _, at in pending if at]))
        batch = []
        for name, data, at in pending:
            fetched = next(got) if at else data
            if isinstance(fetched, Exception):
                batch.append((name, b"", why_unread(at, fetched)))
            else:
                batch.append((name, fetched or b"", "" if fetched else none))
        pending.clear()
        return batch

    for cell in cells:
        pending.append(cell)
        if len(pending) == chunk:
            yield flush()
    if pending:
        yield flush()


def read_local(path: str) -> bytes | OSError:
    """A local file's bytes, or the error reading it gave."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        return e


def beside(named_by: str, path: str) -> str:
    """Where a path written in a file (a manifest's row) points: a URL as it is; otherwise resolved against the
    folder of the file that names it, and normalised (`./`, `../`), as a URL resolves a relative reference: never
    against the working directory. An absolute path is a local file's wherever the naming file is (a gs://
    manifest may name files of a Cloud Storage FUSE mount, /gcs/...)."""
    if "://" in path:
        return path
    scheme, rest = named_by.split("://", 1) if "://" in named_by else ("", named_by)
    if scheme in ("", "file") or path.startswith("/"):
        where = posixpath.normpath(path if path.startswith("/") else posixpath.join(posixpath.dirname(rest), path))
        return f"file://{where}" if scheme == "file" else where
    bucket, _, key = rest.partition("/")
    where = posixpath.normpath(posixpath.join(posixpath.dirname(key), path))
    if where == ".." or where.startswith("../"):
        raise DataError(f"{path} climbs above the bucket {scheme}://{bucket}")
    return f"{scheme}://{bucket}" if where == "." else f"{scheme}://{bucket}/{where}"


def iter_archive(src: Source) -> Iterator[tuple[str, bytes]]:
    """(member name, bytes) of each regular file of a .tar or .tar.gz, read in one pass (no seeks: fine on gs://)."""
    url = src.url
    try:
        with src.fs.open(src.path, "rb") as f, tarfile.open(fileobj=f, mode="r|*") as tar:
            for member in tar:
                if member.isfile():
                    data = tar.extractfile(member)
                    yield member.name, data.read() if data else b""
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise DataError(f"{url}: not a readable tar archive (truncated or corrupt?): {one_line(e)}") from None
    except Exception as e:  # the store's errors while streaming (HTTP, connection), or the local disk's
        raise StorageError(f"cannot read the data: {describe_storage_error(url, e)}") from None


def read_bytes(src: Source, cache: Path | None, log: Log) -> bytes:
    """One whole file (a CSV table), through the cache folder `cache` when remote (None: no cache)."""
    at = local_file(src, cache, log)
    with at.fs.open(at.path, "rb") as f:
        return f.read()
