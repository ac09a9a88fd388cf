"""Streamed shards: batches read from tar shards as the run trains, with memory bounded by a few shards, a shuffle
buffer and the batches being decoded, whatever the data set's size. This module makes batches and is the shards'
format (data.kind shards, job/data/formats.py); job/data/sample_stream.py deals the shards to the processes of a
group and reads one process's samples, job/data/decode_ahead.py decodes them ahead, job/data/shards.py reads the
tars.

The order of an epoch is a function of (seed, epoch, rank) alone, never of how many processes decode:
  - the shards are dealt to the processes of a group once, balancing their sample counts (greedy, largest first);
    with more processes than shards, every process reads every shard and takes every world-th sample of the data;
    each process reads its parts in an order shuffled per epoch, through a shuffle buffer (sample_stream.py);
  - a batch's crops and flips are drawn from (seed, epoch, rank, batch).
A checkpoint keeps each process's stream position and the byte ranges of its last batch.

Every process of a group takes the same number of steps (DistributedDataParallel needs them in step): the most any
of them needs. One whose samples run out first feeds its last batch again as a Batch of weight 0 and no samples of
its own, so no sample counts twice and none is dropped, in training or in evaluation; stopped in that stretch, a
resumed process reads its last batch back by its byte ranges and goes on feeding it. With data.drop_last each takes
as many full batches as the one with the fewest samples has, and the others' extra samples are left out of that
epoch.

Images are decoded and resized in worker processes (job/data/decode.py), in batches submitted ahead of the step
that needs them; reading and the buffer stay in the training process (about 2 us a member). webdataset and
torchdata's StatefulDataLoader are not used: both make the order depend on the number of loader workers and
checkpoint the shuffle buffer's samples, where this keeps references to them.
"""

from __future__ import annotations

import contextlib
import hashlib
import zlib
from collections.abc import Callable, Iterator

import numpy as np
import torch

from job.data.augment import (
    Policy,
    PolicyDraws,
    View,
    apply_policy,
    crop_flip,
    draw_policy,
    draws,
    epoch_seed,
    erase,
    placed,
    to_float,
)
from job.data.batches import Batch, move
from job.data.dataset import Dataset, Split, StreamData
from job.data.decode import IGNORED, Decoder, DeviceDecoder, decode, decoded, decoder_for
from job.data.decode_ahead import Skipped, decoded_ahead, host_copy, submitted
from job.data.formats import Format
from job.data.placement import Streaming, decide_streaming
from job.data.preprocess import Preprocess
from job.data.sample_stream import Part, SampleStream, deal, mix, refill, refs, saved
from job.data.shard_sets import ShardSet, open_shards
from job.data.shards import INDEX, SPLITS, Sample, Shard, ShardFile, samples
from job.data.split import HoldOut, Inventory
from job.errors import CheckpointError, ConfigError, DataError
from job.storage.cloud import filesystem


