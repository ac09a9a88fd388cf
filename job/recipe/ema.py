"""train.ema: an exponential moving average of the model's weights (and floating-point buffers: batch-norm
statistics), the model a run evaluates, chooses, saves to model.pt, predicts with and exports.

Its own small class, not torch.optim.swa_utils.AveragedModel: AveragedModel.update_parameters asks
`n_averaged == 0` of a tensor on the device every step, a host sync per step; here the count of updates is a Python
int, so the decay is known on the host and each update is one foreach lerp queued on the device.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

# timm's ModelEmaV3 warmup (use_warmup=True, warmup_gamma=1, warmup_power=2/3): the (n+1)-th update's decay is
# 1 - (1 + n) ** -(2/3), at most train.ema: the first update copies the model, and the average forgets its random
# start within the first steps instead of keeping it for 1 / (1 - decay) of them.
WARMUP_POWER = 2 / 3


def ema_decay(decay: float, updates: int, warmup: bool = True) -> float:
    """The decay of the update that follows `updates` earlier ones."""
    if not warmup:
        return decay if updates else 0.0
    return min(decay, 1 - (1 + updates) ** -WARMUP_POWER)


class ModelEma:
    """The averaged copy of a model (`module`, in eval mode, no gradients), updated after each optimizer step."""

    def __init__(self, model: nn.Module, decay: float, warmup: bool = True) -> None:
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self.decay, self.warmup, self.updates = decay, warmup, 0
        pairs = list(zip(self.module.state_dict().values(), model.state_dict().values()))
        self.floats = [(a, m) for a, m in pairs if a.is_floating_point()]
        self.others = [(a, m) for a, m in pairs if not a.is_floating_point()]  # counters: copied

    @torch.no_grad()
    def update(self) -> None:
        """One step of the average toward the model's current state, queued on the device (no host sync)."""
        d = ema_decay(self.decay, self.updates, self.warmup)
        torch._foreach_lerp_([a for a, _ in self.floats], [m.detach() for _, m in self.floats], 1 - d)
        if self.others:
            torch._foreach_copy_([a for a, _ in self.others], [m for _, m in self.others])
        self.updates += 1

    def state_dict(self) -> dict:
        return {"updates": self.updates, "module": self.module.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        self.updates = int(state["updates"])
