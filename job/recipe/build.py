"""What a config means on a device, built in one place: the model placed in its memory layout, the precision,
the optimizer (fused where it should be, momentum primed), the schedule, the loss scaler and the loaders.
Training, find-batch-size, evaluate, the benchmark and the naive loop all take their setup from here."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from job.config import Config, DataConfig
from job.console import say, say_own
from job.data.augment import Policy, View, channel_stats, to_float
from job.data.batches import Loader
from job.data.dataset import Dataset, Split
from job.data.decode import DeviceDecoder
from job.data.loader import BatchLoader
from job.data.placement import HELD, Streaming, hold_on
from job.data.read import found_kind, load_data
from job.data.stream import StreamData, StreamLoader, held_decoder, sample_images
from job.errors import ConfigError
from job.group.memory import available_host_memory
from job.recipe import uncompiled, weights
from job.recipe.ema import ModelEma
from job.recipe.mix import Mix
from job.recipe.models import build_model
from job.recipe.plan import Precision, forward_flops, precision_on, saved_precision
from job.recipe.schedule import Lookahead, make_scheduler
from job.storage.run_folder import cache_dir

DATA_INIT_IMAGES = 5000  # the training images a model's init_from_data sees
STATS_IMAGES = 1000  # the training images streamed data's normalisation statistics are taken from


def resolved(cfg: Config) -> Config:
    """The config with the defaults that follow from other settings filled in, as config.yaml records them: the
    image and resize sizes of torchvision weights' preprocessing, random_resized_crop's resize size (8/7 of the
    input, 256 for 224, as ImageNet recipes hold their images); data.kind parquet where the kind is csv and data.path
    holds parquet files (job/data/read.py), said once, when found."""
    d = cfg.data
    if (kind := found_kind(d)) != d.kind:
        say(f"data.kind parquet, found from the files of {d.path} (data.kind {d.kind} reads CSV tables)")
        d = d.model_copy(update={"kind": kind})
        cfg = cfg.model_copy(update={"data": d})
    if d.kind == "csv":
        return cfg
    w = weights.resolve(cfg.model.name, cfg.model.weights)
    image, resize = d.image_size, d.resize_size
    if w is not None and w.crop_size:
        image = image or w.crop_size
        resize = resize or round(image * w.resize_size / w.crop_size)
    if d.random_resized_crop:
        if image is None:
            raise ConfigError("data.random_resized_crop: needs data.image_size, the size of the crops")
        if d.random_crop_padding:
            raise ConfigError(
                "data.random_resized_crop: crops photos; data.random_crop_padding crops small images; choose one"
            )
        resize = resize or round(image * 8 / 7)
    if (image, resize) == (d.image_size, d.resize_size):
        return cfg
    return cfg.model_copy(update={"data": d.model_copy(update={"image_size": image, "resize_size": resize})})


def read_data(cfg: Config, started: Streaming | None = None) -> Dataset | StreamData:
    """The config's data set in memory (or, streamed, its shards opened), remote inputs cached in the job's cache
    folder; `started`: whether the run being resumed streamed, kept unless the config sets data.placement."""
    return load_data(resolved(cfg).data, cache_dir("data"), say, started)


def model_input(cfg: Config, held: tuple[int, ...], is_image: bool) -> tuple[tuple[int, ...], View | None]:
    """The model's input shape, and the view that makes it from images held at `held` (None when they already are
    the model's inputs): data.image_size crops or resizes them on the batch, data.resize_size sets evaluation's
    centre crop, data.random_resized_crop training's crops."""
    d = cfg.data
    if not is_image:
        return held, None
    c, h, w = held
    size = d.image_size or h
    centre = min(1.0, size / d.resize_size) if d.resize_size else 1.0
    scale = tuple(d.crop_scale) if d.random_resized_crop else None
    if scale is None and centre == 1.0 and (h, w) == (size, size):
        return held, None
    return (c, size, size), View(size, centre, scale, tuple(d.crop_ratio))


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
    train: Loader | None  # at the config's batch size (None when built without loaders)
    held_out: dict[str, Loader]  # val and test, those the data has (none when built without loaders)
    input_shape: tuple[int, ...]  # what the model takes: the data's, or its view's
    classes: list[str]  # in index order
    accumulate: int = 1  # batches per optimizer step
    loss: Callable[..., torch.Tensor] = F.cross_entropy  # the training loss of (logits, labels)
    lookahead: Lookahead | None = None  # stepped after each optimizer step, when optim.lookahead_every is set
    multilabel: bool = False  # sigmoids against multi-hot targets (BCE), scored by mAP; else softmax and accuracy
    ema: ModelEma | None = None  # train.ema's average, updated after each optimizer step (after lookahead's)
    mix: Mix | None = None  # train.mixup / train.cutmix: the training batches mixed before the step
    precision_decided: Precision = Precision("fp32")  # this attempt's precision, and why `auto` came to it
    precision_began: Precision = Precision("fp32")  # the run's precision as it began: what its checkpoints record
    sample_flops: float | None = None  # one sample's forward FLOPs, when counted (on a CPU, for precision auto)

    @property
    def evaluated(self) -> nn.Module:
        """The model the run evaluates, chooses, saves and exports: train.ema's average when on, else the model."""
        return self.ema.module if self.ema is not None else self.model

    @property
    def evaluated_on(self) -> str:
        """The split every evaluation reports, and the run chooses on: val, or test when the data has no val."""
        return "val" if "val" in self.held_out else "test"

    @property
    def test(self) -> Loader | None:
        return self.held_out.get("test")


