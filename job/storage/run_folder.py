"""Run folders at any fsspec URL. Every file is written to a local folder first, atomically; when the run's URL is
remote (gs://, memory://, ...) that folder is a staging copy, mirrored to the URL by a background uploader
(job/storage/sync.py), so TensorBoard and the loop only ever touch local disk.

A commit on an object store has no atomic rename: callers write the payload, then its manifest, then the
pointer, the uploader sends them in that order, and readers trust only what the pointer (or a manifest) names
and checksums. The staging folder of a remote run is kept at a fixed place per URL until everything is
uploaded, so a run whose store went away can be continued, and its files sent, by running it again.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem

from job.errors import StorageError, one_line
from job.storage import lease, sync
from job.storage.cloud import describe_storage_error, filesystem
from job.storage.sync import Uploader, write_atomic

PULSE = ".alive"  # the writing process's sign of life (job/run/attempts.py): kept in staging for the next attempt here


def cache_dir(*parts: str) -> Path:
    """The job's local cache (remote inputs, staging of remote runs): $JOB_CACHE_DIR, else ~/.cache/job."""
    root = os.environ.get("JOB_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "job"
    )
    return Path(root, *parts)


class RunDir:
    """One run's output folder: `local` is where files are written, `url` where they must end up.

    `routes` sends some of the run's files elsewhere, by their first path component (Vertex AI's TensorBoard and
    model folders): {"tensorboard": URL, "model.pt": URL}. `staged` stages a local folder too (a Drive mount).
    `store_only` reads the store alone (evaluating a run folder another process may be writing).
    """

    def __init__(
        self,
        url: str,
        routes: dict[str, str] | None = None,
        upload_timeout_s: float = 120.0,
        sync_every_s: float = 30.0,
        staged: bool = False,
        store_only: bool = False,
    ) -> None:
        self.url = url.rstrip("/") or url
        self.fs, self.root = filesystem(self.url)
        self.routes = {prefix: filesystem(to.rstrip("/")) for prefix, to in (routes or {}).items()}
        self.remote = staged or not isinstance(self.fs, LocalFileSystem) or bool(self.routes)
        if self.remote:
            self.local = Path(os.environ.get("JOB_STAGING_DIR") or cache_dir("staging"))
            where = self.url if "://" in self.url else os.path.abspath(self.url)
            self.local /= hashlib.sha256(where.encode()).hexdigest()[:16]
        else:
            self.local = Path(self.root)
        self.upload_timeout_s, self.sync_every_s = upload_timeout_s, sync_every_s
        self.store_only = store_only  # read what the store holds, never this machine's staging copy
        self.uploader: Uploader | None = None
        self._index: dict[str, set[str]] = {}  # remote listings, kept current as files are written and deleted
        self._cache: dict[str, bytes] = {}  # small files read from the store
        self._lock = None
        self._made: Path | None = None  # the outermost folder prepare() made
        self.lease: lease.Lease | None = None  # this process's hold on the folder, from prepare() to finish()

    def path(self, rel: str) -> Path:
        """The local path of a file of the run (a staging copy when the run is remote)."""
        return self.local / rel

    def target(self, rel: str):
        """(filesystem, path) where a file of the run belongs in the store."""
        head, _, rest = rel.partition("/")
        if head in self.routes:
            fs, base = self.routes[head]
            return fs, f"{base}/{rest}" if rest else base
        return self.fs, f"{self.root.rstrip('/')}/{rel}"

    def prepare(self) -> None:
        """Check, before any work, that no other run is writing the folder and that every place the run writes to
        takes a file and gives it back; then hold the folder (lease.py) until finish() or abandon()."""
        lease.check(self.url)  # refused before anything is written
        missing = [p for p in (self.local, *self.local.parents) if not p.exists()]
        self._made = missing[-1] if missing else None
        try:
            self.local.mkdir(parents=True, exist_ok=True)
            probe = self.local / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise StorageError(f"{self.local}: cannot write the output folder: {one_line(e)}") from None
        if self.remote:
            self.probe_store()
        self.lease = lease.Lease(self.url).take()

    def probe_store(self) -> None:
        """The staging folder kept to this process, and a file written to each place in the store and read back."""
        self._lock = open(self.local / ".lock", "w")  # noqa: SIM115 (held for the whole run)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise StorageError(f"{self.url}: another run on this machine is writing to it") from None
        probes = {".probe": self.target(".probe")}
        for prefix in self.routes:  # a route to a file (model.pt) is probed in the folder that will hold it
            fs, path = self.target(prefix)
            probes[prefix] = (
                (fs, f"{path.rsplit('/', 1)[0]}/.probe") if "." in prefix else self.target(f"{prefix}/.probe")
            )
        for rel, (fs, path) in probes.items():
            where = self.url if rel == ".probe" else f"{self.url} ({rel})"
            try:
                if isinstance(fs, LocalFileSystem):
                    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
                token = os.urandom(8).hex().encode()
                fs.pipe_file(path, token)
                if fs.cat_file(path) != token:
                    raise OSError("a probe object read back differs from what was written")
                fs.rm_file(path)
            except Exception as e:  # gcsfs raises HTTP errors of its own besides OSError
                raise StorageError(f"cannot write the output folder: {describe_storage_error(where, e)}") from None

    def start_sync(self) -> None:
        """Start mirroring to the URL (remote runs); before this, staging holds only what prepare() found."""
        if self.remote and self.uploader is None:
            self.uploader = Uploader(self.local, self.target, self.upload_timeout_s, self.sync_every_s)

    def staged_files(self) -> list[str]:
        """Files in the staging folder (left by an earlier attempt before start_sync); none for an unstaged run."""
        if not self.remote or not self.local.is_dir():
            return []
        return sorted(
            str(p.relative_to(self.local))
            for p in self.local.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(self.local).parts)
        )

    def clear_staging(self) -> None:
        for entry in self.local.iterdir() if self.remote and self.local.is_dir() else []:
            if entry.name not in (".lock", PULSE):
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()

    def write(self, rel: str, data: bytes) -> None:
        """Write a file of the run atomically and, when remote, queue its upload."""
        try:
            write_atomic(self.path(rel), data)
        except OSError as e:
            raise StorageError(f"{self.url}: cannot write {rel}: {one_line(e)}") from None
        self.upload(rel)

    def upload(self, *rels: str) -> None:
        """Queue local files of the run for the store, in the order given (no-op for a local run)."""
        for rel in rels:
            self._cache.pop(rel, None)
            self._indexed(rel, add=True)
            if self.uploader is not None:
                self.uploader.put(rel)

    def upload_tree(self, rel_dir: str) -> None:
        """Queue a sync of a folder of growing files (TensorBoard's event files): new bytes only."""
        if self.uploader is not None:
            self.uploader.tree(rel_dir)

    def send(self, rel: str, data: bytes) -> None:
        """Put bytes at a file's place in the store now, past the uploader (recovering an earlier attempt's files)."""
        sync.send(*self.target(rel), data)

    def read(self, rel: str, store_only: bool = False) -> bytes | None:
        """A file of the run, or None when there is none: the local copy when there is one, else the store's."""
        if self.deleted(rel):
            return None
        local = self.path(rel)
        if local.is_file() and not (self.remote and (store_only or self.store_only)):
            return local.read_bytes()
        if not self.remote:
            return None
        if rel not in self._cache or store_only:
            fs, path = self.target(rel)
            try:
                data = fs.cat_file(path)
            except FileNotFoundError:
                return None
            except Exception as e:
                raise StorageError(f"cannot read {rel}: {describe_storage_error(self.url, e)}") from None
            if len(data) > 1 << 16:
                return data
            self._cache[rel] = data
        return self._cache[rel]

    def list(self, rel_dir: str) -> list[str]:
        """Names of the files in a folder of the run (empty when there is no such folder)."""
        local = self.path(rel_dir)
        names = {p.name for p in local.iterdir() if p.is_file()} if local.is_dir() else set()
        if self.remote:
            if rel_dir not in self._index:
                fs, path = self.target(rel_dir)
                try:
                    entries = fs.ls(path, detail=False, refresh=True)
                except FileNotFoundError:
                    entries = []
                except Exception as e:
                    raise StorageError(f"cannot list {rel_dir}: {describe_storage_error(self.url, e)}") from None
                self._index[rel_dir] = {e.rstrip("/").rsplit("/", 1)[-1] for e in entries}
            names |= self._index[rel_dir]
        return sorted(n for n in names if not self.deleted(f"{rel_dir}/{n}"))

    def deleted(self, rel: str) -> bool:
        """Whether a file is on its way out: queued for deletion in the store, its local copy deleted after."""
        return self.uploader is not None and self.uploader.deleting(rel)

    def _indexed(self, rel: str, add: bool) -> None:
        folder, _, name = rel.rpartition("/")
        if folder in self._index:
            (self._index[folder].add if add else self._index[folder].discard)(name)

    def delete(self, rel: str) -> None:
        self._cache.pop(rel, None)
        self._indexed(rel, add=False)
        if self.uploader is not None:  # the uploader deletes the local copy after the store's, in queue order
            self.uploader.delete(rel)
            return
        self.path(rel).unlink(missing_ok=True)
        if self.remote:
            fs, path = self.target(rel)
            try:
                fs.rm_file(path)
            except FileNotFoundError:
                pass
            except Exception as e:
                raise StorageError(f"cannot delete {rel}: {describe_storage_error(self.url, e)}") from None

    def has(self, rel: str) -> bool:
        """Whether the run has this file, here or in the store, without reading it."""
        if self.deleted(rel):
            return False
        if self.path(rel).is_file() or not self.remote:
            return self.path(rel).is_file()
        fs, path = self.target(rel)
        try:
            return fs.exists(path)
        except Exception as e:
            raise StorageError(f"cannot read {rel}: {describe_storage_error(self.url, e)}") from None

    def has_run(self) -> bool:
        """Whether the folder already holds a run (its config or checkpoints)."""
        return self.read("config.yaml") is not None or bool(self.list("checkpoints"))

    def check(self) -> None:
        """Raise when the store has stopped taking the run's files (the uploader gave up)."""
        if self.uploader is not None and self.uploader.error is not None:
            raise StorageError(self._upload_failure())

    def finish(self, timeout: float | None = None) -> None:
        """Wait until the store holds everything, then drop the staging copy and let the folder go; say what could
        not be sent."""
        try:
            if self.uploader is not None:
                if not self.uploader.wait(timeout):
                    raise StorageError(self._upload_failure())
                self.uploader.stop()
                self.uploader = None
                self.clear_staging()
        finally:  # the run writes nothing more either way (a notebook's next run in this process takes the folder)
            self.release()

    def release(self) -> None:
        """Let another run write the folder (this one writes nothing more)."""
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def remove_if_empty(self) -> None:
        """Take back the folders prepare() made when nothing was written in them: a run that failed to start
        leaves no empty run folder behind."""
        if self._made is not None and self._made.is_dir() and not any(p.is_file() for p in self._made.rglob("*")):
            shutil.rmtree(self._made, ignore_errors=True)

    def abandon(self) -> None:
        """Stop uploading at once (the run failed) and let the folder go; the staging copy stays for the next
        attempt."""
        if self.uploader is not None:
            self.uploader.stop()
            self.uploader = None
        self.release()

    def _upload_failure(self) -> str:
        up = self.uploader
        left = up.pending() if up is not None else []
        why = up.error if up is not None and up.error else "timed out"
        names = ", ".join(op.rel for op in left[:3]) + (f" and {len(left) - 3} more" if len(left) > 3 else "")
        return (
            f"{self.url}: the store stopped taking the run's files ({why}); {len(left)} not uploaded "
            f"({names}), kept in {self.local}: run the same command again on this machine to upload them and continue"
        )


NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "fuse", "9p", "ceph", "glusterfs", "lustre", "gpfs", "beegfs")


def network_filesystem(path: str) -> str:
    """The type of a network (or FUSE) filesystem that `path` lies on, from /proc/mounts; '' for a local disk."""
    try:
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return ""
    best, kind = "", ""
    for fields in mounts:
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind if kind.split(".")[0] in NETWORK_FS else ""
