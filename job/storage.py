"""Run folders at any fsspec URL. Every file is written to a local folder first (atomically), and mirrored to
the URL when it is remote (gs://, memory://, ...), so TensorBoard and the loop only ever touch local disk.

A commit on an object store has no atomic rename: callers upload the payload, then its manifest, then the
pointer, and readers trust only what the pointer (or a manifest) names and checksums.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from job.errors import StorageError, one_line


def _file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


FILE_MODE = _file_mode()


class RunDir:
    """One run's output folder: `local` is where files are written, `url` where they must end up."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/") or url
        try:
            self.fs, self.root = url_to_fs(self.url)
        except (ValueError, ImportError) as e:
            raise StorageError(f"{url}: not a usable output URL: {one_line(e)}") from None
        self.remote = not isinstance(self.fs, LocalFileSystem)
        self.local = Path(tempfile.mkdtemp(prefix="job-staging-")) if self.remote else Path(self.root)

    def path(self, rel: str) -> Path:
        """The local path of a file of the run (a staging copy when the run is remote)."""
        return self.local / rel

    def remote_path(self, rel: str) -> str:
        return f"{self.root.rstrip('/')}/{rel}"

    def prepare(self) -> None:
        """Make sure the folder can be written, before any work is done."""
        try:
            self.local.mkdir(parents=True, exist_ok=True)
            probe = self.local / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
            if self.remote:
                self.fs.pipe_file(self.remote_path(".probe"), b"")
                self.fs.rm_file(self.remote_path(".probe"))
        except OSError as e:
            raise StorageError(f"{self.url}: cannot write the output folder: {one_line(e)}") from None

    def write(self, rel: str, data: bytes) -> None:
        """Write a file of the run atomically (temporary file, fsync, rename) and upload it when remote."""
        target = self.path(rel)
        tmp = None
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
            os.fchmod(fd, FILE_MODE)  # mkstemp makes files private; a run's files are as readable as any other
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except OSError as e:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            raise StorageError(f"{self.url}: cannot write {rel}: {one_line(e)}") from None
        self.upload(rel)

    def upload(self, *rels: str) -> None:
        """Copy local files of the run to the remote URL, in the order given (no-op for a local run)."""
        if not self.remote:
            return
        for rel in rels:
            try:
                self.fs.put_file(str(self.path(rel)), self.remote_path(rel))
            except OSError as e:
                raise StorageError(f"{self.url}: cannot upload {rel}: {one_line(e)}") from None

    def upload_tree(self, rel_dir: str) -> None:
        """Upload every file under a local folder of the run (TensorBoard's event files)."""
        base = self.path(rel_dir)
        if self.remote and base.is_dir():
            self.upload(*(str(p.relative_to(self.local)) for p in sorted(base.rglob("*")) if p.is_file()))

    def read(self, rel: str) -> bytes | None:
        """A file of the run as stored at the URL, or None when there is none."""
        try:
            return self.fs.cat_file(self.remote_path(rel))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StorageError(f"{self.url}: cannot read {rel}: {one_line(e)}") from None

    def list(self, rel_dir: str) -> list[str]:
        """Names of the files in a folder of the run at the URL (empty when there is no such folder)."""
        try:
            entries = self.fs.ls(self.remote_path(rel_dir), detail=False)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StorageError(f"{self.url}: cannot list {rel_dir}: {one_line(e)}") from None
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def delete(self, rel: str) -> None:
        self.path(rel).unlink(missing_ok=True)
        if self.remote:
            try:
                self.fs.rm_file(self.remote_path(rel))
            except FileNotFoundError:
                pass
            except OSError as e:
                raise StorageError(f"{self.url}: cannot delete {rel}: {one_line(e)}") from None

    def has_run(self) -> bool:
        """Whether the folder already holds a run (its config or checkpoints)."""
        return self.read("config.yaml") is not None or bool(self.list("checkpoints"))

    def close(self) -> None:
        """Drop the local staging copy of a remote run."""
        if self.remote:
            shutil.rmtree(self.local, ignore_errors=True)
