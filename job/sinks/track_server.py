"""The MLflow server's side of tracking: where a run is tracked (Target), the client, and the Sender, which sends
journal lines in order, each point once per server: the journal's marks (job/sinks/track_journal.py) and the run's
`job.sent` tag, written in the same request as the points it covers, say how far the server's points went, so a
sender that connects again asks one question, not one per metric."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from job.sinks.track_journal import START
from job.storage.cloud import read_url

if TYPE_CHECKING:
    from job.storage.run_folder import RunDir

RUN_TAG = "job.run"  # the run folder's URL: the MLflow run of a job run is found by it when its id was not kept
SENT_TAG = "job.sent"  # "STEP N": the server holds every point line before place N of step STEP
# MLflow's limits on one log_batch call.
BATCH_METRICS, BATCH_PARAMS, BATCH_TAGS = 1000, 100, 100
PARAM_CHARS = 6000


@dataclass(frozen=True)
class Target:
    """Where a run is tracked: the server, the experiment, and the MLflow run's name and identifying tag."""

    uri: str
    experiment: str
    run_name: str
    run_url: str
    fresh: bool = False  # the folder starts afresh (--overwrite): a new MLflow run, not the one of its earlier run
    parent_run_id: str = ""  # the MLflow run this one is a child of (a sweep's study)

    def describe(self) -> str:
        if self.parent_run_id:  # a sweep's trial, named after its study's run when made: <study>-<n>
            return f"MLflow {self.uri}, experiment {self.experiment}, trial {self.run_name} of run {self.parent_run_id}"
        return f"MLflow {self.uri}, experiment {self.experiment}, run {self.run_name}"


def parent_name(c, run_id: str) -> str:
    """The name of a sweep study's run on this server; '' where it holds no such run (the study's run is on another
    server, or was deleted): the trial is then a run of its own."""
    from mlflow.exceptions import MlflowException

    try:
        info = c.get_run(run_id).info
        return info.run_name if info.lifecycle_stage == "active" else ""
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        return ""


def client(uri: str):
    """An MLflow client that fails at once where the server does not answer: its own retries (4 minutes by default)
    are off unless the environment sets them, as the job retries in the background itself."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    from mlflow import MlflowClient

    for name in ("mlflow", "alembic"):  # set on their import; their notes (tables made, ...) are not the run's
        logging.getLogger(name).setLevel(logging.WARNING)
    return MlflowClient(tracking_uri=uri)


def experiment_id(c, where: Target) -> str:
    """The id of `where`'s experiment, made when it is new (its files kept where artifacts() says)."""
    exp = c.get_experiment_by_name(where.experiment)
    if exp is not None:
        return exp.experiment_id
    try:
        return c.create_experiment(where.experiment, artifacts(where.uri))
    except Exception:  # another process made it first (two sweep workers starting together)
        if (exp := c.get_experiment_by_name(where.experiment)) is None:
            raise
        return exp.experiment_id


def artifacts(uri: str) -> str | None:
    """Where a new experiment keeps its files: beside a database file (MLflow's default is ./mlruns in whatever
    folder the job runs from); the server's own choice otherwise."""
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///") :]).resolve().parent.joinpath("mlartifacts").as_uri()
    return None


