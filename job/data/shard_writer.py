"""Shards written: images spooled to one local file as they are read and checked, then cut into WebDataset-style
tar shards of a split in a shuffled order, each put into its place (renamed on a local disk, uploaded to a store)
when full. Memory holds one shard and the spool's offsets, whatever the data set's size."""

from __future__ import annotations

import io
import os
import tarfile
from array import array
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from fsspec.implementations.local import LocalFileSystem
from PIL import Image
from tqdm import tqdm

from job.data.files import Log
from job.data.image import UnreadableImage, heif_readable, image_size, pixel_bytes
from job.data.image import pixels as image_pixels
from job.data.shards import PIXELS
from job.data.split import is_image_name
from job.errors import StorageError
from job.storage.cloud import describe_storage_error, filesystem


class Spool:
    """Every image appended to one local file, with where each lies, its name and extension."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / "images.spool"
        self.f = open(self.path, "wb")  # noqa: SIM115 (closed by spool() once every image is in)
        self.offsets, self.sizes = array("q"), array("q")
        self.names: list[str] = []
        self.exts: list[str] = []
        self.end = 0
        self.largest = 0  # pixels of the largest image

    def add(self, name: str, data: bytes, ext: str) -> None:
        self.offsets.append(self.end)
        self.sizes.append(len(data))
        self.names.append(name)
        self.exts.append(ext)
        self.f.write(data)
        self.end += len(data)

    def ext(self, i: int) -> str:
        return self.exts[i]

    def __len__(self) -> int:
        return len(self.offsets)


def spool(
    entries: Iterable[tuple[str, bytes]], folder: Path, log: Log, src: str
) -> tuple[Spool, set[tuple[int, int]], list[dict[str, str]]]:
    """Every image decoded once to check it (a truncated photo is found here, not mid-epoch) and appended to the
    spool; the image sizes seen (up to 17 of them); the files that could not be decoded, skipped (the caller
    names them)."""
    sp = Spool(folder)
    sizes: set[tuple[int, int]] = set()
    skipped: list[dict[str, str]] = []
    log(f"shard: reading {src}")
    with tqdm(desc="reading", unit=" images", disable=None, mininterval=1) as bar:
        for name, data in entries:
            try:
                size = image_size(data, name)
            except UnreadableImage as e:
                skipped.append({"path": name, "reason": e.reason})
                continue
            if len(sizes) <= 16:
                sizes.add(size)
            sp.largest = max(sp.largest, size[0] * size[1])
            sp.add(name, data, member_ext(name, data))
            bar.update()
    sp.f.close()
    return sp, sizes, skipped


# A shard member's extension for an image whose name has none of ours (a manifest may name images any way). The
# host decoder reads any image by its content; the name routes JPEGs to the GPU's decoder.
FORMAT_EXTS = {"JPEG": "jpg", "MPO": "jpg", "PNG": "png", "WEBP": "webp", "HEIF": "heic", "AVIF": "avif", "GIF": "gif"}


def member_ext(name: str, data: bytes) -> str:
    """The extension an image is stored under in a shard: its own, else that of its format."""
    if is_image_name(name):
        return name.rsplit(".", 1)[-1].lower()
    heif_readable()
    with Image.open(io.BytesIO(data)) as img:
        return FORMAT_EXTS.get(img.format or "", "png")


def target(label: str | tuple[str, ...], classes: list[str]) -> int | str:
    """What a sample's shard member holds of its label: its class index (.cls), or multi-label one character 0 or 1
    a class (.labels: "01001")."""
    if isinstance(label, tuple):
        return "".join("1" if c in label else "0" for c in classes)
    return classes.index(label)


def write_shards(
    sp: Spool,
    items: list[tuple[int, int]],
    rng: np.random.Generator,
    dst: str,
    split: str,
    tmp: Path,
    shard_bytes: int,
    shard_samples: int,
    log: Log,
    decoded: bool = False,
) -> list[dict]:
    """The split's samples (spool index, label) in a shuffled order, cut into shards, each written to DST/<split>/
    when full; `decoded`: each image as its pixels (job/data/image.py's pixel_bytes), else its file's bytes."""
    order = rng.permutation(len(items))
    seen: Counter = Counter()
    copy = []  # a manifest may name an image twice: each row a sample of its own key (<split><image>-<copy>)
    for i, _ in items:
        copy.append(seen[i])
        seen[i] += 1
    entries: list[dict] = []
    pending: list[int] = []
    pending_bytes = 0

    def flush() -> None:
        name = f"{split}/{split}-{len(entries):06d}.tar"
        part = tmp / "shard.tar"
        with open(sp.path, "rb") as spooled, tarfile.open(part, "w", format=tarfile.USTAR_FORMAT) as tar:
            for n in pending:
                i, label = items[n]
                spooled.seek(sp.offsets[i])
                key = f"{split}{i:08d}" + (f"-{copy[n]}" if copy[n] else "")  # a folder's: as ever
                data, ext = spooled.read(sp.sizes[i]), sp.ext(i)
                if decoded:  # the one decoding every host path uses, once, here
                    data, ext = pixel_bytes(image_pixels(data, sp.names[i])), PIXELS
                add(tar, f"{key}.{ext}", data)
                add(tar, f"{key}.{'labels' if isinstance(label, str) else 'cls'}", str(label).encode())
        entries.append({"url": name, "nsamples": len(pending), "filesize": part.stat().st_size})
        put(part, dst, name)

    with tqdm(total=len(items), desc=f"writing {split}", unit=" samples", disable=None, mininterval=1) as bar:
        for i in order.tolist():
            size = sp.sizes[items[i][0]] + 2048  # the image, its .cls, two headers and padding (its file's size)
            if pending and (len(pending) >= shard_samples or pending_bytes + size > shard_bytes):
                flush()
                bar.update(len(pending))
                pending, pending_bytes = [], 0
            pending.append(i)
            pending_bytes += size
        if pending:
            flush()
            bar.update(len(pending))
    return entries


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    member = tarfile.TarInfo(name)
    member.size = len(data)
    tar.addfile(member, io.BytesIO(data))


def put(local: Path, dst: str, rel: str) -> None:
    """A finished file into DST at `rel`: renamed into place on a local disk, uploaded to a remote store."""
    fs, path = filesystem(dst)
    target = f"{path.rstrip('/')}/{rel}"
    try:
        if isinstance(fs, LocalFileSystem):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.replace(local, target)
        else:
            fs.put_file(str(local), target)
    except Exception as e:
        raise StorageError(f"cannot write {dst}/{rel}: {describe_storage_error(dst, e)}") from None
