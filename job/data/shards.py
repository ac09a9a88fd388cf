"""WebDataset-style shards: a data set as a folder URL holding train/*.tar and test/*.tar, optionally classes.txt
(class names, one a line) and index.json (samples per shard, written by `job shard`).

A sample is the run of consecutive tar members sharing a key, the member's path up to the first dot of its file
name: `<key>.jpg|jpeg|png|webp|heic|...` (job/data/split.py's suffixes) holds the image and `<key>.cls` its class
index as text. Shards written by other tools in this convention load; without an index, each shard's samples are
counted once and the count is cached. Where such shards hold no val/ (test/), the share data.val_split
(data.test_split) of train/'s samples is that split, each sample by a hash of its key (open_shards, Carve).

Members are read by a small tar reader of our own: tarfile spends about 34 us a member (TarInfo objects,
checksums), this one about 2 us, which for a CIFAR-size epoch is 0.2 s of the training process's time, not 3 s.
It knows the byte offset of every sample, which is what lets a stream's position be saved and restored exactly.
It reads what other tools write: USTAR members, pax and GNU long-name headers (tarfile's default format and the
webdataset package's TarWriter), base-256 sizes; a sample's bytes start at the first extended header before its
first member, so a range read of them names it as the whole read did. A shard that ends without the tar's end
blocks, or holds another number of samples than its index says, is named: a cut shard never trains silently.
This module does not import torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import tarfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from job.data.files import Log, source
from job.data.split import IMAGE_SUFFIXES, HoldOut, Inventory, Roles, count
from job.errors import DataError, StorageError, one_line
from job.retry import Backoff, retry
from job.storage.cloud import describe_storage_error
from job.storage.sync import write_atomic

SPLITS = ("train", "val", "test")  # val optional, and test too where there is val
# A member of decoded pixels, where the run's own pack keeps small images decoded (job/data/pack.py): numpy's .npy of
# a uint8 H x W x 3 array, which webdataset's decoders read too.
PIXELS = "npy"
IMAGE_EXTS = (*(s.lstrip(".") for s in IMAGE_SUFFIXES), PIXELS)
INDEX = "index.json"
CLASSES = "classes.txt"
BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
COUNTS = "tallies 2"  # the counts cache's format: an earlier one's files are counted again
READ_RETRIES = 5  # a read that fails mid-shard is retried from where it stopped this many times
READ_BACKOFF = Backoff(0.2, 5.0)  # seconds between those tries


@dataclass(frozen=True)
class Carve:
    """A split held out of train/'s shards by key: the samples of a shard whose key job/data/split.py's Roles of
    `hold` sends to `role`."""

    role: str
    hold: HoldOut

    def roles(self) -> Roles:
        return self.hold.roles()


@dataclass(frozen=True)
class Shard:
    url: str
    samples: int  # the split's samples in it: all of them, unless carved
    size: int  # bytes
    top_label: int = -1  # the largest class index in it, when counted (classes.txt or the index name the classes)
    carve: Carve | None = None  # the split takes the samples of this role alone
    stored: int = -1  # with carve: every sample in the file, which reading it is checked against


@dataclass
class Sample:
    shard: int  # the shard's place in the list being read
    start: int  # byte offsets of the sample's first header and of what follows its last member
    end: int
    key: str
    members: dict[str, bytes]  # extension -> contents

    def image(self) -> tuple[str, bytes]:
        for ext in IMAGE_EXTS:
            if ext in self.members:
                return ext, self.members[ext]
        raise DataError(f"sample {self.key}: no image (.{'|.'.join(IMAGE_EXTS)}) among .{', .'.join(self.members)}")

    def label(self) -> int | list[float]:
        """The sample's class index (its .cls member); multi-label, its 0/1 target per class (a .labels member of
        one character 0 or 1 a class, in class order)."""
        hot = self.members.get("labels")
        if hot is not None:
            return [float(c == 49) for c in hot.strip()]  # 49: b"1"
        raw = self.members.get("cls")
        try:
            return int(raw.decode().strip())
        except (AttributeError, ValueError):
            raise DataError(f"sample {self.key}: no class index in a .cls member") from None


class ShardFile:
    """Sequential reads of one shard from an offset, served from chunks of `block_size` bytes (a tar is read in
    small pieces: a header, a member, its padding); a read that fails (a dropped connection, a store's error) is
    retried from where it stopped, READ_RETRIES times, before the store's error is raised."""

    def __init__(self, url: str, offset: int = 0, block_size: int = 8 << 20) -> None:
        self.url, self.pos, self.block_size = url, offset, block_size
        at = source(url, exists=False)  # a file the index names: its own URL
        self.fs, self.path = at.fs, at.path
        self.f = None
        self.chunk, self.used = b"", 0  # bytes read ahead of pos, and how many of them were handed out

    def read(self, n: int) -> bytes:
        if n < 0:
            raise ValueError("ShardFile.read needs a size")
        if self.used == len(self.chunk) and n >= self.block_size:  # a large read: no copy through the chunk
            data = self._read_raw(n)
            self.pos += len(data)
            return data
        chunk, at = self.ahead(n)
        data = chunk[at : at + n]
        self.skip(len(data))
        return data

    def ahead(self, n: int) -> tuple[bytes, int]:
        """The chunk and where in it pos stands, holding n bytes from pos on (fewer only at the end of the shard):
        a parser reads them in place and then skip()s past them."""
        if self.used + n > len(self.chunk):
            rest = self.chunk[self.used :]
            self.chunk, self.used = rest + self._read_raw(max(n - len(rest), self.block_size)), 0
        return self.chunk, self.used

    def skip(self, n: int) -> None:
        self.used += n
        self.pos += n

    def _read_raw(self, n: int) -> bytes:
        """n bytes (fewer at the end) from where the chunk ends."""
        at = self.pos + len(self.chunk) - self.used

        def once() -> bytes:
            try:
                if self.f is None:
                    self.f = self.fs.open(self.path, "rb", block_size=self.block_size)
                    self.f.seek(at)
                return self.f.read(n)
            except Exception:
                self.close()  # the next try opens the shard again where this one stopped
                raise

        try:
            return retry(once, READ_BACKOFF, tries=READ_RETRIES + 1, fatal=(FileNotFoundError, PermissionError))
        except FileNotFoundError:
            raise DataError(f"{self.url}: no such shard (listed, then gone?)") from None
        except PermissionError as e:
            raise StorageError(f"cannot read shard {describe_storage_error(self.url, e)}") from None
        except Exception as e:  # the stores' clients raise many types
            raise StorageError(f"cannot read shard {self.url}: {describe_storage_error(self.url, e)}") from None

    def close(self) -> None:
        if self.f is not None:
            with contextlib.suppress(Exception):
                self.f.close()
            self.f = None


def number(field: bytes) -> int:
    """A tar header's number: octal text, or base-256 (GNU, for sizes past 8 GB); tarfile's own parser."""
    try:
        return tarfile.nti(field)
    except tarfile.InvalidHeaderError:
        raise ValueError(f"not a number: {field!r}") from None


def pax_records(data: bytes) -> dict[str, str]:
    """The records of a pax extended header ("<len> <key>=<value>\\n" each)."""
    found, pos = {}, 0
    while pos < len(data) and data[pos : pos + 1] not in (b"\0", b""):
        space = data.index(b" ", pos)
        length = int(data[pos:space])
        if length <= space - pos or pos + length > len(data):
            raise ValueError(f"a record of length {length} at {pos}")
        key, _, value = data[space + 1 : pos + length - 1].partition(b"=")
        found[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return found


def members(f: ShardFile, url: str, whole: bool = True) -> Iterator[tuple[int, str, bytes]]:
    """(start, name, contents) of each regular file of a tar read from f's position, until its end; `start` is the
    offset of the member's first header, the extended headers that name it included. `whole`: f holds the tar to its
    end, so a tar without its end blocks is cut short. Parsed in place in f's chunk (a few microseconds a member)."""
    extended: dict[str, str] = {}
    first = None  # offset of the first extended header of the member being read
    while True:
        at = f.pos
        buf, i = f.ahead(BLOCK)
        header = buf[i : i + BLOCK]
        if len(header) < BLOCK:
            if whole:
                raise DataError(f"{url}: cut short (it ends at byte {at} without the tar's end blocks)")
            return
        if header == ZERO_BLOCK:
            return
        if header[:2] == b"\x1f\x8b":
            raise DataError(f"{url}: a gzip file, not a tar shard (unpack it, or pack the folder with job shard)")
        try:
            size, checksum = number(header[124:136]), number(header[148:156])
        except ValueError:
            size, checksum = -1, -1
        if size < 0 or sum(header) - sum(header[148:156]) + 256 != checksum:
            raise DataError(f"{url}: not a readable tar shard (a bad header at byte {at}: truncated or corrupt?)")
        kind = header[156:157]
        if kind not in (b"x", b"L", b"g") and "size" in extended:
            if not extended["size"].isdigit():
                raise DataError(f"{url}: not a readable tar shard (a pax size that is not a number at byte {at})")
            size = int(extended["size"])
        whole_size = BLOCK + size + (-size % BLOCK)
        buf, i = f.ahead(whole_size)
        data = buf[i + BLOCK : i + BLOCK + size]
        if len(data) < size:
            raise DataError(f"{url}: cut short (a member ends past the end of the file at byte {at})")
        f.skip(min(whole_size, len(buf) - i))
        if kind in (b"x", b"L"):  # a pax or GNU header describing the next member
            first = at if first is None else first
            try:
                records = (
                    pax_records(data)
                    if kind == b"x"
                    else {"path": data.rstrip(b"\0").decode("utf-8", "surrogateescape")}
                )
            except ValueError:
                raise DataError(f"{url}: not a readable tar shard (a malformed pax header at byte {at})") from None
            extended.update(records)
            continue
        if kind == b"g":  # global pax records: settings for the whole archive, nothing a sample needs
            continue
        start = at if first is None else first
        name = extended.get("path")
        extended, first = {}, None
        if kind not in (b"0", b"\0", b"7"):
            continue
        if name is None:
            name = header[0:100].rstrip(b"\0").decode("utf-8", "surrogateescape")
            if header[257:262] == b"ustar" and header[345:500].rstrip(b"\0"):
                name = header[345:500].rstrip(b"\0").decode("utf-8", "surrogateescape") + "/" + name
        yield start, name, data


def split_key(name: str) -> tuple[str, str]:
    """(key, extension) of a member: the path up to the first dot of the file name, and what follows it."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


def samples(f: ShardFile, shard: int, url: str, whole: bool = True) -> Iterator[Sample]:
    """The samples of a shard from f's position: runs of members sharing a key. Hidden files are skipped. `whole`:
    f reads to the tar's end (not one sample's range)."""
    current: Sample | None = None
    for at, name, data in members(f, url, whole):
        key, ext = split_key(name)
        if name.rpartition("/")[2].startswith("."):
            continue
        if current is not None and key != current.key:
            current.end = at
            yield current
            current = None
        if current is None:
            current = Sample(shard, at, at, key, {})
        current.members[ext] = data
    if current is not None:
        current.end = f.pos
        yield current


def read_range(url: str, shard: int, start: int, end: int) -> Sample:
    """The one sample stored between two byte offsets of a shard."""
    f = ShardFile(url, start, block_size=max(end - start, BLOCK))
    try:
        raw = f.read(end - start)
    finally:
        f.close()
    got = list(samples(InMemory(raw, start), shard, url, whole=False))
    if len(got) != 1:
        raise DataError(f"{url}: no sample at bytes {start}-{end} (the shard changed since the checkpoint?)")
    return got[0]


class InMemory(ShardFile):
    """Bytes of a shard from `base` on (a download, or one sample's range), read like the file."""

    def __init__(self, data: bytes, base: int) -> None:
        self.url, self.pos, self.block_size, self.f = "", base, len(data) + 1, None
        self.chunk, self.used = data, 0

    def _read_raw(self, n: int) -> bytes:
        return b""  # all there is is in the chunk

    def close(self) -> None:
        self.chunk, self.used = b"", 0


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


def read_json(fs, path: str, url: str) -> dict | None:
    text = read_text(fs, path, url)
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as e:
        raise DataError(f"{url}/{path.rsplit('/', 1)[-1]}: not JSON ({one_line(e)})") from None


def read_text(fs, path: str, url: str) -> str | None:
    try:
        if not fs.exists(path):
            return None
        return fs.cat_file(path).decode()
    except UnicodeDecodeError:
        raise DataError(f"{url}/{path.rsplit('/', 1)[-1]}: not text") from None
    except Exception as e:
        raise StorageError(f"cannot read the data: {describe_storage_error(url, e)}") from None


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
