"""The whole config: its sections, read from a preset or YAML at any URL with `--set` overrides, validated, and its
keys listed and flattened. Validation errors name the key path and what was expected, in one line."""

from __future__ import annotations

import difflib
from importlib import resources
from typing import Any, get_origin

import yaml
from pydantic import BaseModel, Field, ValidationError

from job.config.data import DataConfig
from job.config.model import ModelConfig
from job.config.optim import OptimConfig
from job.config.output import OutputConfig, TrackConfig
from job.config.section import Section
from job.config.train import TrainConfig
from job.errors import ConfigError, StorageError
from job.storage.cloud import describe_storage_error, filesystem

PRESETS = ("iris", "cifar10", "cifar10-fast", "finetune", "photos")
PRESET_LIST = ", ".join(PRESETS)


class Config(Section):
    name: str = Field("run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="Run name.")
    seed: int = Field(0, description="Seed of weights, data order and augmentation.")
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    output: OutputConfig = OutputConfig()
    track: TrackConfig = TrackConfig()


def load_config(source: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The validated config from a preset name or URL (default: the iris preset) with `key=value` overrides."""
    raw = read_yaml(source or "iris")
    for item in overrides:
        apply_override(raw, item)
    return validate(raw)


def read_yaml(source: str) -> dict[str, Any]:
    if source in PRESETS:
        text = (resources.files("job.presets") / f"{source}.yaml").read_text()
    else:
        try:
            fs, path = filesystem(source)
            with fs.open(path, "rb") as f:
                text = f.read().decode("utf-8-sig")
        except FileNotFoundError:
            raise ConfigError(f"config {source}: no such file, and not a preset ({PRESET_LIST})") from None
        except IsADirectoryError:
            raise ConfigError(f"config {source}: is a folder, not a YAML file (or a preset: {PRESET_LIST})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config {source}: not a text file (not UTF-8)") from None
        except Exception as e:  # the stores' clients raise many types
            raise StorageError(f"config: cannot read it: {describe_storage_error(source, e)}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config {source}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config {source}: expected a mapping of sections, got {type(raw).__name__}")
    return raw


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set `a.b=value` in the raw config; the value is parsed as YAML (numbers, booleans, lists)."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item}: expected key=value, e.g. --set train.epochs=5")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    parts = key.strip().split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def validate(raw: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError("; ".join(describe_error(err) for err in e.errors())) from None


def describe_error(err: dict[str, Any]) -> str:
    """One readable phrase for a pydantic error: the key path, what was expected, what was given."""
    loc = [str(p) for p in err["loc"]]
    path = ".".join(loc)
    if err["type"] == "extra_forbidden":
        known = list(_section_at(loc[:-1]).model_fields)
        close = difflib.get_close_matches(loc[-1], known, n=1)
        hint = f"did you mean {'.'.join(loc[:-1] + close)}?" if close else f"known keys: {', '.join(known)}"
        return f"{path}: unknown key ({hint})"
    msg = err["msg"].removeprefix("Value error, ")
    # Union members add their own tag to the path (batch_size.int); keep the user's key path.
    while loc and not _is_field(loc):
        loc.pop()
    path = ".".join(loc) or "config"
    given = err.get("input")
    shown = "" if isinstance(given, dict) else f", got {given!r}"
    return f"{path}: {msg[0].lower() + msg[1:]}{shown}"


def _section_at(loc: list[str]) -> type[BaseModel]:
    model: type[BaseModel] = Config
    for part in loc:
        model = model.model_fields[part].annotation  # type: ignore[assignment]
    return model


def _is_field(loc: list[str]) -> bool:
    model: Any = Config
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return False
        model = model.model_fields[part].annotation
    return True


def check_setting(key: str, given: str) -> None:
    """Refuse a dotted key that names no setting, naming the closest ones; `given`: how the user wrote it."""
    if names_setting(key):
        return
    keys = setting_keys()
    if close := difflib.get_close_matches(key, keys, n=3, cutoff=0.5):
        hint = f"closest: {', '.join(close)}"
    else:
        sections = dict.fromkeys(k.split(".")[0] for k in keys if "." in k)
        hint = f"none close to it; keys are section.key, of the sections {', '.join(sections)}"
    raise ConfigError(f"{given}: names no config key ({hint})")


def names_setting(key: str) -> bool:
    """Whether a dotted key names a setting, or a key inside a mapping setting (model.kwargs.NAME)."""
    model: Any = Config
    for part in key.split("."):
        if get_origin(model) is dict:
            return True
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return False
        model = model.model_fields[part].annotation
    return not (isinstance(model, type) and issubclass(model, BaseModel))


def setting_keys(section: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """Every setting's key, as section.key, in the config's order."""
    keys = []
    for name, field in (section or Config).model_fields.items():
        kind = field.annotation
        is_section = isinstance(kind, type) and issubclass(kind, BaseModel)
        keys += setting_keys(kind, f"{prefix}{name}.") if is_section else [prefix + name]
    return keys


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def flat_items(cfg: Config) -> dict[str, Any]:
    """`section.key: value` for every setting, lists and dicts as text (TensorBoard hparams take scalars)."""
    out: dict[str, Any] = {}
    for section, values in cfg.model_dump().items():
        if not isinstance(values, dict):
            out[section] = values
            continue
        for key, value in values.items():
            out[f"{section}.{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return out
