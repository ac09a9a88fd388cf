"""job/recipe/uncompiled.py: torch's SGD and AdamW called past the wrappers that import torch's compiler, doing what
torch.optim's own do, to the bit; and the FLOP count by torch's formulas."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from job.recipe import uncompiled
from job.recipe.models import CifarCNN, CifarFast


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def groups(m: nn.Module) -> list[dict]:
    """Two groups, the second at its own rate: what layer decay and norm rates make."""
    return [{"params": list(m[0].parameters())}, {"params": list(m[2].parameters()), "lr": 0.03}]


def train(m: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()


SETTINGS = [
    (torch.optim.SGD, uncompiled.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 5e-4}),
    (torch.optim.SGD, uncompiled.SGD, {"lr": 0.1, "momentum": 0.9, "foreach": False}),
    (torch.optim.AdamW, uncompiled.AdamW, {"lr": 0.01, "weight_decay": 0.05, "amsgrad": True}),
    (torch.optim.AdamW, uncompiled.AdamW, {"lr": 0.01, "maximize": True, "foreach": False}),
]


@pytest.mark.parametrize("theirs, ours, how", SETTINGS)
def test_the_optimizers_step_and_save_as_torchs_own_to_the_bit(theirs, ours, how):
    a, b = model(), model()
    opt_a, opt_b = theirs(groups(a), **how), ours(groups(b), **how)
    train(a, opt_a, 5)
    train(b, opt_b, 5)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    # each one's state goes on in the other: the checkpoint format is torch's
    c, d = model(), model()
    c.load_state_dict(b.state_dict())
    d.load_state_dict(a.state_dict())
    opt_c, opt_d = theirs(groups(c), **how), ours(groups(d), **how)
    opt_c.load_state_dict(copy.deepcopy(opt_b.state_dict()))  # a copy: loading keeps the tensors it is given
    opt_d.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    train(a, opt_a, 3, seed=2)
    train(c, opt_c, 3, seed=2)
    train(d, opt_d, 3, seed=2)
    assert all(
        torch.equal(p, q) and torch.equal(p, r) for p, q, r in zip(a.parameters(), c.parameters(), d.parameters())
    )


def test_hooks_run_once_a_step_and_a_schedule_sees_its_optimizer_step():
    m = model()
    opt = uncompiled.SGD(m.parameters(), lr=0.1)
    seen = []
    opt.register_step_pre_hook(lambda *_: seen.append("pre"))
    opt.register_step_post_hook(lambda *_: seen.append("post"))
    handle = register_optimizer_step_post_hook(lambda *_: seen.append("global"))
    try:
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would fail here
            for _ in range(2):
                train(m, opt, 1)
                schedule.step()
    finally:
        handle.remove()
    assert seen == ["pre", "post", "global"] * 2
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * (1 + torch.cos(torch.tensor(torch.pi / 2)).item()) / 2)


def test_a_run_that_compiles_takes_torchs_own_classes():
    from job.config import load_config
    from job.recipe.build import make_optimizer

    m = model()
    assert type(make_optimizer(load_config("iris", []), m)) is uncompiled.SGD
    assert type(make_optimizer(load_config("iris", ["train.compile=true"]), m)) is torch.optim.SGD
    assert type(make_optimizer(load_config("iris", ["train.compile=true", "optim.name=adamw"]), m)) is torch.optim.AdamW


def test_a_method_under_a_wrapper_not_known_to_change_nothing_is_left_to_torch():
    def logged(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)

        return wrapper

    class Wrapped:
        @logged
        def step(self):
            pass

        @torch._disable_dynamo
        def zero_grad(self):
            pass

    assert uncompiled.unwrapped(Wrapped, "step") is None
    assert uncompiled.unwrapped(Wrapped, "zero_grad") is Wrapped.zero_grad.__wrapped__
    assert uncompiled.unwrapped(torch.optim.SGD, "step") is not None


@pytest.mark.parametrize(
    "net, shape",
    [
        (lambda: nn.Sequential(nn.Linear(4, 10), nn.ReLU(), nn.Linear(10, 3)), (4,)),
        (CifarCNN, (3, 32, 32)),
        (lambda: CifarFast(widths=(16, 32, 32)), (3, 32, 32)),
    ],
)
def test_the_flop_count_is_torchs(net, shape):
    from torch.utils.flop_counter import FlopCounterMode

    m = net().eval()
    x = torch.randn(2, *shape)
    with torch.no_grad(), uncompiled.FlopCount() as ours:
        m(x)
    with torch.no_grad(), FlopCounterMode(display=False) as theirs:
        m(x)
    assert ours.flops == theirs.get_total_flops() > 0
