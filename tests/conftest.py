"""Shared fixtures: small real data files (encoded images, CIFAR-10 pickles, CSV tables) made on the fly,
and a way to run `python -m job` as a user would."""

from __future__ import annotations

import io
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATASETS = Path(os.environ.get("JOB_SHARED_DATASETS", ROOT.parent / "shared" / "datasets"))
CIFAR_JPEG = SHARED_DATASETS / "cifar10-jpeg.tar.gz"


@pytest.fixture(autouse=True, scope="session")
def job_cache(tmp_path_factory) -> Path:
    """The job's local cache (remote data, staging of remote runs) for every run of the session, in and out of
    process: a temporary folder, never the user's ~/.cache."""
    root = tmp_path_factory.mktemp("job-cache")
    os.environ["JOB_CACHE_DIR"] = str(root)
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


EMULATOR = """
import http.server, sys
# The emulator serves one request at a time from a listen queue of 5: a client with many requests in flight (as
# the job's concurrent fetches, and GCS itself, expect) overflows it, and each dropped connection waits a second
# for TCP to try again. A longer queue keeps the emulator's answers as they are, only without those stalls.
http.server.HTTPServer.request_queue_size = 1024
from gcp_storage_emulator.__main__ import main
main(sys.argv[1:])
"""


def start_emulator(port: int, bucket: str, log) -> subprocess.Popen:
    """gcp-storage-emulator on 127.0.0.1:port, in memory, with one bucket."""
    args = ["start", "--host", "127.0.0.1", "--port", str(port), "--in-memory", f"--default-bucket={bucket}"]
    return subprocess.Popen([sys.executable, "-c", EMULATOR, *args], stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory) -> str:
    """A real GCS-compatible server (gcp-storage-emulator) on 127.0.0.1; gcsfs here and in the jobs the tests start
    talk to it (STORAGE_EMULATOR_HOST). Yields its URL."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("emulator") / "emulator.log", "wb")  # noqa: SIM115
    proc = start_emulator(port, "job-tests", log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while True:
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1).read()
            break
        except OSError:
            assert proc.poll() is None and time.time() < deadline, f"the GCS emulator did not start (see {log.name})"
            time.sleep(0.1)
    import fsspec

    os.environ.update(STORAGE_EMULATOR_HOST=url, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
    for protocol in (
        "gs",
        "gcs",
    ):  # fsspec.open / TensorBoard in the tests: anonymous, like the job against an emulator
        fsspec.config.conf.setdefault(protocol, {})["token"] = "anon"
    yield url
    proc.terminate()
    proc.wait(10)
    log.close()


class Bucket:
    """A fresh bucket on the emulator: `url(rel)` is gs://bucket/rel, `fs` a gcsfs client without listing caches."""

    def __init__(self, name: str) -> None:
        import gcsfs

        self.name = name
        self.fs = gcsfs.GCSFileSystem(token="anon", use_listings_cache=False, skip_instance_cache=True)
        self.fs.mkdir(name)

    def url(self, rel: str = "") -> str:
        return f"gs://{self.name}/{rel}".rstrip("/")

    def put_tree(self, local: Path, rel: str) -> None:
        files = [p for p in sorted(local.rglob("*")) if p.is_file()]
        self.fs.put([str(p) for p in files], [f"{self.name}/{rel}/{p.relative_to(local)}" for p in files])

    def names(self, rel: str = "") -> list[str]:
        root = f"{self.name}/{rel}".rstrip("/")
        return sorted(p[len(root) + 1 :] for p in self.fs.find(root))


@pytest.fixture
def bucket(gcs_server) -> Bucket:
    return Bucket(f"b-{uuid.uuid4().hex[:12]}")


def pattern_images(n_classes: int, per_class: int, size: int, seed: int = 0) -> tuple[np.ndarray, list[int]]:
    """uint8 N x 3 x size x size images whose class shows in colour and stripes, plus noise: learnable, not trivial."""
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for k in range(n_classes):
        for _ in range(per_class):
            img = rng.integers(0, 80, (3, size, size))
            img[k % 3] += 120
            img[:, :: (k % 4) + 2, :] += 50
            images.append(np.clip(img, 0, 255).astype(np.uint8))
            labels.append(k)
    return np.stack(images), labels


