"""model: which network, its pretrained weights and its constructor's arguments. The names a model may have are the
config's to check (the job's own, torchvision's classification models, package.module:ClassName); the recipe builds
them (job/recipe/models.py, weights.py)."""

from __future__ import annotations

import difflib
import functools
import re
from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from job.config.section import Section
from job.errors import ConfigError

USER_MODEL_HINT = "package.module:ClassName"
JOB_MODELS = ("mlp", "cifar_cnn", "cifar_fast", "resnet18")  # the job's own models (job/recipe/models.py builds them)
# How a torchvision weights name looks: DEFAULT, IMAGENET1K_V2, or ResNet50_Weights.IMAGENET1K_V2.
TORCHVISION_NAME = re.compile(r"^(?:[A-Za-z0-9_]+_Weights\.)?[A-Z][A-Z0-9_]*$")


class ModelConfig(Section):
    name: str = Field(
        "mlp",
        description="mlp, cifar_cnn, cifar_fast, resnet18, any classification model torchvision has (resnet50, "
        f"mobilenet_v3_small, efficientnet_b0, vit_b_16, ...), or {USER_MODEL_HINT} for your own nn.Module.",
    )
    weights: str = Field(
        "",
        description="Pretrained weights: a torchvision weights name of the model (DEFAULT, IMAGENET1K_V2, ...; "
        "downloaded once into the job's cache, and their preprocessing becomes the data's default), or the URL of a "
        "state_dict file (.pt/.pth: local path, gs://, http(s)://, a Drive path), read without running code. "
        "Layers whose shape does not fit the data's classes are replaced.",
    )
    freeze_backbone: bool = Field(
        False,
        description="With model.weights: train only the layers replaced to fit the classes (else the class layer); "
        "the rest keep the loaded weights, their batch-norm statistics included.",
    )
    hidden: list[int] = Field([10], description="mlp: hidden layer sizes (ReLU between layers).")
    small_stem: bool | None = Field(
        None,
        description="resnet18: 3x3 stride-1 stem without max-pool, for small images; default: on for images of 64 "
        "px or less, off for larger ones and with model.weights (pretrained weights have the 7x7 stem).",
    )
    kwargs: dict[str, Any] = Field(
        {}, description=f"{USER_MODEL_HINT}, torchvision models and cifar_fast: keyword arguments of the constructor."
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        check_name(v)
        return v

    @field_validator("weights")
    @classmethod
    def _weights(cls, v: str, info: ValidationInfo) -> str:
        if v and "name" in info.data and is_torchvision_name(v):
            try:
                torchvision_weights(info.data["name"], v)
            except ConfigError as e:
                raise ValueError(str(e).removeprefix("model.weights: ")) from None
        return v

    @field_validator("freeze_backbone")
    @classmethod
    def _freeze(cls, v: bool, info: ValidationInfo) -> bool:
        if v and not info.data.get("weights"):
            raise ValueError("needs model.weights: a backbone to keep")
        return v

    @field_validator("hidden")
    @classmethod
    def _hidden(cls, v: list[int]) -> list[int]:
        if any(h <= 0 for h in v):
            raise ValueError("expected positive layer sizes")
        return v


@functools.cache
def torchvision_models() -> tuple[str, ...]:
    """The classification models torchvision builds by name (its detection, video and quantized ones aside)."""
    import torchvision

    return tuple(torchvision.models.list_models(module=torchvision.models))


def own_class(name: str) -> bool:
    """Whether model.name names the user's own class (package.module:ClassName)."""
    return ":" in name


def check_name(name: str) -> None:
    """ValueError for a name that is none of the job's models, torchvision's, or package.module:ClassName."""
    if name in JOB_MODELS or (own_class(name) and all(part.strip() for part in name.split(":", 1))):
        return
    if name in torchvision_models():
        return
    close = difflib.get_close_matches(name, [*JOB_MODELS, *torchvision_models()], n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise ValueError(
        f"unknown model {name!r} ({hint}the job's {', '.join(JOB_MODELS)}, any of torchvision's "
        f"{len(torchvision_models())} classification models such as resnet50 or mobilenet_v3_small, or "
        "package.module:ClassName)"
    )


def is_torchvision_name(weights: str) -> bool:
    """Whether model.weights names torchvision weights (else it is the URL of a state_dict file)."""
    return bool(TORCHVISION_NAME.match(weights))


def torchvision_weights(model_name: str, weights: str):
    """The member of torchvision's weights enum that model.weights names for model.name; ConfigError when the name
    does not belong to the model."""
    import torchvision

    try:
        enum = torchvision.models.get_model_weights(model_name)
    except (ValueError, KeyError):
        raise ConfigError(
            f"model.weights: a torchvision weights name ({weights}) needs a torchvision model, and {model_name} is "
            "not one; give the URL of a state_dict file"
        ) from None
    member = weights.rpartition(".")[2]
    if "." in weights and weights.partition(".")[0] != enum.__name__:
        raise ConfigError(f"model.weights: the weights {weights} are not {model_name}'s ({enum.__name__})")
    try:
        return enum[member]
    except KeyError:
        known = ", ".join(enum.__members__)
        raise ConfigError(f"model.weights: {model_name} has no weights {member} (it has {known})") from None
