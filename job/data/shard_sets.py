"""A shard folder opened: its splits' shards in name order with their sample counts and classes, from its index
(`job shard`'s) or, for shards of other tools, from its listing with each shard read through once and its tally
cached; train/ carved into val (and test) by key where the folder has none. The tars themselves are read by
job/data/shards.py. This module does not import torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from job.data.files import Log, source
from job.data.shards import CLASSES, INDEX, SPLITS, Carve, Shard, ShardFile, read_json, read_text, samples
from job.data.split import HoldOut, Inventory, count
from job.errors import DataError, StorageError, one_line
from job.storage.cloud import describe_storage_error
from job.storage.sync import write_atomic

COUNTS = "tallies 2"  # the counts cache's format: an earlier one's files are counted again


@dataclass
class ShardSet:
    """One data set's shards: per split, its shards in name order with their sample counts; the class names."""

    url: str
    splits: dict[str, list[Shard]]
    classes: list[str]
    image_sizes: list[tuple[int, int]]  # the (width, height) seen when packing; empty when unknown
    inventory: dict | None = None  # `job shard`'s record of the split (data.json's content), when it packed them
    multilabel: bool = False  # each sample's .labels member: any number of the classes (job shard's index says)
    stored: dict | None = None  # how a pack holds its images: decoded or as files (its index's record, if any)

    def samples(self, split: str) -> int:
        return sum(s.samples for s in self.splits.get(split, []))


def open_shards(url: str, cache: Path | None, log: Log, hold: HoldOut | None = None) -> ShardSet:
    """The shard folder at `url`: its index when it has one, else its listing with each shard counted once (the
    count cached in `cache` under the listing's names, sizes and versions). `hold`: the shares of train/'s samples
    held out for val (and test) where the folder has no val/ (test/) and no split of job shard's record: shards from
    other tools. A sample's split is then a hash of its key and the seed (job/data/split.py), as a folder's file's
    is of its path: the same samples however the data is read, and a run's data.json names them."""
    src = source(url)
    fs, path, root = src.fs, src.path, url.rstrip("/")
    index = read_json(fs, f"{path.rstrip('/')}/{INDEX}", url)
    if index is not None:
        try:
            splits = {
                s: [
                    Shard(f"{root}/{e['url']}", int(e["nsamples"]), int(e.get("filesize", 0)))
                    for e in index["splits"].get(s, [])
                ]
                for s in SPLITS
            }
            classes = [str(c) for c in index.get("classes", [])]
            sizes = [tuple(s) for s in index.get("image_sizes", [])]
            inventory = index.get("inventory")
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{url}/{INDEX}: not a shard index ({one_line(e)})") from None
        check_listed(fs, [s for split in SPLITS for s in splits[split]], root)
        carve = carving(splits, inventory, hold)
        listed = [(s.url, s.size, str(s.samples)) for s in splits["train"]]
        tallied = {"train": counted(listed, root, "train", cache, log, carve)} if carve is not None else {}
    else:
        listings = {s: listing(fs, path, root, s) for s in SPLITS}
        carve = carving(listings, None, hold)
        tallied = {s: counted(listings[s], root, s, cache, log, carve if s == "train" else None) for s in SPLITS}
        splits = {
            s: [Shard(u, t.samples, size, t.top) for (u, size, _), t in zip(listings[s], tallied[s])] for s in SPLITS
        }
        classes, sizes, inventory = [], [], None
    if not splits["train"]:
        raise DataError(f"{url}: no train/*.tar shards")
    if not splits["val"] and not splits["test"] and carve is None:
        held = ", and data.val_split holds none out of train/" if hold is not None else ""
        raise DataError(f"{url}: no test/*.tar (or val/*.tar) shards{held}")
    names = read_text(fs, f"{path.rstrip('/')}/{CLASSES}", url)
    if names is not None:
        classes = [line.strip() for line in names.splitlines() if line.strip()]
    if not classes:  # neither file names them: classes 0..the largest index seen
        classes = [str(c) for c in range(1 + max(s.top_label for split in SPLITS for s in splits[split]))]
    if hold is not None and not hold.val and not splits["val"] and inventory is None:
        log(
            f"data: {url} has no val/ shards and data.val_split is 0: evaluations report test and the model is "
            "chosen on test (data.val_split=0.1 holds a tenth of train/ out for val)"
        )
    if carve is not None:
        splits, inventory = carved(splits, tallied, carve, classes, root)
        total = sum(t.samples for t in tallied["train"])
        for role, share in (("val", carve.val), ("test", carve.test)):
            if share:
                log(
                    f"data: {url} has no {role}/ shards: {sum(s.samples for s in splits[role])} of train/'s {total} "
                    f"samples held out for {role} (data.{role}_split {share:g}, by a hash of each sample's key and "
                    "data.split_seed)"
                )
    stored = index.get("stored") if index else None
    return ShardSet(url, splits, classes, sizes, inventory, bool(index and index.get("multilabel")), stored)


def carving(splits: dict[str, list], inventory: dict | None, hold: HoldOut | None) -> HoldOut | None:
    """The shares of train/ held out for the splits the shards lack, where they record no split of their own."""
    if hold is None or inventory is not None:
        return None
    return hold.lacking(not splits["val"], not splits["test"])


