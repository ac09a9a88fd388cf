"""`job shard SRC DST`: any format that lists its items (job/data/formats.py: an image folder or an archive of one,
and the formats of tables of images) packed into WebDataset-style shards (job/data/shards.py), samples shuffled
across shards with a seed; and the pack a run streams from, made once in the job's cache.

It streams: the items are read once, checked and appended to a spool file on local disk with their offsets; the
spool is then read in the shuffled order into shards of at most `shard_bytes` bytes and `shard_samples` samples,
each written to DST as it is finished (job/data/shard_writer.py). Memory holds one shard and the offsets, whatever
the data set's size. index.json, written last, records each shard's sample count; its presence makes a re-run a
no-op.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np
from fsspec.implementations.local import LocalFileSystem

from job.data.files import VERSION_KEYS, Log, Source, source
from job.data.formats import Format, found
from job.data.items import Columns, report_skipped
from job.data.placement import SMALL_IMAGE, decide_stored
from job.data.shard_writer import put, spool, target, write_shards
from job.data.shards import CLASSES, INDEX, SPLITS, read_json
from job.data.split import HoldOut, Inventory, count
from job.errors import ConfigError, DataError, StorageError, one_line
from job.storage.cloud import filesystem

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
    fmt: Format | None = None,
    pixels: bool = False,
) -> dict:
    """Pack SRC into shards at DST; returns DST's index. A DST already packed from SRC is left as it is. Each split
    gets at least `min_shards` shards where it has that many samples (torchrun's processes each need some). `hold`:
    the val and test shares held out of the training images where SRC has no val/ or test/ folder (by a hash of each
    file's path: job/data/split.py), so a folder packed and the same folder read into memory split alike. SRC's
    items, classes and splits are as its format (`fmt`; None: the one found from SRC) reads them, with `columns`
    where its rows name them. SRC: a URL, or the Source a run has resolved it to already. `pixels`: small images
    kept decoded (job/data/placement.py decides, from the largest image; a run's own pack to stream), else every
    image as its file's bytes."""
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
        index = pack_into(
            src,
            dst,
            local,
            log,
            shard_bytes,
            shard_samples,
            seed,
            min_shards,
            hold,
            columns,
            fmt or found(src.url),
            pixels,
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
    fmt: Format,
    pixels: bool,
) -> dict:
    if fmt.items is None:
        raise ConfigError(f"{src.url}: data.kind {fmt.name} cannot be packed into shards")
    items = fmt.items(src, hold, columns, log)  # its keys, labels and splits named (and checked) before any bytes
    with tempfile.TemporaryDirectory(prefix=".spool-", dir=local) as tmp:
        sp, sizes, undecoded = spool(items, Path(tmp), log, src.url)
        files, classes, missing = items.sorted(list(sp.names))
        skipped = missing + undecoded
        report_skipped(skipped, log)
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
            **({"columns": asdict(columns)} if fmt.columns else {}),
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


STREAM_SHARDS = 16  # shards per split at least, for a folder packed to stream: enough to deal over 16 processes


def packed_for_streaming(
    src: Source,
    cache: Path,
    log: Log,
    hold: HoldOut,
    columns: Columns = Columns(),
    skip: bool = True,
    fmt: Format | None = None,
    pixels: bool = True,
) -> str:
    """The shard folder data of a format that lists its items (`fmt`; None: the one found from SRC) streams from
    (data.placement=stream): packed once into `cache`, keyed by SRC's URL and its listing (the format's `listed`:
    names, sizes, versions; a table's own and those of the images it names) and the split settings, so a later run,
    or a resumed one, reads the same shards, and a changed SRC is packed again. SRC's other packs (earlier versions,
    other settings) are removed once no run reads them. `skip` false (data.skip_bad_samples): a file the pack
    skipped (undecodable, or named and not there) stops the run, named. `pixels`: small images kept decoded in the
    pack (job/data/placement.py's Stored, which its index records); false for a run resumed from a checkpoint of a
    version whose packs kept every image as its file, so that its saved byte offsets point into the same pack.

    Why a copy rather than reading the files as they are: a bucket serves many small objects slowly in any
    order but one pass, a .tar.gz cannot be read from a saved position, and shards give every process of a group
    its own balanced share with an exact position to resume from. Files of row groups too, rather than a reader
    whose unit is a row group: their row groups are as large as the writer made them (one per file, often), so they
    neither balance over processes nor shuffle well, and shards give them exact resume and every process count with
    no second streaming engine; the rows are read a row group at a time into the spool. It costs local disk about
    SRC's size (twice that while packing); a pack is the same bytes on any machine (SRC's order and seed 0), so a
    run resumed elsewhere packs it again and goes on where it stopped."""
    fs, path = src.fs, src.path
    fmt = fmt or found(src.url)
    version, size = fingerprint(src, columns, fmt)
    settings = repr((hold, columns)) if fmt.columns else repr(hold)
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
                src, str(dst), log, min_shards=STREAM_SHARDS, hold=hold, columns=columns, fmt=fmt, pixels=pixels
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


def fingerprint(src: Source, columns: Columns, fmt: Format) -> tuple[str, int]:
    """A digest of what SRC holds (each file's name, size and version, as its format lists them) and its size in
    bytes."""
    infos = fmt.listed(src, columns)
    lines = []
    for p, info in sorted(infos.items()):
        version = next((str(info[k]) for k in VERSION_KEYS if info.get(k)), "")
        lines.append(f"{p} {info.get('size')} {version}")
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]
    return digest, sum(int(i.get("size") or 0) for i in infos.values())
