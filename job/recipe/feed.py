"""The data set where a run holds it (the device when it fits, else the host), its normalisation, and the loaders over
it at any batch size: a recipe's feed."""

from __future__ import annotations

import torch

from job.config import Config, DataConfig
from job.console import say_own
from job.data.augment import Policy, View, channel_stats, to_float
from job.data.batches import Loader
from job.data.dataset import Dataset, Split
from job.data.decode import DeviceDecoder
from job.data.loader import BatchLoader
from job.data.placement import HELD, hold_on
from job.data.stream import StreamData, StreamLoader, held_decoder, sample_images
from job.errors import ConfigError
from job.group.memory import available_host_memory
from job.recipe import weights

STATS_IMAGES = 1000  # the training images streamed data's normalisation statistics are taken from


def normalization(cfg: Config, data: Dataset | StreamData, decoder=None) -> tuple[torch.Tensor | None, ...]:
    """The mean and std images are normalised with (None, None: not normalised): the training set's with
    data.normalize=true; with auto, the mean and std torchvision weights were trained with."""
    d = cfg.data
    if not data.is_image or d.normalize is False:
        return None, None
    if d.normalize is True:  # from a seeded random sample of the training set, never the first in storage order
        if isinstance(data, StreamData):
            return channel_stats(sample_images(data.shards.splits["train"], decoder, STATS_IMAGES, cfg.seed).cpu())
        return channel_stats(data.train.x)
    w = weights.resolve(cfg.model.name, cfg.model.weights)
    if w is None or w.mean is None:
        return None, None
    return torch.tensor(w.mean), torch.tensor(w.std)


