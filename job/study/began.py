"""What a study began with, recorded in it by its first worker and held against every later one: its space (a changed
space is refused: its trials would not be one study's), its base config (a change is said, naming the keys) and its
sampler's settings, written out in full so that a study continued under another Optuna release draws the same
trials (Optuna 5 changed TPE's defaults)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from job.config import Config, flat_items
from job.console import say
from job.errors import ConfigError

if TYPE_CHECKING:
    import optuna

    from job.study.space import Space

EXTRA = "extra"  # user attr: a trial begun by two workers for the study's last slot, ended unrun
BEGAN = "began_with"  # study user attr: {"space": ..., "config": ..., "sampler": ...}
# TPE's settings, each named (Optuna 5 turned multivariate and constant liar on by default): constant liar (a running
# trial counted as a poor one, so that workers side by side do not draw alike), random draws for the first 10 trials,
# 24 candidates, and each parameter modelled alone: Optuna 5 also changed the joint (multivariate) model's kernel
# widths, and only the independent one draws alike under 4 and 5 (20 trials the same to 10 digits, 4.9.0 and 5.0.0).
TPE = {"multivariate": False, "constant_liar": True, "n_startup_trials": 10, "n_ei_candidates": 24}


def is_original(t: optuna.trial.FrozenTrial) -> bool:
    """A trial that drew its own parameters: neither a retry of a lost or failed one nor a worker's extra."""
    return "failed_trial" not in t.system_attrs and not t.user_attrs.get(EXTRA)


def original_index(trials: list, number: int) -> int:
    """How many original trials come before trial `number`: its place among the N."""
    return sum(1 for t in trials if t.number < number and is_original(t))


def space_record(space: Space) -> dict[str, Any]:
    """What makes a study's trials one study's: the metric, its direction, the pruner and the searched values (not N:
    `--trials` may raise it)."""
    params = {
        k: p if isinstance(p, list) else {"low": p.low, "high": p.high, "log": p.log} for k, p in space.params.items()
    }
    return {
        "metric": space.metric,
        "direction": space.direction,
        "pruner": space.pruner,
        "sampler": {"name": space.sampler, "seed": space.seed},
        "space": params,
    }


def sampler_record(space: Space) -> dict[str, Any]:
    return {"name": space.sampler, "seed": space.seed, **(TPE if space.sampler == "tpe" else {})}


def flat(doc: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in doc.items():
        out |= flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


def check_began_with(study: optuna.Study, space: Space, cfg: Config) -> dict[str, Any]:
    """Record what the study begins with, or hold this worker's space and config against what it began with: a
    changed space is refused (exit 2), a changed config said in one line. Returns the sampler's recorded settings."""
    mine = {"space": space_record(space), "config": flat_items(cfg), "sampler": sampler_record(space)}
    began = study.user_attrs.get(BEGAN)
    if began is None:
        study.set_user_attr(BEGAN, mine)
        return mine["sampler"]
    if began["space"] != mine["space"]:
        was, now = flat(began["space"]), flat(mine["space"])
        keys = sorted(k for k in was.keys() | now.keys() if was.get(k) != now.get(k))
        if all(t.user_attrs.get(EXTRA) for t in study.get_trials(deepcopy=False)):  # none trained: begin again
            say(f"space: differs from the one study {space.name} began with ({', '.join(keys)}); no trial has run")
            study.set_user_attr(BEGAN, mine)
            return mine["sampler"]
        raise ConfigError(
            f"space: differs from the one study {space.name} began with ({', '.join(keys)}): restore it, or give the "
            "space file another name: to begin a new study"
        )
    was, now = began["config"], mine["config"]
    if keys := sorted(k for k in was.keys() | now.keys() if was.get(k) != now.get(k)):
        changes = ", ".join(f"{k} {was.get(k)!r} -> {now.get(k)!r}" for k in keys[:6])
        more = f" and {len(keys) - 6} more" if len(keys) > 6 else ""
        say(f"config: differs from the one study {space.name} began with: {changes}{more}; trials from now on take it")
    return began["sampler"]


def make_sampler(record: dict[str, Any], grid: dict[str, list] | None = None):
    """The study's sampler from its recorded settings. TPE and random: made afresh for each trial, seeded by the seed
    and the trial's place among the originals, so that a restarted worker draws what one never stopped would, and two
    workers never draw alike for their different trials."""
    import numpy
    import optuna

    name, seed = record["name"], record["seed"]
    if name == "grid":  # its points are shuffled by its seed once and taken in trial order: one sampler
        return optuna.samplers.GridSampler(grid or {}, seed=seed)
    settings = {k: v for k, v in record.items() if k not in ("name", "seed")}

    def inner(place_seed: int) -> optuna.samplers.BaseSampler:
        if name == "random":
            return optuna.samplers.RandomSampler(seed=place_seed)
        return optuna.samplers.TPESampler(seed=place_seed, **settings)

    class PlaceSeeded(optuna.samplers.BaseSampler):
        def __init__(self) -> None:
            self.by_trial: dict[int, optuna.samplers.BaseSampler] = {}

        def of(self, study, trial) -> optuna.samplers.BaseSampler:
            if trial.number not in self.by_trial:
                place = original_index(study.get_trials(deepcopy=False), trial.number)
                # Mixed, not added: generators seeded 0, 1, 2, ... draw alike first values (Mersenne Twister).
                mixed = int(numpy.random.SeedSequence([seed, place]).generate_state(1)[0])
                self.by_trial = {trial.number: inner(mixed)}  # one trial at a time per worker
            return self.by_trial[trial.number]

        def infer_relative_search_space(self, study, trial):
            return self.of(study, trial).infer_relative_search_space(study, trial)

        def sample_relative(self, study, trial, search_space):
            return self.of(study, trial).sample_relative(study, trial, search_space)

        def sample_independent(self, study, trial, name, distribution):
            return self.of(study, trial).sample_independent(study, trial, name, distribution)

        def before_trial(self, study, trial) -> None:
            self.of(study, trial).before_trial(study, trial)

        def after_trial(self, study, trial, state, values) -> None:
            self.of(study, trial).after_trial(study, trial, state, values)

    return PlaceSeeded()
