"""The models a config can name: the job's own registry, every classification model torchvision has, and a user's
own nn.Module named as package.module:ClassName.

Two optional hooks let a model say more than its layers, for its own and users' models alike:
- `init_from_data(images)`: called once before a fresh run trains, with the first training images as the model will
  see them (normalised, not augmented, on its device), for an initialisation that depends on the data.
- `param_epochs`: {parameter name: epochs}; such a parameter's learning rate goes to 0 after that many epochs, so
  the optimizer (its gradient, weight decay and momentum) stops moving it (lookahead, when on, still averages it).
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from job.config.model import own_class
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


class CifarFast(nn.Module):
    """A CIFAR-10 network of the speed-record kind (after the published airbench94 recipe): a 2x2 convolution
    whitening the image's patches, fixed from the data's patch covariance (its bias trains for `whiten_bias_epochs`
    epochs), three groups of conv-pool-norm-GELU-conv-norm-GELU, a max-pool and a linear layer scaled by `scale`.
    Convolutions start as identities (Dirac) on the channels they keep; batch norms have no scale, only a bias."""

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 3,
        widths: tuple[int, int, int] = (64, 256, 256),
        norm_momentum: float = 0.4,
        scale: float = 1 / 9,
        whiten_bias_epochs: int = 3,
    ) -> None:
        super().__init__()
        whiten_width = 2 * in_channels * 2 * 2  # each of the patch's directions, positive and negative
        self.whiten = nn.Conv2d(in_channels, whiten_width, 2, padding=0, bias=True)
        self.whiten.weight.requires_grad_(False)
        nn.init.zeros_(self.whiten.bias)
        groups, width = [], whiten_width
        for out in widths:
            groups.append(ConvGroup(width, out, norm_momentum))
            width = out
        self.groups = nn.Sequential(*groups)
        self.head = nn.Linear(width, num_classes, bias=False)
        self.scale = scale
        self.param_epochs = {"whiten.bias": whiten_bias_epochs}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.groups(F.gelu(self.whiten(x)))
        x = F.adaptive_max_pool2d(x, 1).flatten(1)
        return self.head(x) * self.scale

    @torch.no_grad()
    def init_from_data(self, images: torch.Tensor, eps: float = 5e-4) -> None:
        """The whitening filters: the eigenvectors of the 2x2 patches' covariance, each scaled by 1/sqrt(its
        eigenvalue + eps), and their negatives, largest first."""
        c, k = self.whiten.in_channels, self.whiten.kernel_size[0]
        cov = torch.zeros(c * k * k, c * k * k, dtype=torch.float64, device=images.device)
        count = 0
        for chunk in images.split(500):
            patches = chunk.float().unfold(2, k, 1).unfold(3, k, 1)  # N, C, H', W', k, k
            flat = patches.permute(0, 2, 3, 1, 4, 5).reshape(-1, c * k * k).double()
            cov += flat.T @ flat
            count += flat.shape[0]
        values, vectors = torch.linalg.eigh(cov / max(count, 1))
        values, vectors = values.flip(0), vectors.T.flip(0)
        filters = (vectors / (values.clamp_min(0) + eps).sqrt()[:, None]).reshape(-1, c, k, k)
        self.whiten.weight.copy_(torch.cat([filters, -filters]).to(self.whiten.weight))


class ConvGroup(nn.Sequential):
    """conv, max-pool, batch norm, GELU, conv, batch norm, GELU: CifarFast's unit."""

    def __init__(self, channels_in: int, channels_out: int, norm_momentum: float) -> None:
        super().__init__(
            dirac_conv(channels_in, channels_out),
            nn.MaxPool2d(2),
            bias_norm(channels_out, norm_momentum),
            nn.GELU(),
            dirac_conv(channels_out, channels_out),
            bias_norm(channels_out, norm_momentum),
            nn.GELU(),
        )


def dirac_conv(channels_in: int, channels_out: int) -> nn.Conv2d:
    """A 3x3 'same' convolution without bias, initialised as torch does and then as the identity on its first
    channels_in outputs."""
    conv = nn.Conv2d(channels_in, channels_out, 3, padding="same", bias=False)
    with torch.no_grad():
        nn.init.dirac_(conv.weight[: min(channels_in, channels_out)])
    return conv


def bias_norm(channels: int, momentum: float) -> nn.BatchNorm2d:
    """Batch norm with a trained bias and a scale held at 1."""
    norm = nn.BatchNorm2d(channels, eps=1e-12, momentum=momentum)
    norm.weight.requires_grad_(False)
    return norm


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


SMALL_IMAGES = 64  # resnet18 takes the small stem for images this size or smaller (CIFAR's 32 px, not photos' 96)


def small_stem(cfg, shape: tuple[int, ...]) -> bool:
    """resnet18's stem: as model.small_stem says; otherwise the small one for small images (a 32 px image would
    shrink to 1x1 through the 7x7 stride-2 stem and max-pool), the 7x7 one for larger images (the small stem would
    keep a 96 px photo at full size through the first stage: several times the work) and for pretrained weights,
    which were made with it."""
    if cfg.small_stem is not None:
        return cfg.small_stem
    return not cfg.weights and max(shape[1:], default=0) <= SMALL_IMAGES


def describe(cfg, shape: tuple[int, ...]) -> str:
    """What the start-up line says of a choice made for the data, or ''."""
    if cfg.name != "resnet18":
        return ""
    if small_stem(cfg, shape):
        return " with the small stem (3x3 stride 1, no max-pool: for small images)"
    return " with the 7x7 stride-2 stem"


MODELS: dict[str, Callable[..., nn.Module]] = {
    "mlp": lambda cfg, shape, n: mlp(shape, cfg.hidden, n),
    "cifar_cnn": lambda cfg, shape, n: CifarCNN(n, shape[0]),
    "resnet18": lambda cfg, shape, n: resnet18(n, shape[0], small_stem(cfg, shape)),
    "cifar_fast": lambda cfg, shape, n: own_kwargs(CifarFast, cfg, num_classes=n, in_channels=shape[0]),
}

# Heads torchvision adds for auxiliary losses in training; the job trains on the main output alone.
AUX_HEADS = {"googlenet": ("aux1.", "aux2."), "inception_v3": ("AuxLogits.",)}


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


def own_kwargs(factory: Callable[..., nn.Module], cfg, **given) -> nn.Module:
    """A model built with model.kwargs over what the data gives it (`given`, which model.kwargs may override)."""
    kwargs = {**given, **cfg.kwargs}
    try:
        return factory(**kwargs)
    except TypeError as e:
        raise ConfigError(f"model.kwargs: {cfg.name} does not take {kwargs}: {one_line(e)}") from None


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
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    model = own_kwargs(factory, cfg, **({"num_classes": num_classes} if "num_classes" in params else {}))
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
