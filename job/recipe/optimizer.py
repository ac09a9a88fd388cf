"""The optimizer a config asks for: torch.optim's SGD or AdamW over the model's parameter groups (normalisation layers,
blocks below the class layer and parameters that train for some epochs apart), fused where it should be."""

from __future__ import annotations

import torch
from torch import nn

from job.config import Config
from job.errors import ConfigError


def make_optimizer(cfg: Config, model: nn.Module, fused: bool = False) -> torch.optim.Optimizer:
    """`fused` (CUDA with fp16): one kernel per step, which also takes fp16's loss scale and overflow flag on the
    device, so GradScaler never waits for the GPU (with the other kernels it reads the flag on the host every step)."""
    o = cfg.optim
    how = {"fused": True} if fused else {}
    params = param_groups(cfg, model)
    if o.name == "adamw":
        return torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay, **how)
    if o.nesterov and o.momentum == 0:
        raise ConfigError("optim.nesterov: needs optim.momentum > 0")
    how |= {"momentum": o.momentum, "nesterov": o.nesterov}
    return torch.optim.SGD(params, lr=o.lr, weight_decay=o.weight_decay, **how)


# The normalisation layers (their torch classes by name: torch's common base of them is not public)
NORMS = (
    *(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm),
    *(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LayerNorm, nn.GroupNorm),
)


def param_groups(cfg: Config, model: nn.Module) -> list:
    """The trainable parameters, in one group (a plain list) unless some train otherwise: normalisation layers' at
    optim.norm_lr_scale times the rate (their weight decay divided by it, so that decay per step, rate times decay,
    is the same), those the model's `param_epochs` names, marked with their epochs, each block below the class layer
    at its optim.layer_decay rate, and with train.finetune_stages all but the class layer marked to start after
    them. A frozen backbone's parameters are left out (no optimizer state)."""
    o = cfg.optim
    limits = dict(getattr(model, "param_epochs", None) or {})
    named = dict(model.named_parameters())
    if unknown := sorted(set(limits) - set(named)):
        raise ConfigError(f"model {cfg.model.name}: param_epochs names no parameter of it: {', '.join(unknown)}")
    norms = {id(p) for m in model.modules() if isinstance(m, NORMS) for p in m.parameters(recurse=False)}
    depth = layer_depths(named)
    stages = cfg.train.finetune_stages
    if o.layer_decay == 1:  # one rate for every block: only the class layer apart, and that only for the stages
        depth = {name: min(below, 1) if stages else 0 for name, below in depth.items()}
    groups: dict[tuple, list] = {(False, None, 0): []}  # the plain group first: its rate is the one logged
    for name, p in named.items():
        if p.requires_grad:
            norm = o.norm_lr_scale != 1 and id(p) in norms
            groups.setdefault((norm, limits.get(name), depth[name]), []).append(p)
    if len(groups) == 1 and not stages:
        return groups[(False, None, 0)]
    out = []
    for (norm, epochs, below), params in groups.items():
        scale = o.norm_lr_scale if norm else 1.0
        layer = o.layer_decay**below
        group = {"params": params, "lr": o.lr * scale * layer, "weight_decay": o.weight_decay / scale}
        group |= {"lr_scale": scale * layer} | ({"train_epochs": epochs} if epochs is not None else {})
        out.append(group | ({"from_epochs": stages} if stages and below else {}))
    return [g for g in out if g["params"]]


def layer_depths(named: dict[str, nn.Parameter]) -> dict[str, int]:
    """Each parameter's block's place below the class layer (0: the class layer itself). A block is the module two
    names deep (layer3.1, features.4, conv1), in the order the model holds them; the class layer is the block of the
    model's last parameter, as torchvision's classifiers and the job's models end on it."""
    blocks = {name: ".".join(name.split(".")[:-1][:2]) for name in named}
    order = list(dict.fromkeys(blocks.values()))
    head = blocks[next(reversed(named))] if named else ""
    below = {b: 0 if b == head else max(order.index(head) - i, 1) for i, b in enumerate(order)}
    return {name: below[b] for name, b in blocks.items()}


def prime_momentum(optimizer: torch.optim.Optimizer) -> None:
    """Zero momentum buffers for fused SGD before its first step. Its first step otherwise makes them uninitialised
    and fills them in the kernel, which fp16's loss scaler skips on an overflow, leaving them uninitialised. With
    no dampening, a zero buffer's first update is the gradient itself, as SGD's first step is."""
    for group in optimizer.param_groups:
        if isinstance(optimizer, torch.optim.SGD) and group.get("fused") and group["momentum"]:
            for p in group["params"]:
                optimizer.state[p].setdefault(
                    "momentum_buffer", torch.zeros_like(p, memory_format=torch.preserve_format)
                )
