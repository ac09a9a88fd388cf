"""Streaming shards: batches read from tar shards as the run trains, with memory bounded by a few shards, a shuffle
buffer and the batches being decoded, whatever the data set's size.

The order of an epoch is a function of (seed, epoch, rank) alone, never of how many processes decode:
  - the shards are dealt to the processes of a group once, balancing their sample counts (greedy, largest first);
    each process reads its own shards, in an order shuffled per epoch;
  - samples pass through a shuffle buffer whose draws come from a counter-based hash of (seed, epoch, rank, draw),
    so the buffer's "RNG state" is a single number;
  - a batch's crops and flips are drawn from (seed, epoch, rank, batch).
The position after any batch is therefore small and exact: which shard, the byte offset in it, the buffer as
references (shard, first byte, last byte) and the number of draws. A checkpoint saves it; a resumed run reads the
buffer's samples back by range reads and goes on reading from the offset, without reading the epoch again.

Every process of a group takes the same number of steps (DistributedDataParallel needs them in step): the most any
of them needs. One whose shards run out first feeds its last batch again with a loss weight of zero, so no sample
counts twice and none is dropped; with data.drop_last each takes as many full batches as the one with the fewest
samples has, and the others' extra samples are left out of that epoch.

Images are decoded and resized in worker processes (torchvision's decoders, one thread each, off the training
process and its GIL), in batches submitted ahead of the step that needs them; reading and the buffer stay in the
training process (about 2 us a member). webdataset and torchdata's StatefulDataLoader are not used: both make the
order depend on the number of loader workers and checkpoint the shuffle buffer's samples, where this keeps
references to them.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem

from job.cloud import filesystem
from job.data import Dataset, Split
from job.data.decode import Decoder, DeviceDecoder, auto_workers, decode, decoded
from job.data.loader import View, crop_flip, epoch_seed, to_float
from job.data.shards import InMemory, Sample, Shard, ShardFile, ShardSet, open_shards, read_range, samples
from job.errors import ConfigError, DataError
from job.memory import available_host_memory

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


def deal(shards: list[Shard], world: int) -> list[list[int]]:
    """The shards (by index) each process reads: dealt largest first to the process with the fewest samples."""
    if len(shards) < world:
        raise ConfigError(
            f"{len(shards)} shards cannot be split over {world} processes: pack with more (job shard "
            "--samples-per-shard) or run fewer processes"
        )
    hands: list[list[int]] = [[] for _ in range(world)]
    totals = [0] * world
    for i in sorted(range(len(shards)), key=lambda i: (-shards[i].samples, i)):
        r = min(range(world), key=lambda r: (totals[r], r))
        hands[r].append(i)
        totals[r] += shards[i].samples
    return [sorted(h) for h in hands]


class SampleStream:
    """One process's samples of one epoch: its shards read in sequence through a shuffle buffer of `buffer`
    samples. `position()` between samples is what a checkpoint keeps; `at` continues from one."""

    def __init__(self, urls: list[str], buffer: int, key: tuple[int, ...], at: dict | None = None) -> None:
        self.urls, self.size, self.key = urls, buffer, key
        self.shard, self.offset, self.draws = 0, 0, 0
        self.buffer: list[Sample] = []
        self.remote = not isinstance(filesystem(urls[0])[0], LocalFileSystem) if urls else False
        if at is not None:
            self.shard, self.offset, self.draws = at["shard"], at["offset"], at["draws"]
            self.buffer = refill(urls, at["buffer"])

    def position(self) -> tuple:
        """Where the stream stands, cheaply (taken after every batch): the buffer's samples as they are now.
        `saved()` turns it into what a checkpoint keeps."""
        return self.shard, self.offset, self.draws, tuple(self.buffer)

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
        """The samples of the shards from the position on; remote shards downloaded READ_AHEAD ahead."""
        fetch = ShardPrefetch(self.urls, self.shard, self.offset) if self.remote else None
        try:
            while self.shard < len(self.urls):
                url = self.urls[self.shard]
                f = fetch.get(self.shard) if fetch else ShardFile(url, self.offset)
                try:
                    for sample in samples(f, self.shard, url):
                        self.offset = sample.end
                        yield sample
                finally:
                    f.close()
                self.shard, self.offset = self.shard + 1, 0
        finally:
            if fetch:
                fetch.close()


def saved(position: tuple) -> dict:
    """A stream position as a checkpoint holds it: the buffer as references to its samples' bytes."""
    shard, offset, draws, buffer = position
    return {"shard": shard, "offset": offset, "draws": draws, "buffer": [[s.shard, s.start, s.end] for s in buffer]}


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


