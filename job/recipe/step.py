"""The training step, and how it runs: eagerly, captured as one graph per batch shape, or through torch.compile.

A small model's step is bound by per-operation overhead, not by arithmetic: each kernel launch on a GPU and
each dispatched operation on a CPU costs microseconds that the work itself does not. Capture removes that
overhead without changing what the step computes:

- CUDA: forward, loss and backward (and the optimizer step, for SGD without a schedule or loss scaler) are
  captured once as a CUDA graph and replayed for every batch of that shape. The first steps of each shape run
  eagerly on a side stream (cuDNN picks its kernels, lazy state is made), as real steps of the run.
- CPU: forward, loss and backward are traced once into a graph of ATen operations that TorchScript's
  interpreter runs without Python or autograd bookkeeping per operation; the first traced step is checked
  against the eager step on the same batch and used only when they agree. Worth it for small steps only.

A batch of another shape (the last, partial batch of an epoch) gets its own graph. Where capture is not
possible the step runs eagerly, and the run says why.
"""

from __future__ import annotations

import contextlib
import enum
import os
import re
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from job.errors import JobError, one_line
from job.group.memory import is_out_of_memory
from job.recipe.record import record


class StepKind(enum.Enum):
    EAGER = "eager"
    CUDA_GRAPH = "one CUDA graph per batch shape"
    CPU_TRACE = "traced on the CPU"


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
        if self.kind is StepKind.CUDA_GRAPH:
            what = (
                "forward, backward and SGD step"
                if self.optimizer_inside
                else "forward and backward; optimizer step eager"
            )
            return f"one CUDA graph per batch shape ({what})"
        what = "forward, backward and SGD step" if self.optimizer_inside else "forward and backward"
        return f"traced on the CPU ({what} as one graph per batch shape)"


class Accumulator:
    """Gradient accumulation (train.accumulate_steps): the gradients of a group of batches summed, each batch's
    weighted by its share of the group's samples, so that the optimizer steps once on what one batch of all of them
    would have given. Works on the fresh gradients any kind of step leaves, so capture and AMP keep working (the
    loss scale of fp16 stays fixed within a group: the scaler updates at the optimizer step)."""

    def __init__(self, params: list[torch.Tensor], every: int) -> None:
        self.params, self.every = params, every
        self.sums: list[torch.Tensor] | None = None
        self.weight, self.last = 1.0, True

    def plan(self, loader, i: int) -> None:
        """Batch i of the loader's epoch comes next: its weight in its group, and whether it ends the group (the
        epoch's last batch ends the last group, however short)."""
        start = i - i % self.every
        end = min(start + self.every, len(loader))
        self.weight = loader.samples(i) / sum(loader.samples(j) for j in range(start, end))
        self.last = i == end - 1

    def add(self) -> bool:
        """Add the fresh gradients in `.grad` to the group's sum; at the group's last batch, put the sum in `.grad`
        for the optimizer and return True."""
        if self.sums is None:
            self.sums = [torch.zeros_like(p) for p in self.params]
        pairs = [(s, p.grad) for s, p in zip(self.sums, self.params) if p.grad is not None]
        if pairs:
            torch._foreach_add_([s for s, _ in pairs], [g for _, g in pairs], alpha=self.weight)
        if not self.last:
            return False
        for p, s in zip(self.params, self.sums):
            p.grad = s
        return True

    def reset(self) -> None:
        if self.sums is not None:
            torch._foreach_zero_(self.sums)

    def saved(self, epoch_step: int) -> dict:
        """Stopped inside a group of batches (after `epoch_step` of the epoch): the group's gradient sums so far, on
        the host, for a checkpoint (the same in every process: DDP has averaged each batch's); else nothing."""
        if self.sums is None or epoch_step % self.every == 0:
            return {}
        return {"accumulated": [t.detach().cpu() for t in self.sums]}

    def restore(self, sums: list[torch.Tensor] | None, device: torch.device) -> None:
        """A checkpoint's sums back on the device: the resumed run adds the rest of the group to them."""
        self.sums = [t.to(device) for t in sums] if sums is not None else None


