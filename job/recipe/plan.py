"""How a run takes its training step, decided once: the precision `auto` comes to, the facts (device, precision, a
forward pass's FLOPs, the model, what wraps it, the optimizer), the plan they give with its reason (pure functions:
job/recipe/step.py holds each way a step runs), the CPU threads a step of that size should use, and the step built as
planned."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from job.console import say
from job.group import distributed
from job.recipe.models import own_class
from job.recipe.step import CpuTracedStep, CudaGraphStep, EagerStep, StepKind, StepPlan
from job.recipe.uncompiled import FlopCount

if TYPE_CHECKING:
    from job.config import Config
    from job.recipe.build import Recipe
    from job.run.meters import LossLog

# A CPU step whose forward pass does less arithmetic than this is dominated by per-operation overhead: it is
# traced, and it runs on one thread (waking a second thread costs more than it saves at this size).
SMALL_STEP_FLOPS = 2e7
# Tracing costs about 0.07 s of CPU once (its operations recorded as they run: recipe/record.py) and saves about 200 us
# step on the Iris MLP (2,000 steps: traced 2.2 s of CPU, eager 2.7 s; 500 steps: even): a run shorter than this many
# steps is over before tracing has paid for itself, and steps eagerly.
TRACE_REPAID_STEPS = 1000


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


def cpu_computes_bf16() -> bool:
    """Whether this CPU has AMX, matrix units that multiply bf16 natively (Intel Xeon from Sapphire Rapids on). torch's
    own check (the CPU's flags and the kernel's leave to use AMX's tiles); torch has no public one. A CPU with
    AVX512-BF16 alone is not counted: bf16 on it is not measured here."""
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        return bool(check()) if check is not None else False
    except Exception:  # a torch whose check cannot run here: no AMX known
        return False


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
    """What decides how a step runs: the device, train.step_capture, the precision, a forward pass's FLOPs, whether
    the model is the user's own class, fp16's loss scaler, what wraps the model (none, ddp, compile), and the
    optimizer: `plain_sgd`, SGD whose step is the same arithmetic every batch with nothing on the host's side between
    steps (no accumulation, schedule, lookahead, EMA or loss scaler; a constant rate): what a captured step may hold
    whole; `bare_sgd`, that and one group without momentum (two operations a tensor, traced on a CPU); `steps`, the
    run's training steps as its first attempt planned them (all its epochs'; kept in its checkpoints, so that a
    resumed run steps as it began even when train.epochs changes), None when not known."""

    device: str
    capture: str = "auto"
    precision: str = "fp32"
    step_flops: float = float("inf")
    own_model: bool = False
    loss_scaler: bool = False
    wrapper: str = "none"
    plain_sgd: bool = False
    bare_sgd: bool = False
    steps: int | None = None


def plan_step(f: StepFacts) -> StepPlan:
    """How the step runs, from the facts alone (no device needed: a pure function)."""
    if f.wrapper == "compile":
        return StepPlan(StepKind.EAGER, "the compiled model in eager steps: step capture is off with torch.compile")
    if f.wrapper == "ddp":
        return StepPlan(StepKind.EAGER, "DistributedDataParallel reduces gradients from autograd hooks: no capture")
    if f.capture == "off":
        return StepPlan(StepKind.EAGER, "train.step_capture off")
    small = f.step_flops < SMALL_STEP_FLOPS
    traced = f.device == "cpu" and small and f.precision == "fp32"
    if (f.device == "cuda" or traced) and f.own_model and f.capture == "auto":
        return StepPlan(
            StepKind.EAGER,
            "a model of your own: a captured step replays what its forward did in Python when captured, a "
            "random.random() draw or a counter, frozen; train.step_capture=on captures it when it does neither",
        )
    if f.device == "cuda":
        return StepPlan(StepKind.CUDA_GRAPH, "a step replayed without launching its kernels one by one", f.plain_sgd)
    if traced and f.capture == "auto" and f.steps is not None and f.steps < TRACE_REPAID_STEPS:
        return StepPlan(
            StepKind.EAGER,
            f"a {f.steps:,}-step run: tracing pays for itself from {TRACE_REPAID_STEPS:,} steps",
        )
    if traced:
        return StepPlan(StepKind.CPU_TRACE, "a small step, bound by per-operation overhead", f.bare_sgd)
    if f.device == "cpu" and f.loss_scaler:
        return StepPlan(StepKind.EAGER, "fp16's loss scaler on a CPU")
    if f.device == "cpu" and small:  # the check against the eager step would refuse it
        return StepPlan(
            StepKind.EAGER, f"{f.precision} on a CPU: a traced step would round differently from the eager one"
        )
    if f.device == "cpu":
        return StepPlan(StepKind.EAGER, "a CPU step this large is bound by arithmetic; capture would not help")
    return StepPlan(StepKind.EAGER, f"no step capture on {f.device}")


def forward_flops(model: nn.Module, input_shape: tuple[int, ...]) -> float:
    """Floating-point operations of one forward pass per sample, counted on a batch of 2 on the CPU."""
    was_training = model.training
    model.eval()
    counter = FlopCount()  # outside the try: a counter that cannot count is a bug to see, not a large model
    try:
        with torch.no_grad(), counter:
            model(torch.zeros(2, *input_shape))
        return counter.flops / 2
    except Exception:  # an operation the counter does not know: treat the model as large
        return float("inf")
    finally:
        model.train(was_training)


def step_facts(
    r: Recipe,
    capture: str,
    step_flops: float = float("inf"),
    own_model: bool = False,
    wrapper: str = "none",
    steps: int | None = None,
) -> StepFacts:
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
    bare = plain and len(groups) == 1 and groups[0]["momentum"] == 0 and not groups[0]["maximize"]
    return StepFacts(
        r.device.type, capture, r.precision, step_flops, own_model, r.scaler.is_enabled(), wrapper, plain, bare, steps
    )


def build_step(r: Recipe, sums: torch.Tensor, plan: StepPlan, model=None) -> EagerStep:
    """The recipe's step as `plan` says (plan_step), adding each step's loss to `sums`. `model`: what the step calls,
    when not the recipe's own model (a DistributedDataParallel or compiled wrapper of it)."""
    args = (model if model is not None else r.model, r.optimizer, r.scheduler, r.scaler, r.amp, sums)
    how = {"accumulate": r.accumulate, "loss": r.loss, "lookahead": r.lookahead, "plan": plan, "ema": r.ema}
    if plan.kind is StepKind.CUDA_GRAPH:
        return CudaGraphStep(*args, **how)
    if plan.kind is StepKind.CPU_TRACE:
        return CpuTracedStep(*args, **how)
    return EagerStep(*args, **how)


