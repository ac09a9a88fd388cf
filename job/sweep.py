"""Sweeps: an Optuna study whose trials are ordinary runs in <output>/trials/<n>/. Each `job sweep` is one worker, a
loop that takes the next trial (a preempted one first, continued from its checkpoint with its parameters) until the
study holds its N finished trials; then it writes the results (trials.csv, best.json, best/, a picture)."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from job.config import Config, load_config
from job.console import say
from job.errors import ConfigError, Interrupted, JobError, StorageError, one_line
from job.space import Space, read_space, setting
from job.study_storage import HEARTBEAT_S, masked, open_storage, storage_url
from job.sweep_results import write_results

if TYPE_CHECKING:
    import optuna

    from job.stop import StopRequest

MLFLOW_RUN = "mlflow_run_id"  # study user attr: the study's MLflow run, the trials' runs its children
EXTRA = "extra"  # user attr: a trial begun by two workers for the study's last slot, ended unrun


def is_original(t: optuna.trial.FrozenTrial) -> bool:
    """A trial that drew its own parameters: neither a retry of a lost one nor a worker's extra."""
    return "failed_trial" not in t.system_attrs and not t.user_attrs.get(EXTRA)


def original_index(trials: list, number: int) -> int:
    """How many original trials come before trial `number`: its place among the N."""
    return sum(1 for t in trials if t.number < number and is_original(t))


def make_sampler(space: Space):
    """A sampler made afresh for each trial, seeded by the space's seed and the trial's place among the originals: a
    restarted worker draws what one never stopped would, and two workers never draw alike for their different
    trials."""
    import numpy
    import optuna

    if space.sampler == "grid":  # its points are shuffled by its seed once and taken in trial order: one sampler
        return optuna.samplers.GridSampler(dict(space.params), seed=space.seed)

    class PlaceSeeded(optuna.samplers.BaseSampler):
        def __init__(self) -> None:
            self.by_trial: dict[int, optuna.samplers.BaseSampler] = {}

        def of(self, study, trial) -> optuna.samplers.BaseSampler:
            if trial.number not in self.by_trial:
                place = original_index(study.get_trials(deepcopy=False), trial.number)
                # Mixed, not added: generators seeded 0, 1, 2, ... draw alike first values (Mersenne Twister).
                seed = int(numpy.random.SeedSequence([space.seed, place]).generate_state(1)[0])
                self.by_trial = {trial.number: inner(seed)}  # one trial at a time per worker
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

    def inner(seed: int) -> optuna.samplers.BaseSampler:
        if space.sampler == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        return optuna.samplers.TPESampler(seed=seed)

    return PlaceSeeded()


def make_pruner(space: Space):
    import optuna

    if space.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2)
    if space.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner()
    return optuna.pruners.NopPruner()


def suggest(trial: optuna.trial.Trial, space: Space) -> dict[str, Any]:
    values = {}
    for key, p in space.params.items():
        if isinstance(p, list):
            values[key] = trial.suggest_categorical(key, p)
        elif isinstance(p.low, int) and isinstance(p.high, int):
            values[key] = trial.suggest_int(key, p.low, p.high, log=p.log)
        else:
            values[key] = trial.suggest_float(key, p.low, p.high, log=p.log)
    return values


class Extra(Exception):
    """A trial begun for a slot another worker had taken: ended unrun."""


