"""What changes over the steps of a run: the learning-rate schedule, parameters that train for the first epochs
only, and lookahead's slow weights. All of them are functions of the optimizer step and of the run's length, so a
resumed run given more epochs re-plans them and goes on along the new curve."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from job.config import Config, parse_warmup
from job.errors import ConfigError

LOOKAHEAD_DECAY = 0.95  # per step: the slow average keeps LOOKAHEAD_DECAY ** every of itself at the run's end


def make_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, total_steps: int, at: int = 0):
    """A per-step schedule over the whole run (`total_steps` optimizer steps), or None. Parameter groups with a
    `train_epochs` limit get a rate of 0 after that many epochs, those with `from_epochs` (train.finetune_stages) a
    rate of 0 before; optim.warmup comes before the schedule. `at`: the step it starts at (a schedule made before at
    step 0 on the same optimizer: its groups hold their initial rates; not for cosine, which replan sets itself)."""
    o = cfg.optim
    limited = any("train_epochs" in g or "from_epochs" in g for g in optimizer.param_groups)
    per_epoch = total_steps // cfg.train.epochs
    warm = warmup_steps(cfg, per_epoch)
    if warm >= total_steps:
        raise ConfigError(f"optim.warmup: {warm} steps, the whole run ({total_steps}): leave some to the schedule")
    if o.schedule == "onecycle":
        if warm:
            raise ConfigError("optim.warmup: onecycle warms up itself; use it with cosine, triangle or none")
        if limited:
            raise ConfigError(
                f"optim.schedule: onecycle cannot hold the parameters model {cfg.model.name} (or "
                "train.finetune_stages) trains for some epochs only; use none, cosine or triangle"
            )
        cycle_momentum = o.name == "adamw" or o.momentum > 0  # never add momentum a recipe did not ask for
        peaks = [o.lr * g.get("lr_scale", 1.0) for g in optimizer.param_groups]
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=peaks, total_steps=total_steps, cycle_momentum=cycle_momentum, last_epoch=at - 1
        )
    if o.schedule == "cosine" and not limited and not warm:
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    if o.schedule == "none" and not limited and not warm:
        return None
    shape = warmed(curve(cfg, total_steps - warm), warm)

    def of_group(g: dict) -> Callable[[int], float]:
        if "train_epochs" in g:
            return until(shape, g["train_epochs"] * per_epoch)
        if "from_epochs" in g:
            return after(shape, g["from_epochs"] * per_epoch)
        return shape

    lambdas = [of_group(g) for g in optimizer.param_groups]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas, last_epoch=at - 1)
    scheduler.total_steps = total_steps  # kept in its state: the length it was planned over
    return scheduler


def curve(cfg: Config, total: int) -> Callable[[int], float]:
    """The schedule's factor of the peak rate at optimizer step t of `total`."""
    o = cfg.optim
    if o.schedule == "cosine":
        return lambda t: (1 + math.cos(math.pi * min(t, total) / total)) / 2
    if o.schedule == "triangle":
        peak = max(1, int(o.peak_at * total))

        def triangle(t: int) -> float:
            if t < peak:
                return o.start_factor + (1 - o.start_factor) * t / peak
            return 1 + (o.end_factor - 1) * min(t - peak, total - peak) / max(total - peak, 1)

        return triangle
    return lambda t: 1.0


def until(shape: Callable[[int], float], steps: int) -> Callable[[int], float]:
    return lambda t: shape(t) if t < steps else 0.0


def after(shape: Callable[[int], float], steps: int) -> Callable[[int], float]:
    return lambda t: shape(t) if t >= steps else 0.0


def warmup_steps(cfg: Config, per_epoch: int) -> int:
    """optim.warmup in optimizer steps (epochs counted at `per_epoch` optimizer steps each)."""
    amount, unit = parse_warmup(cfg.optim.warmup)
    return int(amount) if unit == "steps" else round(amount * per_epoch)


def warmed(shape: Callable[[int], float], warm: int) -> Callable[[int], float]:
    """A linear rise over the first `warm` steps (1/warm of the rate at the first, all of it at the last), then
    `shape` from its own start: the schedule runs over the steps after the warm-up, as torchvision's recipes chain
    LinearLR and the schedule."""
    if not warm:
        return shape
    return lambda t: (t + 1) / warm if t < warm else shape(t - warm)


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
    if not isinstance(scheduler, torch.optim.lr_scheduler.CosineAnnealingLR):
        # OneCycleLR and LambdaLR made at a step set its rates themselves (the groups' initial rates the first made)
        return make_scheduler(cfg, optimizer, total_steps, at=step)
    scheduler.last_epoch = step
    for group, base in zip(optimizer.param_groups, scheduler.base_lrs):  # its closed form, with eta_min 0
        group["lr"] = base * curve(cfg, total_steps)(step)
    return scheduler


class Lookahead:
    """Every `every` optimizer steps, each floating-point tensor of the model's state (weights and batch-norm
    statistics) and its slow copy meet: the copy moves toward the tensor by 1 - decay, and the tensor takes the copy.
    decay = LOOKAHEAD_DECAY**every * (step / total)**3, so the slow copy forgets fast at first and averages over more
    steps as the run ends; after the last step the model is the slow copy."""

    def __init__(self, model: nn.Module, every: int, total_steps: int) -> None:
        self.tensors = [t for t in model.state_dict().values() if t.is_floating_point()]
        self.slow = [t.detach().clone() for t in self.tensors]
        self.every, self.total, self.steps = every, total_steps, 0

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        if self.steps % self.every == 0:
            decay = LOOKAHEAD_DECAY**self.every * (min(self.steps, self.total) / self.total) ** 3
            torch._foreach_lerp_(self.slow, self.tensors, 1 - decay)
            torch._foreach_copy_(self.tensors, self.slow)
        if self.steps == self.total:
            torch._foreach_copy_(self.tensors, self.slow)

    def state_dict(self) -> dict:
        return {"steps": self.steps, "slow": self.slow}

    def load_state_dict(self, state: dict) -> None:
        if len(state["slow"]) != len(self.slow):
            raise ValueError(f"lookahead holds {len(state['slow'])} tensors; this model has {len(self.slow)}")
        self.steps = int(state["steps"])
        torch._foreach_copy_(self.slow, [t.to(s.device) for s, t in zip(self.slow, state["slow"])])
