"""The training step as plain PyTorch calls, and the plan of how a step runs.

On a CPU the step is eager: forward, loss, backward and the optimizer step, with nothing between them but the
precision's autocast and the loss added to the run's sums on the device. On a GPU the same step is replayed as a
CUDA graph per batch shape (job/recipe/cuda_graph.py), or runs a torch.compile'd model; where capture is not possible
the step runs eagerly, and the run says why.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from job.recipe.accumulate import Accumulator


class StepKind(enum.Enum):
    EAGER = "eager"
    CUDA_GRAPH = "one CUDA graph per batch shape"


@dataclass(frozen=True)
class StepPlan:
    """How the step runs, whether the optimizer step is inside what is captured, and why: decided once, by
    plan_step; a step that cannot run as planned falls back to an eager plan with its reason."""

    kind: StepKind
    reason: str = ""
    optimizer_inside: bool = False

    def describe(self) -> str:
        if self.kind is StepKind.EAGER:
            return f"eager ({self.reason})" if self.reason else "eager"
        if self.optimizer_inside:
            return "one CUDA graph per batch shape (forward, backward and SGD step)"
        return "one CUDA graph per batch shape (forward and backward; optimizer step eager)"


class EagerStep:
    """Forward, loss, backward and optimizer step as plain PyTorch calls; the loss is added to `sums` on the device.
    `accumulate`: batches per optimizer step (an Accumulator sums their gradients); `loss`: of (logits, labels);
    `lookahead`, `ema`: stepped after each optimizer step; `compiled`: the model is torch.compile's."""

    def __init__(
        self,
        model: nn.Module,
        optimizer,
        scheduler,
        scaler,
        amp: Callable,
        sums: torch.Tensor,
        accumulate: int = 1,
        loss: Callable[..., torch.Tensor] = F.cross_entropy,
        lookahead=None,
        plan: StepPlan = StepPlan(StepKind.EAGER),
        ema=None,
        compiled: bool = False,
    ) -> None:
        self.model, self.optimizer, self.scheduler, self.scaler, self.amp = model, optimizer, scheduler, scaler, amp
        self.sums, self.loss, self.lookahead, self.ema = sums, loss, lookahead, ema
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.accumulator = Accumulator(self.params, accumulate) if accumulate > 1 else None
        # The tutorials' step and nothing else (fp32, an optimizer step every batch, no loss scaler, schedule,
        # lookahead or EMA): taken in one call, as a small step's overhead is Python's calls (bench/eager_overhead.py).
        others = (scheduler, lookahead, ema, self.accumulator)
        self.bare = amp is contextlib.nullcontext and not scaler.is_enabled() and all(o is None for o in others)
        self.plan = plan
        self.fallback: StepPlan | None = None  # the eager plan it fell back to, and why
        # whether the model takes an empty batch (padded steps), once known; a compiled model is not asked
        self.empty_ok: bool | None = False if compiled else None

    @property
    def description(self) -> str:
        return (self.fallback or self.plan).describe()

    def fall_back(self, reason: str) -> None:
        self.fallback = StepPlan(StepKind.EAGER, reason[:300])

    def __call__(self, x: torch.Tensor, y: torch.Tensor, weight: float = 1.0) -> None:
        """`weight` scales the loss: a process's uneven part of a global batch under torchrun (1.0 otherwise)."""
        if self.bare and weight == 1.0:
            loss = self.loss(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.sums.add_(loss.detach())
            self.optimizer.step()
            return
        self.backward(x, y, weight)
        self.apply()

    def apply(self) -> None:
        """The optimizer step on the fresh gradients in `.grad`; accumulating, their addition to the group's sum,
        and the step at the group's last batch."""
        if self.accumulator is None:
            self.update()
        elif self.accumulator.add():
            self.update()
            self.accumulator.reset()

    def backward(self, x: torch.Tensor, y: torch.Tensor, weight: float = 1.0) -> None:
        """Forward, loss and backward: fresh gradients in `.grad`, the loss added to the sums."""
        with self.amp():
            if weight == 0.0 and self.takes_empty(x):  # padding: the model runs on none of the samples (below)
                loss = nothing_learnt(self.model(x[:0]))
            else:
                loss = self.loss(self.model(x), y)
                if weight != 1.0:
                    loss = loss * weight
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler.is_enabled():
            self.scaler.scale(loss).backward()
        else:
            loss.backward()
        self.sums += loss.detach()

    def takes_empty(self, x: torch.Tensor) -> bool:
        """Whether the model takes an empty batch (padded steps), found once. A compiled model is not asked: a batch
        of 0 would compile it again."""
        if self.empty_ok is None:
            inner = getattr(self.model, "module", self.model)  # DDP's
            self.empty_ok = runs_empty(inner, x)
        return self.empty_ok

    def update(self) -> None:
        """The optimizer step on the gradients in place, then the schedule."""
        if self.scaler.is_enabled():
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        if self.lookahead is not None:
            self.lookahead.step()
        if self.ema is not None:
            self.ema.update()

    def set_grads(self, grads: list[torch.Tensor]) -> None:
        if self.params and self.params[0].grad is not grads[0]:
            for p, g in zip(self.params, grads):
                p.grad = g


def nothing_learnt(outputs) -> torch.Tensor:
    """The loss of a padded step (a process of a group that has run out of samples steps along with the others, so
    that DDP's all-reduce of gradients happens): the model's outputs on an empty batch summed, 0 with gradients of 0
    for every parameter it used. Run on no samples, BatchNorm keeps its running statistics and SyncBatchNorm counts
    none into the other processes' batch statistics, as a weight of 0 on the last batch again would not. Times 0: an
    output that does not depend on the batch (an auxiliary loss) teaches nothing either."""
    floats = [t.float().sum() for t in tensor_leaves(outputs) if t.is_floating_point()]
    return torch.stack(floats).sum() * 0


def tensor_leaves(outputs) -> list[torch.Tensor]:
    """The tensors of a model's outputs: a tensor, or tuples, lists and dicts of them, nested."""
    if torch.is_tensor(outputs):
        return [outputs]
    if isinstance(outputs, dict):
        outputs = list(outputs.values())
    if isinstance(outputs, (tuple, list)):
        return [t for o in outputs for t in tensor_leaves(o)]
    return []


def runs_empty(model: nn.Module, x: torch.Tensor) -> bool:
    """Whether `model` takes a batch of none of x's samples and gives a floating-point output for it: asked by a
    forward in evaluation mode, which touches no batch-norm statistics and makes no collective call of
    SyncBatchNorm (the other processes of a group take no part). Each module's mode is put back as it was."""
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad():
            nothing_learnt(model(x[:0]))
        return True
    except Exception:  # a reshape by the batch's size, no floating-point output: whatever the cause, the same answer
        return False
    finally:
        for m, training in modes.items():
            m.training = training
