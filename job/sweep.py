"""Sweeps: an Optuna study whose trials are ordinary runs in <output>/trials/<n>/. Each `job sweep` is one worker, a
loop that takes the next trial (a preempted one first, continued from its checkpoint with its parameters) until the
study holds its N finished trials; then it writes the results (trials.csv, best.json, best/, a picture)."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from job.cloud import read_url, write_url
from job.config import Config, load_config, read_yaml
from job.console import say
from job.errors import ConfigError, Interrupted, JobError, StorageError, one_line

if TYPE_CHECKING:
    import optuna

    from job.stop import StopRequest

HEARTBEAT_S = 2  # a running trial's sign of life in the study
GRACE_S = 10  # a trial silent this long was lost with its worker: the next worker takes it over
MLFLOW_RUN = "mlflow_run_id"  # study user attr: the study's MLflow run, the trials' runs its children
EXTRA = "extra"  # user attr: a trial begun by two workers for the study's last slot, ended unrun
SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("none", "median", "hyperband")
NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "fuse", "9p", "ceph", "glusterfs", "lustre", "gpfs", "beegfs")
# The fields of an evaluation record in metrics.jsonl (job/evaluate.py Scored.record), after the split's name.
SPLIT_METRICS = ("loss", "accuracy", "top5") + tuple(
    f"{avg}_{name}" for avg in ("macro", "weighted") for name in ("precision", "recall", "f1")
)


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
    metric = str(raw.get("metric", "val_accuracy"))
    direction = str(raw.get("direction", "maximize"))
    if direction not in ("maximize", "minimize"):
        raise ConfigError(f"space direction: expected maximize or minimize, got {direction!r}")
    written = metrics_written(cfg)
    if metric not in written:
        raise ConfigError(f"space metric: the run never writes {metric!r}; it writes {', '.join(written)}")
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
    """The keys of the run's evaluation records: train_loss and the evaluated split's scores (val when the config
    holds one out; a folder's own val/ cannot be known before reading it, so both then)."""
    tables = cfg.data.kind in ("csv", "cifar10")  # no val of their own: val only when val_split holds one out
    splits = ["val"] if cfg.data.val_split else ["test"] if tables else ["val", "test"]
    scores = [m for m in SPLIT_METRICS if not (m == "top5" and cfg.data.kind == "csv")]  # top-5 of over 5 classes
    return ["train_loss", *(f"{s}_{m}" for s in splits for m in scores)]


def setting(key: str, value: Any) -> str:
    """An override as --set takes it; JSON is YAML, and a float's repr reads back exactly."""
    return f"{key}={json.dumps(value)}"


def storage_url(study: str, output: str) -> str:
    """The study's storage: --study, or study.db in a local output folder; SQLite refused where its locks fail."""
    if not study:
        if "://" in output and not output.startswith("file://"):
            raise ConfigError(
                f"--output {output} is not a local folder, where study.db would go: pass --study postgresql://... "
                "(workers on several machines) or --study sqlite:///LOCAL/PATH.db"
            )
        study = f"sqlite:///{os.path.abspath(output.removeprefix('file://'))}/study.db"
    scheme = study.partition("://")[0]
    if scheme == "sqlite":
        path = study.removeprefix("sqlite:///")
        if "://" in path or path.startswith("gs:/"):
            raise ConfigError(f"--study {study}: SQLite needs a local file; use --study postgresql://... for a bucket")
        fs = network_filesystem(os.path.abspath(path))
        if not fs and os.path.abspath(path).startswith("/gcs/"):  # Vertex AI's Cloud Storage FUSE, mounted or not here
            fs = "Cloud Storage FUSE"
        if fs:
            raise ConfigError(
                f"--study {study}: the file is on a network filesystem ({fs}), where SQLite's locks are not safe: use "
                "--study postgresql://... or a sqlite path on a local disk"
            )
    elif not scheme.startswith(("postgresql", "mysql")):
        raise ConfigError(f"--study {study}: expected sqlite:///PATH or postgresql://USER@HOST:PORT/DB")
    return study


def network_filesystem(path: str) -> str:
    """The type of a network (or FUSE) filesystem that `path` lies on, from /proc/mounts; '' for a local disk."""
    try:
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return ""
    best, kind = "", ""
    for fields in mounts:
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind if kind.split(".")[0] in NETWORK_FS else ""


def open_storage(url: str) -> optuna.storages.RDBStorage:
    """The study's storage with heartbeats: a trial whose worker went silent is failed and retried (same params)."""
    import importlib.util

    import optuna

    kwargs: dict[str, Any] = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    engine = url
    if url.startswith("postgresql://") and not importlib.util.find_spec("psycopg"):  # SQLAlchemy 2.1's default
        engine = url.replace("postgresql://", "postgresql+psycopg2://", 1)
    if url.startswith("sqlite"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    failed: Exception | None = None
    for _ in range(3):  # workers starting together on a fresh database race to create its tables: the loser retries
        try:
            return optuna.storages.RDBStorage(
                engine,
                engine_kwargs=kwargs,
                heartbeat_interval=HEARTBEAT_S,
                grace_period=GRACE_S,
                heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=None),
            )
        except Exception as e:  # sqlalchemy's and the drivers' errors
            failed = e
            time.sleep(1.0)
    raise StorageError(f"--study {masked(url)}: cannot open the study's storage: {one_line(failed)}")


def masked(url: str) -> str:
    """A storage URL without its password."""
    head, sep, rest = url.partition("://")
    user, at, host = rest.rpartition("@")
    return f"{head}{sep}{user.split(':')[0]}{':***' if ':' in user else ''}{at}{host}" if at else url


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
        watch = Watch(trial, self.space, run)
        try:
            if self.nproc > 1:
                self.run_group(run, n, params, watch)
            else:
                self.run_here(run, n, params, watch)
        except Interrupted:
            watch.close()
            if not watch.pruned:
                raise
        watch.close()
        if watch.records:
            trial.set_user_attr("epochs", watch.records[-1].get("epoch"))
        if watch.pruned:
            note(run, watch.pruned)
            say(f"trial {n}: {watch.pruned}")
            raise optuna.TrialPruned(watch.pruned)
        values = [r[self.space.metric] for r in watch.records if self.space.metric in r]
        if not values:
            raise ConfigError(f"trial {n}: the run wrote no {self.space.metric} (see {run}/metrics.jsonl)")
        return max(values) if self.space.direction == "maximize" else min(values)

    def run_here(self, run: str, n: int, params: dict[str, Any], watch: Watch) -> None:
        """The trial in this process: no start-up cost per trial; SIGTERM stops it at a committed checkpoint."""
        from job.stop import StopRequest

        cfg = load_config(self.config, self.trial_overrides(n, params))
        with StopRequest(cfg.train.grace_seconds) as stop:  # the worker's own watch is back after it
            watch.start(lambda: stop.limit(0))  # a pruned trial stops as at its time limit: committed, Interrupted
            self.train(cfg, run, self.device, "auto", False, stop)

    def run_group(self, run: str, n: int, params: dict[str, Any], watch: Watch) -> None:
        """The trial as `job train --nproc-per-node N`: the parameters drawn once, here, the same on every process."""
        sets = [a for s in self.trial_overrides(n, params) for a in ("--set", s)]
        argv = [sys.executable, "-m", "job", "train", "--config", self.config, "--output", run]
        argv += ["--device", self.device, "--nproc-per-node", str(self.nproc), *sets]
        child = subprocess.Popen(argv)
        previous = signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
        try:
            watch.start(lambda: child.send_signal(signal.SIGTERM))
            code = child.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
        if code == 75:
            raise Interrupted(f"trial {n} stopped with its checkpoint committed")
        if code:
            raise TrialFailed(f"trial {n}: python -m job train exited {code} (see above)", code)


class TrialFailed(JobError):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.exit_code = code


class Watch:
    """Reads the trial's metrics.jsonl as evaluations are written, reports each to the study, and stops the run
    when the pruner says so (the run stays unaware of Optuna)."""

    def __init__(self, trial, space: Space, run: str) -> None:
        self.trial, self.space, self.run = trial, space, run
        self.records: list[dict[str, Any]] = []
        self.reported: set[int] = set()
        self.pruned = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ask = None

    def start(self, ask_stop) -> None:
        self._ask = ask_stop
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.poll()

    def _follow(self) -> None:
        while not self._stop.wait(0.3):
            self.poll()

    def poll(self) -> None:
        from job.report import METRICS, records_in
        from job.storage import RunDir

        try:  # where the run writes it on this machine (a remote run's staging copy): each line as it is written
            text = RunDir(self.run).path(METRICS).read_text()
        except (OSError, UnicodeDecodeError):
            return
        self.records = [r for r in records_in(text[: text.rfind("\n") + 1]) if "train_loss" in r]  # whole lines
        metric = self.space.metric
        for r in self.records:
            if metric in r and r["step"] not in self.reported:
                self.reported.add(r["step"])
                self.trial.report(float(r[metric]), r["step"])
                if not self.pruned and self.space.pruner != "none" and self.trial.should_prune():
                    self.pruned = (
                        f"pruned by the {self.space.pruner} pruner at step {r['step']}: {metric} {r[metric]:.4g}"
                    )
                    if self._ask is not None:
                        self._ask()


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
    worker.parent_run_id = parent_run(worker)
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
    best = write_results(worker)
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


def parent_run(worker: Worker) -> str:
    """The study's MLflow run (track.mlflow set), made by the first worker and kept in the study's user attrs; ''
    untracked, or when the server does not answer (the trials are then tracked alone, their points kept as ever)."""
    from job.track import experiment_id, target

    where = target(worker.cfg, worker.output)
    if where is None:
        return ""
    if known := worker.study.user_attrs.get(MLFLOW_RUN):
        return known
    try:
        from mlflow import MlflowClient

        c = MlflowClient(tracking_uri=where.uri)
        made = c.create_run(experiment_id(c, where), run_name=worker.space.name, tags={"job.study": worker.space.name})
    except Exception as e:  # the client's and the server's errors
        say(f"tracking: no MLflow run for the study ({one_line(e)}); each trial is tracked alone")
        return ""
    worker.study.set_user_attr(MLFLOW_RUN, made.info.run_id)
    return worker.study.user_attrs[MLFLOW_RUN]


def end_parent_run(worker: Worker, best: dict) -> None:
    """The study's MLflow run finished, with the best trial's metric."""
    from job.track import target

    where = target(worker.cfg, worker.output)
    if not worker.parent_run_id or where is None:
        return
    try:
        from mlflow import MlflowClient

        c = MlflowClient(tracking_uri=where.uri)
        for name, value in best.get("metric", {}).items():
            c.log_metric(worker.parent_run_id, f"best_{name}", value)
        c.set_tag(worker.parent_run_id, "job.best_trial", str(best.get("trial", "")))
        c.set_terminated(worker.parent_run_id)
    except Exception as e:  # the client's and the server's errors
        say(f"tracking: the study's MLflow run could not be ended ({one_line(e)})")


def note(run: str, why: str) -> None:
    """Say in the run's run.json (top-level note) why it ended where it did."""
    from job.attempts import RUN_JSON, document

    data = read_url(f"{run}/{RUN_JSON}")
    doc = document(data) if data else {}
    write_url(f"{run}/{RUN_JSON}", (json.dumps(doc | {"note": why}, indent=1) + "\n").encode())


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


def write_results(worker: Worker) -> dict:
    """The table, trials.csv, best.json, best/ (the best trial's model, usable as --model) and the picture of the
    metric against each parameter. Each worker that finds the study done writes them alike, each file whole."""
    import optuna

    space, out = worker.space, worker.output.rstrip("/")
    rows = trial_rows(worker)
    text = io.StringIO()
    fields = list(dict.fromkeys(k for r in rows for k in r))
    writer = csv.DictWriter(text, fields)
    writer.writeheader()
    writer.writerows(rows)
    write_url(f"{out}/trials.csv", text.getvalue().encode())
    print(table(rows, fields[:-1]))
    complete = [t for t in worker.study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
    if not complete:
        say(f"sweep {space.name}: no trial completed; results in {out}/trials.csv")
        return {}
    best_t = worker.study.best_trial
    n = optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(best_t)
    n = best_t.number if n is None else n
    best = {
        "trial": n,
        "values": best_t.params,
        "metric": {space.metric: best_t.value},
        "run": best_t.user_attrs["run"],
    }
    for name in ("model.pt", "model.json", "config.yaml"):
        data = read_url(f"{best['run']}/{name}")
        if data is None:
            raise StorageError(f"{best['run']}/{name}: missing from the best trial's run")
        write_url(f"{out}/best/{name}", data)
    write_url(f"{out}/best.json", (json.dumps(best, indent=1) + "\n").encode())
    write_url(f"{out}/params.png", picture(rows, space))
    say(
        f"sweep {space.name}: best trial {n}, {space.metric} {best_t.value:.4f} with "
        f"{', '.join(f'{k}={v}' for k, v in best_t.params.items())}; {out}/best.json, {out}/best/ (--model), "
        f"{out}/trials.csv, {out}/params.png"
    )
    return best


def table(rows: list[dict[str, Any]], fields: list[str]) -> str:
    def cell(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else "" if v is None else str(v)

    cells = [fields, *([cell(r.get(f)) for f in fields] for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(fields))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in cells)


def picture(rows: list[dict[str, Any]], space: Space) -> bytes:
    """The metric of each finished trial against each parameter, one panel a parameter (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.ticker
    from matplotlib import pyplot as plt

    done = [r for r in rows if r[space.metric] is not None]
    fig, axes = plt.subplots(1, len(space.params), figsize=(4 * len(space.params), 3.5), squeeze=False)
    for ax, (key, p) in zip(axes[0], space.params.items()):
        if isinstance(p, list):
            names = [str(v) for v in p]
            ax.scatter([names.index(str(r[key])) for r in done], [r[space.metric] for r in done])
            ax.set_xticks(range(len(names)), names)
        else:
            ax.scatter([r[key] for r in done], [r[space.metric] for r in done])
            if p.log:
                ax.set_xscale("log")
                ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # labels that overlap
        ax.set_xlabel(key)
        ax.set_ylabel(space.metric)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    return buf.getvalue()