def set_cpu_threads(cfg: Config, r: Recipe) -> float:
    """On a CPU, the threads a step of this size should use; returns the step's forward FLOPs (inf elsewhere: what
    a step costs matters on a CPU only, for threads and tracing)."""
    if r.device.type != "cpu":
        return float("inf")
    flops = (r.sample_flops or forward_flops(r.model, r.input_shape)) * r.train.batch_size
    threads = cfg.train.cpu_threads
    torch.set_num_threads(threads if threads != "auto" else 1 if flops < SMALL_STEP_FLOPS else torch.get_num_threads())
    return flops


def make_step(cfg: Config, r: Recipe, log: LossLog, step_flops: float, steps: int | None = None) -> EagerStep:
    """The training step as this run takes it: through DDP and torch.compile where they apply, else captured."""
    t = cfg.train
    model = distributed.wrap(r.model, r.device)
    model = torch.compile(model) if t.compile else model  # checkpoints keep the plain module's names
    wrapper = "compile" if t.compile else "ddp" if model is not r.model else "none"
    facts = step_facts(r, t.step_capture, step_flops, own_class(cfg.model.name), wrapper, steps)
    step = build_step(r, log.sums, plan_step(facts), model=model)
    layout = ", channels-last" if r.channels_last else ""
    compiled = ", torch.compile" if t.compile else ""
    accumulated = f"; the optimizer steps every {t.accumulate_steps} batches" if t.accumulate_steps > 1 else ""
    why = f" ({r.precision_decided.why})" if r.precision_decided.why else ""
    say(f"step: {r.precision}{why}{layout}{compiled}; {step.description}{accumulated}")
    return step
