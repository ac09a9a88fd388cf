"""What a config means on a device, built in one place: the model placed in its memory layout, the precision,
the optimizer (fused where it should be, momentum primed), the schedule, the loss scaler and the loaders.
Training, find-batch-size, evaluate, the benchmark and the naive loop all take their setup from here."""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from job.config import Config
from job.data import Dataset, Split, load_data
from job.data.loader import BatchLoader, channel_stats, choose_placement
from job.data.stream import Decoder, StreamData, StreamLoader, auto_workers, first_images
from job.env import resolve_precision
from job.errors import ConfigError
from job.models import build_model
from job.report import say
from job.storage import cache_dir


def read_data(cfg: Config) -> Dataset:
    """The config's data set in memory, remote inputs cached in the job's cache folder."""
    return load_data(cfg.data, cfg.seed, cache_dir("data"), say)


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
    ) -> None:
        self.cfg, self.device, self.channels_last = cfg, device, channels_last
        d = cfg.data
        self.is_image = data.is_image
        self.stream = data if isinstance(data, StreamData) else None
        if self.stream is not None:  # read as the run trains: nothing held but the normalisation's statistics
            self.held_on = None
            self.decoder = Decoder(auto_workers(d.workers), d.image_size)
            self.mean = self.std = None
            if d.normalize:
                self.mean, self.std = channel_stats(first_images(data.shards.splits["train"], self.decoder))
            n = data.shards.samples("train")
            self.batch_size = n if d.batch_size == "full" else d.batch_size
            return
        nbytes = data.train.x.nbytes + data.test.x.nbytes
        self.held_on = choose_placement(nbytes, device, d.placement, d.device_share, limit)
        self.mean = self.std = None
        if data.is_image and d.normalize:
            self.mean, self.std = channel_stats(data.train.x)
        self.train_split, self.test_split = (
            Split(s.x.to(self.held_on), s.y.to(self.held_on)) for s in (data.train, data.test)
        )
        self.batch_size = len(data.train) if d.batch_size == "full" else d.batch_size

    @property
    def where(self) -> str:
        return "the device" if self.held_on.type == self.device.type != "cpu" else "the host"

    def streaming(self) -> str:
        n = self.decoder.workers
        return (
            f"streamed, decoded in {n} worker process{'es' if n > 1 else ''}" if n else "streamed, decoded in-process"
        )

    def streamed(self, split: str, batch: int, rank: int, world: int, **how) -> StreamLoader:
        d = self.cfg.data
        return StreamLoader(
            self.stream.shards.splits[split],
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
            **how,
        )

    def train(self, batch: int, rank: int = 0, world: int = 1) -> BatchLoader | StreamLoader:
        """Training batches, this process's slice of each (rank of world)."""
        d = self.cfg.data
        image_aug = {"crop_padding": d.random_crop_padding, "hflip": d.random_hflip} if self.is_image else {}
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
            **image_aug,
        )
        if len(loader) == 0:
            raise ConfigError(f"data.drop_last: the training split ({n}) is smaller than one batch")
        return loader

    def test(self, batch: int, rank: int = 0, world: int = 1) -> BatchLoader | StreamLoader:
        """Test batches of data.eval_batch_size, else of the training batch size."""
        if self.stream is not None:
            return self.streamed("test", self.cfg.data.eval_batch_size or batch, rank, world)
        return BatchLoader(
            self.test_split,
            self.cfg.data.eval_batch_size or batch,
            self.device,
            self.held_on,
            mean=self.mean,
            std=self.std,
            shard=(rank, world),
            channels_last=self.channels_last,
        )


@dataclass
class Recipe:
    model: nn.Module  # on the device, in its memory layout, in training mode
    device: torch.device
    precision: str  # fp32, bf16 or fp16: what `auto` came to on this device
    channels_last: bool
    amp: Callable[[], Any]  # a context factory for the precision
    optimizer: torch.optim.Optimizer
    scheduler: Any  # per step over the whole run, or None
    scaler: torch.amp.GradScaler  # enabled for fp16 only
    feed: Feed
    train: BatchLoader | StreamLoader | None  # at the config's batch size (None when built without loaders)
    test: BatchLoader | StreamLoader | None


