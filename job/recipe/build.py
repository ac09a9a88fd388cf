"""What a config means on a device, built in one place: the model placed in its memory layout, the precision,
the optimizer (job/recipe/optimizer.py), the schedule, the loss (job/recipe/losses.py), the loss scaler and the data's
feed with its loaders (job/recipe/feed.py). Training, find-batch-size, evaluate, the benchmark and the naive loop all
take their setup from here."""

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

from job.config import Config
from job.console import say
from job.data.augment import View
from job.data.batches import Loader
from job.data.dataset import Dataset
from job.data.placement import Streaming
from job.data.read import found_kind, load_data
from job.data.stream import StreamData
from job.errors import ConfigError
from job.recipe import weights
from job.recipe.ema import ModelEma
from job.recipe.feed import Feed, saved_stats
from job.recipe.losses import CountedLoss, MultiLabelLoss, balanced_weights, positive_weights
from job.recipe.mix import Mix
from job.recipe.models import build_model
from job.recipe.optimizer import make_optimizer, prime_momentum
from job.recipe.plan import Precision, forward_flops, precision_on, saved_precision
from job.recipe.schedule import Lookahead, make_scheduler
from job.storage.run_folder import cache_dir

DATA_INIT_IMAGES = 5000  # the training images a model's init_from_data sees


def resolved(cfg: Config) -> Config:
    """The config with the defaults that follow from other settings filled in, as config.yaml records them: the
    image and resize sizes of torchvision weights' preprocessing, random_resized_crop's resize size (8/7 of the
    input, 256 for 224, as ImageNet recipes hold their images); the data.kind of another table format where the kind
    is the default and data.path holds that format's files (job/data/read.py), said once, when found."""
    d = cfg.data
    if (kind := found_kind(d)) != d.kind:
        say(f"data.kind {kind}, found from the files of {d.path} (data.kind {d.kind} cannot read them)")
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
