"""A sweep's space file, read and checked against the config before any work: what is searched, how, and on which
metric."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from job.config import Config, load_config, read_yaml
from job.errors import ConfigError
from job.recorded import possible_scores

SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("none", "median", "hyperband")


@dataclass(frozen=True)
class Range:
    """A parameter drawn from [low, high]: integers when both ends are, on a log scale when `log`."""

    low: float
    high: float
    log: bool = False


@dataclass(frozen=True)
class Space:
    """The space file, read and checked: what is searched, how, and on which metric."""

    name: str
    metric: str
    direction: str
    trials: int
    sampler: str
    seed: int
    pruner: str
    params: dict[str, Range | list]


def read_space(url: str, trials: int | None, cfg: Config, config: str, overrides: list[str]) -> Space:
    """The space file at `url`, every key checked against the config before any work: one line for the first
    fault."""
    try:
        raw = read_yaml(url)
    except ConfigError as e:
        raise ConfigError(f"space {str(e).removeprefix('config ')}") from None
    known = {"name", "metric", "direction", "trials", "sampler", "pruner", "space"}
    if unknown := sorted(set(raw) - known):
        raise ConfigError(f"space {url}: unknown key {unknown[0]} (known: {', '.join(sorted(known))})")
    written = metrics_written(cfg)
    if not written:
        raise ConfigError(
            "space metric: a sweep chooses its trials on the val split, and this config holds none out (the test "
            "split is only reported): set data.val_split, e.g. --set data.val_split=0.2"
        )
    metric = str(raw.get("metric", written[1]))  # val_accuracy, or val_map for multi-label
    if metric not in written:
        raise ConfigError(f"space metric: the run never writes {metric!r} for val; it writes {', '.join(written)}")
    lowest = "minimize" if metric.endswith("_loss") else "maximize"  # as the run chooses on it (train.choose_on)
    direction = str(raw.get("direction", lowest))
    if direction not in ("maximize", "minimize"):
        raise ConfigError(f"space direction: expected maximize or minimize, got {direction!r}")
    if direction != lowest:
        raise ConfigError(
            f"space direction: {metric} is better {'lower' if lowest == 'minimize' else 'higher'}: {lowest}"
        )
    sampler = raw.get("sampler") or {}
    sampler = {"name": sampler} if isinstance(sampler, str) else sampler
    if not isinstance(sampler, dict) or sampler.get("name", "tpe") not in SAMPLERS:
        raise ConfigError(f"space sampler: expected {{name: {'|'.join(SAMPLERS)}, seed: N}}, got {sampler!r}")
    seed = sampler.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ConfigError(f"space sampler.seed: expected an integer, got {seed!r}")
    pruner = str(raw.get("pruner") or "none").lower()
    if pruner not in PRUNERS:
        raise ConfigError(f"space pruner: expected one of {', '.join(PRUNERS)}, got {pruner!r}")
    params = {str(k): read_param(str(k), v) for k, v in (raw.get("space") or {}).items()}
    if not params:
        raise ConfigError(f"space {url}: no parameters under space: (e.g. optim.lr: {{low: 0.001, high: 0.1}})")
    for key, param in params.items():  # each value the trials may set, as --set would set it: names close keys
        for value in [param.low, param.high] if isinstance(param, Range) else param:
            try:
                load_config(config, [*overrides, setting(key, value)])
            except ConfigError as e:
                raise ConfigError(f"space: {e}") from None
    n = trials if trials is not None else raw.get("trials", 10)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"trials: expected a whole number > 0, got {n!r}")
    name = sampler.get("name", "tpe")
    if name == "grid":
        if ranged := [k for k, p in params.items() if isinstance(p, Range)]:
            raise ConfigError(f"space {ranged[0]}: a grid takes lists of values, not a range")
        size = 1
        for p in params.values():
            size *= len(p)
        n = min(n, size)  # a grid is done when each point has been tried once
    study = str(raw.get("name") or f"{cfg.name}-sweep")
    return Space(study, metric, direction, n, name, seed, pruner, params)


def read_param(key: str, v: Any) -> Range | list:
    if isinstance(v, list):
        if not v:
            raise ConfigError(f"space {key}: an empty list of values")
        return v
    if not isinstance(v, dict) or set(v) - {"low", "high", "log"} or not {"low", "high"} <= set(v):
        raise ConfigError(f"space {key}: expected {{low: A, high: B[, log: true]}} or a list of values, got {v!r}")
    low, high, log = v["low"], v["high"], bool(v.get("log", False))
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (low, high)):
        raise ConfigError(f"space {key}: low and high must be numbers, got {low!r} and {high!r}")
    if not low < high:
        raise ConfigError(f"space {key}: an empty or reversed range (low {low} is not below high {high})")
    if log and low <= 0:
        raise ConfigError(f"space {key}: a log range needs low > 0, got {low}")
    return Range(low, high, log)


def metrics_written(cfg: Config) -> list[str]:
    """The val scores of the run's evaluation records (job/recorded.py), which a sweep may choose its trials on, as
    each trial's run chooses its model on it (train.choose_on): for the task and number of classes where the config
    says them, else all a run of it may write (the run checks again once it has read its data). None where the config
    holds no val split out (a folder's own val/ cannot be known before reading it)."""
    tables = cfg.data.kind in ("csv", "cifar10")  # no val of their own: val only when val_split holds one out
    if tables and not cfg.data.val_split:
        return []
    task = False if tables else {"multiclass": False, "multilabel": True}.get(cfg.data.task)
    return [f"val_{m}" for m in possible_scores(task, 10 if cfg.data.kind == "cifar10" else None)]


def setting(key: str, value: Any) -> str:
    """An override as --set takes it; JSON is YAML, and a float's repr reads back exactly."""
    return f"{key}={json.dumps(value)}"