def build(
    cfg: Config,
    device: torch.device,
    data: Dataset,
    *,
    loaders: bool = True,
    rank: int = 0,
    world: int = 1,
    memory_limit: float | None = None,
) -> Recipe:
    """Everything the config asks for, on `device`. `loaders`: the training and test loaders at the config's batch
    size (the schedule spans their steps); `memory_limit`: bytes the data may take on the device at most."""
    model = build_model(cfg.model, data.input_shape, len(data.classes))
    precision = resolve_precision(cfg.train.precision, device)
    channels_last = use_channels_last(cfg.train.channels_last, model, device, precision)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = not cfg.train.deterministic
    model.to(device, memory_format=torch.channels_last if channels_last else torch.preserve_format)
    model.train()
    optimizer = make_optimizer(cfg, model, fused=device.type == "cuda" and precision == "fp16")
    prime_momentum(optimizer)
    feed = Feed(cfg, data, device, channels_last, memory_limit)
    train = test = scheduler = None
    if loaders:
        train, test = feed.train(feed.batch_size, rank, world), feed.test(feed.batch_size, rank, world)
        scheduler = make_scheduler(cfg, optimizer, cfg.train.epochs * len(train))
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    amp = autocast(precision, device)
    return Recipe(model, device, precision, channels_last, amp, optimizer, scheduler, scaler, feed, train, test)


def autocast(precision: str, device: torch.device) -> Callable[[], Any]:
    """A context factory for a precision (fp32: none). Without autocast's weight cache, which a captured CUDA graph
    cannot hold across replays."""
    if precision == "fp32":
        return contextlib.nullcontext
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return lambda: torch.autocast(device.type, dtype=dtype, cache_enabled=False)


def use_channels_last(setting: str, model: nn.Module, device: torch.device, precision: str) -> bool:
    """channels_last for a model with 2-d convolutions: when asked, or (auto) where convolutions run faster in it:
    on a CPU (oneDNN's kernels; the tutorials' CIFAR-10 CNN trains about 15% faster on this project's CPU), and on a
    GPU computing in bf16 or fp16 (tensor cores)."""
    if setting == "off" or not any(isinstance(m, nn.Conv2d) for m in model.modules()):
        return False
    return setting == "on" or device.type == "cpu" or (device.type == "cuda" and precision in ("bf16", "fp16"))


def make_optimizer(cfg: Config, model: nn.Module, fused: bool = False) -> torch.optim.Optimizer:
    """`fused` (CUDA with fp16): one kernel per step, which also takes fp16's loss scale and overflow flag on the
    device, so GradScaler never waits for the GPU (with the other kernels it reads the flag on the host every step)."""
    o = cfg.optim
    how = {"fused": True} if fused else {}
    if o.name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=o.lr, weight_decay=o.weight_decay, **how)
    if o.nesterov and o.momentum == 0:
        raise ConfigError("optim.nesterov: needs optim.momentum > 0")
    return torch.optim.SGD(
        model.parameters(), lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, weight_decay=o.weight_decay, **how
    )


def prime_momentum(optimizer: torch.optim.Optimizer) -> None:
    """Zero momentum buffers for fused SGD before its first step. Its first step otherwise makes them uninitialised
    and fills them in the kernel, which fp16's loss scaler skips on an overflow, leaving them uninitialised. With
    no dampening, a zero buffer's first update is the gradient itself, as SGD's first step is."""
    for group in optimizer.param_groups:
        if isinstance(optimizer, torch.optim.SGD) and group.get("fused") and group["momentum"]:
            for p in group["params"]:
                optimizer.state[p].setdefault(
                    "momentum_buffer", torch.zeros_like(p, memory_format=torch.preserve_format)
                )


def make_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, total_steps: int):
    """A per-step schedule over the whole run, or None."""
    o = cfg.optim
    if o.schedule == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    if o.schedule == "onecycle":
        cycle_momentum = o.name == "adamw" or o.momentum > 0  # never add momentum a recipe did not ask for
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=o.lr, total_steps=total_steps, cycle_momentum=cycle_momentum
        )
    return None


def planned_steps(scheduler) -> int | None:
    """The run length a schedule was planned over, in steps (None: no schedule)."""
    if scheduler is None:
        return None
    cosine = isinstance(scheduler, torch.optim.lr_scheduler.CosineAnnealingLR)
    return scheduler.T_max if cosine else scheduler.total_steps


def replan(cfg: Config, optimizer: torch.optim.Optimizer, total_steps: int, step: int):
    """The schedule planned over a new run length, at `step`. A schedule is a function of the step and of the run's
    length: a resumed run given more epochs goes on along the new curve and ends where the schedule ends (the old
    plan would climb again after its end, or refuse to step past it). The learning rates (and OneCycle's momentum)
    are set for `step` now."""
    scheduler = make_scheduler(cfg, optimizer, total_steps)
    scheduler.last_epoch = step
    if isinstance(scheduler, torch.optim.lr_scheduler.CosineAnnealingLR):  # its closed form, with eta_min 0
        lrs = [base * (1 + math.cos(math.pi * step / total_steps)) / 2 for base in scheduler.base_lrs]
    else:
        with warnings.catch_warnings():  # OneCycleLR's get_lr is closed in the step; it asks to be called by step()
            warnings.simplefilter("ignore")
            lrs = scheduler.get_lr()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    return scheduler