@dataclass
class Worker:
    """One worker of a sweep: what every trial it runs shares."""

    space: Space
    cfg: Config
    config: str
    overrides: list[str]
    output: str
    device: str
    nproc: int
    train: Callable[..., dict]  # job.train.run, handed in by the command line: a sweep never imports the loop
    study: Any = None
    lost: int | None = None  # the trial id this worker's last trial had
    parent_run_id: str = ""  # the study's MLflow run, each trial's run a child of it

    def trial_overrides(self, n: int, params: dict[str, Any]) -> list[str]:
        """The trial's settings over the config: --set, a checkpoint at every evaluation (so a preempted trial loses
        at most the steps since its last evaluation, and a pruned one stops where it was judged), its params."""
        t = self.cfg.train
        every = (
            [f"train.checkpoint_every_epochs={t.eval_every_epochs}"]
            if t.checkpoint_every_epochs > t.eval_every_epochs
            else []
        )
        parent = [f"track.parent_run_id={self.parent_run_id}"] if self.parent_run_id else []
        return [*self.overrides, *every, *parent, *(setting(k, v) for k, v in params.items())]

    def objective(self, trial: optuna.trial.Trial) -> float:
        import optuna

        self.lost = trial._trial_id
        frozen = self.study._storage.get_trial(trial._trial_id)
        first = optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(frozen)
        trials = self.study.get_trials(deepcopy=False)
        if first is None and original_index(trials, trial.number) >= self.space.trials:
            trial.set_user_attr(EXTRA, True)
            raise Extra
        params = suggest(trial, self.space)
        n = trial.number if first is None else first
        run = f"{self.output.rstrip('/')}/trials/{n}"
        trial.set_user_attr("run", run)
        tries = len(optuna.storages.RetryHeartbeatStaleTrialCallback.retry_history(frozen))
        again = f" (continued from its last checkpoint, try {tries + 1})" if first is not None else ""
        say(f"trial {n}{again}: {', '.join(f'{k}={v}' for k, v in params.items())}")
        judge = Judge(trial, self.space, run)
        for record in judge.records():  # an earlier attempt's evaluations, reported (and judged) before going on
            judge(record)
        try:
            if not judge.pruned:
                (self.run_group if self.nproc > 1 else self.run_here)(run, n, params, judge)
        except Interrupted:
            if not judge.pruned:
                raise
        records = judge.records()
        for record in records:  # a group's last evaluations, written as its child ended
            judge(record)
        if records:
            trial.set_user_attr("epochs", records[-1].get("epoch"))
        if judge.pruned:
            from job.attempts import write_note

            write_note(run, judge.pruned)
            say(f"trial {n}: {judge.pruned}")
            raise optuna.TrialPruned(judge.pruned)
        values = [r[self.space.metric] for r in records if self.space.metric in r]
        if not values:
            raise ConfigError(f"trial {n}: the run wrote no {self.space.metric} (see {run}/metrics.jsonl)")
        return max(values) if self.space.direction == "maximize" else min(values)

    def run_here(self, run: str, n: int, params: dict[str, Any], judge: Judge) -> None:
        """The trial in this process: no start-up cost per trial; SIGTERM stops it at a committed checkpoint, and so
        does its pruner, at the evaluation it judged."""
        from job.stop import StopRequest

        cfg = load_config(self.config, self.trial_overrides(n, params))
        with StopRequest(cfg.train.grace_seconds) as stop:  # the worker's own watch is back after it
            self.train(cfg, run, self.device, "auto", False, stop, judge=judge)

    def run_group(self, run: str, n: int, params: dict[str, Any], judge: Judge) -> None:
        """The trial as `job train --nproc-per-node N`: the parameters drawn once, here, the same on every process."""
        sets = [a for s in self.trial_overrides(n, params) for a in ("--set", s)]
        argv = [sys.executable, "-m", "job", "train", "--config", self.config, "--output", run]
        argv += ["--device", self.device, "--nproc-per-node", str(self.nproc), *sets]
        child = subprocess.Popen(argv)
        previous = signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
        # The child's evaluations are judged as its metrics.jsonl grows (it cannot be handed the judge), and a pruned
        # group is sent SIGTERM: it stops where the signal finds it, past the evaluation judged by the steps run while
        # the file is read (a poll, 0.3 s) and the group agrees to stop. Its stop line says SIGTERM; the trial's note
        # says it was pruned, and where.
        watch = Watch(judge, lambda: child.send_signal(signal.SIGTERM))
        try:
            code = child.wait()
        finally:
            watch.close()
            signal.signal(signal.SIGTERM, previous)
        if code == 75:
            raise Interrupted(f"trial {n} stopped with its checkpoint committed")
        if code:
            raise TrialFailed(f"trial {n}: python -m job train exited {code} (see above)", code)


class TrialFailed(JobError):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.exit_code = code


class Judge:
    """A trial's evaluations reported to the study, each judged by its pruner (the run stays unaware of Optuna): given
    each evaluation's record, says why the run should stop there, or None."""

    def __init__(self, trial, space: Space, run: str) -> None:
        self.trial, self.space, self.run = trial, space, run
        self.reported: set[int] = set()
        self.pruned = ""  # why the trial was pruned, and where, for its note

    def __call__(self, record: dict[str, Any]) -> str | None:
        metric, step = self.space.metric, record["step"]
        if self.pruned or metric not in record or step in self.reported:
            return None
        self.reported.add(step)
        self.trial.report(float(record[metric]), step)
        if self.space.pruner == "none" or not self.trial.should_prune():
            return None
        self.pruned = f"pruned by the {self.space.pruner} pruner at step {step}: {metric} {record[metric]:.4g}"
        return f"the sweep's pruner ({self.space.pruner}, at step {step})"

    def records(self) -> list[dict[str, Any]]:
        """The evaluations in the trial's metrics.jsonl, where the run writes it on this machine (a remote run's
        staging copy, else the store's once the run is over), whole lines only."""
        from job.cloud import read_url
        from job.report import METRICS, records_in
        from job.storage import RunDir

        try:
            text = RunDir(self.run).path(METRICS).read_text()
        except (OSError, UnicodeDecodeError):
            text = (read_url(f"{self.run}/{METRICS}") or b"").decode(errors="replace")
        return [r for r in records_in(text[: text.rfind("\n") + 1]) if "train_loss" in r]


class Watch:
    """A thread that judges a child process's evaluations as its metrics.jsonl grows, and asks it to stop when
    pruned."""

    def __init__(self, judge: Judge, ask_stop: Callable[[], None]) -> None:
        self.judge, self.ask_stop = judge, ask_stop
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _follow(self) -> None:
        while not self._stop.wait(0.3):
            if any(self.judge(record) for record in self.judge.records()):
                self.ask_stop()


