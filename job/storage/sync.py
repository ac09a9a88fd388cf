"""The background uploader of a remote run: mirrors the local staging folder to the run's URL from one thread,
in the order the run asked, so the loop never waits on the network.

Order is the commit protocol: a checkpoint's payload, then its manifest, then the pointer, each sent only after
the one before it arrived, so a half-uploaded checkpoint is never visible as committed. A failed upload is
retried with backoff; when the store has not accepted it within `timeout_s` seconds of its first try (plus a second
per MiB), the uploader stops, keeps everything not yet sent in order, and says so (`error`): the run then ends with
exit 4, its files kept locally. The bound is real: each request to an asynchronous store (gcsfs) runs on fsspec's
event loop with what is left of it, the client's own retries included, and is cancelled when it runs out or when
the uploader is stopped.
TensorBoard's event files grow by appends; each sync sends only the new bytes and joins them to the object in
the store by a server-side compose where the store has one (gcsfs `merge`), else the whole file.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import hashlib
import os
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import fsspec
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.local import LocalFileSystem

from job.errors import one_line
from job.retry import Backoff, Stopped, retry

SNAPSHOT_BYTES = 1 << 20
MAX_COMPOSES = 1000  # GCS allows 1,024 components per object; past this the file is sent whole once more
SLOWEST_BYTES_PER_S = 1 << 20  # a file gets the upload timeout plus a second per MiB: slower counts as stopped
UPLOAD_BACKOFF = Backoff(0.5, 8.0)  # seconds between tries of an upload, within its deadline


def _file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


FILE_MODE = _file_mode()


def write_atomic(target: Path, data: bytes, replace: bool = True) -> bool:
    """Write a file whole or not at all: a temporary file beside it, fsync, rename. `replace` False: only when there
    is no file there yet (a hard link in place of the rename); returns False when there was one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        os.fchmod(fd, FILE_MODE)  # mkstemp makes files private; a run's files are as readable as any other
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, target)
        else:
            link_or_create(Path(tmp), target, data)
    except FileExistsError:
        Path(tmp).unlink(missing_ok=True)
        return False
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    folder = os.open(target.parent, os.O_RDONLY)  # the rename itself, durable: a crash now still finds the file
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
    return True


def link_or_create(tmp: Path, target: Path, data: bytes) -> None:
    """The complete file `tmp` put at `target` only when nothing is there (FileExistsError otherwise): a hard link,
    atomic; where the filesystem has none (a Drive or Cloud Storage FUSE mount, exFAT), an exclusive create, also
    refused when something is there, written and synced at once (a reader may meet it half-written for a moment)."""
    try:
        os.link(tmp, target)
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in NO_LINKS:
            raise
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    tmp.unlink()


# What a filesystem without hard links answers os.link with.
NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV, errno.EMLINK, errno.EACCES}