class Sender:
    """Sends journal lines to one MLflow server in order, each point once: a point line before the cursor (`through`,
    from the journal's marks and the run's job.sent tag) is held there already. Params, tags, files, the model
    version and the status are sent as the server lacks them."""

    def __init__(self, where: Target, run_dir: RunDir, run_id: str | None = None, through=START) -> None:
        self.where, self.run_dir, self.run_id = where, run_dir, run_id
        self.client = None
        self.through: tuple[int, int] = tuple(through)
        self.reached: dict[str, int] = {}  # metric -> the last step sent by this process (a line sent in parts)
        self.params: dict[str, str] | None = None  # as the server holds them, then as the journal's lines set them
        self.artifact_uri = ""
        self.started_ms: int | None = None  # the run's real start, for an MLflow run made later
        self.missing: list[str] = []  # files that could not be sent: gone from where the journal says
        self.sent_points = 0

    def connect(self) -> str:
        """The MLflow run of this job run on this server: the one kept, else the one tagged with the run's URL, else
        a new one (named after its parent's, where it has one)."""
        if self.client is None:
            self.client = client(self.where.uri)
        c = self.client
        if self.run_id is None:
            exp_id = experiment_id(c, self.where)
            url = self.where.run_url.replace("'", "\\'")
            found = [] if self.where.fresh else c.search_runs([exp_id], f"tags.`{RUN_TAG}` = '{url}'", max_results=1)
            if found:
                self.run_id = found[0].info.run_id
            else:
                tags, name, parent = {RUN_TAG: self.where.run_url}, self.where.run_name, self.where.parent_run_id
                if parent and (study := parent_name(c, parent)):  # a sweep's trial, named after its study
                    tags["mlflow.parentRunId"] = parent
                    name = f"{study}-{name}"
                made = c.create_run(exp_id, start_time=self.started_ms, run_name=name, tags=tags)
                self.run_id = made.info.run_id
        if self.params is None:
            run = c.get_run(self.run_id)
            self.params, self.artifact_uri = dict(run.data.params), run.info.artifact_uri
            if SENT_TAG in run.data.tags:
                step, n = run.data.tags[SENT_TAG].split()
                self.through = max(self.through, (int(step), int(n)))
            elif run.data.metrics and self.through == START:  # a run sent before the tag was kept: ask, once
                for key in run.data.metrics:
                    history = c.get_metric_history(self.run_id, key)
                    self.reached[key] = max((m.step for m in history), default=-1)
        return self.run_id

    def send(self, lines: list[dict[str, Any]]) -> int:
        """Send `lines` in order; returns how many were sent: all of them, or the client raises and the caller keeps
        them for another try (what the server took by then it holds, and is not sent again)."""
        self.connect()
        from mlflow.entities import Metric, RunTag

        c, run_id = self.client, self.run_id
        batch: list[Metric] = []
        done = self.through  # the cursor once the current batch is taken: past the last line wholly in it

        def flush() -> None:
            if batch:
                c.log_batch(run_id, metrics=batch, tags=[RunTag(SENT_TAG, f"{done[0]} {done[1]}")])
                self.sent_points += len(batch)
                for m in batch:
                    self.reached[m.key] = max(self.reached.get(m.key, -1), m.step)
                batch.clear()
            self.through = max(self.through, done)

        for entry in lines:
            if "step" in entry:
                step, t, place = int(entry["step"]), int(entry.get("t", time.time() * 1000)), entry.get("n", 0)
                if (step, place) < self.through:
                    continue
                for key, value in entry.get("m", {}).items():
                    if step > self.reached.get(key, -1):
                        batch.append(Metric(key, value, t, step))
                        if len(batch) == BATCH_METRICS:
                            flush()
                done = (step, place + 1)
                continue
            flush()
            if "params" in entry:
                self.send_params(entry)
            if "tags" in entry:
                tags = [RunTag(k, str(v)) for k, v in entry["tags"].items()]
                for at in range(0, len(tags), BATCH_TAGS):
                    c.log_batch(run_id, tags=tags[at : at + BATCH_TAGS])
            if "files" in entry:
                self.send_files(entry["files"])
            if "register" in entry:
                self.register(entry["register"], entry.get("version_tags") or {})
            if "status" in entry:
                if entry["status"] == "RUNNING":
                    c.update_run(run_id, status="RUNNING")
                else:
                    c.set_terminated(run_id, entry["status"], entry.get("t"))
        flush()
        return len(lines)

    def send_params(self, entry: dict[str, Any]) -> None:
        """A params line: new keys as params; a key whose value changed on resume keeps its first value (MLflow's
        params do not change) and gets its new one as the param KEY/at_step_STEP, and the tag job.changed/KEY
        saying the value, the step and the time."""
        from mlflow.entities import Param, RunTag

        c, held, at = self.client, self.params, entry.get("at")
        items, tags = [], []
        for k, v in entry["params"].items():
            v = str(v)[:PARAM_CHARS]
            if k not in held:
                items.append(Param(k, v))
            elif held[k] != v and at is not None:
                if f"{k}/at_step_{at}" not in held:
                    items.append(Param(f"{k}/at_step_{at}", v))
                when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(entry.get("t", 0) / 1000))
                tags.append(RunTag(f"job.changed/{k}", f"{v} at step {at}, {when} (was {held[k]})"))
            held[k] = v
        for at_ in range(0, len(items), BATCH_PARAMS):
            c.log_batch(self.run_id, params=items[at_ : at_ + BATCH_PARAMS])
        for at_ in range(0, len(tags), BATCH_TAGS):
            c.log_batch(self.run_id, tags=tags[at_ : at_ + BATCH_TAGS])
        held.update((p.key, p.value) for p in items)

    def send_files(self, files: list[list[str]]) -> None:
        """The run's files ([rel, the artifact folder it goes to]), each one not already there; one that is gone is
        named in `missing`."""
        c = self.client
        held: dict[str, set[str]] = {}
        with tempfile.TemporaryDirectory(prefix="job-track-") as tmp:
            for rel, folder in files:
                if folder not in held:
                    held[folder] = {Path(f.path).name for f in c.list_artifacts(self.run_id, folder or None)}
                name = Path(rel).name
                if name in held[folder]:
                    continue
                local = self.local_copy(rel, Path(tmp) / name)
                if local is None:
                    if rel not in self.missing:
                        self.missing.append(rel)
                    continue
                c.log_artifact(self.run_id, str(local), folder or None)
                held[folder].add(name)

    def local_copy(self, rel: str, spare: Path) -> Path | None:
        """A file of the run (or at a URL of its own: an export written elsewhere) on this machine's disk; None when
        it is gone."""
        if "://" in rel or os.path.isabs(rel):
            if os.path.isfile(rel):
                return Path(rel)
            data = read_url(rel)
            if data is None:
                return None
            spare.write_bytes(data)
            return spare
        local = self.run_dir.path(rel)
        if local.is_file():
            return local
        data = self.run_dir.read(rel)  # a run in a bucket, sent later from another machine
        if data is None:
            return None
        spare.write_bytes(data)
        return spare

    def register(self, name: str, tags: dict[str, Any]) -> None:
        """The run's model as a new version of `name`, once."""
        from mlflow.exceptions import MlflowException

        c = self.client
        try:
            c.create_registered_model(name)
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        if any(v.run_id == self.run_id for v in c.search_model_versions(f"name='{name}'")):
            return
        c.create_model_version(
            name, f"{self.artifact_uri}/model", run_id=self.run_id, tags={k: str(v) for k, v in tags.items()}
        )

    def describe_missing(self) -> str:
        """'' or a clause naming the files that could not be sent."""
        if not self.missing:
            return ""
        names = ", ".join(self.missing[:5]) + (f" and {len(self.missing) - 5} more" if len(self.missing) > 5 else "")
        return f"; not sent, gone from where the run's journal says they are: {names}"
