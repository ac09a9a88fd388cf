"""What a run takes from torch without the import of its compiler.

torch wraps an optimizer's step, zero_grad, state_dict, load_state_dict and add_param_group, and its FLOP counter's
dispatch, so that torch.compile leaves them out of what it captures; each wrapper imports the compiler
(torch._dynamo, with sympy and triton: 1.1-1.5 s of CPU on this project's machine) the first time it runs, whether
anything is compiled or not: a fifth of a short CPU run. A run that compiles nothing (train.compile off) takes
these: torch's SGD and AdamW, their own arithmetic, state, hooks and state_dict format, their methods called
unwrapped, and a FLOP count by torch's own formulas. Where a torch release lays its wrappers out otherwise,
`inspect.unwrap` finds nothing to unwrap and the method runs as torch has it, import included.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def past_wrappers(cls: type, name: str):
    """cls.name as torch wrote it, under every wrapper torch.optim put around it (functools.wraps marks each)."""
    return inspect.unwrap(getattr(cls, name))


class Uncompiled:
    """The methods torch.optim wraps for its compiler, called unwrapped. step runs without gradients, as the
    wrapper has it for an optimizer that is not `differentiable` (the job's never are); its hooks still run."""

    def step(self, closure=None):
        with torch.no_grad():
            return past_wrappers(self.torch_class, "step")(self, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        past_wrappers(torch.optim.Optimizer, "zero_grad")(self, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return past_wrappers(torch.optim.Optimizer, "state_dict")(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        past_wrappers(torch.optim.Optimizer, "load_state_dict")(self, state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        past_wrappers(torch.optim.Optimizer, "add_param_group")(self, param_group)


class SGD(Uncompiled, torch.optim.SGD):
    torch_class = torch.optim.SGD


class AdamW(Uncompiled, torch.optim.AdamW):
    torch_class = torch.optim.AdamW


class FlopCount(TorchDispatchMode):
    """The floating-point operations run under it, by torch's own formulas (torch.utils.flop_counter's
    flop_registry: matrix products, convolutions, attention). Not torch's FlopCounterMode, whose dispatch is wrapped
    for the compiler; this one also leaves out its per-module table, which nothing here reads."""

    def __init__(self) -> None:
        from torch.utils.flop_counter import flop_registry  # with triton: only where FLOPs are counted (a CPU run)

        super().__init__()
        self.flops, self.formulas = 0, flop_registry

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # torch's switch for a mode that needs no wrapper: nothing is compiled while it counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (formula := self.formulas.get(func._overloadpacket)) is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        return out
