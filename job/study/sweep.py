"""Sweeps: an Optuna study whose trials are ordinary runs in <output>/trials/<n>/. Each `job sweep` is one worker, a
loop that takes the next trial (a preempted or failed one first, continued from its checkpoint with its parameters)
until the study's N trials have ended; then it writes the results (trials.csv, best.json, best/, a picture)."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from job.config import Config, load_config
from job.console import say
from job.errors import (
    Cancelled,
    ConfigError,
    Interrupted,
    JobError,
    MetricNotWritten,
    StorageError,
    exit_code,
    one_line,
)
from job.study.began import EXTRA, check_began_with, is_original, make_sampler, original_index
from job.study.prune import Judge, Watch
from job.study.results import write_results
from job.study.space import Space, read_space, setting
from job.study.storage import HEARTBEAT_S, masked, open_storage, storage_url

if TYPE_CHECKING:
    import optuna

    from job.group.stop import StopRequest

MLFLOW_RUN = "mlflow_run_id"  # study user attr, with the server's URI: the study's MLflow run, its trials' parent
FAILURE = "failure"  # user attr: why a trial's run failed, one line; EXIT: the exit code it failed with
EXIT = "exit_code"
PLACE = "trial"  # user attr: the trial's place among the N originals, its folder's name (retries take no place)
STOPPED = "stopped"  # user attr: why a trial was stopped short (its pruner, a loss not finite)
TRIES_AFTER_FAILURE = 1  # a failed trial is run once more (a transient cause passes), then ends FAIL


def label(t: optuna.trial.FrozenTrial) -> int:
    """A trial's place among the study's N, as its folder and the results name it."""
    return t.user_attrs.get(PLACE, chain(t))


def chain(t: optuna.trial.FrozenTrial) -> int:
    """The number of the original trial `t` retries (its folder's), or its own."""
    import optuna

    n = optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(t)
    return t.number if n is None else n


@dataclass
class Standing:
    """Where a study stands, each original trial by the latest try of it: ended (COMPLETE, PRUNED, or FAIL with no
    retry queued: failed twice, or from before failures were retried), waiting (a retry queued), or running."""

    drawn: int = 0
    ended: int = 0
    waiting: int = 0
    running: int = 0
    failed: list = field(default_factory=list)  # the ended FAIL tries, in trial order

    @classmethod
    def of(cls, trials: list) -> Standing:
        from optuna.trial import TrialState

        latest: dict[int, Any] = {}
        for t in sorted(trials, key=lambda t: t.number):
            if not t.user_attrs.get(EXTRA):
                latest[chain(t)] = t
        s = cls(drawn=sum(map(is_original, trials)))
        for t in latest.values():
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL):
                s.ended += 1
                s.failed += [t] if t.state == TrialState.FAIL else []
            elif t.state == TrialState.WAITING:
                s.waiting += 1
            else:
                s.running += 1
        return s


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
    train: Callable[..., dict]  # job.run.train.run, handed in by the command line: a sweep never imports the loop
    study: Any = None
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
        chosen = [f"train.choose_on={self.space.metric}"]  # model.pt: the evaluation that gave the trial's value
        return [*self.overrides, *every, *parent, *chosen, *(setting(k, v) for k, v in params.items())]

    def objective(self, trial: optuna.trial.Trial) -> float:
        import optuna

        trials = self.study.get_trials(deepcopy=False)
        frozen = trials[trial.number]  # a study's trials are numbered from 0, in order
        first = optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(frozen)
        if first is None and original_index(trials, trial.number) >= self.space.trials:
            trial.set_user_attr(EXTRA, True)
            raise Extra
        for key in (FAILURE, EXIT, STOPPED):  # a retry is made with its failed try's attrs: not this try's
            if frozen.user_attrs.get(key) is not None:
                trial.set_user_attr(key, None)
        params = suggest(trial, self.space)
        n = original_index(trials, trial.number if first is None else first)  # its place among the N: its folder
        run = f"{self.output.rstrip('/')}/trials/{n}"
        trial.set_user_attr(PLACE, n)
        trial.set_user_attr("run", run)
        tries = optuna.storages.RetryHeartbeatStaleTrialCallback.retry_history(frozen)
        again = ""
        if tries:
            how = "after a failure" if trials[tries[-1]].user_attrs.get(FAILURE) else "from its last checkpoint"
            again = f" (continued {how}, try {len(tries) + 1})"
        say(f"trial {n}{again}: {', '.join(f'{k}={v}' for k, v in params.items())}")
        # Each ending but a completed or stopped-short one queues the trial's retry before the trial is FAIL: a worker
        # looking at the study never sees a failed trial without the retry it will have.
        try:
            return self.run_trial(trial, n, params, run)
        except optuna.TrialPruned:
            raise
        except MetricNotWritten as e:  # the space's fault, not the trial's: it never trained, and ends unrun
            trial.set_user_attr(EXTRA, True)
            raise ConfigError(f"space metric: {self.space.metric}: {one_line(e)}") from None
        except Exception as e:
            if isinstance(e, (Interrupted, Cancelled)):  # stopped with its checkpoint: continued by the next worker
                self.retry(trial.number)
                raise
            if not isinstance(e, JobError):
                traceback.print_exc()  # a bug: its traceback, as `job train` would print it
            why = one_line(e) if isinstance(e, JobError) else f"{type(e).__name__}: {one_line(e)}"
            trial.set_user_attr(FAILURE, why)
            trial.set_user_attr(EXIT, exit_code(e))
            failures = 1 + sum(bool(trials[i].user_attrs.get(FAILURE)) for i in tries)
            if failures > TRIES_AFTER_FAILURE:
                say(f"trial {n} failed (exit {exit_code(e)}): {why}; it failed before too, and ends FAIL")
            else:
                say(f"trial {n} failed (exit {exit_code(e)}): {why}; it is tried once more")
                self.retry(trial.number)
            raise TrialError(why) from None
        except BaseException:  # Ctrl-C, a second signal: the trial is left to the next worker as a stopped one is
            self.retry(trial.number)
            raise

    def retry(self, number: int) -> None:
        """Queue trial `number` again: the same parameters and folder, continued from its last checkpoint."""
        import optuna

        frozen = self.study.get_trials(deepcopy=False)[number]
        optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=None)(self.study, frozen)

    def run_trial(self, trial: optuna.trial.Trial, n: int, params: dict[str, Any], run: str) -> float:
        """The trial's run, its evaluations judged as they come; returns its value: its chosen evaluation's."""
        import optuna

        judge = Judge(trial, self.space.metric, self.space.pruner, run)
        for record in judge.records():  # an earlier attempt's evaluations, reported (and judged) before going on
            judge(record)
        try:
            if not judge.stopped:
                (self.run_group if self.nproc > 1 else self.run_here)(run, n, params, judge)
        except Interrupted:
            if not judge.stopped:
                raise
        lines = judge.lines()
        records = [r for r in lines if "train_loss" in r]
        for record in records:  # a group's last evaluations, written as its child ended
            judge(record)
        if records:
            trial.set_user_attr("epochs", records[-1].get("epoch"))
        if judge.stopped:
            from job.run.attempts import write_note

            write_note(run, judge.stopped)
            trial.set_user_attr(STOPPED, judge.stopped)
            say(f"trial {n}: {judge.stopped}")
            raise optuna.TrialPruned(judge.stopped)
        # The trial's value: its chosen evaluation's (the run chose on the metric: model.pt holds those weights), as
        # the test of the chosen model at the end names it; with no test split, the best of its evaluations.
        metric = self.space.metric
        values = [r[metric] for r in records if metric in r]
        chosen = next((r["chosen_epoch"] for r in reversed(lines) if "chosen_epoch" in r), None)
        at = [r[metric] for r in records if metric in r and r.get("epoch") == chosen]
        if not values:
            raise ConfigError(f"trial {n}: the run wrote no {metric} (see {run}/metrics.jsonl)")
        return at[-1] if at else max(values) if self.space.direction == "maximize" else min(values)

    def run_here(self, run: str, n: int, params: dict[str, Any], judge: Judge) -> None:
        """The trial in this process: no start-up cost per trial; SIGTERM stops it at a committed checkpoint, and so
        does its pruner, at the evaluation it judged."""
        from job.group.stop import StopRequest

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


