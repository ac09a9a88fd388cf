"""How a run takes its training step, decided once: the precision `auto` comes to, the facts (device, precision, the
model, what wraps it, the optimizer), the plan they give with its reason (pure functions: job/recipe/step.py and
job/recipe/cuda_graph.py hold each way a step runs), the CPU threads a step of that size should use (from a forward
pass's FLOPs), and the step built as planned."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from job.console import say
from job.group import distributed
from job.group.env import CPU_INFO, cpu_field
from job.recipe.cuda_graph import CudaGraphStep
from job.recipe.models import own_class
from job.recipe.step import EagerStep, StepKind, StepPlan

if TYPE_CHECKING:
    from job.config import Config
    from job.recipe.build import Recipe

# A CPU step whose forward pass does less arithmetic than this is dominated by per-operation overhead: it runs on one
# thread (waking a second thread costs more than it saves at this size), and in fp32 under precision auto.
SMALL_STEP_FLOPS = 2e7


@dataclass(frozen=True)
class Precision:
    """What train.precision comes to on a device: fp32, bf16 or fp16, and why when it was `auto` ("" when named)."""

    name: str
    why: str = ""
    device: str = ""  # the kind of device it was decided for, as a checkpoint records it

    def saved(self) -> dict:
        return {"name": self.name, "why": self.why, "device": self.device}


def saved_precision(saved: object) -> Precision | None:
    """The precision a checkpoint recorded (None from one that recorded none)."""
    if not isinstance(saved, dict) or saved.get("name") not in ("fp32", "bf16", "fp16"):
        return None
    return Precision(saved["name"], str(saved.get("why", "")), str(saved.get("device", "")))


def choose_precision(
    setting: str,
    device_type: str,
    step_flops: float,
    gpu_capability: tuple[int, int] | None = None,
    cpu_bf16: bool = False,
) -> Precision:
    """`auto`: bf16 autocast (fp32 weights) where the hardware computes bf16 natively and the step is bound by
    arithmetic, else fp32. From the facts alone: a GPU's compute capability, whether the CPU has AMX (cpu_bf16), and a
    training step's forward FLOPs."""
    if setting != "auto":
        return Precision(setting)
    if device_type == "cuda" and gpu_capability is not None and gpu_capability >= (8, 0):
        return Precision("bf16", "auto: bf16 autocast on a GPU that computes it natively")
    if device_type == "cpu" and cpu_bf16 and not step_flops < float("inf"):  # a forward the counter could not run
        return Precision("fp32", "auto: the step's FLOPs could not be counted")
    if device_type == "cpu" and cpu_bf16 and step_flops < SMALL_STEP_FLOPS:
        return Precision("fp32", "auto: a small step is bound by per-operation overhead, not arithmetic")
    if device_type == "cpu" and cpu_bf16:
        # Measured: the tutorials' CIFAR-10 step 15 ms against 37 ms in fp32, same test accuracy (docs/benchmarks.md)
        return Precision("bf16", "auto: this CPU's AMX units compute bf16 natively")
    return Precision("fp32", "auto: no native bf16 here")


def cpu_computes_bf16(flags: Path = CPU_INFO) -> bool:
    """Whether this CPU has AMX, matrix units that multiply bf16 natively (Intel Xeon from Sapphire Rapids on), as the
    kernel lists its flags (amx_tile and amx_bf16: the kernel lists them only where it supports AMX's state). torch
    has no public check. Elsewhere than Linux none is known. A CPU with AVX512-BF16 alone is not counted: bf16 on it
    is not measured here."""
    listed = cpu_field("flags", flags) or ""  # none listed (not Linux, no /proc): no AMX known
    return {"amx_tile", "amx_bf16"} <= set(listed.split())


def kept_precision(fresh: Precision, started: Precision | None, gpu_capability: tuple[int, int] | None) -> Precision:
    """`auto` decides once a run: a resumed run computes as it began (`started`, as its checkpoints record it: its
    arithmetic goes on unchanged, and so its resume is exact) on the same kind of device, bf16 on a GPU only where
    that computes it natively; else, and for a run that starts, the `fresh` decision. Where the two differ it says
    what the fresh one would have been."""
    if started is None or started.device != fresh.device or started.name == fresh.name:
        return fresh
    if started.name == "bf16" and fresh.device == "cuda" and (gpu_capability or (0, 0)) < (8, 0):
        return fresh
    began = started.why.removeprefix("auto: ") if started.why else f"train.precision={started.name} at its start"
    afresh = fresh.why.removeprefix("auto: ")
    return Precision(started.name, f"auto, as the run began: {began}; afresh here: {fresh.name}, {afresh}")


def precision_on(setting: str, device: torch.device, step_flops: float, started: Precision | None = None) -> Precision:
    """What train.precision comes to on `device` (choose_precision, with this machine's facts; a resumed run's
    `started` precision kept, kept_precision). In a group of CPU processes every one decides alike: bf16 only where
    all of them have AMX."""
    if setting != "auto":
        return Precision(setting, "", device.type)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    amx = device.type == "cpu" and all(distributed.gather_objects(cpu_computes_bf16()))
    fresh = replace(choose_precision(setting, device.type, step_flops, capability, amx), device=device.type)
    return replace(kept_precision(fresh, started, capability), device=device.type)