def write_image_folder(
    root: Path,
    n_classes: int = 3,
    per_class: int = 12,
    size: int = 16,
    fmt: str = "png",
    test_per_class: int = 4,
) -> Path:
    """root/train/<class>/*.png|jpg and root/test/<class>/*, real encoded files."""
    for split, count, seed in (("train", per_class, 0), ("test", test_per_class, 1)):
        images, labels = pattern_images(n_classes, count, size, seed)
        for i, (img, k) in enumerate(zip(images, labels)):
            folder = root / split / f"class{k}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{i:04d}.{fmt}").write_bytes(encode(img, fmt))
    return root


def write_cifar_batches(folder: Path, n_train: int = 100, n_test: int = 40) -> Path:
    """CIFAR-10's python-version files (data_batch_1..5, test_batch, batches.meta) with pattern images."""
    folder.mkdir(parents=True, exist_ok=True)
    x, y = pattern_images(10, n_train // 10, 32, 0)
    per = -(-len(x) // 5)
    for b in range(5):
        dump(
            {
                b"data": x[b * per : (b + 1) * per].reshape(-1, 3072),
                b"labels": y[b * per : (b + 1) * per],
                b"batch_label": f"training batch {b + 1} of 5".encode(),
            },
            folder / f"data_batch_{b + 1}",
        )
    tx, ty = pattern_images(10, n_test // 10, 32, 1)
    dump({b"data": tx.reshape(-1, 3072), b"labels": ty}, folder / "test_batch")
    names = [
        b"airplane",
        b"automobile",
        b"bird",
        b"cat",
        b"deer",
        b"dog",
        b"frog",
        b"horse",
        b"ship",
        b"truck",
    ]
    dump({b"label_names": names, b"num_vis": 3072}, folder / "batches.meta")
    return folder


def dump(obj, path: Path) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


def tar_folder(src: Path, archive: Path, arcname: str) -> Path:
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src, arcname=arcname)
    return archive


def job_env(extra_pythonpath: str = "") -> dict:
    """The environment of a `python -m job` process: this checkout first on PYTHONPATH."""
    paths = [str(ROOT), extra_pythonpath, os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def run_job(*args: str, cwd: Path | None = None, timeout: int = 300, env: dict | None = None):
    """`python -m job ARGS` in a fresh process, as a user runs it."""
    extra = dict(env or {})
    full_env = {**job_env(extra.pop("PYTHONPATH", "")), **extra}
    return subprocess.run(
        [sys.executable, "-m", "job", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env
    )


def invoke(args: list[str]) -> tuple[int, str]:
    """`python -m job ARGS` in this process (imports paid once): the exit code and what went to stderr. The signal
    handlers are put back after it, as a process of its own would leave them to nobody."""
    import contextlib
    import signal

    from job.cli import main

    err, argv = io.StringIO(), sys.argv
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    sys.argv = ["python -m job", *args]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                main()
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = argv
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return code, err.getvalue()


def start_job(*args: str, env: dict | None = None, **popen_kwargs) -> subprocess.Popen:
    """`python -m job ARGS` started in the background (to be signalled or killed), stderr captured."""
    return subprocess.Popen(
        [sys.executable, "-m", "job", *args],
        env={**job_env(), **(env or {})},
        text=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        **popen_kwargs,
    )


def sets(*overrides: str) -> list[str]:
    """--set arguments for each key=value."""
    return [arg for item in overrides for arg in ("--set", item)]


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    return write_image_folder(tmp_path / "images")


@pytest.fixture
def cifar_folder(tmp_path: Path) -> Path:
    return write_cifar_batches(tmp_path / "cifar-10-batches-py")


@pytest.fixture
def real_cifar_subset(tmp_path_factory) -> Path:
    """A few hundred real CIFAR-10 JPEGs from the shared copy, in the image-folder layout."""
    if not CIFAR_JPEG.is_file():
        pytest.skip(f"the shared CIFAR-10 copy is not at {CIFAR_JPEG} (set JOB_SHARED_DATASETS)")
    root = tmp_path_factory.mktemp("cifar-real")
    counts: dict[tuple[str, str], int] = {}
    limit = {"train": 40, "test": 10}
    with tarfile.open(CIFAR_JPEG) as tar:
        for member in tar:
            parts = member.name.split("/")
            if not member.isfile() or len(parts) < 4:
                continue
            split, cls = parts[-3], parts[-2]
            key = (split, cls)
            if counts.get(key, 0) >= limit.get(split, 0):
                if len(counts) == 20 and all(counts[k] >= limit[k[0]] for k in counts):
                    break
                continue
            counts[key] = counts.get(key, 0) + 1
            target = root / split / cls / parts[-1]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tar.extractfile(member).read())
    return root


def encode(img: np.ndarray, fmt: str = "png") -> bytes:
    """A 3 x H x W uint8 image as PNG or JPEG file bytes."""
    buf = io.BytesIO()
    Image.fromarray(img.transpose(1, 2, 0)).save(buf, format="PNG" if fmt == "png" else "JPEG", quality=95)
    return buf.getvalue()


# What a finished run folder (any URL) holds, read as a user would: for comparing an interrupted run with one that
# never stopped.
TIMING_KEYS = {"samples_per_s", "wall_s"}


def weights(url: str) -> dict:
    import fsspec
    import torch

    with fsspec.open(f"{url}/model.pt", "rb") as f:
        return torch.load(f, weights_only=True)


def metrics(url: str) -> list[dict]:
    import fsspec

    with fsspec.open(f"{url}/metrics.jsonl", "r") as f:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in f if line.strip()]


def train_losses(url: str) -> list[tuple[int, float]]:
    return scalars(url, "train/loss")


def scalars(url: str, tag: str) -> list[tuple[int, float]]:
    """(step, value) of one TensorBoard scalar of a run, from every event file, honouring purge markers."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(f"{url}/tensorboard", size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def assert_same_run(a: str, b: str) -> None:
    """Bit for bit on the CPU: the final weights, every evaluation (timings aside) and the logged training loss."""
    import torch

    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert metrics(a) == metrics(b)
    assert train_losses(a) == train_losses(b)


def pointer(url: str) -> dict:
    """The run's newest commit (checkpoints/latest.json)."""
    import fsspec

    with fsspec.open(f"{url}/checkpoints/latest.json") as f:
        return json.load(f)


STOPPING_MODEL = '''
import os, signal
from torch import nn

class Net(nn.Module):
    """DOC"""

    def __init__(self, num_classes):
        super().__init__()
        self.net = LAYERS
        self.steps, self.at = 0, int(os.environ.get("STOP_AT_STEP", "0"))

    def forward(self, x):
        if self.training:
            self.steps += 1
            if self.steps == self.at:
                os.kill(os.getpid(), signal.SIGTERM)
        return self.net(x)
'''


def stopping_model(layers: str, doc: str) -> str:
    """The source of a module defining Net(num_classes): `layers` (an nn.Sequential expression that may use
    num_classes) that sends its own process SIGTERM in training step $STOP_AT_STEP of each attempt (from 1; unset:
    never), as a preemption would."""
    return STOPPING_MODEL.replace("LAYERS", layers).replace("DOC", doc)


# The MLflow tracking server of the tracking and sweep tests.
def start_mlflow_server(root: Path, port: int) -> subprocess.Popen:
    args = ["--backend-store-uri", f"sqlite:///{root}/mlflow.db", "--artifacts-destination", str(root / "artifacts")]
    log = open(root / "server.log", "ab")  # noqa: SIM115 (the server writes it while it runs)
    return subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", *args, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.time() + 300  # the first start migrates the database: a minute on a busy machine
    while True:
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=2).read().strip() == b"OK":
                return
        except OSError:
            pass
        alive = proc.poll() is None and time.time() < deadline
        assert alive, f"the MLflow server did not start: {log.read_text()[-500:]}"
        time.sleep(0.5)


def stop_group(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(30)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory) -> str:
    """A real MLflow tracking server (SQLite backend, artifacts served by it) on 127.0.0.1, one per session; yields
    its URL."""
    root = tmp_path_factory.mktemp("mlflow")
    url = f"http://127.0.0.1:{free_port()}"
    proc = start_mlflow_server(root, int(url.rsplit(":", 1)[1]))
    wait_healthy(url, proc, root / "server.log")
    yield url
    stop_group(proc)
