"""The run's config: typed sections with a doc per field, YAML from a preset or any URL, `--set` overrides.

Validation errors name the key path and what was expected, in one line, before any work is done.
"""

from __future__ import annotations

import difflib
import threading
import warnings
from importlib import resources
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from job.duration import parse_duration
from job.errors import ConfigError, StorageError
from job.recorded import possible_scores
from job.run.cost import parse_budget
from job.storage.cloud import describe_storage_error, filesystem

PRESETS = ("iris", "cifar10", "cifar10-fast", "finetune", "photos")
PRESET_LIST = ", ".join(PRESETS)
USER_MODEL_HINT = "package.module:ClassName"

CHOOSABLE = ("auto", *(f"val_{m}" for m in possible_scores(None, None)))  # train.choose_on: val scores a run writes


def positive_int_or(word: str, v: Any) -> Any:
    """A positive integer (not a boolean, which YAML and Python also count as integers), or the one word."""
    if v == word or (isinstance(v, int) and not isinstance(v, bool) and v > 0):
        return v
    raise ValueError(f"expected a positive integer or '{word}'")


def admits_numbers(annotation: Any) -> bool:
    """Whether a field takes numbers and not booleans (int | None, float, int | Literal["full"], ...)."""
    kinds = set(get_args(annotation)) | {annotation}
    return bool(kinds & {int, float}) and bool not in kinds


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        """true/false are never numbers, though YAML and Python count them as integers (true would be 1 epoch)."""
        if isinstance(v, bool) and admits_numbers(cls.model_fields[info.field_name].annotation):
            raise ValueError("expected a number")
        return v