class EagerStep:
    """Forward, loss, backward and optimizer step as plain PyTorch calls; the loss is added to `sums` on the device.
    `accumulate`: batches per optimizer step (an Accumulator sums their gradients); `loss`: of (logits, labels);
    `lookahead`, `ema`: stepped after each optimizer step."""

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
    ) -> None:
        self.model, self.optimizer, self.scheduler, self.scaler, self.amp = model, optimizer, scheduler, scaler, amp
        self.sums, self.loss, self.lookahead, self.ema = sums, loss, lookahead, ema
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.accumulator = Accumulator(self.params, accumulate) if accumulate > 1 else None
        self.plan = plan
        self.fallback: StepPlan | None = None  # the eager plan it fell back to, and why
        self.empty_ok: bool | None = None  # whether the model takes an empty batch (padded steps), once known

    @property
    def description(self) -> str:
        return (self.fallback or self.plan).describe()

    def fall_back(self, reason: str) -> None:
        self.fallback = StepPlan(StepKind.EAGER, reason[:300])

    def __call__(self, x: torch.Tensor, y: torch.Tensor, weight: float = 1.0) -> None:
        """`weight` scales the loss: a process's uneven part of a global batch under torchrun (1.0 otherwise)."""
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
            self.empty_ok = not hasattr(inner, "_orig_mod") and runs_empty(inner, x)
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
    leaves = torch.utils._pytree.tree_leaves(outputs)  # a tensor, or a model's tuple or dict of them
    return torch.stack([t.float().sum() for t in leaves if torch.is_tensor(t) and t.is_floating_point()]).sum() * 0


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


def shape_key(x: torch.Tensor, y: torch.Tensor) -> tuple:
    return tuple(x.shape), x.dtype, tuple(y.shape), x.is_contiguous(memory_format=torch.channels_last)


