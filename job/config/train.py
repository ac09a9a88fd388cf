"""train: how the run trains and when it stops: epochs, precision, step capture, accumulation, mixing, EMA, the
choice of the model, checkpoints, time limit, cost and budget."""

from __future__ import annotations

import threading
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from job.config.budget import parse_budget
from job.config.section import Section, positive_int_or
from job.duration import parse_duration
from job.recorded import possible_scores

CHOOSABLE = ("auto", *(f"val_{m}" for m in possible_scores(None, None)))  # train.choose_on: val scores a run writes


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
        description="auto: replay each training step as one CUDA graph on a GPU, where the model allows it (the run "
        "says what it chose and why), for the job's own and torchvision's models; on: the same for a model of your "
        "own too (whose forward must not draw or count in Python); off: eager steps. A CPU step is eager whatever "
        "this says (on, from a config written for the traced CPU step, still runs).",
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