class DataConfig(Section):
    kind: Literal["csv", "cifar10", "folder", "manifest", "parquet", "shards"] = Field(
        "csv",
        description="Reader: a CSV table, CIFAR-10's python-version layout, image folders (class folders at the top, "
        "or train/ val/ test/ folders of them), a manifest (a CSV or JSONL file of image paths and labels), parquet "
        "(a .parquet file, a folder of them, or the Hugging Face hub's data/<split>-*.parquet layout: images from its "
        "Image struct, labels from a ClassLabel or data.label_column; a table of feature columns is read as csv; "
        "found from the files: csv, the default, reads a data.path of parquet files as parquet, and the start-up "
        "says so), "
        "or WebDataset-style tar shards (train/*.tar, test/*.tar; `python -m job shard` makes them).",
    )
    path: str = Field(
        "",
        description="URL of the data (local path, gs://, memory://, a Drive mount). "
        "Empty with kind csv: the bundled Iris table.",
    )
    batch_size: int | Literal["full"] = Field(64, description="Training batch size, or 'full' for the whole split.")
    eval_batch_size: int | None = Field(None, gt=0, description="Test batch size; default: batch_size.")
    shuffle: bool = Field(True, description="Shuffle the training set each epoch (a seeded, resumable order).")
    drop_last: bool = Field(False, description="Drop the last partial training batch of each epoch.")
    target: str = Field("species", description="csv: the name of the label column.")
    test_path: str = Field("", description="csv: a separate test table; empty: split the table by test_split.")
    val_split: float = Field(
        0.1,
        ge=0,
        lt=1,
        description="Share of each class held out from training for validation when the data has no val split of "
        "its own (0: none). The run chooses on val (train.keep_best, early stopping); test is only reported. A file's "
        "split is a hash of its path (a table's: of its row number) and split_seed, so added files never move others.",
    )
    test_split: float | None = Field(
        None,
        ge=0,
        lt=1,
        description="Share held out for testing when the data has no test split of its own; default: 0.2 of a csv "
        "table's rows (scikit-learn's train_test_split), none of an image folder's or manifest's files.",
    )
    split_seed: int = Field(
        42,
        description="The seed of the held-out files and rows, apart from `seed` so that runs of other seeds choose "
        "and test on the same ones; a csv table's test rows are scikit-learn's train_test_split(test_size="
        "test_split, random_state=split_seed).",
    )
    skip_bad_samples: bool = Field(
        True,
        description="An image that cannot be decoded (empty, truncated, not an image) is skipped and named, and "
        "data.json in the run folder lists every one; false: the first one stops the run (exit 3).",
    )
    path_column: str = Field(
        "path",
        description="manifest: the column of image paths (relative to the file, or URLs); parquet: the image column, "
        "when no column is the Hugging Face Image feature.",
    )
    label_column: str = Field(
        "label",
        description="manifest and parquet: the column of labels (class names or indexes; parquet: else its one "
        "ClassLabel column).",
    )
    split_column: str = Field(
        "split", description="manifest: the column of splits (train, val, test), when the file has one."
    )
    label_separator: str | None = Field(
        None,
        min_length=1,
        description="manifest: the labels of a multi-label image in one cell, split at this text (e.g. '|': "
        "dog|person); an empty cell is an image with none. Without it, a JSON list (a JSONL value, or a CSV cell "
        '\'["dog", "person"]\') holds them.',
    )
    task: Literal["auto", "multiclass", "multilabel"] = Field(
        "auto",
        description="multiclass: one class an image (softmax); multilabel: any number of classes an image, none "
        "included (sigmoids, BCE, thresholds chosen on val). auto: multilabel when the labels are lists (a JSON "
        "list, data.label_separator, 0/1 columns or a parquet Sequence(ClassLabel)), else multiclass.",
    )
    image_size: int | None = Field(
        None,
        gt=0,
        description="Images: the square size the model sees. folder and shards: images are resized to it when read "
        "(required when sizes differ), unless data.resize_size holds them larger; other sizes held are resized on "
        "the batch. Default with torchvision weights: their crop size (224 for most).",
    )
    resize_size: int | None = Field(
        None,
        gt=0,
        description="Photos: folder and shards hold each image at this square size (the short side resized to it, "
        "the centre kept); evaluation sees its centre image_size/resize_size, resized to image_size. Default: the "
        "torchvision weights' resize size (256 or 232 for 224), or image_size x 8/7 with random_resized_crop.",
    )
    normalize: bool | Literal["auto"] = Field(
        "auto",
        description="Images: true: subtract the training set's mean and divide by its std; false: none; auto: the "
        "pretrained weights' own mean and std when model.weights names torchvision weights, else none.",
    )
    random_crop_padding: int = Field(
        0, ge=0, description="Small images: pad by this many pixels and crop back at random (0: off)."
    )
    random_resized_crop: bool = Field(
        False,
        description="Photos: train on a random crop of data.crop_scale of each image's area, with aspect ratio in "
        "data.crop_ratio, resized to data.image_size (torchvision's RandomResizedCrop, on the whole batch at once).",
    )
    crop_scale: tuple[float, float] = Field(
        (0.08, 1.0), description="random_resized_crop: the range of the crop's share of the image's area."
    )
    crop_ratio: tuple[float, float] = Field(
        (3 / 4, 4 / 3), description="random_resized_crop: the range of the crop's aspect ratio (width / height)."
    )
    random_crop_padding_mode: Literal["constant", "reflect"] = Field(
        "constant",
        description="random_crop_padding: pad with zeros (constant), or with the image mirrored at its edge (reflect).",
    )
    random_hflip: bool | Literal["alternate"] = Field(
        False,
        description="Images: flip horizontally with probability 0.5; alternate: flip each image at random in the first "
        "epoch and the other way in each epoch after, so that every image is seen both ways every two epochs.",
    )
    augment: list[Literal["trivial_augment", "rand_augment", "random_erasing"]] = Field(
        [],
        description="Images, per training image, on the batch (torchvision.transforms.v2's operations and "
        "magnitudes, drawn from the run's seed): trivial_augment (TrivialAugmentWide: one operation at a random "
        "magnitude) or rand_augment (RandAugment: two operations at magnitude 9 of 31), after crops and flips; "
        "random_erasing: a random box of the normalised image set to 0, with data.erasing_probability.",
    )
    erasing_probability: float = Field(
        0.25, gt=0, le=1, description="data.augment random_erasing: the share of training images erased."
    )
    download: bool = Field(False, description="cifar10: download with torchvision when the local path is empty.")
    cache: bool = Field(
        True,
        description="Remote data: keep a local copy (in $JOB_CACHE_DIR, else ~/.cache/job), keyed by URL and the "
        "objects' generation and size, so later runs do not download it again.",
    )
    placement: Literal["auto", "device", "host", "stream"] = Field(
        "auto",
        description="Where the decoded data lives: on the training device (fast), in host memory, nowhere (stream: "
        "shards are read and decoded as the run trains; an image folder, archive or manifest is packed into shards in "
        "the job's cache first, once), or auto (shards and image folders stream when decoded they would not fit in "
        "device_share of free host memory; data held in memory goes on the device when it fits in device_share of "
        "free device memory).",
    )
    device_share: float = Field(
        0.5, gt=0, le=1, description="placement auto: share of free device (and, for shards, host) memory."
    )
    shuffle_buffer: int = Field(
        1000, ge=0, description="shards, streamed: samples held in the shuffle buffer (0: shard order only)."
    )
    decode: Literal["auto", "host", "device"] = Field(
        "auto",
        description="shards, streamed: where images are decoded: host (data.workers processes), device (JPEG images "
        "by the GPU's nvJPEG, batched, resized there too; a CUDA device only); auto: host, until device decoding is "
        "measured faster (docs/benchmarks.md).",
    )
    workers: int | Literal["auto"] = Field(
        "auto",
        description="shards, streamed: image-decoding processes (0: decode in the training process); "
        "auto: one per CPU core but one, at most 8; 0 when training on a CPU of two cores or fewer.",
    )

    @field_validator("batch_size", mode="before")
    @classmethod
    def _batch_size(cls, v: Any) -> Any:
        return positive_int_or("full", v)

    @field_validator("test_split")
    @classmethod
    def _shares(cls, v: float | None, info: ValidationInfo) -> float | None:
        if v is not None and v + info.data.get("val_split", 0) >= 1:
            raise ValueError("data.val_split and data.test_split together hold out everything: leave some to train on")
        return v

    @field_validator("crop_scale", "crop_ratio")
    @classmethod
    def _range(cls, v: tuple[float, float], info: ValidationInfo) -> tuple[float, float]:
        lo, hi = v
        if not 0 < lo <= hi or (info.field_name == "crop_scale" and hi > 1):
            top = " <= 1" if info.field_name == "crop_scale" else ""
            raise ValueError(f"expected [low, high] with 0 < low <= high{top}")
        return v

    @field_validator("augment")
    @classmethod
    def _augment(cls, v: list[str]) -> list[str]:
        if "trivial_augment" in v and "rand_augment" in v:
            raise ValueError("trivial_augment and rand_augment are two policies of the same operations: choose one")
        return list(dict.fromkeys(v))

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, v: Any) -> Any:
        if v == 0:
            return v
        return positive_int_or("auto", v)