class CudaGraphStep(EagerStep):
    """The step replayed as a CUDA graph per batch shape, after `warmup` eager steps of that shape."""

    def __init__(self, *args, warmup: int = 3, **how) -> None:
        super().__init__(*args, **how)
        # The whole step fits in the graph when the optimizer's arithmetic does not change between steps on the
        # host's side: SGD with a constant rate, every batch (the plan says). Otherwise the graph ends at the gradients.
        self.whole = self.plan.optimizer_inside
        self.warmup = warmup
        # One memory pool for every shape's graph: each graph's outputs (gradients, loss) stay referenced, the
        # graphs replay one at a time on one stream, and a replay's gradients are used up before another graph
        # replays, so their intermediates may share memory. (Gradients kept across shapes would break this.)
        self.pool = torch.cuda.graph_pool_handle()
        self.seen: Counter = Counter()
        self.graphs: dict[tuple, tuple] = {}
        self.inputs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.side = torch.cuda.Stream()

    @property
    def failed(self) -> str:
        return self.fallback.reason if self.fallback is not None else ""

    def __call__(self, x: torch.Tensor, y: torch.Tensor, weight: float = 1.0) -> None:
        if weight != 1.0 or self.failed:  # weight: never in one process, where captured steps are used
            return super().__call__(x, y, weight)
        key = shape_key(x, y)
        if key not in self.inputs:
            self.inputs[key] = (torch.empty_like(x), torch.empty_like(y))
        sx, sy = self.inputs[key]
        sx.copy_(x)
        sy.copy_(y)
        entry = self.graphs.get(key)
        if entry is None:
            self.seen[key] += 1
            if self.seen[key] <= self.warmup:
                self.side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.side):
                    if self.seen[key] < self.warmup:
                        super().__call__(sx, sy)
                    else:
                        self.last_warmup(sx, sy)
                torch.cuda.current_stream().wait_stream(self.side)
                return
            entry = self.capture(sx, sy)
            if entry is None:
                return self.after_failed_capture(sx, sy)
            self.graphs[key] = entry
        graph, grads = entry
        graph.replay()
        if not self.whole:
            self.set_grads(grads)
            self.apply()

    def last_warmup(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """The last eager step before a capture, watched for the host waiting on the GPU (`.item()`, a Python
        branch on a tensor's value) and for a buffer replaced by a new tensor (self.seen = self.seen + 1): a step that
        does either cannot be a graph, and is known as such before capturing."""
        before = dict(self.model.named_buffers())
        with host_waits() as waits:
            self.backward(x, y)
            if self.whole:
                self.update()
        if not self.whole:
            self.apply()
        if waits:
            self.fall_back(f"the step waits for the GPU on the host ({waits[0]}; a .item() or a branch on a value)")
        elif replaced := replaced_buffers(self.model, before):  # a graph would replay into the tensor it replaced
            self.fall_back(f"the model's forward replaces its buffer {', '.join(replaced)} (a graph updates in place)")

    def fall_back(self, reason: str) -> None:
        """Every shape runs eagerly from now on; the graphs' memory goes back to the allocator."""
        self.graphs.clear()
        super().fall_back(f"the step could not be captured as a CUDA graph: {reason[:200]}")

    def capture(self, sx: torch.Tensor, sy: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]] | None:
        """The graph of one step on these static inputs (capturing runs nothing); None, with the reason kept,
        when the model cannot be captured: it then runs eagerly from this batch on."""
        graph = torch.cuda.CUDAGraph()
        self.optimizer.zero_grad(set_to_none=True)  # gradients are made inside the graph, in its own memory
        stream = torch.cuda.current_stream()
        try:
            # thread_local: CUDA calls from other threads (uploads, a notebook kernel) do not spoil this capture.
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                with self.amp():
                    loss = self.loss(self.model(sx), sy)
                (self.scaler.scale(loss) if self.scaler.is_enabled() else loss).backward()
                if self.whole:
                    self.optimizer.step()
                self.sums += loss.detach()
        except Exception as e:  # a CPU tensor or an operation CUDA graphs do not allow: it cannot be a graph
            # A failed capture leaves torch's capture stream current (its context is not exited): put ours back.
            torch.cuda.set_stream(stream)
            # When the step itself raised, the capture's end raises too ("a previous error during capture"),
            # with the step's error as its context: that one says what went wrong.
            first = e.__context__ if isinstance(e.__context__, Exception) and "during capture" in str(e) else e
            if is_out_of_memory(first):
                raise first from None
            why = one_line(first)
        else:
            return graph, [p.grad for p in self.params]
        # The error's traceback holds this frame, and through it the abandoned graph, its memory pool and the partial
        # step's activations, until a garbage collection: let go of them now.
        del first, graph
        self.fall_back(why)
        return None

    def after_failed_capture(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """The step eagerly, the first time after a capture failed, and the device waited for: a failed capture can
        leave CUDA unable to go on (an error of the abandoned capture that stays), which shows here as one line, not
        as a traceback some steps later. Once per run: the wait costs one step's overlap."""
        try:
            torch.cuda.synchronize()
            self.optimizer.zero_grad(set_to_none=True)  # some may point into the abandoned graph's memory
            super().__call__(x, y)
            torch.cuda.synchronize()
        except Exception as e:
            if is_out_of_memory(e):
                raise
            # The device's error may be the capture's, or the step's own that the capture only met first (a label
            # out of range): which one, a run without capture tells.
            raise JobError(
                f"{self.failed}; the step then failed eagerly too ({one_line(e)[:200]}): run the same command with "
                "--set train.step_capture=off (it continues from the last checkpoint); an error there is the step's own"
            ) from None


SYNC_WARNING = "synchronizing CUDA operation"  # what torch's sync debug mode says, in the thread that waited


@contextlib.contextmanager
def host_waits() -> Iterator[list[str]]:
    """The places inside the block where this thread waited for the GPU, as torch's sync debug mode reports them
    (it covers blocking copies to the host and stream synchronisations); the block itself runs as usual."""
    mode = torch.cuda.get_sync_debug_mode()
    with waits_reported() as found:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(mode)


@contextlib.contextmanager
def waits_reported() -> Iterator[list[str]]:
    """The sync debug mode's warnings of this thread inside the block, collected instead of shown.

    The mode is the process's, so other threads' waits are reported too while it is on (the device decoder
    waits for its own stream): those are not the block's, and are dropped. Python's warning state is the
    process's as well, and catch_warnings is not thread-safe (a thread that enters and leaves one around this
    block puts back what it found): so this adds one filter of its own and wraps the shown warnings, each taken
    out afterwards, and the wrapper passes everything on once the block is over, should another thread put it
    back. (A wait of another thread that began in the block and ends after it is shown as usual: torch turns
    its warning into Python's when the call returns.)"""
    found: list[str] = []
    me, watching, shown = threading.get_ident(), [True], warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if not (watching[0] and SYNC_WARNING in str(message)):
            return shown(message, category, filename, lineno, file, line)
        if threading.get_ident() == me:  # where in the user's code: the op's Python line
            found.append(f"{one_line(str(message))} at {os.path.basename(filename)}:{lineno}")

    pattern = f".*{SYNC_WARNING}"
    warnings.filterwarnings("always", pattern)  # every wait, also one seen before at the same line
    rule = ("always", re.compile(pattern, re.I), Warning, None, 0)  # as filterwarnings made it
    warnings.showwarning = show
    try:
        yield found
    finally:
        watching[0] = False
        if warnings.showwarning is show:
            warnings.showwarning = shown
        with contextlib.suppress(ValueError):  # gone already when another thread put back the list it found
            warnings.filters.remove(rule)  # by equality: filterwarnings keeps one of equal rules


class CpuTracedStep(EagerStep):
    """Forward, loss and backward (and a plain SGD update) as one traced graph per batch shape, run by
    TorchScript's interpreter."""

    def __init__(self, *args, **how) -> None:
        super().__init__(*args, **how)
        # Plain SGD (one group, no momentum, a constant rate) is two operations per tensor: traced with the rest,
        # and checked against torch.optim's own step on the first batch like everything else (the plan says).
        self.whole = self.plan.optimizer_inside
        named = [(n, p) for n, p in self.model.named_parameters()]
        self.names = [n for n, p in named if p.requires_grad]
        self.frozen = [(n, p.detach()) for n, p in named if not p.requires_grad]
        self.buffers = list(self.model.named_buffers())
        self.args = [p.detach() for p in self.params] + [t for _, t in self.frozen] + [b for _, b in self.buffers]
        self.traced: dict[tuple, Callable] = {}

    @property
    def failed(self) -> str:
        return self.fallback.reason if self.fallback is not None else ""

    def __call__(self, x: torch.Tensor, y: torch.Tensor, weight: float = 1.0) -> None:
        key = shape_key(x, y)
        fn = None if weight != 1.0 else self.traced.get(key)
        if fn is None:
            if self.failed or weight != 1.0:
                return super().__call__(x, y, weight)
            fn = self.trace(key, x, y)
            if fn is None:
                return super().__call__(x, y)
        # The graph itself, without nn.Module's hooks; none of its inputs requires a gradient, so nothing records one.
        loss, *grads = fn.forward(*self.args, x, y, self.sums)  # the graph adds the loss to the sums
        if not self.whole:
            self.set_grads(grads)
            self.apply()

    def joint(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(loss, *gradients) from (*trainable, *frozen, *buffers, x, y, sums), the loss added to the sums in place:
        the function that is traced (the sums inside it: one call into Python fewer a step)."""
        k, f = len(self.names), len(self.frozen)
        leaves = [t.detach().requires_grad_() for t in tensors[:k]]
        state = dict(zip(self.names, leaves))
        state.update(zip([n for n, _ in self.frozen], tensors[k : k + f]))
        state.update(zip([n for n, _ in self.buffers], tensors[k + f : -3]))
        x, y, sums = tensors[-3:]
        with torch.enable_grad(), self.amp():
            loss = self.loss(torch.func.functional_call(self.model, state, (x,)), y)
        grads = torch.autograd.grad(loss.float(), leaves)
        with torch.no_grad():
            sums.add_(loss.detach().float())
        if not self.whole:
            return (loss.detach().float(), *grads)
        group = self.optimizer.param_groups[0]
        with torch.no_grad():
            for p, g in zip(tensors[:k], grads):
                if group["weight_decay"]:
                    g = g.add(p, alpha=group["weight_decay"])
                p.add_(g, alpha=-group["lr"])
        return (loss.detach().float(),)

    def trace(self, key: tuple, x: torch.Tensor, y: torch.Tensor) -> Callable | None:
        """Trace the step for this batch shape and check it against the eager one; None (and a reason) if not."""
        try:
            with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # TorchScript's deprecation notice: nothing the user can act on
                # Tracing runs the step for real, so on copies (of the batch too: a model may write to its input,
                # and the first step trains on it as it came). A model that reads its data's values on the host
                # (branches on them, calls .item()) cannot be traced, and says so here.
                scratch = torch.zeros_like(self.sums)  # what the sums are is the run's: traced on a copy
                graph = record(self.joint, *[a.clone() for a in self.args], x.clone(), y.clone(), scratch)
                fn = interpreted(graph, (*[a.clone() for a in self.args], x.clone(), y.clone(), scratch))
            self.check(fn, x, y)
        except Exception as e:  # every way tracing can fail means the same: run this model eagerly
            self.fall_back(f"the step could not be traced: {why_not_traced(e)}")
            return None
        self.traced[key] = fn
        return fn

    def check(self, fn: Callable, x: torch.Tensor, y: torch.Tensor) -> None:
        """The traced step must do what the eager step does: the same loss, gradients (or updated weights) and
        buffers, from the same random draws. Both run on the batch; the state is put back after each."""
        rng = torch.get_rng_state()
        state = [t.detach() for t in self.params] + [b for _, b in self.buffers]
        before = [t.clone() for t in state]

        def put_back() -> None:
            with torch.no_grad():
                for t, saved in zip(state, before):
                    t.copy_(saved)
            torch.set_rng_state(rng)

        self.optimizer.zero_grad(set_to_none=True)
        with self.amp():
            loss = self.loss(self.model(x.clone()), y)
        loss.backward()
        if self.whole:
            self.optimizer.step()
        if replaced := self.put_back_buffers():
            self.optimizer.zero_grad(set_to_none=True)
            put_back()
            names = ", ".join(replaced)
            raise RuntimeError(f"the model's forward replaces its buffer {names} (a graph updates buffers in place)")
        eager = [loss.detach().float(), *([] if self.whole else [p.grad for p in self.params])]
        eager += [t.clone() for t in state]
        self.optimizer.zero_grad(set_to_none=True)
        put_back()
        summed = torch.zeros_like(self.sums)
        try:
            with torch.no_grad():
                traced = [*fn(*self.args, x.clone(), y.clone(), summed), *[t.clone() for t in state], summed]
        finally:
            put_back()
        eager.append(loss.detach().float().expand_as(summed))  # the graph adds the loss to the sums it is given
        if len(traced) != len(eager) or not all(
            torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(eager, traced)
        ):
            raise RuntimeError("the traced step does not compute what the eager step computes")

    def put_back_buffers(self) -> list[str]:
        """The buffers the eager step replaced with new tensors (self.seen = self.seen + 1), each put back in its
        place: a graph updates the tensors it was given, and a count kept so would stay frozen."""
        replaced = replaced_buffers(self.model, dict(self.buffers))
        for name, b in self.buffers:
            owner, _, leaf = name.rpartition(".")
            self.model.get_submodule(owner)._buffers[leaf] = b
        return replaced


def replaced_buffers(model: nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    """The names of `before`'s buffers that `model` no longer holds as those tensors: a forward replaced them."""
    now = dict(model.named_buffers())
    return [name for name, b in before.items() if now.get(name) is not b]


def interpreted(graph: torch.fx.GraphModule, example: tuple) -> Callable:
    """The graph as TorchScript's interpreter runs it (the Iris MLP's step: 49 us, against 96 us as the graph's own
    Python code and 229 us eager: bench/cpu_step.py); its tracer does not take some backward operations' arguments
    (batch norm's, a convolution's), and such a graph runs as its Python code, still without autograd's bookkeeping
    (a small network with batch norm: 157 us a step, 332 us eager)."""
    try:
        return torch.jit.trace(graph, example, check_trace=False)
    except RuntimeError as e:
        if "unsupported argument type in the JIT tracer" not in str(e):
            raise
        return graph


def why_not_traced(e: Exception) -> str:
    text = one_line(e)
    if "_local_scalar_dense" in text or "data-dependent" in text:
        return "the model reads its data's values on the host (a Python branch on a tensor, or .item())"
    return text[:200]