def build(
    cfg: Config,
    device: torch.device,
    data: Dataset,
    *,
    loaders: bool = True,
    rank: int = 0,
    world: int = 1,
    memory_limit: float | None = None,
    pretrained: bool = True,
    started: dict | None = None,
) -> Recipe:
    """Everything the config asks for, on `device`. `loaders`: the training and test loaders at the config's batch
    size (the schedule spans their steps); `memory_limit`: bytes the data may take on the device at most;
    `pretrained`: load model.weights (not when a checkpoint's weights replace them); `started`: the checkpoint a run
    continues from, whose normalisation statistics it keeps, and the precision `auto` came to."""
    cfg = resolved(cfg)
    input_shape, view = model_input(cfg, data.input_shape, data.is_image)
    check_image_settings(cfg, input_shape, data.is_image)
    model = build_model(cfg.model, input_shape, len(data.classes))
    if pretrained:
        weights.load_pretrained(cfg.model, model, len(data.classes), cache_dir("weights"))
    kept = saved_precision((started or {}).get("precision"))
    chosen, sample_flops = precision_for(cfg, device, model, input_shape, data, kept)
    precision = chosen.name
    channels_last = use_channels_last(cfg.train.channels_last, model, device, precision)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = not cfg.train.deterministic
    model.to(device, memory_format=torch.channels_last if channels_last else torch.preserve_format)
    model.train()
    optimizer = make_optimizer(cfg, model, fused=device.type == "cuda" and precision == "fp16")
    prime_momentum(optimizer)
    feed = Feed(cfg, data, device, channels_last, memory_limit, view, saved_stats(started))
    if pretrained and not cfg.model.weights and hasattr(model, "init_from_data"):  # a start that depends on the data
        model.init_from_data(feed.sample_images(DATA_INIT_IMAGES))
    train = scheduler = lookahead = ema = None
    held_out: dict[str, Loader] = {}
    accumulate = cfg.train.accumulate_steps
    if loaders:
        train, held_out = feed.train(feed.batch_size, rank, world), feed.held_out(feed.batch_size, rank, world)
        steps = optimizer_steps(cfg, len(train))
        scheduler = make_scheduler(cfg, optimizer, steps)
        lookahead = Lookahead(model, cfg.optim.lookahead_every, steps) if cfg.optim.lookahead_every else None
        ema = ModelEma(model, cfg.train.ema, cfg.train.ema_warmup) if cfg.train.ema else None
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    amp = autocast(precision, device)
    smoothing = cfg.train.label_smoothing
    t = cfg.train
    mixing = (t.mixup or t.cutmix) and t.mix_probability > 0
    mix = Mix(len(data.classes), cfg.seed, t.mixup, t.cutmix, t.mix_probability, t.mix_switch) if mixing else None
    loss = functools.partial(F.cross_entropy, label_smoothing=smoothing) if smoothing else F.cross_entropy
    if data.multilabel:
        balanced = cfg.train.class_weights == "balanced"
        loss = MultiLabelLoss(positive_weights(data).to(device) if balanced else None)
    elif cfg.train.class_weights == "balanced":
        loss = CountedLoss(balanced_weights(data).to(device), smoothing)
    elif (data.streamed and cfg.data.skip_bad_samples) or mix is not None:  # IGNORED labels; mixed targets
        loss = CountedLoss(None, smoothing)
    return Recipe(
        model,
        device,
        precision,
        channels_last,
        amp,
        optimizer,
        scheduler,
        scaler,
        feed,
        train,
        held_out,
        input_shape,
        data.classes,
        accumulate,
        loss,
        lookahead,
        data.multilabel,
        ema,
        mix,
        chosen,
        kept or chosen,  # a resumed run's first decision, whatever an attempt between computed
        sample_flops,
    )