def saved_stats(payload: dict | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The normalisation statistics a checkpoint recorded (None where it recorded none): a resumed run and an
    evaluation normalise as the run did, whatever sample of the data they would draw now."""
    stats = (payload or {}).get("normalization")
    if not isinstance(stats, dict):
        return None
    return torch.tensor(stats["mean"], dtype=torch.float32), torch.tensor(stats["std"], dtype=torch.float32)


class Feed:
    """The data set where the run holds it (the device when it fits, else the host) and the loaders over it at
    any batch size, normalised by the training split's channel statistics when the config asks."""

    def __init__(
        self,
        cfg: Config,
        data: Dataset | StreamData,
        device: torch.device,
        channels_last: bool,
        limit: float | None = None,
        view: View | None = None,
        stats: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self.cfg, self.device, self.channels_last, self.view = cfg, device, channels_last, view
        d = cfg.data
        self.is_image = data.is_image
        self.streaming_choice = data.streaming  # streamed or held, and why: checkpoints record it
        self.inventory = data.inventory  # which files are in which split: checkpoints record its digest
        self.features = data.features  # a table's columns and scaler: model.json records them
        self.stream = data if isinstance(data, StreamData) else None
        if self.stream is not None:  # read as the run trains: nothing held but the normalisation's statistics
            self.held_on = None
            self.decoder = held_decoder(d, device)
            self.mean, self.std = stats or normalization(cfg, data, self.decoder)
            n = data.shards.samples("train")
            self.batch_size = n if d.batch_size == "full" else d.batch_size
            return
        held = {name: data.split(name) for name in ("train", "val", "test") if data.split(name) is not None}
        self.held_on = hold_on(sum(s.x.nbytes for s in held.values()), device, d.placement, d.device_share, limit)
        self.mean, self.std = stats or normalization(cfg, data)
        self.splits = {n: Split(s.x.to(self.held_on), s.y.to(self.held_on), s.names) for n, s in held.items()}
        self.train_split = self.splits["train"]
        self.batch_size = len(data.train) if d.batch_size == "full" else d.batch_size

    def sample_images(self, n: int) -> torch.Tensor:
        """A seeded random sample of n of the training split's images (all when it holds fewer) as the model sees
        them before augmentation: float, normalised, on the device. Never the first in storage order: an image
        folder is sorted by class."""
        if self.stream is not None:
            x = sample_images(self.stream.shards.splits["train"], self.decoder, n, self.cfg.seed)
        else:
            g = torch.Generator().manual_seed(self.cfg.seed)
            pick = torch.randperm(len(self.train_split), generator=g)[:n].sort().values
            x = self.train_split.x[pick.to(self.train_split.x.device)]
        layout = torch.channels_last if self.channels_last else torch.contiguous_format
        return to_float(x.to(self.device), layout, *self.stats(), self.view)

    def stats_cpu(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The normalisation's mean and std per channel on the host (None, None: none)."""
        if self.mean is None:
            return None, None
        return self.mean.detach().cpu().flatten(), self.std.detach().cpu().flatten()

    def stats(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.mean is None:
            return None, None
        return self.mean.to(self.device).view(1, -1, 1, 1), self.std.to(self.device).view(1, -1, 1, 1)

    def describe(self) -> str:
        """Where the data is for the start-up line, and why where that was a decision."""
        held = f"held on {self.where}" if self.stream is None else self.streaming()
        return held + (f" ({self.streaming_choice.reason})" if self.streaming_choice is not HELD else "")

    @property
    def where(self) -> str:
        return "the device" if self.held_on.type == self.device.type != "cpu" else "the host"

    def streaming(self) -> str:
        n = self.decoder.workers
        stored = self.streaming_choice.stored
        if stored is not None and stored.decoded:
            return f"streamed, {stored.reason}"
        if isinstance(self.decoder, DeviceDecoder):
            return f"streamed, JPEG images decoded on {self.device} (nvJPEG)"
        return (
            f"streamed, decoded in {n} worker process{'es' if n > 1 else ''}" if n else "streamed, decoded in-process"
        )

    def streamed(self, split: str, batch: int, rank: int, world: int, **how) -> StreamLoader:
        d = self.cfg.data
        return StreamLoader(
            self.stream.shards.splits.get(split, []),
            batch,
            self.device,
            self.decoder,
            seed=self.cfg.seed,
            mean=self.mean,
            std=self.std,
            rank=rank,
            world=world,
            channels_last=self.channels_last,
            buffer=d.shuffle_buffer,
            view=self.view,
            log=say_own,  # each process reads its own shards: each names what it skips
            **how,
        )

    def train(self, batch: int, rank: int = 0, world: int = 1) -> Loader:
        """Training batches, this process's slice of each (rank of world)."""
        d = self.cfg.data
        reflect = d.random_crop_padding_mode == "reflect"
        image_aug = {"crop_padding": d.random_crop_padding, "reflect": reflect, "hflip": d.random_hflip}
        image_aug["policy"] = policy_of(d)
        image_aug = image_aug if self.is_image else {}
        if self.view is not None and d.random_resized_crop:
            image_aug["resized_crops"] = True
        if self.stream is not None:
            loader = self.streamed("train", batch, rank, world, shuffle=d.shuffle, drop_last=d.drop_last, **image_aug)
            if len(loader) == 0:
                raise ConfigError("data.drop_last: a process's share of the training shards is smaller than one batch")
            return loader
        n = len(self.train_split)
        size = min(batch, n)
        smallest = n % size if n % size and not d.drop_last else size
        if smallest < world:
            raise ConfigError(
                f"data.batch_size: a training batch of {smallest} samples cannot be split over {world} processes; "
                "use a larger batch, fewer processes, or data.drop_last=true"
            )
        loader = BatchLoader(
            self.train_split,
            batch,
            self.device,
            self.held_on,
            seed=self.cfg.seed,
            shuffle=d.shuffle,
            drop_last=d.drop_last,
            mean=self.mean,
            std=self.std,
            shard=(rank, world),
            channels_last=self.channels_last,
            view=self.view,
            **image_aug,
        )
        if len(loader) == 0:
            raise ConfigError(f"data.drop_last: the training split ({n}) is smaller than one batch")
        return loader

    def has(self, split: str) -> bool:
        if self.stream is not None:
            return self.stream.shards.samples(split) > 0
        return split in self.splits

    def test(self, batch: int, rank: int = 0, world: int = 1, split: str = "test") -> Loader:
        """Batches of a held-out split (test, or val) of data.eval_batch_size, else of the training batch size."""
        if self.stream is not None:
            # Read the same way at every evaluation: kept decoded after its first pass if it takes a small share of
            # the host's memory (a sixteenth of what is available), so evaluations decode nothing again.
            keep = int(available_host_memory() / 16)
            return self.streamed(split, self.cfg.data.eval_batch_size or batch, rank, world, keep_bytes=keep)
        return BatchLoader(
            self.splits[split],
            self.cfg.data.eval_batch_size or batch,
            self.device,
            self.held_on,
            mean=self.mean,
            std=self.std,
            shard=(rank, world),
            channels_last=self.channels_last,
            view=self.view,
        )

    def held_out(self, batch: int, rank: int = 0, world: int = 1) -> dict[str, Loader]:
        """The loaders of the held-out splits the data has: val, test, or both."""
        return {s: self.test(batch, rank, world, s) for s in ("val", "test") if self.has(s)}


def policy_of(d: DataConfig) -> Policy:
    """data.augment as the loaders take it."""
    erasing = d.erasing_probability if "random_erasing" in d.augment else 0.0
    return Policy("trivial_augment" in d.augment, "rand_augment" in d.augment, erasing)
