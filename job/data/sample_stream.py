"""One process's samples of one epoch, read from its parts of the shards through a shuffle buffer, with a position
that is small and exact after any sample. Torch-free: bytes and integers only.

A part is a shard, or every `step`-th sample of one (when a group has more processes than the data has shards,
they share shards that way). The buffer's draws come from a counter-based hash of (key, draw), so its "RNG state"
is one number; the position is (shard, byte offset, samples passed in the shard, draws, the buffer as byte ranges of
its samples). A resumed stream reads the buffer's samples back by range reads and goes on from the offset.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from fsspec.implementations.local import LocalFileSystem

from job.data.files import source
from job.data.shards import Carve, InMemory, Sample, Shard, ShardFile, read_range, samples
from job.errors import DataError

MASK = (1 << 64) - 1
READ_AHEAD = 2  # remote shards downloaded ahead of the one being read
CHUNK = 8 << 20  # bytes a remote shard is downloaded in: one request each


def mix(*parts: int) -> int:
    """A 64-bit hash of integers (splitmix64 steps): the shuffle buffer's draws, reproducible from a counter."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (p & MASK)) * 0xBF58476D1CE4E5B9 & MASK
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & MASK
        h ^= h >> 31
    return h


@dataclass(frozen=True)
class Part:
    """Samples first, first + step, ... of a shard of `samples` samples (step 1: the whole shard); with `carve`,
    of the `in_split` samples of the shard its split takes (their keys' role), counted among those alone."""

    url: str
    samples: int  # in the whole shard: what its reading is checked against
    first: int = 0
    step: int = 1
    carve: Carve | None = None
    in_split: int = -1  # with carve: the samples of the split in the shard

    @classmethod
    def of(cls, shard: Shard, first: int = 0, step: int = 1) -> Part:
        """The part of a split's shard: the whole file, or its split's samples where the split is carved by key."""
        if shard.carve is None:
            return cls(shard.url, shard.samples, first, step)
        return cls(shard.url, shard.stored, first, step, shard.carve, shard.samples)

    @property
    def taken(self) -> int:
        return len(range(self.first, self.samples if self.carve is None else self.in_split, self.step))


class SampleStream:
    """One process's samples of one epoch: its parts read in sequence through a shuffle buffer of `buffer`
    samples. `position()` between samples is what a checkpoint keeps; `at` continues from one."""

    def __init__(self, parts: list[Part], buffer: int, key: tuple[int, ...], at: dict | None = None) -> None:
        self.parts, self.size, self.key = parts, buffer, key
        self.shard, self.offset, self.index, self.in_split, self.draws = 0, 0, 0, 0, 0
        self.buffer: list[Sample] = []
        self.remote = not isinstance(source(parts[0].url, exists=False).fs, LocalFileSystem) if parts else False
        if at is not None:
            self.shard, self.offset, self.draws = at["shard"], at["offset"], at["draws"]
            self.index = at.get("index", 0)  # None: not saved (an earlier version's place); not checked
            self.in_split = at.get("in_split", self.index)  # earlier versions: no carve, every sample counts
            self.buffer = refill([p.url for p in parts], at["buffer"])

    def position(self) -> tuple:
        """Where the stream stands, cheaply (taken after every batch): the buffer's samples as they are now.
        `saved()` turns it into what a checkpoint keeps."""
        return self.shard, self.offset, self.index, self.in_split, self.draws, tuple(self.buffer)

    def draw(self, n: int) -> int:
        self.draws += 1
        return mix(*self.key, self.draws) % n

    def __iter__(self) -> Iterator[Sample]:
        for sample in self.read():
            if len(self.buffer) < self.size:
                self.buffer.append(sample)
                continue
            if not self.size:
                yield sample
                continue
            j = self.draw(self.size)
            out, self.buffer[j] = self.buffer[j], sample
            yield out
        while self.buffer:
            j = self.draw(len(self.buffer))
            out = self.buffer[j]
            self.buffer[j] = self.buffer[-1]
            self.buffer.pop()
            yield out

    def read(self) -> Iterator[Sample]:
        """This process's samples of its parts from the position on; remote shards downloaded READ_AHEAD ahead.
        Each shard read to its end is held against the number of samples it should hold."""
        urls = [p.url for p in self.parts]
        fetch = ShardPrefetch(urls, self.shard, self.offset) if self.remote else None
        try:
            while self.shard < len(self.parts):
                part = self.parts[self.shard]
                roles = part.carve.roles() if part.carve is not None else None
                f = fetch.get(self.shard) if fetch else ShardFile(part.url, self.offset)
                try:
                    for sample in samples(f, self.shard, part.url):
                        ours = roles is None or roles(sample.key) == part.carve.role
                        mine = ours and (part.step == 1 or self.in_split % part.step == part.first)
                        self.offset, self.index = sample.end, None if self.index is None else self.index + 1
                        self.in_split = None if self.in_split is None else self.in_split + ours
                        if mine:
                            yield sample
                finally:
                    f.close()
                expected = part.samples, part.in_split if roles is not None else self.in_split
                if self.index is not None and (self.index, self.in_split) != expected:
                    split = f" ({self.in_split} of its split)" if roles is not None else ""
                    said = f" ({part.in_split})" if roles is not None else ""
                    raise DataError(
                        f"{part.url}: holds {self.index} samples{split} where its count says {part.samples}{said} "
                        "(changed since it was counted or packed? pack it again)"
                    )
                self.shard, self.offset, self.index, self.in_split = self.shard + 1, 0, 0, 0
        finally:
            if fetch:
                fetch.close()


