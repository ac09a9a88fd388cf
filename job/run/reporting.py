"""Which sinks a run's reporter has, by process, settings and platform: metrics.jsonl, TensorBoard and the console in
the process that writes the run (job/sinks/report.py), and there MLflow (track.mlflow or MLFLOW_TRACKING_URI),
Vertex AI's metric file (a tuning trial), Kubeflow Trainer's TrainJob progress (its status variables in the pod) and
the caller's sinks (a sweep's pruning judge); in every process of a Ray Train group, Ray's report. The loop names
none of them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from job.config import Config, flat_items
from job.console import say
from job.group import distributed, platforms
from job.sinks import hypertune, kubeflow_progress, track
from job.sinks.report import FollowerReport, Report
from job.sinks.sink import EachEvaluation, Sink

if TYPE_CHECKING:
    from job.group.stop import StopRequest
    from job.run.attempts import Attempt
    from job.run.progress import Progress
    from job.sinks.track_server import Target
    from job.storage.run_folder import RunDir

Judge = Callable[[dict[str, Any]], "str | None"]  # an evaluation's record -> why the run should stop there, or None


def destination(cfg: Config, run_dir: RunDir, fresh: bool) -> Target | None:
    """Where the run is tracked (MLflow), known before the run is set up: a finished run's tracking is sent there
    at once. None in a group's other processes (rank 0 alone talks to the server)."""
    return track.target(cfg, run_dir.url, fresh=fresh) if distributed.is_writer() else None


def check(cfg: Config, fields: list[str]) -> None:
    """Refuse, on every process alike and before anything is written, a setting a sink cannot take: a Vertex AI
    tuning trial's metric that no evaluation writes (`fields`, what each evaluation's record holds)."""
    hypertune.trial(cfg.track.hp_metric_tag, fields)


def open_report(
    cfg: Config,
    run_dir: RunDir,
    steps_per_epoch: int,
    fields: list[str],
    state: Progress,
    resumed: bool,
    where: Target | None,
    stop: StopRequest,
    judge: Judge | None = None,
    sinks: Iterable[Sink] = (),
) -> Report:
    """The reporter of this process, its sinks subscribed (a tracking server that refuses is said here, among the
    start lines). `fields`: what each evaluation's record holds; `resumed`: the run continues from `state`, a
    checkpoint's; `judge`: the caller's judge of each evaluation, whose reason to stop is asked of `stop` (acted on
    right after the evaluation: the run commits its step); `sinks`: the caller's own."""
    everywhere: list[Sink] = []
    if platforms.current().joined:  # in Ray Train's worker: each evaluation and checkpoint reported to Ray
        from job.sinks.ray_report import RayReport

        everywhere.append(RayReport(run_dir.url))
    if not distributed.is_writer():
        return FollowerReport(everywhere)
    own: list[Sink] = []
    if where is not None:
        own.append(track.Tracker(where, run_dir, state.step if resumed else -1))
    epochs = cfg.train.epochs
    tuning = hypertune.trial(cfg.track.hp_metric_tag, fields)  # a Vertex AI tuning trial's metric file
    progress = kubeflow_progress.from_environment(epochs * steps_per_epoch, state.step, epochs)
    own += [sink for sink in (tuning, progress) if sink is not None]
    if judge is not None:
        own.append(EachEvaluation(lambda record: stop.ask(judge(record))))
    start = state.step + 1 if resumed else 0
    return Report(run_dir, flat_items(cfg), epochs, steps_per_epoch, start, [*own, *everywhere, *sinks])


def describe_attempt(report: Report, attempt: Attempt, cfg: Config, decided: dict[str, Any]) -> None:
    """A tracked run's MLflow run gets the settings and `decided`, what the run decided as it was set up (the device,
    the precision, the step, ...), as params, and the attempt (begun) as tags; the attempt tells it how it ends."""
    for sink in report.sinks:
        if isinstance(sink, track.Tracker):
            attempt.track(sink, cfg, flat_items(cfg) | {f"decided.{k}": v for k, v in decided.items()})
            say(f"tracking: {sink.where.describe()}")