@dataclass(frozen=True)
class StepFacts:
    """What decides how a step runs: the device, train.step_capture, the precision, whether the model is the user's
    own class, fp16's loss scaler, what wraps the model (none, ddp, compile), and the optimizer: `plain_sgd`, SGD
    whose step is the same arithmetic every batch with nothing on the host's side between steps (no accumulation,
    schedule, lookahead, EMA or loss scaler; a constant rate): what a captured step may hold whole."""

    device: str
    capture: str = "auto"
    precision: str = "fp32"
    own_model: bool = False
    loss_scaler: bool = False
    wrapper: str = "none"
    plain_sgd: bool = False


def plan_step(f: StepFacts) -> StepPlan:
    """How the step runs, from the facts alone (no device needed: a pure function)."""
    if f.wrapper == "compile":
        return StepPlan(StepKind.EAGER, "the compiled model in eager steps: step capture is off with torch.compile")
    if f.wrapper == "ddp":
        return StepPlan(StepKind.EAGER, "DistributedDataParallel reduces gradients from autograd hooks: no capture")
    if f.capture == "off":
        return StepPlan(StepKind.EAGER, "train.step_capture off")
    if f.device == "cpu":  # train.step_capture=on too: torch has no maintained public way to capture a CPU step
        return StepPlan(StepKind.EAGER, "a CPU step runs eagerly")
    if f.device != "cuda":
        return StepPlan(StepKind.EAGER, f"no step capture on {f.device}")
    if f.own_model and f.capture == "auto":
        return StepPlan(
            StepKind.EAGER,
            "a model of your own: a captured step replays what its forward did in Python when captured, a "
            "random.random() draw or a counter, frozen; train.step_capture=on captures it when it does neither",
        )
    return StepPlan(StepKind.CUDA_GRAPH, "a step replayed without launching its kernels one by one", f.plain_sgd)


def forward_flops(model: nn.Module, input_shape: tuple[int, ...]) -> float:
    """Floating-point operations of one forward pass per sample, counted on a batch of 2 on the CPU by torch's FLOP
    counter (its first use imports torch's compiler, as torch.optim's first step does anyway: one import for both)."""
    from torch.utils.flop_counter import FlopCounterMode  # with triton: only where FLOPs are counted (a CPU run)

    was_training = model.training
    model.eval()
    counter = FlopCounterMode(display=False)  # outside the try: a counter that cannot count is a bug to see
    try:
        with torch.no_grad(), counter:
            model(torch.zeros(2, *input_shape))
        return counter.get_total_flops() / 2
    except Exception:  # an operation the counter does not know: treat the model as large
        return float("inf")
    finally:
        model.train(was_training)


def step_facts(r: Recipe, capture: str, own_model: bool = False, wrapper: str = "none") -> StepFacts:
    """The facts plan_step decides from, read off the recipe."""
    o, groups = r.optimizer, r.optimizer.param_groups
    plain = (
        r.accumulate == 1
        and isinstance(o, torch.optim.SGD)
        and r.scheduler is None
        and r.lookahead is None
        and r.ema is None
        and not r.scaler.is_enabled()
        and not any(isinstance(g["lr"], torch.Tensor) for g in groups)
    )
    return StepFacts(r.device.type, capture, r.precision, own_model, r.scaler.is_enabled(), wrapper, plain)


def build_step(r: Recipe, sums: torch.Tensor, plan: StepPlan, model=None, compiled: bool = False) -> EagerStep:
    """The recipe's step as `plan` says (plan_step), adding each step's loss to `sums`. `model`: what the step calls,
    when not the recipe's own model (a DistributedDataParallel or torch.compile wrapper of it: `compiled`)."""
    args = (model if model is not None else r.model, r.optimizer, r.scheduler, r.scaler, r.amp, sums)
    how = {"accumulate": r.accumulate, "loss": r.loss, "lookahead": r.lookahead, "plan": plan, "ema": r.ema}
    if plan.kind is StepKind.CUDA_GRAPH:
        return CudaGraphStep(*args, **how)
    return EagerStep(*args, **how, compiled=compiled)


def set_cpu_threads(cfg: Config, r: Recipe) -> None:
    """On a CPU, the threads a step of this size should use (train.cpu_threads auto: one for a small step)."""
    if r.device.type != "cpu":
        return
    threads = cfg.train.cpu_threads
    if threads == "auto":
        flops = (r.sample_flops or forward_flops(r.model, r.input_shape)) * r.train.batch_size
        threads = 1 if flops < SMALL_STEP_FLOPS else torch.get_num_threads()
    torch.set_num_threads(threads)


def make_step(cfg: Config, r: Recipe, sums: torch.Tensor) -> EagerStep:
    """The training step as this run takes it: through DDP and torch.compile where they apply, else captured; each
    step's loss added to `sums` (the run's loss log's)."""
    t = cfg.train
    model = distributed.wrap(r.model, r.device)
    model = torch.compile(model) if t.compile else model  # checkpoints keep the plain module's names
    wrapper = "compile" if t.compile else "ddp" if model is not r.model else "none"
    facts = step_facts(r, t.step_capture, own_class(cfg.model.name), wrapper)
    step = build_step(r, sums, plan_step(facts), model=model, compiled=t.compile)
    layout = ", channels-last" if r.channels_last else ""
    compiled = ", torch.compile" if t.compile else ""
    accumulated = f"; the optimizer steps every {t.accumulate_steps} batches" if t.accumulate_steps > 1 else ""
    why = f" ({r.precision_decided.why})" if r.precision_decided.why else ""
    say(f"step: {r.precision}{why}{layout}{compiled}; {step.description}{accumulated}")
    return step
