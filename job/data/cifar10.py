"""CIFAR-10 in its own "python version" layout: the cifar-10-python.tar.gz archive or its cifar-10-batches-py/ folder.

The batches are pickles of numpy arrays. They are read with an unpickler that builds nothing but numpy arrays,
so a tampered file cannot run code.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path

import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem

from job.data.dataset import Dataset, Split
from job.data.files import Log, Source, read_entries, source
from job.data.formats import Format
from job.data.split import Roles
from job.errors import DataError, one_line

CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
BATCH_NAME = re.compile(r"(?:^|/)(data_batch_\d+|test_batch|batches\.meta)$")


def load_cifar10(cfg, cache: Path | None, log: Log) -> Dataset:
    """The train and test batches at cfg.path; remote data are kept in the folder `cache` (None: no cache)."""
    url = cfg.path
    src = source(url, exists=not cfg.download)  # a download makes it
    if cfg.download:
        download_if_missing(src)
    entries = read_entries(src, lambda name: BATCH_NAME.search(name) is not None, cache, log, maxdepth=2)
    blobs = {BATCH_NAME.search(name).group(1): data for name, data in entries}
    train_names = sorted((n for n in blobs if n.startswith("data_batch_")), key=lambda n: int(n.rsplit("_", 1)[1]))
    if not train_names or "test_batch" not in blobs:
        raise DataError(
            f"{url}: no CIFAR-10 python-version batches (data_batch_1..5, test_batch) found; "
            "use data.kind folder for image folders"
        )
    train = _join([read_batch(blobs[n], n, url) for n in train_names])
    test = read_batch(blobs["test_batch"], "test_batch", url)
    classes = CLASSES
    if "batches.meta" in blobs:
        names = _get(read_pickle(blobs["batches.meta"], "batches.meta", url), "label_names")
        if names:
            classes = [n.decode() if isinstance(n, bytes) else str(n) for n in names]
    val = None
    if cfg.val_split:  # the training images' own numbers, 1 to 50,000, are their keys
        role = Roles(cfg.split_seed, cfg.val_split, 0)
        held = torch.tensor([role(f"train/{i}") == "val" for i in range(len(train))])
        train, val = Split(train.x[~held], train.y[~held]), Split(train.x[held], train.y[held])
    return Dataset(train, test, classes, f"cifar10 {url}", val=val)


def read_batch(blob: bytes, name: str, url: str) -> Split:
    d = read_pickle(blob, name, url)
    data, labels = _get(d, "data"), _get(d, "labels")
    if not isinstance(data, np.ndarray) or labels is None or data.ndim != 2 or data.shape[1] != 3072:
        raise DataError(f"{url} {name}: expected 'data' N x 3072 uint8 and 'labels', not a CIFAR-10 batch")
    if len(labels) != len(data):
        raise DataError(f"{url} {name}: {len(data)} images but {len(labels)} labels")
    x = torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8)).view(-1, 3, 32, 32)
    return Split(x, torch.as_tensor(np.asarray(labels, dtype=np.int64)))


class ArrayUnpickler(pickle.Unpickler):
    """Builds dicts, lists, bytes and numpy arrays; refuses every other global a pickle names."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"): ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"): ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"): ("numpy", "ndarray"),
        ("numpy", "dtype"): ("numpy", "dtype"),
        ("_codecs", "encode"): ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refused to load {module}.{name}")
        return super().find_class(*self.ALLOWED[(module, name)])


def read_pickle(blob: bytes, name: str, url: str) -> dict:
    try:
        d = ArrayUnpickler(io.BytesIO(blob), encoding="bytes").load()
    except Exception as e:  # a corrupt pickle raises anything from EOFError to ValueError
        raise DataError(f"{url} {name}: not a readable CIFAR-10 batch: {one_line(e)}") from None
    if not isinstance(d, dict):
        raise DataError(f"{url} {name}: expected a pickled dict, got {type(d).__name__}")
    return d


def download_if_missing(src: Source) -> None:
    """Fetch the official archive with torchvision's downloader when the local folder holds no batches."""
    url, fs, path = src.url, src.fs, src.path
    if fs.exists(path) and fs.ls(path):
        return
    if not isinstance(fs, LocalFileSystem):
        raise DataError(f"{url}: data.download works on local paths only")
    import torchvision

    root = path.rstrip("/")
    if root.endswith("cifar-10-batches-py"):
        root = root[: -len("cifar-10-batches-py")] or "."
    try:
        torchvision.datasets.CIFAR10(root=root, train=True, download=True)
    except Exception as e:  # network failures surface as many exception types
        raise DataError(f"{url}: download failed: {one_line(e)}") from None


def _get(d: dict, key: str):
    return d.get(key.encode(), d.get(key))


def _join(splits: list[Split]) -> Split:
    return Split(torch.cat([s.x for s in splits]), torch.cat([s.y for s in splits]))


def load(cfg, cache: Path | None, log: Log, src: Source | None = None, started=None) -> Dataset:
    return load_cifar10(cfg, cache, log)


FORMAT = Format("cifar10", load, about="CIFAR-10's python-version batches (the archive, or its folder)")