class ModelConfig(Section):
    name: str = Field(
        "mlp",
        description="mlp, cifar_cnn, cifar_fast, resnet18, any classification model torchvision has (resnet50, "
        f"mobilenet_v3_small, efficientnet_b0, vit_b_16, ...), or {USER_MODEL_HINT} for your own nn.Module.",
    )
    weights: str = Field(
        "",
        description="Pretrained weights: a torchvision weights name of the model (DEFAULT, IMAGENET1K_V2, ...; "
        "downloaded once into the job's cache, and their preprocessing becomes the data's default), or the URL of a "
        "state_dict file (.pt/.pth: local path, gs://, http(s)://, a Drive path), read without running code. "
        "Layers whose shape does not fit the data's classes are replaced.",
    )
    freeze_backbone: bool = Field(
        False,
        description="With model.weights: train only the layers replaced to fit the classes (else the class layer); "
        "the rest keep the loaded weights, their batch-norm statistics included.",
    )
    hidden: list[int] = Field([10], description="mlp: hidden layer sizes (ReLU between layers).")
    small_stem: bool | None = Field(
        None,
        description="resnet18: 3x3 stride-1 stem without max-pool, for small images; default: on for images of 64 "
        "px or less, off for larger ones and with model.weights (pretrained weights have the 7x7 stem).",
    )
    kwargs: dict[str, Any] = Field(
        {}, description=f"{USER_MODEL_HINT}, torchvision models and cifar_fast: keyword arguments of the constructor."
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        from job.recipe.models import check_name

        check_name(v)
        return v

    @field_validator("weights")
    @classmethod
    def _weights(cls, v: str, info: ValidationInfo) -> str:
        from job.recipe.weights import resolve

        if v and "name" in info.data:
            try:
                resolve(info.data["name"], v)
            except ConfigError as e:
                raise ValueError(str(e).removeprefix("model.weights: ")) from None
        return v

    @field_validator("freeze_backbone")
    @classmethod
    def _freeze(cls, v: bool, info: ValidationInfo) -> bool:
        if v and not info.data.get("weights"):
            raise ValueError("needs model.weights: a backbone to keep")
        return v

    @field_validator("hidden")
    @classmethod
    def _hidden(cls, v: list[int]) -> list[int]:
        if any(h <= 0 for h in v):
            raise ValueError("expected positive layer sizes")
        return v


class OptimConfig(Section):
    name: Literal["sgd", "adamw"] = Field("sgd", description="Optimizer.")
    lr: float = Field(0.01, gt=0, description="Learning rate (the peak rate with onecycle).")
    momentum: float = Field(0.0, ge=0, lt=1, description="sgd: momentum.")
    nesterov: bool = Field(False, description="sgd: Nesterov momentum.")
    weight_decay: float = Field(0.0, ge=0, description="Weight decay.")
    schedule: Literal["none", "cosine", "onecycle", "triangle"] = Field(
        "none",
        description="Learning-rate schedule over all steps of the run; triangle: linear from start_factor x lr up to "
        "lr at peak_at of the run, then linear down to end_factor x lr.",
    )
    start_factor: float = Field(0.2, ge=0, description="triangle: the rate at the first step, as a share of lr.")
    peak_at: float = Field(0.23, gt=0, lt=1, description="triangle: where the rate peaks, as a share of the steps.")
    end_factor: float = Field(0.07, ge=0, description="triangle: the rate at the last step, as a share of lr.")
    norm_lr_scale: float = Field(
        1.0,
        gt=0,
        description="The learning rate of normalisation layers' parameters (batch, layer, group norm) times this; "
        "their weight decay per step stays that of the others.",
    )
    warmup: float | str = Field(
        0.0,
        description="Warm-up before the schedule: the rate rises linearly from lr / n to lr over the first n "
        "optimizer steps, then optim.schedule runs over the steps left. Epochs (a number: 2, 0.5), or optimizer steps "
        "('500 steps'); 0: none. optim.schedule onecycle warms up itself.",
    )
    layer_decay: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Per-layer rates (1: off): the class layer trains at lr, and each block below it at layer_decay "
        "times the rate of the block above (blocks: the model's modules two names deep, e.g. layer3.1, in order), so "
        "the pretrained early layers move least.",
    )
    lookahead_every: int = Field(
        0,
        ge=0,
        description="Lookahead (0: off): every this many optimizer steps the weights and batch-norm statistics move "
        "toward a slow average of themselves and go on from it; the average keeps 0.95^k of itself at most, rising "
        "with the cube of the run's progress (the speed-record recipe's), and the run ends on the average.",
    )

    @field_validator("warmup", mode="before")
    @classmethod
    def _warmup(cls, v: Any) -> Any:
        parse_warmup(v)  # refused here, with the key's name; read where the schedule is made
        return v