def refill(urls: list[str], refs: list[list[int]]) -> list[Sample]:
    """A saved shuffle buffer read back: each sample by a range read of its shard, concurrently."""
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda ref: read_range(urls[ref[0]], *ref), refs))


@dataclass
class StreamData:
    """A shard data set read as the run trains: what the recipe needs to know before reading it."""

    shards: ShardSet
    classes: list[str]
    input_shape: tuple[int, ...]
    source: str
    is_image: bool = True

    def describe(self) -> str:
        shape = "x".join(str(s) for s in self.input_shape)
        return (
            f"{self.source}: {self.shards.samples('train')} train / {self.shards.samples('test')} test, "
            f"{len(self.classes)} classes, inputs {shape}"
        )


class StreamLoader:
    """Batches of one split read from its shards, on `device`: the BatchLoader's interface (batches, len,
    loss_weight, n) plus position() and resume_at() for exact resume."""

    def __init__(
        self,
        shards: list[Shard],
        batch_size: int,
        device: torch.device,
        decoder: Decoder,
        *,
        seed: int = 0,
        shuffle: bool = False,
        buffer: int = 0,
        drop_last: bool = False,
        crop_padding: int = 0,
        reflect: bool = False,
        hflip: bool | str = False,
        mean: torch.Tensor | None = None,
        std: torch.Tensor | None = None,
        rank: int = 0,
        world: int = 1,
        channels_last: bool = False,
        ahead: int = 4,
        view: View | None = None,
        resized_crops: bool = False,
        keep_bytes: int = 0,
    ) -> None:
        self.shards, self.device, self.decoder = shards, device, decoder
        # A split read the same way every pass (no shuffle, no augmentation: the test split) whose decoded images
        # take at most keep_bytes is kept decoded after its first whole pass, and replayed from memory.
        self.keep_bytes = keep_bytes if not (shuffle or crop_padding or hflip or resized_crops) else 0
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.view, self.resized_crops = view, resized_crops
        self.seed, self.shuffle, self.buffer, self.drop_last = seed, shuffle, buffer if shuffle else 0, drop_last
        self.crop_padding, self.hflip, self.rank, self.world = crop_padding, hflip, rank, world
        self.reflect = reflect
        self.hands = deal(shards, world)
        self.counts = [sum(shards[i].samples for i in hand) for hand in self.hands]
        self.n = sum(s.samples for s in shards)
        self.batch_size = min(batch_size, self.n)
        self.local = [self.batch_size * (r + 1) // world - self.batch_size * r // world for r in range(world)]
        if min(self.local) < 1:
            raise ConfigError(f"data.batch_size: a batch of {self.batch_size} cannot be split over {world} processes")
        self.pin = device.type == "cuda"
        self.layout = torch.channels_last if channels_last else torch.contiguous_format
        self.mean = mean.to(device).view(1, -1, 1, 1) if mean is not None else None
        self.std = std.to(device).view(1, -1, 1, 1) if std is not None else None
        self.ahead = max(ahead, 2 * decoder.workers + 1)
        self.last_position: tuple | None = None
        self.saved: tuple[int, int, dict] | None = None

    def __len__(self) -> int:
        steps = [divmod(n, b) for n, b in zip(self.counts, self.local)]
        if self.drop_last:
            return min(full for full, _ in steps)
        return max(full + (1 if rest else 0) for full, rest in steps)

    def taken(self, r: int, i: int) -> int:
        """Samples process r takes in step i."""
        return max(0, min(self.local[r], self.counts[r] - i * self.local[r]))

    def loss_weight(self, i: int) -> float:
        """What this process's mean loss in step i is multiplied by so that DDP's average over the processes is the
        mean over the samples of the step (0 for a process whose shards ran out)."""
        if self.world == 1:
            return 1.0
        return self.taken(self.rank, i) * self.world / self.samples(i)

    def samples(self, i: int) -> int:
        """Samples in step i over all processes."""
        return sum(self.taken(r, i) for r in range(self.world))

    def resume_at(self, epoch: int, step: int, position: dict | None) -> None:
        """Where the next batches(epoch, step) starts: the stream position saved after step `step`."""
        self.saved = (epoch, step, position) if position is not None else None

    def position(self) -> dict | None:
        return saved(self.last_position) if self.last_position is not None else None

    def urls(self, epoch: int) -> list[str]:
        hand = self.hands[self.rank]
        if self.shuffle and len(hand) > 1:
            g = torch.Generator().manual_seed(mix(epoch_seed(self.seed, epoch), self.rank))
            hand = [hand[i] for i in torch.randperm(len(hand), generator=g).tolist()]
        return [self.shards[i].url for i in hand]

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The epoch's batches from step `start` on, as (inputs, labels) on the training device."""
        at = None
        if start:
            if self.saved is None or self.saved[:2] != (epoch, start):
                raise DataError(f"no saved stream position for step {start} of epoch {epoch + 1}")
            at = self.saved[2]
        if self.kept is not None:
            for x, y in self.kept[start:]:
                x, y = self.place(x, y)
                yield to_float(x, self.layout, self.mean, self.std, self.view, None), y
            return
        record: list | None = [] if self.keep_bytes and not start else None
        record_bytes = 0
        key = (epoch_seed(self.seed, epoch), self.rank)
        urls = self.urls(epoch)
        stream = SampleStream(urls, self.buffer, key, at)
        self.last_position = stream.position()
        steps, b = len(self), self.local[self.rank]
        pending: deque = deque()
        group_names: deque = deque()
        samples_iter = iter(stream)
        i, last = start, None
        try:
            while i < steps:
                while len(pending) < self.ahead:
                    group = [s for _, s in zip(range(b), samples_iter)]
                    if not group or (self.drop_last and len(group) < b):
                        break
                    items = [(f"{urls[s.shard]}:{s.key}", *s.image()) for s in group]
                    labels = torch.tensor([s.label() for s in group])
                    firsts = self.first_flips(group)
                    pending.append((self.decoder.submit(items), labels, stream.position(), firsts))
                    group_names.append((items[0][0], items[-1][0]))
                if pending:
                    future, labels, position, firsts = pending.popleft()
                    images = decoded(future, group_names.popleft())
                    if record is not None:  # kept in host memory, whatever decoded it
                        record.append((images.cpu(), labels))
                        record_bytes += images.nbytes
                        record = record if record_bytes <= self.keep_bytes else None
                    x, y = self.place(images, labels)
                    x, boxes = self.augment(x, epoch, i, firsts)
                    last = (to_float(x, self.layout, self.mean, self.std, self.view, boxes), y)
                    self.last_position = position
                elif last is None:
                    return
                elif record is not None:
                    record.append(record[-1])  # replayed as it was fed: the last batch again
                yield last  # a process whose shards ran out feeds its last batch again, at loss weight 0
                i += 1
            if record is not None:
                self.kept = record
        finally:
            for future, *_ in pending:
                future.cancel()

    def place(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:  # decoded on the device, on the decoder's stream: its memory is now in use on this one too
            x.record_stream(torch.cuda.current_stream(x.device))
        elif self.pin and not x.is_pinned():
            x = x.pin_memory()
        if self.pin and not y.is_pinned():
            y = y.pin_memory()
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def first_flips(self, group: list[Sample]) -> torch.Tensor | None:
        """random_hflip alternate: whether each sample is flipped in even epochs, a function of the seed and the
        sample's key alone, so the same in every epoch however the stream is shuffled."""
        if self.hflip != "alternate":
            return None
        return torch.tensor([zlib.crc32(f"{self.seed}:{s.key}".encode()) & 1 for s in group], dtype=torch.bool)

    def augment(
        self, x: torch.Tensor, epoch: int, i: int, firsts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Batch i's crops and flips done (`firsts`: alternate flips' even-epoch sides), and its resized-crop boxes
        drawn (the view applies them)."""
        if not (self.crop_padding or self.hflip or self.resized_crops):
            return x, None
        g = torch.Generator().manual_seed(mix(epoch_seed(self.seed, epoch), self.rank, i) >> 1)
        n = x.shape[0]
        crops = torch.randint(0, 2 * self.crop_padding + 1, (n, 2), generator=g) if self.crop_padding else None
        if firsts is not None:
            flips = firsts ^ bool(epoch % 2)
        else:
            flips = torch.rand(n, generator=g) < 0.5 if self.hflip else None
        boxes = self.view.draw(n, *x.shape[-2:], g).to(self.device) if self.resized_crops else None
        if crops is None and flips is None:
            return x, boxes
        to = self.device
        x = crop_flip(
            x,
            self.crop_padding,
            crops.to(to) if crops is not None else None,
            flips.to(to) if flips is not None else None,
            self.reflect,
        )
        return x, boxes


def load_shards(cfg, cache, log) -> StreamData | Dataset:
    """The shard data set at cfg.path: streamed (placement stream, or auto when decoded it would not fit in
    device_share of free host memory), else decoded whole into memory like any other data set."""
    shards = open_shards(cfg.path, cache, log)
    shape = image_shape(cfg, shards)
    data = StreamData(shards, shards.classes, shape, f"shards {cfg.path}")
    if cfg.placement == "stream":
        return data
    decoded = (shards.samples("train") + shards.samples("test")) * int(np.prod(shape))
    if cfg.placement == "auto":
        room = cfg.device_share * available_host_memory()
        if decoded > room:
            log(
                f"data: decoded, {cfg.path} would take {decoded / 1e9:.1f} GB, more than {room / 1e9:.1f} GB: "
                "streaming it"
            )
            return data
    decoder = held_decoder(cfg)
    splits = [read_all(shards.splits[s], decoder) for s in ("train", "test")]
    return Dataset(splits[0], splits[1], shards.classes, f"shards {cfg.path}")


def held_decoder(cfg, device: torch.device | None = None) -> Decoder | DeviceDecoder:
    """The decoder that makes images the size they are held at (held_size): data.workers processes, or with
    data.decode device, the training device itself; `device`: the training device, when it trains while decoding."""
    fit = cfg.resize_size is not None
    if cfg.decode == "device" and device is not None:
        if device.type != "cuda":
            raise ConfigError(f"data.decode: device decodes on a CUDA device; this run trains on {device.type}")
        return DeviceDecoder(device, held_size(cfg), fit)
    return Decoder(auto_workers(cfg.workers, device.type if device is not None else None), held_size(cfg), fit)


def held_size(cfg) -> int | None:
    """The square size images are decoded to: data.resize_size (photos, kept larger than the model's input for
    crops), else data.image_size, else None (as they are)."""
    return cfg.resize_size or cfg.image_size


def image_shape(cfg, shards: ShardSet) -> tuple[int, int, int]:
    """3 x H x W of the images as they are held: data.resize_size or data.image_size, else the one size the shards'
    index records, else the first image's."""
    if held_size(cfg) is not None:
        return 3, held_size(cfg), held_size(cfg)
    if len(shards.image_sizes) > 1:
        seen = ", ".join(f"{w}x{h}" for w, h in shards.image_sizes[:3])
        raise ConfigError(
            f"data.image_size: the images of {cfg.path} differ in size ({seen}, ...); set data.image_size"
        )
    if shards.image_sizes:
        w, h = shards.image_sizes[0]
        return 3, h, w
    first = shards.splits["train"][0].url
    f = ShardFile(first)
    try:
        sample = next(samples(f, 0, first), None)
    finally:
        f.close()
    if sample is None:
        raise DataError(f"{first}: no samples")
    return tuple(decode([(f"{first}:{sample.key}", *sample.image())], None).shape[1:])


def read_all(shards: list[Shard], decoder: Decoder, batch: int = 256) -> Split:
    """Every sample of the shards, in name order, decoded into memory."""
    stream = iter(SampleStream([s.url for s in shards], 0, (0,)))
    futures, labels = [], []
    while group := [s for _, s in zip(range(batch), stream)]:
        names = [f"{shards[s.shard].url}:{s.key}" for s in group]
        futures.append((decoder.submit([(name, *s.image()) for name, s in zip(names, group)]), (names[0], names[-1])))
        labels.extend(s.label() for s in group)
    x = torch.cat([decoded(f, names) for f, names in futures])
    return Split(x, torch.tensor(labels))


def first_images(shards: list[Shard], decoder: Decoder, n: int = 1000) -> torch.Tensor:
    """The first n images of the shards in name order: what normalisation's channel statistics are taken from."""
    stream = iter(SampleStream([s.url for s in shards], 0, (0,)))
    group = [s for _, s in zip(range(n), stream)]
    return decoded(decoder.submit([(s.key, *s.image()) for s in group]), (group[0].key, group[-1].key))