def sweep(
    space_url: str,
    study: str,
    trials: int | None,
    config: str,
    overrides: list[str],
    output: str,
    device: str,
    nproc: int,
    stop: StopRequest,
    train: Callable[..., dict],
) -> dict:
    """Run trials of the study until it holds its N finished ones, then write the results; returns best.json.
    `train`: job.train.run, which runs a trial in this process."""
    cfg = load_config(config, overrides)
    output = output or f"runs/{cfg.name}-sweep"
    space = read_space(space_url, trials, cfg, config, overrides)
    if nproc < 1:
        raise ConfigError(f"--nproc-per-node: expected 1 or more, got {nproc}")
    url = storage_url(study, output)
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # its failure lines and tracebacks: this module says its own
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # heartbeats, retries
    storage = open_storage(url)
    try:
        study_ = optuna.create_study(
            storage=storage,
            study_name=space.name,
            direction=space.direction,
            sampler=make_sampler(space),
            pruner=make_pruner(space),
            load_if_exists=True,
        )
    except Exception as e:
        raise StorageError(f"--study {masked(url)}: cannot open study {space.name}: {one_line(e)}") from None
    worker = Worker(space, cfg, config, overrides, output, device, nproc, train, study_)
    worker.parent_run_id = parent_run(worker, url)
    say(
        f"sweep {space.name}: {space.trials} trial{'s' if space.trials != 1 else ''} of {', '.join(space.params)}, "
        f"{space.direction} {space.metric}; "
        f"study {masked(url)}"
    )
    from optuna.trial import TrialState

    while True:
        if stop.received:  # between trials (during one, the trial's own watch takes the signal)
            raise Interrupted(
                f"stopped by {stop.describe(stop.received)} between trials: run the same command to go on"
            )
        optuna.storages.fail_stale_trials(study_)
        ts = study_.get_trials(deepcopy=False)
        done = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in ts)
        if done >= space.trials:
            break
        running = sum(t.state == TrialState.RUNNING for t in ts)
        if any(t.state == TrialState.WAITING for t in ts) or done + running < space.trials:
            run_one(worker)
        else:  # another worker runs the last trials; one of them may yet be lost
            time.sleep(HEARTBEAT_S)
    best = write_results(study_, space, output, trial_rows(worker))
    end_parent_run(worker, best)
    return best


def run_one(worker: Worker) -> None:
    """One trial; a stop or failure of its run ends it FAIL with a retry queued (same params, same folder), and ends
    this worker with the run's error. A fault in the config or the data (exit 2, 3) is not retried: it would fail
    again."""
    import optuna

    worker.lost = None
    try:
        worker.study.optimize(worker.objective, n_trials=1, catch=(Extra,))
    except BaseException as e:
        if worker.lost is not None and getattr(e, "exit_code", None) not in (2, 3):
            frozen = worker.study._storage.get_trial(worker.lost)
            if frozen.state == optuna.trial.TrialState.FAIL and not frozen.user_attrs.get(EXTRA):
                optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=None)(worker.study, frozen)
        raise


def parent_run(worker: Worker, url: str) -> str:
    """The study's MLflow run (track.mlflow set), made by the first worker (job/track.py: workers starting together
    agree on one) and kept in the study's user attrs; '' untracked, or when the server does not answer (the trials
    are then tracked alone, their points kept as ever)."""
    from job.track import study_run, target

    where = target(worker.cfg, worker.output)
    if where is None:
        return ""
    if known := worker.study.user_attrs.get(MLFLOW_RUN):
        return known
    identity = hashlib.sha256(f"{masked(url)}#{worker.space.name}".encode()).hexdigest()[:16]  # storage and name
    if run_id := study_run(where, worker.space.name, identity):
        worker.study.set_user_attr(MLFLOW_RUN, run_id)
    return run_id


def end_parent_run(worker: Worker, best: dict) -> None:
    """The study's MLflow run finished, with the best trial's metric."""
    from job.track import end_study_run, target

    where = target(worker.cfg, worker.output)
    if worker.parent_run_id and where is not None:
        end_study_run(where, worker.parent_run_id, best)


def trial_rows(worker: Worker) -> list[dict[str, Any]]:
    """One row per trial folder, as its latest attempt in the study left it, in trial order."""
    import optuna

    from job.attempts import history, moment
    from job.storage import RunDir

    latest: dict[int, Any] = {}
    for t in worker.study.get_trials(deepcopy=False):
        if t.user_attrs.get(EXTRA) or "run" not in t.user_attrs:
            continue
        n = optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(t)
        latest[t.number if n is None else n] = t
    rows = []
    for n, t in sorted(latest.items()):
        attempts = history(RunDir(t.user_attrs["run"]))
        ends = [(a["started"], a.get("ended") or (a.get("last_seen") or {}).get("time")) for a in attempts]
        seconds = sum(moment(end) - moment(start) for start, end in ends if start and end)
        rows.append(
            {
                "trial": n,
                **t.params,
                worker.space.metric: t.value,
                "state": t.state.name,
                "epochs": t.user_attrs.get("epochs"),
                "seconds": round(seconds, 1),
                "attempts": len(attempts),
                "run": t.user_attrs["run"],
            }
        )
    return rows
