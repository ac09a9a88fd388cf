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
A folder of shards is opened, listed and counted by job/data/shard_sets.py. This module does not import torch.
"""

from __future__ import annotations

import contextlib
import json
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass

from job.data.files import source
from job.data.split import IMAGE_SUFFIXES, HoldOut, Roles
from job.errors import DataError, StorageError, one_line
from job.retry import Backoff, retry
from job.storage.cloud import describe_storage_error

SPLITS = ("train", "val", "test")  # val optional, and test too where there is val
# A member of decoded pixels, where the run's own pack keeps small images decoded (job/data/pack.py): numpy's .npy of
# a uint8 H x W x 3 array, which webdataset's decoders read too.
PIXELS = "npy"
IMAGE_EXTS = (*(s.lstrip(".") for s in IMAGE_SUFFIXES), PIXELS)
INDEX = "index.json"
CLASSES = "classes.txt"
BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
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
