"""Pretrained weights (model.weights): a torchvision weights name or the URL of a state_dict file, fitted to the
data's classes, and the backbone frozen when the config asks.

A torchvision name resolves to its download URL and its preprocessing (input size, resize, mean and std), which
become the data's defaults. Files are read with torch.load(weights_only=True), so a weights file never runs code.
Downloads over http(s) are kept in the job's cache ($JOB_CACHE_DIR/weights), so a second run reads them from disk.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from torch import nn

from job.config.model import is_torchvision_name, torchvision_weights
from job.console import say
from job.errors import CheckpointError, ConfigError, StorageError, one_line
from job.storage.cloud import describe_storage_error, filesystem

NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


@dataclass(frozen=True)
class Weights:
    """Where pretrained weights come from, and (for torchvision's) the preprocessing they were trained with."""

    source: str  # as the config gave it
    url: str  # what is read: a download URL, or the file's own URL
    name: str = ""  # torchvision's full name (ResNet50_Weights.IMAGENET1K_V2); empty for a file
    crop_size: int | None = None
    resize_size: int | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    hash_prefix: str | None = None  # torchvision's files carry the start of their sha256 in their name


def resolve(model_name: str, weights: str) -> Weights | None:
    """The weights model.weights names for model.name (None when it names none); ConfigError when a torchvision
    name does not belong to the model."""
    if not weights:
        return None
    if not is_torchvision_name(weights):
        return Weights(source=weights, url=weights)
    w = torchvision_weights(model_name, weights)
    t = w.transforms()
    found = torch.hub.HASH_REGEX.search(Path(urlparse(w.url).path).name)
    return Weights(
        source=weights,
        url=w.url,
        name=f"{type(w).__name__}.{w.name}",
        crop_size=t.crop_size[0],
        resize_size=t.resize_size[0],
        mean=tuple(t.mean),
        std=tuple(t.std),
        hash_prefix=found.group(1) if found else None,
    )


def read_state(w: Weights, cache: Path) -> dict[str, torch.Tensor]:
    """The weights' state_dict, on the CPU: downloaded once into `cache` (http, https), else read from their URL."""
    scheme = urlparse(w.url).scheme
    if scheme in ("http", "https"):
        data = download(w, cache).read_bytes()
    else:
        try:
            fs, path = filesystem(w.url)
            with fs.open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise ConfigError(f"model.weights: {w.url}: no such file") from None
        except IsADirectoryError:
            raise ConfigError(f"model.weights: {w.url} is a folder, not a weights file") from None
        except Exception as e:  # the stores' clients raise many types
            raise StorageError(f"model.weights: cannot read it: {describe_storage_error(w.url, e)}") from None
    return to_state_dict(data, w.source)


def at_hand(cfg, cache: Path) -> None:
    """model.weights ready before anything else is read: downloaded into `cache` (http, https), or found at its URL;
    one that cannot be had is one line within seconds, not after the data is decoded."""
    w = resolve(cfg.name, cfg.weights)
    if w is None:
        return
    if urlparse(w.url).scheme in ("http", "https"):
        download(w, cache)
        return
    try:
        fs, path = filesystem(w.url)
        kind = fs.info(path)["type"]
    except FileNotFoundError:
        raise ConfigError(f"model.weights: {w.url}: no such file") from None
    except Exception as e:  # the stores' clients raise many types
        raise StorageError(f"model.weights: cannot read it: {describe_storage_error(w.url, e)}") from None
    if kind == "directory":
        raise ConfigError(f"model.weights: {w.url} is a folder, not a weights file")


def cache_path(w: Weights, cache: Path) -> Path:
    """Where the file at w.url is kept in `cache`: keyed by the URL, so two files of one name do not collide."""
    name = Path(urlparse(w.url).path).name or "weights.pt"
    return cache / f"{hashlib.sha256(w.url.encode()).hexdigest()[:12]}-{name}"


def download(w: Weights, cache: Path) -> Path:
    """The file at w.url in the cache, downloaded on first use (torch.hub's downloader: a temporary file renamed
    into place, torchvision's hash prefix checked)."""
    path = cache_path(w, cache)
    if path.is_file():
        say(f"weights: {w.name or w.url} from the cache ({path})")
        return path
    cache.mkdir(parents=True, exist_ok=True)
    say(f"weights: downloading {w.url} into {cache}")
    try:
        torch.hub.download_url_to_file(w.url, str(path), hash_prefix=w.hash_prefix, progress=True)
    except RuntimeError as e:  # the hash check
        raise StorageError(f"model.weights: {w.url}: {one_line(e)}") from None
    except OSError as e:  # urllib's URLError and HTTPError are OSErrors
        raise StorageError(
            f"model.weights: cannot download {w.url} ({one_line(e)}; offline, or behind a firewall?): put that file "
            f'at {path}, or set model.weights to a copy of it (a local path or gs:// URL), or model.weights="" to '
            "train from scratch"
        ) from None
    return path


def to_state_dict(data: bytes, source: str) -> dict[str, torch.Tensor]:
    """A state_dict from a file's bytes: a bare one, one under "model" or "state_dict" (a training checkpoint,
    this job's included), with a DistributedDataParallel or torch.compile prefix taken off."""
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, AttributeError) as e:
        raise CheckpointError(
            f"model.weights: {source} is not a state_dict file torch.load can read without running code "
            f"(weights_only): {one_line(e)}"
        ) from None
    for key in ("model", "state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"model.weights: {source} holds no state_dict (a mapping of names to tensors)")
    for prefix in ("module.", "_orig_mod."):
        if all(k.startswith(prefix) for k in obj):
            obj = {k[len(prefix) :]: v for k, v in obj.items()}
    return obj


def fit(model: nn.Module, state: dict[str, torch.Tensor], num_classes: int, w: Weights, model_name: str) -> list[str]:
    """Load `state` into `model`, keeping the model's fresh layers where the weights' class count differs from the
    data's (the layers whose output is the class scores); returns those layers' names. ConfigError naming the first
    mismatching keys when the weights are another architecture's."""
    from job.recipe.models import AUX_HEADS

    own = model.state_dict()
    aux = AUX_HEADS.get(model_name, ())
    state = {k: v for k, v in state.items() if not (k.startswith(aux) and k not in own)} if aux else state
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        parts = [f"{len(missing)} missing ({', '.join(missing[:3])})" if missing else ""]
        parts.append(f"{len(unexpected)} unexpected ({', '.join(unexpected[:3])})" if unexpected else "")
        raise ConfigError(
            f"model.weights: {w.source} are not weights of {model_name}: keys {'; '.join(p for p in parts if p)}"
        )
    replaced, wrong = set(), []
    for k, t in own.items():
        s = state[k]
        if s.shape == t.shape:
            continue
        if t.ndim and t.shape[0] == num_classes and s.shape[1:] == t.shape[1:]:
            replaced.add(k.rpartition(".")[0])
        else:
            wrong.append(f"{k} is {tuple(s.shape)} in the file, {tuple(t.shape)} in the model")
    if wrong:
        raise ConfigError(f"model.weights: {w.source} do not fit {model_name}: {'; '.join(wrong[:2])}")
    model.load_state_dict({k: v for k, v in state.items() if k.rpartition(".")[0] not in replaced}, strict=False)
    return sorted(replaced)


def class_layer(model: nn.Module, num_classes: int) -> str:
    """The last layer that outputs the class scores (a Linear or a 1x1 Conv2d with num_classes outputs)."""
    found = ""
    for name, m in model.named_modules():
        if (isinstance(m, nn.Linear) and m.out_features == num_classes) or (
            isinstance(m, nn.Conv2d) and m.out_channels == num_classes
        ):
            found = name
    return found


def freeze_backbone(model: nn.Module, head: list[str]) -> int:
    """Train only the `head` layers: every other parameter stops taking gradients, and every other batch-norm layer
    normalises with its pretrained running statistics and leaves them as they are, in training as in evaluation.
    The frozen weights were trained against those statistics; updating them from small fine-tuning batches would
    shift what the frozen layers compute. Returns the number of trainable parameters."""
    inside = tuple(f"{h}." for h in head)
    trainable = 0
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(inside))
        trainable += p.numel() if p.requires_grad else 0
    for name, m in model.named_modules():
        if isinstance(m, NORMS) and not f"{name}.".startswith(inside):
            m.register_forward_pre_hook(keep_evaluating)
    return trainable


def keep_evaluating(module: nn.Module, args) -> None:
    """A frozen batch-norm layer runs as in evaluation whatever mode its model is in (model.pt keeps torchvision's
    layout, which replacing it with FrozenBatchNorm2d would not)."""
    module.training = False


def load_pretrained(cfg, model: nn.Module, num_classes: int, cache: Path) -> None:
    """model.weights loaded into `model` and, with model.freeze_backbone, all but the class layers frozen; says what
    was replaced and what trains."""
    w = resolve(cfg.name, cfg.weights)
    if w is None:
        return
    replaced = fit(model, read_state(w, cache), num_classes, w, cfg.name)
    what = w.name or w.url
    if replaced:
        say(f"weights: {what} loaded; {', '.join(replaced)} replaced to fit {num_classes} classes")
    else:
        say(f"weights: {what} loaded")
    if cfg.freeze_backbone:
        head = replaced or [class_layer(model, num_classes)]
        if not head[0]:
            raise ConfigError(f"model.freeze_backbone: {cfg.name} has no layer that outputs the {num_classes} classes")
        n = freeze_backbone(model, head)
        say(f"model.freeze_backbone: training {', '.join(head)} only ({n:,} parameters); batch-norm statistics frozen")