def send(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Put bytes at a place in a store now: atomically where the store is a local folder (a Drive mount)."""
    if isinstance(fs, LocalFileSystem):
        write_atomic(Path(path), data)
    else:
        fs.pipe_file(path, data)


def create(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> bool:
    """Put bytes at a place only when nothing is there; False when something is. Atomic in a local folder and on GCS
    (gcsfs's mode="create" is a generation precondition); other stores check, then write, so their callers read back
    what they wrote."""
    if isinstance(fs, LocalFileSystem):
        return write_atomic(Path(path), data, replace=False)
    try:
        fs.pipe_file(path, data, mode="create")
    except FileExistsError:
        return False
    except TypeError:  # an fsspec or gcsfs older than their exclusive writes (2025): check, then write
        if fs.exists(path):
            return False
        fs.pipe_file(path, data)
    return True


def append(path: str, data: bytes) -> None:
    """Add bytes to the end of a file in a local folder, durably."""
    with open(path, "ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@dataclass(frozen=True)
class Op:
    kind: str  # put | delete | tree (every file under a folder, growing files by their new bytes)
    rel: str
    data: bytes | None = None  # put: the file as it was when queued (small files, rewritten in place)


class Uploader:
    """Mirrors files of the folder `local` to the store: `place(rel)` gives the (filesystem, path) where a file
    belongs. Gives up when the store has refused an upload for `timeout_s` seconds; syncs growing files' folders
    every `tree_every_s` seconds while nothing else is queued."""

    def __init__(
        self,
        local: Path,
        place: Callable[[str], tuple[fsspec.AbstractFileSystem, str]],
        timeout_s: float,
        tree_every_s: float,
    ) -> None:
        self.local, self.place, self.timeout_s, self.tree_every_s = local, place, timeout_s, tree_every_s
        self.queue: deque[Op] = deque()
        self.cond = threading.Condition()
        self.trees: set[str] = set()  # folders synced every tree_every_s while the run goes on
        self.sent: dict[str, tuple[int, int]] = {}  # growing file -> (bytes in the store, composes so far)
        self.error: str | None = None
        self._deleting: set[str] = set()  # files queued for deletion, whose local copies wait for their turn
        self._stop = threading.Event()
        self._busy = False
        self._request: concurrent.futures.Future | None = None  # a request under way to an asynchronous store
        self._deadline = 0.0  # when the op under way must have reached the store
        self._thread = threading.Thread(target=self._work, name="job-uploader", daemon=True)
        self._thread.start()

    def put(self, rel: str) -> None:
        """Queue a file. Small files are read now: a pointer rewritten by the next commit must still arrive as it
        was, after its own checkpoint and before the next one. Large files (payloads) are never rewritten."""
        path = self.local / rel
        small = path.is_file() and path.stat().st_size <= SNAPSHOT_BYTES
        self._add(Op("put", rel, path.read_bytes() if small else None))

    def delete(self, rel: str) -> None:
        """Queue a deletion: the store's copy, then the local one. Until then the file counts as gone."""
        with self.cond:
            self._deleting.add(rel)
            self._add(Op("delete", rel))

    def deleting(self, rel: str) -> bool:
        """Whether a file is queued for deletion (its local copy may still be there)."""
        with self.cond:
            return rel in self._deleting

    def tree(self, rel_dir: str) -> None:
        with self.cond:
            self.trees.add(rel_dir)
            waiting = list(self.queue)[1:] if self._busy else self.queue  # the op under way may have read already
            if Op("tree", rel_dir) not in waiting:  # one sync still to start covers every change before it
                self._add(Op("tree", rel_dir))

    def _add(self, op: Op) -> None:
        with self.cond:
            self.queue.append(op)
            self.cond.notify_all()

    def pending(self) -> list[Op]:
        with self.cond:
            return list(self.queue)

    def wait(self, timeout: float | None = None) -> bool:
        """Until everything asked for is in the store (True), the uploader gave up, or the timeout passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while (self.queue or self._busy) and self.error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.cond.wait(left)
            return self.error is None

    def stop(self) -> None:
        """End the thread: a request under way to an asynchronous store is cancelled, so this returns at once. A
        local write (a Drive mount) cannot be cancelled; this waits up to a minute for it, and a thread that outlives
        that changes nothing more (every change it makes is checked against the stop first)."""
        with self.cond:
            self._stop.set()
            if self._request is not None:
                self._request.cancel()
            self.cond.notify_all()
        self._thread.join(timeout=60)

    def _work(self) -> None:
        while not self._stop.is_set():
            with self.cond:
                if not self.queue:
                    self.cond.wait(self.tree_every_s)
                    if not self.queue:  # quiet for a while: pick up what TensorBoard flushed since
                        self.queue.extend(Op("tree", d) for d in sorted(self.trees))
                    continue
                op = self.queue[0]
                self._busy = True
            done = self._attempt(op)
            with self.cond:
                self._busy = False
                if done and not self._stop.is_set():
                    self.queue.popleft()
                self.cond.notify_all()
            if not done:
                return  # gave up: the rest stays queued, in order, for the caller to report

    def _attempt(self, op: Op) -> bool:
        """Whether the op reached the store: tried again until its deadline (False, with `error` said) or a stop."""
        size = len(op.data) if op.data is not None else self._size(op)
        self._deadline = time.monotonic() + self.timeout_s + size / SLOWEST_BYTES_PER_S
        try:
            retry(lambda: self._do(op), UPLOAD_BACKOFF, deadline=self._deadline, stop=self._stop)
            return True
        except Stopped:
            return False
        except Exception as e:  # the stores' clients raise many types (HTTP, connection, timeout)
            why = "no answer" if isinstance(e, (TimeoutError, asyncio.TimeoutError)) else one_line(e)
            with self.cond:
                self.error = f"{op.kind} {op.rel}: {why}"
                self.cond.notify_all()
            return False

    def _size(self, op: Op) -> int:
        """The bytes an op sends, as far as the folder tells now."""
        path = self.local / op.rel
        with contextlib.suppress(OSError):
            if op.kind == "put":
                return path.stat().st_size
            if op.kind == "tree" and path.is_dir():
                return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        return 0

    def _call(self, fs: fsspec.AbstractFileSystem, method: str, *args):
        """fs.method(*args), bounded by the op's deadline and by stop(): an asynchronous store's coroutine runs on
        its event loop with the time left and is cancelled by stop(); any other store's call runs as it is."""
        if not isinstance(fs, AsyncFileSystem):
            return getattr(fs, method)(*args)
        left = max(self._deadline - time.monotonic(), 0.001)
        coro = asyncio.wait_for(getattr(fs, f"_{method}")(*args), timeout=left)
        with self.cond:
            if self._stop.is_set():
                coro.close()
                raise concurrent.futures.CancelledError
            self._request = request = asyncio.run_coroutine_threadsafe(coro, fs.loop)
        try:
            return request.result()
        finally:
            with self.cond:
                self._request = None

    def _send(self, fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
        if isinstance(fs, LocalFileSystem):
            write_atomic(Path(path), data)
        else:
            self._call(fs, "pipe_file", path, data)

    def _do(self, op: Op) -> None:
        if op.kind == "delete":  # the local copy goes after the store's, so puts queued before never miss it
            fs, remote = self.place(op.rel)
            with contextlib.suppress(FileNotFoundError):
                self._call(fs, "rm_file", remote)
            with self.cond:
                if self._stop.is_set():
                    return
                (self.local / op.rel).unlink(missing_ok=True)
                self._deleting.discard(op.rel)
        elif op.kind == "put":
            self._send(*self.place(op.rel), op.data if op.data is not None else (self.local / op.rel).read_bytes())
        else:
            base = self.local / op.rel
            for path in sorted(base.rglob("*")) if base.is_dir() else []:
                if path.is_file() and not path.name.startswith("."):
                    self._send_growing(str(path.relative_to(self.local)), path)

    def _send_growing(self, rel: str, path: Path) -> None:
        """An append-only file: the new bytes only, composed onto the object in the store."""
        size = path.stat().st_size
        sent, composes = self.sent.get(rel, (-1, 0))
        if size == sent:
            return
        fs, remote = self.place(rel)
        with open(path, "rb") as f:
            data = f.read(size)
        local = isinstance(fs, LocalFileSystem)
        can_add = local or hasattr(fs, "merge")  # append to a local file, or compose in GCS
        if sent < 0 or sent > size or composes >= MAX_COMPOSES or not can_add:
            self._send(fs, remote, data)  # the first time, or a store that can neither append nor compose: whole
            self.sent[rel] = (size, 0)
            return
        delta = data[sent:]
        if local:
            self.sent.pop(rel, None)  # until the append is known to be whole
            append(remote, delta)
            self.sent[rel] = (size, composes)
            return
        # The part sits beside its object (compose needs one bucket), named so TensorBoard never reads it.
        part = f"{remote.rsplit('/', 1)[0]}/.job-part-{hashlib.sha256(rel.encode()).hexdigest()[:12]}"
        self._call(fs, "pipe_file", part, delta)
        try:
            self._call(fs, "merge", remote, [remote, part])
            stored = self._call(fs, "info", remote)["size"]
        finally:
            with contextlib.suppress(Exception):  # a part left behind is harmless; the next sync overwrites it
                self._call(fs, "rm_file", part)
        if stored != size:  # a retried compose can apply twice: send the file whole next time
            self.sent.pop(rel, None)
            raise OSError(f"{rel}: {stored} bytes in the store after a compose, {size} expected")
        self.sent[rel] = (size, composes + 1)