def parse_warmup(v: Any) -> tuple[float, str]:
    """optim.warmup as (amount, unit): a number of epochs, or 'N steps' / 'N epochs'; ValueError otherwise."""
    hint = "expected epochs (a number >= 0) or optimizer steps such as '500 steps'"
    if isinstance(v, bool):
        raise ValueError(hint)
    if isinstance(v, (int, float)):
        amount, unit = float(v), "epochs"
    elif isinstance(v, str) and len(words := v.split()) == 2 and words[1] in ("steps", "step", "epochs", "epoch"):
        try:
            amount, unit = float(words[0]), words[1].rstrip("s") + "s"
        except ValueError:
            raise ValueError(hint) from None
        if unit == "steps" and not amount.is_integer():
            raise ValueError(hint)
    else:
        raise ValueError(hint)
    if not 0 <= amount < float("inf"):
        raise ValueError(hint)
    return amount, unit


class TrainConfig(Section):
    epochs: int = Field(10, gt=0, description="Epochs to train.")
    precision: Literal["fp32", "bf16", "fp16", "auto"] = Field(
        "fp32",
        description="fp32, or autocast to bf16 or fp16 (fp16 with a gradient scaler); auto: bf16 where the hardware "
        "computes it natively, on a GPU from compute capability 8.0 and, for a step bound by arithmetic, on a CPU with "
        "AMX (Intel Xeon from Sapphire Rapids on); else fp32. The run says what it came to and why; a resumed run "
        "computes as its checkpoint did on the same kind of device.",
    )
    channels_last: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Convolutions in channels-last memory layout; auto: on a CPU (oneDNN's convolutions are faster "
        "in it) and on a GPU with bf16 or fp16, where tensor cores want it.",
    )
    step_capture: Literal["auto", "on", "off"] = Field(
        "auto",
        description="auto: replay each training step as one CUDA graph on a GPU, and trace small steps into one graph "
        "on a CPU in a run of 1,000 steps or more, where the model allows it (the run says what it chose and why), "
        "for the job's own and torchvision's models; on: the same for a model of your own too (whose forward must not "
        "draw or count in Python) and for a shorter run; off: eager steps.",
    )
    accumulate_steps: int = Field(
        1,
        gt=0,
        description="Gradient accumulation: step the optimizer every this many batches, on their gradients summed "
        "with each batch weighted by its share of the samples (N batches of B train as one batch of N*B). The "
        "schedule counts optimizer steps; logs and checkpoint names count batches.",
    )
    label_smoothing: float = Field(
        0.0, ge=0, lt=1, description="Training loss: cross-entropy against targets smoothed by this share."
    )
    mixup: float = Field(
        0.0,
        ge=0,
        description="MixUp (0: off): each training batch blended with itself reversed, by a share drawn from "
        "Beta(mixup, mixup) (0.2 to 0.8 are usual), the targets blended alike (timm's Mixup, batch mode).",
    )
    cutmix: float = Field(
        0.0,
        ge=0,
        description="CutMix (0: off): a box of the reversed batch pasted into each training image, its area drawn from "
        "Beta(cutmix, cutmix) (1.0 is usual), the targets weighed by area.",
    )
    mix_probability: float = Field(
        1.0, ge=0, le=1, description="train.mixup / train.cutmix: the share of training batches mixed."
    )
    mix_switch: float = Field(
        0.5,
        ge=0,
        le=1,
        description="With both train.mixup and train.cutmix: the share of mixed batches cut, not blended.",
    )
    finetune_stages: int = Field(
        0,
        ge=0,
        description="Two-stage fine-tuning (0: off): for this many epochs only the class layer learns (the rest at a "
        "rate of 0), then the whole model, at per-layer rates with optim.layer_decay.",
    )
    ema: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Exponential moving average of the weights (0: off; 0.999, 0.9999: its decay per optimizer step): "
        "after each optimizer step the average moves toward the model by 1 - decay; the averaged weights are the ones "
        "evaluated, chosen, saved to model.pt, predicted with and exported, and checkpoints keep them.",
    )
    ema_warmup: bool = Field(
        True,
        description="train.ema: the decay rises as timm's ModelEmaV3 warmup has it, 1 - (1 + n)^(-2/3) after n "
        "updates, up to train.ema, so the average forgets the random start; false: train.ema from the first update.",
    )
    test_time_augmentation: Literal["none", "flip", "flip_shift"] = Field(
        "none",
        description="Images, at every evaluation: the mean logits of each test image and its mirror image (flip), "
        "and also of the pair shifted one pixel up-left and one down-right (flip_shift: 6 passes).",
    )
    compile: bool = Field(False, description="Run the model through torch.compile (step capture is then off).")
    cpu_threads: int | Literal["auto"] = Field(
        "auto",
        description="CPU training: threads for PyTorch's operations; auto: one for a small model (a step under "
        "2e7 FLOPs), where waking more costs more than it saves, else PyTorch's default.",
    )
    log_every_steps: int = Field(100, gt=0, description="Log the mean training loss every this many steps.")
    eval_every_epochs: int = Field(
        1, gt=0, description="Evaluate on the val split (the test split when there is none) every this many epochs."
    )
    checkpoint_every_epochs: int = Field(1, gt=0, description="Commit a checkpoint every this many epochs.")
    keep_last: int = Field(3, gt=0, description="Checkpoints to keep; older ones are deleted after a commit.")
    choose_on: Literal[CHOOSABLE] = Field(
        "auto",
        description="The val metric the run chooses its model on (the chosen epoch, model.pt, train.keep_best, early "
        "stopping): any score its evaluations write for the val split, val_loss lowest, the others highest; auto: "
        "val_accuracy, val_map for multi-label. Without a val split only auto (the final weights are kept).",
    )  # fmt: skip
    keep_best: bool = Field(
        False,
        description="Also keep the checkpoint of the chosen model: the best of train.choose_on (test accuracy when "
        "there is no val), by more than train.early_stopping_min_delta.",
    )
    early_stopping_patience: int = Field(
        0,
        ge=0,
        description="End the run after this many evaluations without a train.choose_on better than the best by "
        "train.early_stopping_min_delta (0: off); model.pt then holds the best-on-val weights.",
    )
    early_stopping_min_delta: float = Field(
        0.0, ge=0, description="early_stopping_patience: the least gain in train.choose_on that counts as better."
    )
    class_weights: Literal["none", "balanced"] = Field(
        "none",
        description="balanced: weigh each class's training loss by n_samples / (n_classes x its samples), as "
        "scikit-learn's and Keras's 'balanced', so a class with few images is not ignored; multi-label: each "
        "class's positives by its negatives / positives (BCEWithLogitsLoss's pos_weight).",
    )
    grace_seconds: float = Field(
        20.0,
        gt=0,
        description="After SIGTERM, SIGINT or the time limit: time to finish the step and commit before giving up.",
    )
    time_limit: float | None = Field(
        None,
        gt=0,
        le=threading.TIMEOUT_MAX,
        allow_inf_nan=False,
        description="Wall-clock limit of one attempt, counted from the command's start: when it is reached the run "
        "stops after the current step, commits a checkpoint and exits 75, and the same command continues it. Seconds, "
        "or a duration such as 45m or 11h30m; leave room for the commit within the platform's own limit.",
    )
    deterministic: bool = Field(
        False,
        description="Use deterministic algorithms (slower on a GPU); an operation that has none "
        "warns once and runs as it can.",
    )
    price_per_device_hour: float | dict[str, float] | None = Field(
        None,
        description="What a device hour costs, for run.json's cost and the end line: a number, or a map from device "
        "to price, keyed by the device's name as run.json records it, a part of it (H100, A100), or its type (cpu, "
        "cuda); a device the map does not name leaves the cost unpriced. A CPU run counts a device per process.",
    )
    budget: str | None = Field(
        None,
        description="The most the run may spend, counted over all its attempts: device time (2h30m: device hours, so "
        "two GPUs spend it in half the time) or money ($12.50, priced by train.price_per_device_hour). The run ends at "
        "the first checkpoint after which training on to the next would pass it, estimated from the time the last "
        "checkpoint interval took: the checkpoint is committed, exit 0; the same command with a larger budget "
        "continues it.",
    )

    @field_validator("finetune_stages")
    @classmethod
    def _stages(cls, v: int, info: ValidationInfo) -> int:
        if v and v >= info.data.get("epochs", v + 1):
            raise ValueError("expected fewer epochs than train.epochs: the whole model trains after them")
        return v

    @field_validator("channels_last", "step_capture", mode="before")
    @classmethod
    def _on_off(cls, v: Any) -> Any:
        """YAML reads a bare on/off as a boolean."""
        if isinstance(v, bool):
            return "on" if v else "off"
        return v

    @field_validator("time_limit", mode="before")
    @classmethod
    def _time_limit(cls, v: Any) -> Any:
        if isinstance(v, bool):  # YAML's yes/no/true: never a number of seconds
            raise ValueError("expected seconds or a duration such as 45m, 11h30m, 2d")
        return parse_duration(v) if isinstance(v, str) else v

    @field_validator("cpu_threads", mode="before")
    @classmethod
    def _cpu_threads(cls, v: Any) -> Any:
        return positive_int_or("auto", v)

    @field_validator("price_per_device_hour", mode="before")
    @classmethod
    def _price(cls, v: Any) -> Any:
        prices = v.items() if isinstance(v, dict) else [("", v)] if v is not None else []
        for device, p in prices:
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < float("inf"):
                of = f", got {p!r} for {device}" if device else ""  # a map is not shown: say which entry
                raise ValueError(f"expected a price of 0 or more (a number, or a map from device to one){of}")
        return v

    @field_validator("budget", mode="before")
    @classmethod
    def _budget(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None:
            return v
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise ValueError("expected device time such as 2h30m, or money such as $12.50")
        budget = parse_budget(str(v))
        if budget.money and info.data.get("price_per_device_hour") is None:
            raise ValueError("money needs a price: set train.price_per_device_hour, or give device time (2h30m)")
        return budget.text


class OutputConfig(Section):
    dir: str = Field(
        "",
        description="URL of the run folder; --output overrides it. Default: Vertex AI's AIP_CHECKPOINT_DIR when "
        "set, else ./runs/<name>.",
    )
    staged: bool = Field(
        False,
        description="Also stage a local output folder and copy files to it in the background, as for a remote URL: "
        "for a Google Drive mount in Colab, which syncs appended and rewritten files slowly.",
    )
    sync_every_seconds: float = Field(
        30.0, gt=0, description="Remote runs: send new TensorBoard events at least this often (also at checkpoints)."
    )
    upload_timeout_seconds: float = Field(
        120.0,
        gt=0,
        description="Remote runs: give up when a file has not reached the store this long after its first try (plus "
        "a second per MiB of it), retries included; the run then exits 4 with its checkpoints kept locally, and the "
        "same command continues it and sends them.",
    )


# The key is track.register, as users write it; pydantic warns that it hides BaseModel.register, used by no config.
warnings.filterwarnings("ignore", 'Field name "register" in "TrackConfig"')


class TrackConfig(Section):
    mlflow: str = Field(
        "",
        description="MLflow tracking URI: http(s)://HOST:PORT or sqlite:///PATH; empty: the environment's "
        "MLFLOW_TRACKING_URI, else no tracking. What the server does not take waits in the run folder "
        "(track.jsonl) and is sent when it answers again, or by `python -m job track RUN`.",
    )
    experiment: str = Field("", description="The MLflow experiment; default: the config's name.")
    log_model: bool = Field(True, description="Send the chosen model (model.pt, model.json) as the artifact `model`.")
    register: str = Field(
        "",
        description="Register the chosen model as a new version of this name in the MLflow Model Registry, tagged "
        "with its val metrics.",
    )
    hp_metric_tag: str = Field(
        "val_accuracy",
        description="Under Vertex AI hyperparameter tuning (CLOUD_ML_TRIAL_ID or CLOUD_ML_HP_METRIC_FILE set): the "
        "metrics.jsonl key reported at each evaluation, in cloudml-hypertune's format, to $CLOUD_ML_HP_METRIC_FILE "
        "(default /tmp/hypertune/output.metrics); the study's metricId.",
    )
    parent_run_id: str = Field(
        "", description="Make the run's MLflow run a child of this MLflow run (a sweep sets it: its study's run)."
    )

    @field_validator("mlflow")
    @classmethod
    def _uri(cls, v: str) -> str:
        return tracking_uri(v) if v else v


def tracking_uri(uri: str) -> str:
    """A tracking URI the MLflow client can open, as given; a ValueError naming what is wrong. The one reading of it,
    for track.mlflow and the environment's MLFLOW_TRACKING_URI alike."""
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    if parts.scheme in ("http", "https"):
        if not parts.hostname:
            raise ValueError("names no host (http://HOST:PORT)")
        try:
            parts.port  # noqa: B018  (a port that is no number raises here)
        except ValueError:
            raise ValueError("has a port that is no number") from None
    elif parts.scheme in ("sqlite", "postgresql", "mysql", "mssql"):
        if not parts.path.strip("/") and parts.scheme == "sqlite":
            raise ValueError("names no database file (sqlite:///PATH)")
    elif parts.scheme != "databricks":  # MLflow 3 retired its folder store: a path is a typo or that store
        raise ValueError("expected http(s)://HOST:PORT (a tracking server) or sqlite:///PATH (a database file)")
    return uri


class Config(Section):
    name: str = Field("run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="Run name.")
    seed: int = Field(0, description="Seed of weights, data order and augmentation.")
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    output: OutputConfig = OutputConfig()
    track: TrackConfig = TrackConfig()


def load_config(source: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The validated config from a preset name or URL (default: the iris preset) with `key=value` overrides."""
    raw = read_yaml(source or "iris")
    for item in overrides:
        apply_override(raw, item)
    return validate(raw)


def read_yaml(source: str) -> dict[str, Any]:
    if source in PRESETS:
        text = (resources.files("job.presets") / f"{source}.yaml").read_text()
    else:
        try:
            fs, path = filesystem(source)
            with fs.open(path, "rb") as f:
                text = f.read().decode("utf-8-sig")
        except FileNotFoundError:
            raise ConfigError(f"config {source}: no such file, and not a preset ({PRESET_LIST})") from None
        except IsADirectoryError:
            raise ConfigError(f"config {source}: is a folder, not a YAML file (or a preset: {PRESET_LIST})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config {source}: not a text file (not UTF-8)") from None
        except Exception as e:  # the stores' clients raise many types
            raise StorageError(f"config: cannot read it: {describe_storage_error(source, e)}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config {source}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config {source}: expected a mapping of sections, got {type(raw).__name__}")
    return raw


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set `a.b=value` in the raw config; the value is parsed as YAML (numbers, booleans, lists)."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item}: expected key=value, e.g. --set train.epochs=5")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    parts = key.strip().split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def validate(raw: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError("; ".join(describe_error(err) for err in e.errors())) from None


def describe_error(err: dict[str, Any]) -> str:
    """One readable phrase for a pydantic error: the key path, what was expected, what was given."""
    loc = [str(p) for p in err["loc"]]
    path = ".".join(loc)
    if err["type"] == "extra_forbidden":
        known = list(_section_at(loc[:-1]).model_fields)
        close = difflib.get_close_matches(loc[-1], known, n=1)
        hint = f"did you mean {'.'.join(loc[:-1] + close)}?" if close else f"known keys: {', '.join(known)}"
        return f"{path}: unknown key ({hint})"
    msg = err["msg"].removeprefix("Value error, ")
    # Union members add their own tag to the path (batch_size.int); keep the user's key path.
    while loc and not _is_field(loc):
        loc.pop()
    path = ".".join(loc) or "config"
    given = err.get("input")
    shown = "" if isinstance(given, dict) else f", got {given!r}"
    return f"{path}: {msg[0].lower() + msg[1:]}{shown}"


def _section_at(loc: list[str]) -> type[BaseModel]:
    model: type[BaseModel] = Config
    for part in loc:
        model = model.model_fields[part].annotation  # type: ignore[assignment]
    return model


def _is_field(loc: list[str]) -> bool:
    model: Any = Config
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return False
        model = model.model_fields[part].annotation
    return True


def check_setting(key: str, given: str) -> None:
    """Refuse a dotted key that names no setting, naming the closest ones; `given`: how the user wrote it."""
    if names_setting(key):
        return
    keys = setting_keys()
    if close := difflib.get_close_matches(key, keys, n=3, cutoff=0.5):
        hint = f"closest: {', '.join(close)}"
    else:
        sections = dict.fromkeys(k.split(".")[0] for k in keys if "." in k)
        hint = f"none close to it; keys are section.key, of the sections {', '.join(sections)}"
    raise ConfigError(f"{given}: names no config key ({hint})")


def names_setting(key: str) -> bool:
    """Whether a dotted key names a setting, or a key inside a mapping setting (model.kwargs.NAME)."""
    model: Any = Config
    for part in key.split("."):
        if get_origin(model) is dict:
            return True
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return False
        model = model.model_fields[part].annotation
    return not (isinstance(model, type) and issubclass(model, BaseModel))


def setting_keys(section: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """Every setting's key, as section.key, in the config's order."""
    keys = []
    for name, field in (section or Config).model_fields.items():
        kind = field.annotation
        is_section = isinstance(kind, type) and issubclass(kind, BaseModel)
        keys += setting_keys(kind, f"{prefix}{name}.") if is_section else [prefix + name]
    return keys


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def flat_items(cfg: Config) -> dict[str, Any]:
    """`section.key: value` for every setting, lists and dicts as text (TensorBoard hparams take scalars)."""
    out: dict[str, Any] = {}
    for section, values in cfg.model_dump().items():
        if not isinstance(values, dict):
            out[section] = values
            continue
        for key, value in values.items():
            out[f"{section}.{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return out