def saved(position: tuple) -> dict:
    """A stream position as a checkpoint holds it: the buffer as references to its samples' bytes."""
    shard, offset, index, in_split, draws, buffer = position
    return {
        "shard": shard,
        "offset": offset,
        "index": index,
        "in_split": in_split,
        "draws": draws,
        "buffer": refs(buffer),
    }


def refs(group: list[Sample]) -> list[list[int]]:
    """Samples as references to their bytes (shard, start, end): what a checkpoint keeps of them."""
    return [[s.shard, s.start, s.end] for s in group]


class ShardPrefetch:
    """Remote shards downloaded whole, in a thread, a few ahead of the one being read: a cold bucket then costs
    about what local disk does. Each download goes through ShardFile, whose reads resume after a failure."""

    def __init__(self, urls: list[str], first: int, offset: int) -> None:
        self.urls, self.first, self.offset = urls, first, offset
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="shard-fetch")
        self.pending: dict[int, Future] = {}
        for k in range(first, min(first + READ_AHEAD + 1, len(urls))):
            self.pending[k] = self.pool.submit(self.download, k)

    def download(self, k: int) -> ShardFile:
        start = self.offset if k == self.first else 0
        f = ShardFile(self.urls[k], start, block_size=CHUNK)
        chunks = []
        try:
            while chunk := f.read(CHUNK):
                chunks.append(chunk)
        finally:
            f.close()
        return InMemory(b"".join(chunks), start)

    def get(self, k: int) -> ShardFile:
        nxt = k + READ_AHEAD + 1
        if nxt < len(self.urls) and nxt not in self.pending:
            self.pending[nxt] = self.pool.submit(self.download, nxt)
        return self.pending.pop(k).result()

    def close(self) -> None:
        for f in self.pending.values():
            f.cancel()
        self.pool.shutdown(wait=False, cancel_futures=True)


def refill(urls: list[str], held: list[list[int]]) -> list[Sample]:
    """Saved samples read back: each by a range read of its shard, concurrently."""
    if not held:
        return []
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda ref: read_range(urls[ref[0]], *ref), held))


def deal(shards: list[Shard], world: int) -> list[list[Part]]:
    """The parts of the shards each process reads: whole shards dealt largest first to the process with the fewest
    samples; with fewer shards than processes, every world-th sample of the data (in name order) to each."""
    if len(shards) < world:
        hands: list[list[Part]] = [[] for _ in range(world)]
        base = 0
        for s in shards:
            for r in range(world):
                part = Part.of(s, (r - base) % world, world)
                if part.taken:
                    hands[r].append(part)
            base += s.samples
        return hands
    whole: list[list[int]] = [[] for _ in range(world)]
    totals = [0] * world
    for i in sorted(range(len(shards)), key=lambda i: (-shards[i].samples, i)):
        r = min(range(world), key=lambda r: (totals[r], r))
        whole[r].append(i)
        totals[r] += shards[i].samples
    return [[Part.of(shards[i]) for i in sorted(h)] for h in whole]