class StreamLoader:
    """Batches of one split read from its shards, on `device`, for process `rank` of `world`: the loader contract
    (job/data/batches.py), with a position that restores exactly anywhere in an epoch."""

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
        policy: Policy = Policy(),
        keep_bytes: int = 0,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.device, self.decoder = device, decoder
        self.skipped = Skipped(log)  # samples that could not be decoded: their label IGNORED, named once each
        # A split read the same way every pass (no shuffle, no augmentation: the test split) whose decoded images
        # take at most keep_bytes is kept decoded after its first whole pass, and replayed from memory.
        self.keep_bytes = keep_bytes if not (shuffle or crop_padding or hflip or resized_crops or policy) else 0
        self.kept: list[tuple[torch.Tensor, torch.Tensor, tuple[str, ...]]] | None = None
        self.view, self.resized_crops = view, resized_crops
        self.seed, self.shuffle, self.buffer, self.drop_last = seed, shuffle, buffer if shuffle else 0, drop_last
        self.crop_padding, self.hflip, self.rank, self.world = crop_padding, hflip, rank, world
        self.reflect, self.policy = reflect, policy
        shards = [s for s in shards if s.samples]  # an empty shard holds nothing to deal
        self.n = sum(s.samples for s in shards)
        if self.n < world:
            raise ConfigError(f"{self.n} samples cannot be shared by {world} processes: run fewer")
        self.hands = deal(shards, world)
        self.counts = [sum(p.taken for p in hand) for hand in self.hands]
        self.batch_size = min(batch_size, self.n)
        self.local = [self.batch_size * (r + 1) // world - self.batch_size * r // world for r in range(world)]
        if min(self.local) < 1:
            raise ConfigError(f"data.batch_size: a batch of {self.batch_size} cannot be split over {world} processes")
        self.layout = torch.channels_last if channels_last else torch.contiguous_format
        self.mean = mean.to(device).view(1, -1, 1, 1) if mean is not None else None
        self.std = std.to(device).view(1, -1, 1, 1) if std is not None else None
        self.ahead = max(ahead, 2 * decoder.workers + 1)
        self.last_place: tuple | None = None  # (stream position, last batch's samples, its step) after the last batch
        self.epoch_digest = ""  # the parts the epoch being read takes (digest())
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
        mean over the samples of the step (0 for a process whose samples ran out)."""
        if self.world == 1:
            return 1.0
        return self.taken(self.rank, i) * self.world / self.samples(i)

    def samples(self, i: int) -> int:
        """Samples in step i over all processes."""
        return sum(self.taken(r, i) for r in range(self.world))

    def batch(self, x: torch.Tensor, y: torch.Tensor, i: int, names: tuple[str, ...] = ()) -> Batch:
        return Batch(x, y, self.loss_weight(i), self.samples(i), self.taken(self.rank, i), names)

    def resume_at(self, epoch: int, step: int, places: list[dict]) -> None:
        """Continue at step `step` of `epoch` from the place this process saved there."""
        if len(places) != self.world or not all(isinstance(p, dict) and p for p in places):
            raise CheckpointError(
                f"the checkpoint was taken in epoch {epoch + 1} by {len(places)} process(es) of a stream and holds "
                f"no place for {self.world}: resume with as many, or from an epoch's end"
            )
        place = places[self.rank]
        if "stream" not in place:  # an earlier version's: the stream's place alone, its count in the shard unknown
            place = {"stream": {**place, "index": None}, "last": None, "last_step": None}
        expected = self.digest(epoch)
        if place.get("parts", expected) != expected:
            raise CheckpointError(
                f"the checkpoint's place in epoch {epoch + 1} is in other shards than data.path holds now (packed "
                "again?): resume with the shards it was taken on, or from an epoch's end"
            )
        self.saved = (epoch, step, place)

    def digest(self, epoch: int) -> str:
        """What a saved place refers to: this process's parts of the shards in the epoch's order, by file name and
        sample count (a data set moved elsewhere keeps them)."""
        named = "\n".join(
            f"{p.url.rsplit('/', 1)[-1]} {p.samples} {p.first} {p.step}"
            + (f" {p.carve} {p.in_split}" if p.carve else "")  # a split held out by key: which, and its count
            for p in self.parts(epoch)
        )
        return hashlib.sha256(named.encode()).hexdigest()[:16]

    def position(self) -> dict:
        if self.last_place is None:
            return {}
        stream, last, step = self.last_place
        return {"stream": saved(stream), "last": refs(last), "last_step": step, "parts": self.epoch_digest}

    def parts(self, epoch: int) -> list[Part]:
        hand = self.hands[self.rank]
        if self.shuffle and len(hand) > 1:
            g = torch.Generator().manual_seed(mix(epoch_seed(self.seed, epoch), self.rank))
            hand = [hand[i] for i in torch.randperm(len(hand), generator=g).tolist()]
        return hand

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator[Batch]:
        """The epoch's batches from step `start` on, on the training device."""
        at = None
        if start:
            if self.saved is None or self.saved[:2] != (epoch, start):
                raise DataError(f"no saved stream position for step {start} of epoch {epoch + 1}")
            at = self.saved[2]
        if self.kept is not None:
            for i, (x, y, names) in enumerate(self.kept[start:], start):
                x = to_float(move(x, self.device), self.layout, self.mean, self.std, self.view)
                yield self.batch(x, move(y, self.device), i, names)
            return
        record: list | None = [] if self.keep_bytes and not start else None
        record_bytes = 0
        parts = self.parts(epoch)
        urls = [p.url for p in parts]
        self.epoch_digest = self.digest(epoch)
        key = (epoch_seed(self.seed, epoch), self.rank)
        try:
            stream = SampleStream(parts, self.buffer, key, at["stream"] if at else None)
            self.last_place = (
                (stream.position(), refill(urls, at["last"] or []) or None, at["last_step"]) if at else None
            )
        except (KeyError, IndexError, TypeError):
            raise CheckpointError(
                f"the checkpoint's place in epoch {epoch + 1} is not one this version reads"
            ) from None
        b, last, names = self.local[self.rank], None, ()
        ahead = decoded_ahead(stream, urls, b, self.decoder, self.ahead, self.drop_last, self.skipped)
        with contextlib.closing(ahead) as groups:
            for i in range(start, len(self)):
                got = next(groups, None)
                if got is not None:
                    images, labels, place, group = got
                    names = tuple(f"{urls[s.shard]}:{s.key}" for s in group) if not self.shuffle else ()
                    if record is not None:  # kept in host memory, whatever decoded it
                        record.append((host_copy(images), labels, names))
                        record_bytes += images.nbytes
                        record = record if record_bytes <= self.keep_bytes else None
                    last = self.make(images, labels, epoch, i, group)
                    self.last_place = (place, group, i)
                else:  # this process has run out: the last batch again, as padding that names nothing
                    names = ()
                    if last is None:
                        if self.last_place is None:
                            return
                        last = self.replayed(urls, epoch)  # resumed in the padded stretch: the last batch read back
                    elif record is not None:
                        record.append((*record[-1][:2], ()))  # replayed as it was fed: the last batch again
                yield self.batch(*last, i, names)
        if record is not None:
            self.kept = record

    def make(
        self, images: torch.Tensor, labels: torch.Tensor, epoch: int, i: int, group: list[Sample]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded images of step i as the model takes them: on the device, augmented, float."""
        x, y = move(images, self.device), move(labels, self.device)
        x, boxes, drawn = self.augment(x, epoch, i, group)
        return erase(to_float(x, self.layout, self.mean, self.std, self.view, boxes), drawn), y

    def replayed(self, urls: list[str], epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last batch this process read, made again from its samples' bytes as it was made at its step."""
        _, group, step = self.last_place
        if group is None:
            raise CheckpointError(
                "the checkpoint was taken by an earlier version where this process had run out of samples, which it "
                "cannot continue from: resume from an epoch's end (--resume with that epoch's checkpoint)"
            )
        future, names, labels = submitted(group, urls, self.decoder)
        return self.make(self.skipped.decoded(future, names, labels), labels, epoch, step, group)

    def augment(
        self, x: torch.Tensor, epoch: int, i: int, group: list[Sample]
    ) -> tuple[torch.Tensor, torch.Tensor | None, PolicyDraws | None]:
        """Batch i's crops, flips and data.augment's operations done, and its resized-crop boxes and erased boxes
        drawn (the view and erase apply them), from (seed, epoch, rank, i). Alternate flips: a sample's side in even
        epochs is a function of the seed and its key, so the same in every epoch however the stream is shuffled."""
        if not (self.crop_padding or self.hflip or self.resized_crops or self.policy):
            return x, None, None
        g = torch.Generator().manual_seed(mix(epoch_seed(self.seed, epoch), self.rank, i) >> 1)

        def alternate() -> torch.Tensor:
            firsts = [zlib.crc32(f"{self.seed}:{s.key}".encode()) & 1 for s in group]
            return torch.tensor(firsts, dtype=torch.bool) ^ bool(epoch % 2)

        how = (self.crop_padding, self.hflip, self.view, self.resized_crops, alternate)
        crops, flips, boxes = draws(g, x.shape[0], tuple(x.shape[-2:]), *how)
        drawn = draw_policy(self.policy, g, x.shape[0], tuple(x.shape[-2:]), self.view)
        # Drawn on the host, copied through page-locked memory: a pageable copy would make the host wait every step.
        crops, flips, boxes = (move(t, self.device) if t is not None else None for t in (crops, flips, boxes))
        drawn = placed(drawn, self.device, move)
        if crops is not None or flips is not None:
            x = crop_flip(x, self.crop_padding, crops, flips, self.reflect)
        return apply_policy(x, drawn, move), boxes, drawn


def load_shards(cfg, cache, log, started: Streaming | None = None) -> StreamData | Dataset:
    """The shard data set at cfg.path: streamed (placement stream, or auto when decoded it would not fit in
    device_share of free host memory, or as the run being resumed did), else decoded whole into memory like any
    other data set."""
    shards = open_shards(cfg.path, cache, log, HoldOut.of(cfg))
    shape = image_shape(cfg, shards)

    def decoded() -> int:
        return sum(shards.samples(s) for s in SPLITS) * int(np.prod(shape))

    choice = decide_streaming(cfg.placement, decoded, cfg.device_share, started, log, cfg.path)
    inventory = Inventory.from_json(shards.inventory) if shards.inventory is not None else None
    for line in inventory.lines() if inventory is not None else ():
        log(line)
    if choice.streamed:
        return StreamData(shards, shards.classes, shape, f"shards {cfg.path}", choice, multilabel=shards.multilabel)
    train, val, test = read_splits(shards, held_decoder(cfg))
    return Dataset(train, test, shards.classes, f"shards {cfg.path}", choice, val=val, inventory=inventory)


def held_decoder(cfg, device: torch.device | None = None, pre: Preprocess | None = None) -> Decoder | DeviceDecoder:
    """The decoder that makes images the size they are held at (held_size): data.workers processes, or with
    data.decode device, the training device itself; `device`: the training device, when it trains while decoding;
    `pre`: how images are held (default: as cfg says)."""
    try:
        return decoder_for(cfg.decode, cfg.workers, device, pre or Preprocess.of(cfg), cfg.skip_bad_samples)
    except ConfigError as e:
        raise ConfigError(f"data.decode: {e}") from None


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
    stream = iter(SampleStream([Part.of(s) for s in shards], 0, (0,)))
    futures, labels, every = [], [], []
    while group := [s for _, s in zip(range(batch), stream)]:
        names = [f"{shards[s.shard].url}:{s.key}" for s in group]
        futures.append((decoder.submit([(name, *s.image()) for name, s in zip(names, group)]), (names[0], names[-1])))
        labels.extend(s.label() for s in group)
        every += names
    y = torch.tensor(labels)
    x = torch.cat([decoded(f, names, y[i * batch : (i + 1) * batch]) for i, (f, names) in enumerate(futures)])
    good = (y != IGNORED).reshape(len(y), -1).all(1)  # held in memory: one that cannot be decoded is left out
    return Split(x[good], y[good], [name for name, g in zip(every, good.tolist()) if g])


def read_splits(shards: ShardSet, decoder: Decoder) -> tuple[Split | None, ...]:
    """Each split (SPLITS' order) decoded into memory, None where it has no shards; train/'s shards read once where
    splits are held out of them by key (Carve), each sample then put in its split."""
    read = [read_all(shards.splits[s], decoder) if shards.splits[s] and not by_key(shards.splits[s]) else None
            for s in SPLITS]  # fmt: skip
    held = {s.url: s for split in SPLITS for s in shards.splits[split] if s.carve is not None}
    if not held:
        return tuple(read)
    urls = sorted(held)
    every = read_all([Shard(url, held[url].stored, held[url].size) for url in urls], decoder)
    role = held[urls[0]].carve.roles()
    roles = [role(key) for key in keys(every.names, urls)]
    for i, split in enumerate(SPLITS):
        if by_key(shards.splits[split]):
            pick = [k for k, r in enumerate(roles) if r == split]
            read[i] = Split(every.x[pick], every.y[pick], [every.names[k] for k in pick])
    return tuple(read)


def by_key(shards: list[Shard]) -> bool:
    """Whether a split is held out of train/'s shards by key (all of its shards are, or none)."""
    return bool(shards) and shards[0].carve is not None


def keys(names: list[str], urls: list[str]) -> Iterator[str]:
    """The sample keys of names "<shard URL>:<key>" listed in the order of `urls` (read_all's)."""
    at = 0
    for name in names:
        while not name.startswith(f"{urls[at]}:"):
            at += 1
        yield name[len(urls[at]) + 1 :]


def sample_images(shards: list[Shard], decoder: Decoder, n: int, seed: int) -> torch.Tensor:
    """A seeded random sample of n of the shards' images (all of them when they hold fewer): what normalisation's
    statistics and a model's data-dependent start see. Shards are visited in a seeded order until four times n
    samples are read (so a large data set is not read whole), and n are drawn from those; never the first in
    storage order, which a folder packed by class would make one class."""
    g = torch.Generator().manual_seed(mix(seed, 0x5EED))
    order = torch.randperm(len(shards), generator=g).tolist()
    chosen, total = [], 0
    for i in order:
        chosen.append(shards[i])
        total += shards[i].samples
        if total >= 4 * n:
            break
    picked = set(torch.randperm(total, generator=g)[:n].tolist())  # drawn before reading: only n kept in memory
    stream = SampleStream([Part.of(s) for s in chosen], 0, (0,))
    group = [sample for k, sample in enumerate(stream) if k in picked]
    marks = torch.zeros(len(group), dtype=torch.int64)
    images = decoded(decoder.submit([(s.key, *s.image()) for s in group]), (group[0].key, group[-1].key), marks)
    return images[marks != IGNORED]


def is_shards(url: str) -> bool:
    """A folder `job shard` wrote (index.json) or of train|val|test/*.tar shards."""
    fs, path = filesystem(url)
    root = path.rstrip("/")
    try:
        return fs.isdir(path) and (fs.exists(f"{root}/{INDEX}") or bool(fs.glob(f"{root}/*/*.tar")))
    except Exception:  # the stores' clients raise many types: read as a folder, which names the fault
        return False


def load(cfg, cache, log, src=None, started: Streaming | None = None) -> StreamData | Dataset:
    return load_shards(cfg, cache, log, started)


FORMAT = Format(
    "shards",
    load,
    about="WebDataset-style tar shards (train/*.tar, test/*.tar; `python -m job shard` makes them)",
    holds=is_shards,
    streams=True,
)
