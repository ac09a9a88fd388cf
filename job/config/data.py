"""data: which reader, where the data is, how it is split, decoded, augmented and placed."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from job.config.section import Section, positive_int_or
from job.data.formats import DEFAULT, KNOWN, names


class DataConfig(Section):
    kind: str = Field(
        DEFAULT,
        description=f"The data's format: one of {', '.join(KNOWN)} or one a program registered (job/data/formats.py;"
        " each format's module says what it reads). The default reads a CSV table; given a data.path that another "
        "format of tables holds, it reads with that format, and the start-up says so.",
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
        description="A table of images: the column of image paths (relative to the file, or URLs), or of images "
        "where no column is the Hugging Face Image feature.",
    )
    label_column: str = Field(
        "label",
        description="A table of images: the column of labels (class names or indexes; else its one ClassLabel "
        "column, where the format has them).",
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
        "list, data.label_separator, 0/1 columns or a Sequence(ClassLabel) column), else multiclass.",
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

    @field_validator("kind")
    @classmethod
    def _kind(cls, v: str) -> str:
        if v not in names():
            raise ValueError(f"expected one of {', '.join(names())}")
        return v

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
