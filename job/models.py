"""The models a config can name: the job's own registry, every classification model torchvision has, and a user's
own nn.Module named as package.module:ClassName."""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import math
from collections.abc import Callable

import torch
from torch import nn

from job.errors import ConfigError, one_line


class CifarCNN(nn.Sequential):
    """The tutorials' CIFAR-10 network, layer for layer (no activations between layers, as they wrote it)."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__(
            nn.Conv2d(in_channels, 32, 5, 1, 2),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 5, 1, 2),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, 1, 2),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(64 * 4 * 4, 64),
            nn.Linear(64, num_classes),
        )


def mlp(input_shape: tuple[int, ...], hidden: list[int], num_classes: int) -> nn.Sequential:
    """Linear layers with ReLU between them (inputs flattened): the tutorials' Iris net is mlp((4,), [10], 3)."""
    sizes = [math.prod(input_shape), *hidden]
    layers: list[nn.Module] = [nn.Flatten()] if len(input_shape) > 1 else []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(sizes[-1], num_classes))


def resnet18(num_classes: int, in_channels: int, small_stem: bool) -> nn.Module:
    """torchvision's ResNet-18; the small stem (3x3 stride 1, no max-pool) keeps 32x32 inputs from shrinking to 1x1."""
    import torchvision

    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    if small_stem or in_channels != 3:
        stride, kernel = (1, 3) if small_stem else (2, 7)
        model.conv1 = nn.Conv2d(in_channels, 64, kernel, stride, kernel // 2, bias=False)
    if small_stem:
        model.maxpool = nn.Identity()
    return model


def small_stem(cfg) -> bool:
    """resnet18's stem: small unless asked otherwise, or unless pretrained weights (made with the 7x7 stem) load."""
    return cfg.small_stem if cfg.small_stem is not None else not cfg.weights


MODELS: dict[str, Callable[..., nn.Module]] = {
    "mlp": lambda cfg, shape, n: mlp(shape, cfg.hidden, n),
    "cifar_cnn": lambda cfg, shape, n: CifarCNN(n, shape[0]),
    "resnet18": lambda cfg, shape, n: resnet18(n, shape[0], small_stem(cfg)),
}

# Heads torchvision adds for auxiliary losses in training; the job trains on the main output alone.
AUX_HEADS = {"googlenet": ("aux1.", "aux2."), "inception_v3": ("AuxLogits.",)}


@functools.cache
def torchvision_models() -> tuple[str, ...]:
    """The classification models torchvision builds by name (its detection, video and quantized ones aside)."""
    import torchvision

    return tuple(torchvision.models.list_models(module=torchvision.models))


def own_class(name: str) -> bool:
    """Whether model.name names the user's own class (package.module:ClassName)."""
    return ":" in name


def check_name(name: str) -> None:
    """ConfigError for a name that is none of the job's models, torchvision's, or package.module:ClassName."""
    if name in MODELS or (own_class(name) and all(part.strip() for part in name.split(":", 1))):
        return
    if name in torchvision_models():
        return
    close = difflib.get_close_matches(name, [*MODELS, *torchvision_models()], n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise ValueError(
        f"unknown model {name!r} ({hint}the job's {', '.join(MODELS)}, any of torchvision's "
        f"{len(torchvision_models())} classification models such as resnet50 or mobilenet_v3_small, or "
        "package.module:ClassName)"
    )


def build_model(cfg, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The model the config names, checked with one forward pass on a sample of the data's shape."""
    if cfg.name in MODELS:
        model = MODELS[cfg.name](cfg, input_shape, num_classes)
    elif own_class(cfg.name):
        model = user_model(cfg, num_classes)
    else:
        model = torchvision_model(cfg, num_classes)
    check_shapes(model, cfg.name, input_shape, num_classes)
    return model


def torchvision_model(cfg, num_classes: int) -> nn.Module:
    """A torchvision classification model with `num_classes` outputs, freshly initialised (model.weights loads
    after), built with model.kwargs; without the auxiliary training heads of GoogLeNet and Inception v3."""
    import torchvision

    kwargs = {"num_classes": num_classes, **cfg.kwargs}
    if cfg.name in AUX_HEADS:
        kwargs.setdefault("aux_logits", False)
        kwargs.setdefault("init_weights", True)
    try:
        return torchvision.models.get_model(cfg.name, weights=None, **kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model.kwargs: torchvision's {cfg.name} does not take {kwargs}: {one_line(e)}") from None


def user_model(cfg, num_classes: int) -> nn.Module:
    """Import package.module:ClassName from PYTHONPATH and build it with model.kwargs (num_classes if it takes one)."""
    module_name, _, attr = cfg.name.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except ImportError as e:
        raise ConfigError(f"model.name: cannot import {module_name}: {one_line(e)}") from None
    except AttributeError:
        raise ConfigError(f"model.name: {module_name} has no {attr}") from None
    kwargs = dict(cfg.kwargs)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    if "num_classes" in params and "num_classes" not in kwargs:
        kwargs["num_classes"] = num_classes
    try:
        model = factory(**kwargs)
    except TypeError as e:
        raise ConfigError(f"model.kwargs: {cfg.name} does not take {kwargs}: {one_line(e)}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.name: {cfg.name} built a {type(model).__name__}, not a torch.nn.Module")
    return model


def check_shapes(model: nn.Module, name: str, input_shape: tuple[int, ...], num_classes: int) -> None:
    """Fail before training when the model cannot take the data's inputs or gives the wrong number of outputs."""
    was_training = model.training
    model.eval()
    shape = "x".join(map(str, input_shape))
    try:
        with torch.no_grad():
            out = model(torch.zeros(2, *input_shape))
    except RuntimeError as e:
        raise ConfigError(f"model {name} cannot take the data's inputs ({shape}): {one_line(e)}") from None
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(f"model {name}: outputs {got} for 2 inputs of {shape}; expected (2, {num_classes}) logits")
