"""Google Cloud conventions: the filesystem behind any URL (with gs:// credentials found once and named to the
user), preflight checks of every location a run touches, Vertex AI's output variables, and Cloud Storage FUSE.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import fsspec
from fsspec.core import split_protocol, url_to_fs

from job.errors import DataError, StorageError, one_line

# gcsfs's experimental zonal/HNS layer asks every bucket for its type over gRPC before the first request: an extra
# round trip per bucket on GCS, and a 60 s stall against emulators. It helps with folder renames, which this job
# never does (commits are pointer objects), so the plain JSON API is used unless the user chose otherwise.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

# gcsfs logs each request it gives up on with a traceback; the job reports such failures itself, in one line.
logging.getLogger("gcsfs").addHandler(logging.NullHandler())

GCS_PROTOCOLS = ("gs", "gcs")
SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"


def is_gcs(url: str) -> bool:
    return split_protocol(url)[0] in GCS_PROTOCOLS


@functools.cache
def gcs_credentials() -> tuple[Any, str]:
    """(token for gcsfs, where it came from), found the way Google's client libraries do, once per process."""
    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if emulator not in ("", "default"):
        return "anon", f"anonymous (storage emulator at {emulator})"
    key = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS", "")
    if key and not os.path.isfile(key):
        raise StorageError(f"GOOGLE_APPLICATION_CREDENTIALS={key}: no such key file")
    import google.auth
    from google.auth.exceptions import DefaultCredentialsError

    try:
        credentials, project = google.auth.default(scopes=[SCOPE])
    except DefaultCredentialsError as e:
        if key:  # the file is there: it is what is wrong (google-auth's args: the message, then the cause)
            why = "; ".join(one_line(a) if isinstance(a, BaseException) else str(a) for a in e.args) or one_line(e)
            raise StorageError(f"GOOGLE_APPLICATION_CREDENTIALS={key}: not a usable key file: {why}") from None
        raise StorageError(
            "gs://: no Google Cloud credentials found: set GOOGLE_APPLICATION_CREDENTIALS to a key file, run "
            "`gcloud auth application-default login`, or run on a VM or job with a service account"
        ) from None
    except (OSError, ValueError) as e:  # a malformed key file
        raise StorageError(f"gs://: the Google Cloud credentials cannot be used: {one_line(e)}") from None
    try:  # an expired login or a revoked key shows here, in seconds, rather than as retries of every request
        from google.auth.transport.requests import Request

        credentials.refresh(Request())
    except Exception as e:  # google-auth raises RefreshError, TransportError, and the transport's own errors
        raise StorageError(f"gs://: the Google Cloud credentials were refused: {one_line(e)}") from None
    if key:
        source = f"key file {key}"
    elif type(credentials).__module__.startswith("google.auth.compute_engine"):
        source = "the metadata server (this machine's service account)"
    else:
        source = "application default credentials (gcloud)"
    account = getattr(credentials, "service_account_email", None)
    if account and account != "default":
        source += f", {account}"
    return credentials, source + (f", project {project}" if project else "")


@functools.cache
def _gcs_filesystem():
    import gcsfs

    token, _ = gcs_credentials()
    # A request that hangs fails after this long and is retried (gcsfs retries 6 times); aiohttp's default, 5
    # minutes, would hold a run's last uploads for half an hour against a store that stopped answering.
    return gcsfs.GCSFileSystem(token=token, requests_timeout=60)


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and path of a URL; gs:// with the credentials gcs_credentials() names."""
    try:
        if is_gcs(url):
            fs = _gcs_filesystem()
            return fs, fs._strip_protocol(url)
        return url_to_fs(url)
    except (ValueError, ImportError) as e:
        raise StorageError(f"{url}: not a usable URL: {one_line(e)}") from None


def fetch_concurrency(url: str) -> dict[str, int]:
    """Keyword arguments for fetching many objects at once: GCS answers small reads in tens of milliseconds each,
    so many requests in flight; an emulator serves one request at a time from a listen queue of 5, where more than
    a few in flight only overflow the queue (each dropped connection stalls a second), so there, 4."""
    if not is_gcs(url):
        return {}
    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "") not in ("", "default")
    return {"batch_size": 4 if emulator else 64}


def describe_storage_error(url: str, e: BaseException) -> str:
    """One line on why a location cannot be used: a missing bucket, a refusal, or the store's own words."""
    text = one_line(e)
    bucket = split_protocol(url)[1].split("/", 1)[0]
    if is_gcs(url):
        who = gcs_credentials()[1]
        if isinstance(e, FileNotFoundError):
            return f"{url}: bucket {bucket} does not exist, or {who} cannot see it"
        if "Forbidden" in text or "403" in text or isinstance(e, PermissionError):
            return f"{url}: permission denied for {who} ({text})"
    if isinstance(e, PermissionError):
        return f"{url}: permission denied ({text})"
    return f"{url}: {text}"


def check_input(url: str, key: str) -> None:
    """An input must exist before a run starts (`key`: the setting that names it); a missing bucket or a refusal is
    a storage error (exit 4)."""
    fs, path = filesystem(url)
    try:
        if fs.exists(path):
            return
        if is_gcs(url):
            fs.info(path.split("/", 1)[0])  # the bucket: FileNotFoundError when it does not exist
    except Exception as e:  # gcsfs raises HTTP errors of its own besides OSError (and ValueError for bad names)
        raise StorageError(f"cannot read the data: {describe_storage_error(url, e)}") from None
    raise DataError(f"{key} {url}: no such file or folder")


def vertex_outputs() -> dict[str, str]:
    """Vertex AI's output folders, when the job runs there: run (the run folder), tensorboard, model."""
    env = os.environ
    run = env.get("AIP_CHECKPOINT_DIR") or env.get("AIP_MODEL_DIR")
    if not run:
        return {}
    found = {"run": run}
    if env.get("AIP_TENSORBOARD_LOG_DIR"):
        found["tensorboard"] = env["AIP_TENSORBOARD_LOG_DIR"]
    if env.get("AIP_MODEL_DIR") and env.get("AIP_CHECKPOINT_DIR"):
        found["model.pt"] = env["AIP_MODEL_DIR"].rstrip("/") + "/model.pt"
    return found


def fuse_path(url: str) -> str | None:
    """The Cloud Storage FUSE path of a gs:// URL when its bucket is mounted (Vertex AI mounts buckets at /gcs)."""
    if not is_gcs(url):
        return None
    bucket, _, rest = split_protocol(url)[1].partition("/")
    mount = os.path.join(os.environ.get("JOB_GCS_FUSE_ROOT", "/gcs"), bucket)
    return os.path.join(mount, rest) if os.path.isdir(mount) else None


def read_url(url: str) -> bytes | None:
    """A whole file at any URL; None when there is none, a StorageError when the store fails to say."""
    fs, path = filesystem(url)
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        return None
    except Exception as e:  # the stores' clients raise many types
        raise StorageError(f"cannot read {url}: {describe_storage_error(url, e)}") from None


def write_url(url: str, data: bytes) -> None:
    """A whole file at any URL, written at once (atomically in a local folder: sync.send)."""
    from job.storage.sync import send

    fs, path = filesystem(url)
    try:
        send(fs, path, data)
    except Exception as e:  # the stores' clients raise many types
        raise StorageError(f"cannot write {url}: {describe_storage_error(url, e)}") from None