class TrialError(Exception):
    """A trial's run failed: the trial ends FAIL with the reason in its user attrs."""


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
    """Run trials of the study until its N trials have ended, then write the results; returns best.json.
    `train`: job.run.train.run, which runs a trial in this process."""
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
            pruner=make_pruner(space),
            load_if_exists=True,
        )
    except Exception as e:
        raise StorageError(f"--study {masked(url)}: cannot open study {space.name}: {one_line(e)}") from None
    grid = {k: p for k, p in space.params.items() if isinstance(p, list)}
    study_.sampler = make_sampler(check_began_with(study_, space, cfg), grid)  # as the study began: recorded in it
    worker = Worker(space, cfg, config, overrides, output, device, nproc, train, study_)
    worker.parent_run_id = parent_run(worker, url)
    say(
        f"sweep {space.name}: {space.trials} trial{'s' if space.trials != 1 else ''} of {', '.join(space.params)}, "
        f"{space.direction} {space.metric}; "
        f"study {masked(url)}"
    )
    while True:
        if stop.received:  # between trials (during one, the trial's own watch takes the signal)
            raise Interrupted(
                f"stopped by {stop.describe(stop.received)} between trials: run the same command to go on"
            )
        optuna.storages.fail_stale_trials(study_)
        standing = Standing.of(study_.get_trials(deepcopy=False))
        if standing.ended >= space.trials:
            break
        if standing.waiting or standing.drawn < space.trials:
            run_one(worker)
        elif standing.running:  # another worker runs the last trials; one of them may yet be lost
            time.sleep(HEARTBEAT_S)
        else:
            break
    best = write_results(study_, space, output, trial_rows(worker))
    end_parent_run(worker, best)
    failed = Standing.of(study_.get_trials(deepcopy=False)).failed
    if failed:
        whys = "; ".join(
            f"trial {label(t)} (exit {t.user_attrs.get(EXIT, 1)}: {t.user_attrs.get(FAILURE)})" for t in failed
        )
        say(f"sweep {space.name}: {len(failed)} of {space.trials} trials failed: {whys}")
        if not best:
            raise TrialFailed(f"sweep {space.name}: no trial completed", failed[0].user_attrs.get(EXIT, 1))
    if not best:  # every trial stopped short (pruned, or its loss not finite): the config trains nothing usable
        raise ConfigError(f"sweep {space.name}: no trial completed; each was stopped short (see {output}/trials.csv)")
    return best


