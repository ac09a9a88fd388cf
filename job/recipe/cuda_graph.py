"""The training step replayed as one CUDA graph per batch shape (torch.cuda.graph, torch's public capture API).

Forward, loss and backward (and the optimizer step, for SGD without a schedule or loss scaler) are captured once and
replayed for every batch of that shape: a small model's step is bound by kernel launches, which a replay makes in
one. The first steps of each shape run eagerly on a side stream (cuDNN picks its kernels, lazy state is made), as real
steps of the run. A batch of another shape (the last, partial batch of an epoch) gets its own graph. Where capture is
not possible the step runs eagerly, and the run says why.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import warnings
from collections import Counter
from collections.abc import Iterator

import torch
from torch import nn

from job.errors import JobError, one_line
from job.group.memory import is_out_of_memory
from job.recipe.step import EagerStep


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


def replaced_buffers(model: nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    """The names of `before`'s buffers that `model` no longer holds as those tensors: a forward replaced them."""
    now = dict(model.named_buffers())
    return [name for name, b in before.items() if now.get(name) is not b]
