"""optim: the optimizer, its learning rate, its schedule and warm-up, and per-layer rates."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from job.config.section import Section


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