def run_one(worker: Worker) -> None:
    """One trial. A failed run ends it FAIL with its reason, retried once (a transient cause passes), and the worker
    goes on; a stop ends it FAIL with a retry queued (same params, same folder) and ends this worker."""
    worker.study.optimize(worker.objective, n_trials=1, catch=(Extra, TrialError))


def parent_run(worker: Worker, url: str) -> str:
    """The study's MLflow run (track.mlflow set), made by the first worker (job/sinks/track_study.py: workers starting
    together agree on one), holding the space, the metric and its direction, and kept in the study's user attrs; ''
    untracked, or when the server does not answer, said at once (the trials are then tracked alone, their points kept
    as ever)."""
    from job.sinks.track import target
    from job.sinks.track_study import study_run

    where = target(worker.cfg, worker.output)
    if where is None:
        return ""
    key = f"{MLFLOW_RUN} {where.uri}"  # each server its own: a study continued with another track.mlflow
    if known := worker.study.user_attrs.get(key):
        return known
    identity = hashlib.sha256(f"{masked(url)}#{worker.space.name}".encode()).hexdigest()[:16]  # storage and name
    if run_id := study_run(where, worker.space, identity):
        worker.study.set_user_attr(key, run_id)
    return run_id


def end_parent_run(worker: Worker, best: dict) -> None:
    """The study's MLflow run finished: the best trial's params and value, and the results written in the output
    (trials.csv, best.json, params.png), each once however many workers end it."""
    from job.sinks.track import target
    from job.sinks.track_study import end_study_run

    where = target(worker.cfg, worker.output)
    if worker.parent_run_id and where is not None:
        end_study_run(where, worker.parent_run_id, best, worker.output)


def trial_rows(worker: Worker) -> list[dict[str, Any]]:
    """One row per trial folder, as its latest try in the study left it, in trial order: its parameters, value, state,
    time, and what it cost (device hours, spend at train.price_per_device_hour, training lost to kills)."""
    from job.run.attempts import history, moment
    from job.run.cost import totals
    from job.storage.run_folder import RunDir

    latest = {chain(t): t for t in worker.study.get_trials(deepcopy=False) if "run" in t.user_attrs}
    rows = []
    for _, t in sorted(latest.items()):
        if t.user_attrs.get(EXTRA):
            continue
        attempts = history(RunDir(t.user_attrs["run"]))
        ends = [(a["started"], a.get("ended") or (a.get("last_seen") or {}).get("time")) for a in attempts]
        seconds = sum(moment(end) - moment(start) for start, end in ends if start and end)
        cost = totals(attempts, worker.cfg.train.price_per_device_hour)
        rows.append(
            {
                "trial": label(t),
                **t.params,
                worker.space.metric: t.value,
                "state": t.state.name,
                "epochs": t.user_attrs.get("epochs"),
                "seconds": round(seconds, 1),
                "attempts": len(attempts),
                "device_hours": cost["device_hours"],
                "spent": cost["spent"],
                "lost_s": round(sum(a.get("lost_s") or 0.0 for a in attempts), 1),
                "note": t.user_attrs.get(FAILURE) or t.user_attrs.get(STOPPED) or "",
                "run": t.user_attrs["run"],
            }
        )
    return rows
