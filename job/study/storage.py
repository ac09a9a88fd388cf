"""Where a sweep's study lives: its Optuna storage URL, checked (SQLite only on a local disk, where its locks hold),
and opened with heartbeats, so that a trial whose worker went silent is taken over by the next."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from job.errors import ConfigError, StorageError, one_line
from job.retry import Backoff, retry
from job.storage.run_folder import network_filesystem

if TYPE_CHECKING:
    import optuna

HEARTBEAT_S = 2  # a running trial's sign of life in the study
GRACE_S = 10  # a trial silent this long was lost with its worker: the next worker takes it over
OPEN_BACKOFF = Backoff(1.0, 1.0)  # a second between tries of opening the storage


def storage_url(study: str, output: str) -> str:
    """The study's storage: --study, or study.db in a local output folder; SQLite refused where its locks fail."""
    if not study:
        if "://" in output and not output.startswith("file://"):
            raise ConfigError(
                f"--output {output} is not a local folder, where study.db would go: pass --study postgresql://... "
                "(workers on several machines) or --study sqlite:///LOCAL/PATH.db"
            )
        study = f"sqlite:///{os.path.abspath(output.removeprefix('file://'))}/study.db"
    scheme = study.partition("://")[0]
    if scheme == "sqlite":
        path = study.removeprefix("sqlite:///")
        if "://" in path or path.startswith("gs:/"):
            raise ConfigError(f"--study {study}: SQLite needs a local file; use --study postgresql://... for a bucket")
        fs = network_filesystem(os.path.abspath(path))
        if not fs and os.path.abspath(path).startswith("/gcs/"):  # Vertex AI's Cloud Storage FUSE, mounted or not here
            fs = "Cloud Storage FUSE"
        if fs:
            raise ConfigError(
                f"--study {study}: the file is on a network filesystem ({fs}), where SQLite's locks are not safe: use "
                "--study postgresql://... or a sqlite path on a local disk"
            )
    elif not scheme.startswith(("postgresql", "mysql")):
        raise ConfigError(f"--study {study}: expected sqlite:///PATH or postgresql://USER@HOST:PORT/DB")
    return study


def open_storage(url: str) -> optuna.storages.RDBStorage:
    """The study's storage with heartbeats: a trial whose worker went silent is failed and retried (same params)."""
    import importlib.util

    import optuna

    kwargs: dict[str, Any] = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    engine = url
    if url.startswith("postgresql://") and not importlib.util.find_spec("psycopg"):  # SQLAlchemy 2.1's default
        engine = url.replace("postgresql://", "postgresql+psycopg2://", 1)
    if url.startswith("sqlite"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)

    def opened() -> optuna.storages.RDBStorage:
        return optuna.storages.RDBStorage(
            engine,
            engine_kwargs=kwargs,
            heartbeat_interval=HEARTBEAT_S,
            grace_period=GRACE_S,
            heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=None),
        )

    try:  # workers starting together on a fresh database race to create its tables: the loser tries again
        return retry(opened, OPEN_BACKOFF, tries=3)
    except Exception as e:  # sqlalchemy's and the drivers' errors
        raise StorageError(f"--study {masked(url)}: cannot open the study's storage: {one_line(e)}") from None


def masked(url: str) -> str:
    """A storage URL without its password."""
    head, sep, rest = url.partition("://")
    user, at, host = rest.rpartition("@")
    return f"{head}{sep}{user.split(':')[0]}{':***' if ':' in user else ''}{at}{host}" if at else url