class CountedLoss:
    """Cross-entropy averaged over the batch's samples that count: a streamed sample that could not be decoded is
    labelled IGNORED and left out, and a batch of none of them gives 0, not torch's NaN. `weight`: each class's
    weight on its samples' losses (Keras's class_weight; torch's weight= divides by the batch's summed weights
    instead, which a batch split over processes would not reproduce)."""

    def __init__(self, weight: torch.Tensor | None, smoothing: float = 0.0) -> None:
        self.weight, self.smoothing = weight, smoothing

    def __call__(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y`: class indexes, or (train.mixup, train.cutmix) probabilities per class, whose weight is the classes'
        weights mixed alike, and which count where they hold any class (a row of zeros: IGNORED samples)."""
        losses = F.cross_entropy(logits, y, reduction="none", label_smoothing=self.smoothing)
        soft = y.is_floating_point()
        counted = y.sum(1) > 0 if soft else y >= 0
        if self.weight is not None:
            losses = losses * (y @ self.weight if soft else self.weight[y.clamp(min=0)])
        return (losses * counted).sum() / counted.sum().clamp(min=1)


class MultiLabelLoss:
    """Multi-label: binary cross-entropy of each class's sigmoid against its 0/1 target (BCEWithLogitsLoss), the mean
    over the classes and the samples that count (a streamed sample that could not be decoded has targets below 0).
    `pos_weight`: each class's weight on its positives (train.class_weights=balanced)."""

    def __init__(self, pos_weight: torch.Tensor | None) -> None:
        self.pos_weight = pos_weight

    def __call__(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        counted = (y >= 0).all(1)
        losses = F.binary_cross_entropy_with_logits(
            logits.float(), y.clamp(min=0), pos_weight=self.pos_weight, reduction="none"
        ).mean(1)
        return (losses * counted).sum() / counted.sum().clamp(min=1)


def positive_weights(data: Dataset | StreamData) -> torch.Tensor:
    """train.class_weights balanced, multi-label: each class's negatives / positives among the training samples, as
    BCEWithLogitsLoss's pos_weight (1 for a class with none)."""
    if isinstance(data, StreamData):
        if data.inventory is None:
            raise ConfigError("train.class_weights=balanced: these shards do not record their class counts")
        inv = data.inventory
        positives = torch.tensor([float(inv.counts["train"].get(c, 0)) for c in data.classes])
        n = float(inv.total("train"))
    else:
        positives, n = data.train.y.cpu().double().sum(0), float(len(data.train))
    return torch.where(positives > 0, (n - positives) / positives.clamp(min=1), torch.ones_like(positives)).float()


def balanced_weights(data: Dataset | StreamData) -> torch.Tensor:
    """train.class_weights balanced: n_samples / (n_classes x the class's samples), as scikit-learn's
    compute_class_weight('balanced'); 0 for a class with no training samples."""
    k = len(data.classes)
    if isinstance(data, StreamData):
        if data.inventory is None:
            raise ConfigError(
                "train.class_weights=balanced: these shards do not record their class counts (shards packed by "
                "`python -m job shard` do)"
            )
        per = data.inventory.counts["train"]
        counts = torch.tensor([float(per.get(c, 0)) for c in data.classes])
    else:
        counts = torch.bincount(data.train.y.cpu(), minlength=k).double()
    weights = torch.where(counts > 0, counts.sum() / (k * counts.clamp(min=1)), torch.zeros_like(counts))
    return weights.float()


def policy_of(d: DataConfig) -> Policy:
    """data.augment as the loaders take it."""
    erasing = d.erasing_probability if "random_erasing" in d.augment else 0.0
    return Policy("trivial_augment" in d.augment, "rand_augment" in d.augment, erasing)


def check_image_settings(cfg: Config, input_shape: tuple[int, ...], is_image: bool) -> None:
    """ConfigError for settings that need images the data does not have."""
    d, t = cfg.data, cfg.train
    if t.test_time_augmentation != "none" and not is_image:
        raise ConfigError("train.test_time_augmentation: flips and shifts images; this data is a table")
    if (t.mixup or t.cutmix) and not is_image:
        raise ConfigError("train.mixup, train.cutmix: mix images; this data is a table")
    if d.augment and not is_image:
        raise ConfigError(f"data.augment: {', '.join(d.augment)} change images; this data is a table")
    if is_image and d.random_crop_padding_mode == "reflect" and d.random_crop_padding >= min(input_shape[1:]):
        raise ConfigError(
            f"data.random_crop_padding: reflect pads by less than the image's side ({min(input_shape[1:])}), got "
            f"{d.random_crop_padding}"
        )


def optimizer_steps(cfg: Config, batches: int, epochs: int | None = None) -> int:
    """Optimizer steps in `epochs` (default: the run's) of `batches` batches: one per train.accumulate_steps
    batches, and one at each epoch's end for the batches left over."""
    return (cfg.train.epochs if epochs is None else epochs) * math.ceil(batches / cfg.train.accumulate_steps)


def precision_for(
    cfg: Config,
    device: torch.device,
    model: nn.Module,
    input_shape: tuple[int, ...],
    data: Dataset,
    started: Precision | None = None,
) -> tuple[Precision, float | None]:
    """What train.precision comes to for this model on `device` (job/recipe/plan.py decides; a resumed run's `started`
    precision kept there), and one sample's forward FLOPs when auto needed them counted: on a CPU, where its choice
    depends on what a training batch's step costs."""
    flops = forward_flops(model, input_shape) if device.type == "cpu" and cfg.train.precision == "auto" else None
    n = data.samples("train")
    batch = n if cfg.data.batch_size == "full" else min(cfg.data.batch_size, n)
    return precision_on(cfg.train.precision, device, (flops or 0.0) * batch, started), flops


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
    params = param_groups(cfg, model)
    # torch's classes only where something is compiled: their wrappers import the compiler (job/recipe/uncompiled.py)
    classes = (torch.optim.SGD, torch.optim.AdamW) if cfg.train.compile else (uncompiled.SGD, uncompiled.AdamW)
    if o.name == "adamw":
        return classes[1](params, lr=o.lr, weight_decay=o.weight_decay, **how)
    if o.nesterov and o.momentum == 0:
        raise ConfigError("optim.nesterov: needs optim.momentum > 0")
    return classes[0](params, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, weight_decay=o.weight_decay, **how)


NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)


def param_groups(cfg: Config, model: nn.Module) -> list:
    """The trainable parameters, in one group (a plain list) unless some train otherwise: normalisation layers' at
    optim.norm_lr_scale times the rate (their weight decay divided by it, so that decay per step, rate times decay,
    is the same), those the model's `param_epochs` names, marked with their epochs, each block below the class layer
    at its optim.layer_decay rate, and with train.finetune_stages all but the class layer marked to start after
    them. A frozen backbone's parameters are left out (no optimizer state)."""
    o = cfg.optim
    limits = dict(getattr(model, "param_epochs", None) or {})
    named = dict(model.named_parameters())
    if unknown := sorted(set(limits) - set(named)):
        raise ConfigError(f"model {cfg.model.name}: param_epochs names no parameter of it: {', '.join(unknown)}")
    norms = {id(p) for m in model.modules() if isinstance(m, NORMS) for p in m.parameters(recurse=False)}
    depth = layer_depths(named)
    stages = cfg.train.finetune_stages
    if o.layer_decay == 1:  # one rate for every block: only the class layer apart, and that only for the stages
        depth = {name: min(below, 1) if stages else 0 for name, below in depth.items()}
    groups: dict[tuple, list] = {(False, None, 0): []}  # the plain group first: its rate is the one logged
    for name, p in named.items():
        if p.requires_grad:
            norm = o.norm_lr_scale != 1 and id(p) in norms
            groups.setdefault((norm, limits.get(name), depth[name]), []).append(p)
    if len(groups) == 1 and not stages:
        return groups[(False, None, 0)]
    out = []
    for (norm, epochs, below), params in groups.items():
        scale = o.norm_lr_scale if norm else 1.0
        layer = o.layer_decay**below
        group = {"params": params, "lr": o.lr * scale * layer, "weight_decay": o.weight_decay / scale}
        group |= {"lr_scale": scale * layer} | ({"train_epochs": epochs} if epochs is not None else {})
        out.append(group | ({"from_epochs": stages} if stages and below else {}))
    return [g for g in out if g["params"]]


def layer_depths(named: dict[str, nn.Parameter]) -> dict[str, int]:
    """Each parameter's block's place below the class layer (0: the class layer itself). A block is the module two
    names deep (layer3.1, features.4, conv1), in the order the model holds them; the class layer is the block of the
    model's last parameter, as torchvision's classifiers and the job's models end on it."""
    blocks = {name: ".".join(name.split(".")[:-1][:2]) for name in named}
    order = list(dict.fromkeys(blocks.values()))
    head = blocks[next(reversed(named))] if named else ""
    below = {b: 0 if b == head else max(order.index(head) - i, 1) for i, b in enumerate(order)}
    return {name: below[b] for name, b in blocks.items()}


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
