"""`job shard SRC DST`: an image folder (train/<class>/*, test/<class>/*; at any URL, or a .tar/.tar.gz of one)
packed into WebDataset-style shards (job/data/shards.py), samples shuffled across shards with a seed.

It streams: the images are read once, checked and appended to a spool file on local disk with their offsets; the
spool is then read in the shuffled order into shards of at most `shard_bytes` bytes and `shard_samples` samples,
each written to DST as it is finished. Memory holds one shard and the offsets, whatever the data set's size.
index.json, written last, records each shard's sample count; its presence makes a re-run a no-op.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
from array import array
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

import numpy as np
from fsspec.implementations.local import LocalFileSystem
from PIL import Image
from tqdm import tqdm

from job.data.files import (
    VERSION_KEYS,
    Log,
    Source,
    beside,
    images_listed,
    is_manifest,
    read_bytes,
    read_entries,
    source,
)
from job.data.folder import Listing, check_files, report_skipped, sorted_files
from job.data.image import UnreadableImage, heif_readable, image_size, pixel_bytes
from job.data.image import pixels as image_pixels
from job.data.manifest import Columns
from job.data.parquet import is_parquet, parquet_listed
from job.data.placement import SMALL_IMAGE, decide_stored
from job.data.shards import CLASSES, INDEX, PIXELS, SPLITS, read_json
from job.data.split import Files, HoldOut, Inventory, count, is_image_name, label_names
from job.errors import ConfigError, DataError, StorageError, one_line
from job.storage.cloud import describe_storage_error, filesystem

# What a source spools: the spool, the image sizes seen, the files skipped, the files by split, and the classes.
Spooled = tuple["Spool", set[tuple[int, int]], list[dict[str, str]], Files, list[str]]
SHARD_BYTES, SHARD_SAMPLES = 256_000_000, 1000  # a shard at most: `job shard`'s --shard-size and --samples-per-shard
SIZE_UNITS = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "K": 1e3, "M": 1e6, "G": 1e9, "B": 1}


def parse_size(text: str) -> int:
    """'256MB', '1.5GB', '4000000' -> bytes."""
    t = text.strip().upper()
    unit = next((u for u in SIZE_UNITS if t.endswith(u)), "")
    try:
        value = float(t[: len(t) - len(unit)] if unit else t) * SIZE_UNITS.get(unit, 1)
    except ValueError:
        raise ConfigError(f"--shard-size: expected a size such as 256MB, got {text!r}") from None
    if value < 1e4:
        raise ConfigError(f"--shard-size: at least 10KB, got {text!r}")
    return int(value)


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


def pack(
    src: str | Source,
    dst: str,
    log: Log,
    *,
    shard_bytes: int = SHARD_BYTES,
    shard_samples: int = SHARD_SAMPLES,
    seed: int = 0,
    min_shards: int = 1,
    hold: HoldOut = HoldOut(),
    columns: Columns = Columns(),
    parquet: bool | None = None,
    pixels: bool = False,
) -> dict:
    """Pack SRC into shards at DST; returns DST's index. A DST already packed from SRC is left as it is. Each split
    gets at least `min_shards` shards where it has that many samples (torchrun's processes each need some). `hold`:
    the val and test shares held out of the training images where SRC has no val/ or test/ folder (by a hash of each
    file's path: job/data/split.py), so a folder packed and the same folder read into memory split alike. A
    manifest (.csv, .jsonl) as SRC: its images, classes and splits as data.kind manifest reads them (`columns`); parquet
    files (`parquet`; None: found from SRC), their rows' images as data.kind parquet reads them. SRC: a URL, or the
    Source a run has resolved it to already. `pixels`: small images kept decoded (job/data/placement.py decides,
    from the largest image; a run's own pack to stream), else every image as its file's bytes."""
    if shard_samples < 1:
        raise ConfigError(f"--samples-per-shard: expected a positive number, got {shard_samples}")
    out_fs, out_path = filesystem(dst)
    root = out_path.rstrip("/")
    url = src.url if isinstance(src, Source) else src
    done = read_json(out_fs, f"{root}/{INDEX}", dst)
    if done is not None:
        if done.get("source") != url:
            raise ConfigError(f"{dst} holds shards packed from {done.get('source')}: choose another destination")
        was = done.get("hold_out", {"val": 0.0, "test": 0.0, "split_seed": hold.seed})
        if (was["val"], was["test"], was["split_seed"]) != (hold.val, hold.test, hold.seed):
            raise ConfigError(
                f"{dst} was packed with --val-split {was['val']} --test-split {was['test']} --split-seed "
                f"{was['split_seed']}: pack into another destination for another split"
            )
        read = done.get("columns")
        if read is not None and {**asdict(Columns()), **read} != asdict(columns):  # packs before the labels' keys
            was = Columns(**{**asdict(Columns()), **read})
            shown = f"--path-column {was.path} --label-column {was.label} --split-column {was.split}"
            how = f", data.label_separator {was.separator!r}, data.task {was.task}"
            raise ConfigError(f"{dst} was packed with {shown}{how}: pack into another destination for other columns")
        counts = " / ".join(f"{sum(e['nsamples'] for e in done['splits'].get(s, []))} {s}" for s in SPLITS)
        log(f"shard: {dst} is already packed from {url} ({counts} samples)")
        return done
    src = src if isinstance(src, Source) else source(src)
    local = Path(out_path) if isinstance(out_fs, LocalFileSystem) else None
    made = local is not None and not local.exists()
    if local is not None:
        local.mkdir(parents=True, exist_ok=True)
    try:
        parquet = is_parquet(src.url) if parquet is None else parquet
        index = pack_into(
            src, dst, local, log, shard_bytes, shard_samples, seed, min_shards, hold, columns, parquet, pixels
        )
    except BaseException:
        if made and not any(local.iterdir()):  # a failed start leaves no empty folder behind
            local.rmdir()
        raise
    made_splits = ", ".join(
        f"{sum(e['nsamples'] for e in index['splits'][s])} {s} samples in {len(index['splits'][s])} shard"
        + ("s" if len(index["splits"][s]) != 1 else "")
        for s in SPLITS
        if index["splits"][s]
    )
    log(f"shard: {made_splits}, {len(index['classes'])} classes, in {dst}")
    return index


def pack_into(
    src: Source,
    dst: str,
    local: Path | None,
    log: Log,
    shard_bytes: int,
    shard_samples: int,
    seed: int,
    min_shards: int,
    hold: HoldOut,
    columns: Columns,
    parquet: bool,
    pixels: bool,
) -> dict:
    with tempfile.TemporaryDirectory(prefix=".spool-", dir=local) as tmp:
        if is_manifest(src.path):
            sp, sizes, skipped, files, classes = spool_manifest(src, Path(tmp), log, hold, columns)
        elif parquet:
            sp, sizes, skipped, files, classes = spool_parquet(src, Path(tmp), log, hold, columns)
        else:
            sp, sizes, skipped, files, classes = spool_folder(src, Path(tmp), log, hold)
        at = {name: i for i, name in enumerate(sp.names)}
        stored = decide_stored(sp.largest) if pixels else None
        rng = np.random.default_rng(seed)
        present = [r for r in SPLITS if files.roles[r]]
        if files.multilabel:  # an image counts once in its split, and once for each class it shows
            counts = {r: {c: sum(c in label for _, label in files.roles[r]) for c in classes} for r in present}
            images = {r: len(files.roles[r]) for r in present}
            inventory = Inventory(classes, counts, files.held_out, skipped, images)
        else:
            counts = {r: count([classes.index(c) for _, c in files.roles[r]], classes) for r in present}
            inventory = Inventory(classes, counts, files.held_out, skipped)
        index = {
            "format": "webdataset",
            "source": src.url,
            "seed": seed,
            "classes": classes,
            "image_sizes": sorted(sizes)[:16],
            "splits": {},
            "hold_out": {"val": hold.val, "test": hold.test, "split_seed": hold.seed},
            "inventory": inventory.to_json(),
            **({"columns": asdict(columns)} if is_manifest(src.path) or parquet else {}),
            **({"multilabel": True} if files.multilabel else {}),
            **({"stored": stored.saved()} if stored is not None else {}),
        }
        for split in SPLITS:
            items = [(at[name], target(c, classes)) for name, c in files.roles[split]]
            most = min(shard_samples, -(-len(items) // min_shards)) if items else shard_samples
            index["splits"][split] = write_shards(
                sp, items, rng, dst, split, Path(tmp), shard_bytes, most, log, stored is not None and stored.decoded
            )
        for rel, text in ((CLASSES, "".join(f"{c}\n" for c in classes)), (INDEX, json.dumps(index, indent=1))):
            (Path(tmp) / rel).write_text(text)
            put(Path(tmp) / rel, dst, rel)  # index.json last: its presence says DST is complete
    return index


def spool_folder(src: Source, folder: Path, log: Log, hold: HoldOut) -> Spooled:
    """An image folder's (or archive's) images spooled, sorted into classes and splits by their paths."""
    listing = Listing()
    sp, sizes, skipped = spool(read_entries(src, listing.keep, None, log), folder, log, src.url)
    report_skipped(skipped, log)
    files = sorted_files(list(sp.names), hold, src.url)
    listing.report(src.url, files, log)
    return sp, sizes, skipped, files, files.classes()


def spool_manifest(src: Source, folder: Path, log: Log, hold: HoldOut, columns: Columns) -> Spooled:
    """A manifest's images spooled, in the classes and splits its rows give (job/data/manifest.py); an image it
    names that is not there is skipped and named, as one that cannot be decoded is."""
    from job.data.manifest import Images, class_order, manifest_files

    url = src.url
    files, labels = manifest_files(url, read_bytes(src, None, log), columns, hold)  # columns: labels' separator, task
    classes = class_order(labels, {c for _, label in files.roles["train"] for c in label_names(label)})
    check_files(files, classes, url)
    images = Images(url, [p for role in files.roles.values() for p, _ in role], None, log)
    return spool_named(images, folder, log, url, files, classes)


def spool_parquet(src: Source, folder: Path, log: Log, hold: HoldOut, columns: Columns) -> Spooled:
    """Parquet rows' images spooled, a row group at a time, in the classes and splits job/data/parquet.py gives
    them; a row with no image (no bytes, no path, a path to no file) is skipped and named."""
    from job.data.parquet import ParquetData

    rows = ParquetData(src, columns, hold, None, log)
    if rows.table:
        raise ConfigError(f"{src.url}: a table of feature columns (no image column) is read into memory, not packed")
    check_files(rows.files, rows.classes, src.url)
    return spool_named(rows, folder, log, src.url, rows.files, rows.classes)


def spool_named(images, folder: Path, log: Log, src: str, files: Files, classes: list[str]) -> Spooled:
    """The images a table names (`images`: (name, bytes) iterated, then `missing()`) spooled; the rows whose image
    is not there or cannot be decoded dropped from `files` and named."""
    sp, sizes, skipped = spool(images, folder, log, src)
    there = set(sp.names)
    files.roles = {role: [(p, c) for p, c in items if p in there] for role, items in files.roles.items()}
    files.held_out = {role: [p for p in names if p in there] for role, names in files.held_out.items()}
    skipped = images.missing() + skipped
    report_skipped(skipped, log)
    return sp, sizes, skipped, files, classes


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


STREAM_SHARDS = 16  # shards per split at least, for a folder packed to stream: enough to deal over 16 processes


def packed_for_streaming(
    src: Source,
    cache: Path,
    log: Log,
    hold: HoldOut,
    columns: Columns = Columns(),
    skip: bool = True,
    parquet: bool = False,
    pixels: bool = True,
) -> str:
    """The shard folder an image folder, archive, manifest or parquet data set (`parquet`) streams from
    (data.placement=stream): packed once into
    `cache`, keyed by SRC's URL and its listing (names, sizes, versions; a manifest's own and those of the images
    it names in its folder) and the split settings, so a later run, or a resumed one, reads the same shards, and a
    changed SRC is packed again. SRC's other packs (earlier versions, other settings) are removed once no run reads
    them. `skip` false (data.skip_bad_samples): a file the pack skipped (undecodable, or named and not there)
    stops the run, named. `pixels`: small images kept decoded in the pack (job/data/placement.py's Stored, which
    its index records); false for a run resumed from a checkpoint of a version whose packs kept every image as its
    file, so that its saved byte offsets point into the same pack.

    Why a copy rather than reading the files as they are: a bucket serves many small objects slowly in any
    order but one pass, a .tar.gz cannot be read from a saved position, and shards give every process of a group
    its own balanced share with an exact position to resume from. Parquet too, rather than a reader whose unit is a
    row group: its row groups are as large as the writer made them (one per file, often), so they neither balance
    over processes nor shuffle well, and shards give it exact resume and every process count with no second
    streaming engine; the rows are read a row group at a time into the spool. It costs local disk about SRC's size
    (twice that while packing); a pack is the same bytes on any machine (SRC's order and seed 0), so a run resumed
    elsewhere packs it again and goes on where it stopped."""
    fs, path = src.fs, src.path
    version, size = fingerprint(src, columns, parquet)
    settings = repr((hold, columns)) if is_manifest(path) or parquet else repr(hold)
    settings += f" pixels up to {SMALL_IMAGE}" if pixels else ""  # another rule for keeping pixels: another pack
    version += f"-{hashlib.sha256(settings.encode()).hexdigest()[:6]}"  # another split is another pack
    stem = hashlib.sha256(fs.unstrip_protocol(path).encode()).hexdigest()[:16]
    folder = cache / "shards"
    dst = folder / f"{stem}-{version}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / f"{stem}.lock", "w")  # noqa: SIM115 (held until the pack is done)
    except OSError as e:
        raise StorageError(f"data.placement=stream: cannot use the job's cache {cache}: {one_line(e)}") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # torchrun's processes on one machine: one packs, the others wait for it
        for old in folder.glob(f"{stem}-*"):
            if old != dst and old.is_dir():
                remove_unread(old)  # SRC's pack of an earlier version or other settings, unless a run reads it
        if (dst / INDEX).is_file():
            log(f"data: streaming {src.url} from its shards in {dst}")
            index = read_json(LocalFileSystem(), str(dst / INDEX), str(dst))
        else:
            free = shutil.disk_usage(folder).free
            if free < 2 * size:
                raise DataError(
                    f"data.placement=stream: packing {src.url} into shards needs about {2 * size / 1e9:.1f} GB of "
                    f"local disk in {folder}, and {free / 1e9:.1f} GB are free: point JOB_CACHE_DIR at a larger disk, "
                    "or pack it with `python -m job shard SRC DST` and train on DST"
                )
            log(f"data: streaming {src.url}: packing it into shards in {dst} once (later runs read them)")
            index = pack(
                src, str(dst), log, min_shards=STREAM_SHARDS, hold=hold, columns=columns, parquet=parquet, pixels=pixels
            )
        reading(dst, cache)
    bad = index["inventory"]["skipped"]
    if bad and not skip:
        raise DataError(f"{src.url}: {bad[0]['path']}: {bad[0]['reason']} (data.skip_bad_samples is false)")
    return str(dst)


READING: list = []  # the packs this process reads, each with a shared lock held until the process ends


def reading(pack: Path, cache: Path) -> None:
    """Mark a pack as read by this process (a shared lock on <pack>/.reading, held until it exits), so that no run
    packing SRC again (changed, or with other split settings) removes it under a run still training from it."""
    try:
        f = open(pack / ".reading", "a")  # noqa: SIM115 (held for the life of the process)
        fcntl.flock(f, fcntl.LOCK_SH)
    except OSError as e:
        raise StorageError(f"data.placement=stream: cannot use the job's cache {cache}: {one_line(e)}") from None
    READING.append(f)


def remove_unread(pack: Path) -> None:
    """A pack removed when no process reads it (its lock taken at once); else, or where it cannot be, left."""
    try:
        with open(pack / ".reading", "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            shutil.rmtree(pack, ignore_errors=True)
    except OSError:
        return


def fingerprint(src: Source, columns: Columns, parquet: bool = False) -> tuple[str, int]:
    """A digest of what SRC holds (each file's name, size and version; an archive's own; a manifest's own and those
    of the images it names in its folder) and its size in bytes."""
    if is_manifest(src.path):
        infos = named(src, columns)
    elif parquet:
        infos = parquet_listed(src)
    else:
        infos = images_listed(src)
    lines = []
    for p, info in sorted(infos.items()):
        version = next((str(info[k]) for k in VERSION_KEYS if info.get(k)), "")
        lines.append(f"{p} {info.get('size')} {version}")
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]
    return digest, sum(int(i.get("size") or 0) for i in infos.values())


def named(src: Source, columns: Columns) -> dict[str, dict]:
    """A manifest and the images under its folder that its rows name (one listing): path -> info. Images it names
    by URL elsewhere are not watched: a change to one is not seen."""
    from job.data.manifest import manifest_files

    fs, path, url = src.fs, src.path, src.url
    folder = path.rsplit("/", 1)[0]
    try:  # read as the pack reads it: a misspelt column or a bad label named before any pack of SRC is touched
        files, _ = manifest_files(url, fs.cat_file(path), columns, HoldOut())
        paths = {fs._strip_protocol(beside(url, p)) for role in files.roles.values() for p, _ in role}
        return {path: fs.info(path)} | {p: i for p, i in fs.find(folder, detail=True).items() if p in paths}
    except (DataError, ConfigError):
        raise
    except Exception as e:  # the stores' clients raise many types
        raise StorageError(f"cannot list the data: {describe_storage_error(url, e)}") from None
