"""What a run takes from torch without the import of its compiler.

torch wraps an optimizer's step, zero_grad, state_dict, load_state_dict and add_param_group, and its FLOP counter's
dispatch, so that torch.compile leaves them out of what it captures; each wrapper imports the compiler
(torch._dynamo, with sympy and triton: 1.1-1.5 s of CPU on this project's machine) the first time it runs, whether
anything is compiled or not: a fifth of a short CPU run. A run that compiles nothing (train.compile off) takes
these: torch's SGD and AdamW, their own arithmetic, state, hooks and state_dict format, their methods called past
those wrappers, and a FLOP count by torch's own formulas. Only the wrappers known to do nothing but that (and what
the job does itself: grad mode, hooks) are passed by; a method under any other wrapper runs as torch has it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# The wrappers passed by, by __qualname__: the compiler's skip (which imports it), the grad mode an optimizer step runs
# in (Uncompiled.step sets the same), and the hooks around a step (which the subclass's own step gets from torch).
PASSED = (
    "_disable_dynamo.<locals>.inner",
    "_use_grad_for_differentiable.<locals>._use_grad",
    "Optimizer.profile_hook_step.<locals>.wrapper",
)


def unwrapped(cls: type, name: str) -> Callable | None:
    """cls.name under the wrappers of PASSED; None when any other wrapper is around it (torch's own then runs). A
    wrapper is told by its code's own name: functools.wraps gives it the name of what it wraps (Python 3.11 on)."""
    fn = getattr(cls, name)
    while hasattr(fn, "__wrapped__"):
        if getattr(fn.__code__, "co_qualname", None) not in PASSED:
            return None
        fn = fn.__wrapped__
    return fn


class Uncompiled:
    """The methods torch.optim wraps for its compiler, called unwrapped where that is known to change nothing else.
    `torch_class`: the torch optimizer whose methods these are."""

    torch_class: type[torch.optim.Optimizer]
    methods: dict[str, Callable | None]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        names = ("step", "zero_grad", "state_dict", "load_state_dict", "add_param_group")
        cls.methods = {name: unwrapped(cls.torch_class, name) for name in names}

    def call(self, name: str, *args) -> Any:
        own = self.methods[name]
        return own(self, *args) if own is not None else getattr(self.torch_class, name)(self, *args)

    def step(self, closure=None):
        with torch.set_grad_enabled(self.defaults["differentiable"]):  # as torch's step wrapper has it
            return self.call("step", closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.call("zero_grad", set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.call("state_dict")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.call("load_state_dict", state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.call("add_param_group", param_group)


class SGD(Uncompiled, torch.optim.SGD):
    torch_class = torch.optim.SGD


class AdamW(Uncompiled, torch.optim.AdamW):
    torch_class = torch.optim.AdamW


class FlopCount(TorchDispatchMode):
    """The floating-point operations run under it, by torch's own formulas (torch.utils.flop_counter's
    flop_registry: matrix products and convolutions; attention as torch's own counter counts it). Not torch's
    FlopCounterMode, whose dispatch is wrapped for the compiler; this one also leaves out its per-module table,
    which nothing here reads."""

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