def carved(
    splits: dict[str, list[Shard]], tallied: dict[str, list[Tally]], carve: HoldOut, classes: list[str], root: str
) -> tuple[dict[str, list[Shard]], dict]:
    """The splits with val (and test) taken out of train/'s shards by key, and the split's record (data.json)."""
    out: dict[str, list[Shard]] = {"train": [], "val": list(splits["val"]), "test": list(splits["test"])}
    per_label: dict[str, Counter] = {role: Counter() for role in SPLITS}
    held_out: dict[str, list[str]] = {"val": [], "test": []}
    for shard, tally in zip(splits["train"], tallied["train"]):
        name = shard.url[len(root) + 1 :]
        for role, labels in tally.labels.items():
            per_label[role].update(labels)
            if labels:
                top = max(labels)
                out[role].append(
                    Shard(shard.url, sum(labels.values()), shard.size, top, Carve(role, carve), shard.samples)
                )
        for role, keys in tally.held.items():
            held_out[role] += [f"{name}:{key}" for key in keys]
    for role in ("val", "test"):  # the splits the shards have, by class where they were counted
        for tally in tallied.get(role, []):
            per_label[role].update(tally.labels[role])
    counts = {role: count(per_label[role], classes) for role in SPLITS if per_label[role]}
    return out, Inventory(classes, counts, held_out, []).to_json()


def check_listed(fs, shards: list[Shard], root: str) -> None:
    """Each shard the index lists is there at the size it records (one listing a folder the index names, before any
    reading): a shard gone, cut short or rewritten since it was packed is named now, not mid-epoch."""
    folders: dict[str, dict[str, int | None]] = {}
    for shard in shards:
        folder, _, name = fs._strip_protocol(shard.url).rpartition("/")
        if folder not in folders:
            try:
                listing = fs.find(folder, maxdepth=1, detail=True)
            except Exception as e:
                raise StorageError(f"cannot list the data: {describe_storage_error(root, e)}") from None
            folders[folder] = {p.rsplit("/", 1)[-1]: info.get("size") for p, info in listing.items()}
        size = folders[folder].get(name, -1)
        if size == -1:
            raise DataError(f"{shard.url}: listed in {INDEX} but not there")
        if shard.size and size is not None and int(size) != shard.size:
            raise DataError(
                f"{shard.url}: {size} bytes where {INDEX} records {shard.size} (cut short or changed since it was "
                "packed: pack it again)"
            )


@dataclass
class Tally:
    """One shard read through: its samples, its largest class index, its samples by split and class (the split
    the shard is in, or by key where train/ is carved), and the keys it holds out of train."""

    samples: int
    top: int
    labels: dict[str, Counter]
    held: dict[str, list[str]]

    def to_json(self) -> list:
        return [self.samples, self.top, {r: sorted(c.items()) for r, c in self.labels.items()}, self.held]

    @classmethod
    def from_json(cls, d: list) -> Tally:
        samples, top, labels, held = d
        return cls(int(samples), int(top), {r: Counter(dict(map(tuple, c))) for r, c in labels.items()}, held)


def tally(url: str, split: str, carve: HoldOut | None) -> Tally:
    """Read one shard through, its samples sorted by key where `carve` holds some out (job/data/split.py's Roles)."""
    roles = carve.roles() if carve is not None else None
    labels: dict[str, Counter] = {split: Counter()}
    held: dict[str, list[str]] = {}
    f = ShardFile(url)
    try:
        for sample in samples(f, 0, url):
            role = roles(sample.key) if roles is not None else split
            labels.setdefault(role, Counter())[sample.label()] += 1
            if role != split:
                held.setdefault(role, []).append(sample.key)
    finally:
        f.close()
    every = [label for c in labels.values() for label in c]
    return Tally(sum(sum(c.values()) for c in labels.values()), max(every, default=-1), labels, held)


def listing(fs, path: str, root: str, split: str) -> list[tuple[str, int, str]]:
    """A split's shards in name order, each as (URL, size, version)."""
    try:
        found = fs.find(f"{path.rstrip('/')}/{split}", maxdepth=1, detail=True)
    except Exception as e:
        raise StorageError(f"cannot list the data: {describe_storage_error(root, e)}") from None
    tars = sorted((p, info) for p, info in found.items() if p.endswith(".tar"))
    return [
        (
            f"{root}/{split}/{p.rsplit('/', 1)[-1]}",
            int(info.get("size") or 0),
            str(info.get("generation") or info.get("mtime")),
        )
        for p, info in tars
    ]


def counted(
    shards: list[tuple[str, int, str]], root: str, split: str, cache: Path | None, log: Log, carve: HoldOut | None
) -> list[Tally]:
    """Each of a split's shards (URL, size, version) read through once (tally), kept in `cache` under their names,
    sizes, versions and the shares carved."""
    if not shards:
        return []
    described = "\n".join(f"{u.rsplit('/', 1)[-1]} {size} {version}" for u, size, version in shards)
    key = hashlib.sha256(f"{COUNTS}\n{root}\n{split}\n{described}\n{carve}".encode()).hexdigest()[:32]
    kept = cache / "shard-counts" / f"{key}.json" if cache is not None else None
    tallies = read_tallies(kept, len(shards))
    if tallies is None:
        t0 = time.perf_counter()
        tallies = [tally(u, split, carve) for u, _, _ in shards]
        took = time.perf_counter() - t0
        n = f"{len(shards)} shard{'s' if len(shards) != 1 else ''}"
        log(f"data: counted {sum(t.samples for t in tallies)} {split} samples in {n} in {took:.1f} s")
        if kept is not None:
            with contextlib.suppress(OSError):  # a read-only cache: count again next time
                text = json.dumps([t.to_json() for t in tallies])
                write_atomic(kept, text.encode())  # whole: a group's others may read it
    return tallies


def read_tallies(kept: Path | None, shards: int) -> list[Tally] | None:
    """The counts cache of a split's shards, or None where there is none or it cannot be used (an earlier
    version's, or a write cut short): counted again."""
    if kept is None or not kept.is_file():
        return None
    try:
        tallies = [Tally.from_json(d) for d in json.loads(kept.read_text())]
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return tallies if len(tallies) == shards else None
