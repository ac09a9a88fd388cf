"""MLflow tracking: a job run is one MLflow run, and every point it makes reaches the server exactly once.

The run keeps a journal of what it tells the tracker (track.jsonl in the run folder, committed with every checkpoint
as metrics.jsonl is): points by step, params, tags, statuses and the files to send at the end. A resumed attempt cuts
the journal back to its checkpoint and makes the same points again, bit for bit; the server is asked how far each
metric got, and only later steps are sent. A thread sends, so a slow or absent server never slows a step; what it
could not send stays in the journal, and `python -m job track RUN` sends it later, as often as asked, never twice.
The server is the record of what was sent: nothing here can believe it sent what the server never took.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from job.cloud import read_url
from job.config import tracking_uri
from job.errors import ConfigError

if TYPE_CHECKING:
    from job.config import Config
    from job.storage import RunDir

JOURNAL = "track.jsonl"
RUN_TAG = "job.run"  # the run folder's URL: the MLflow run of a job run is found by it when its id was not kept
STUDY_TAG = "job.study"  # a sweep study's identity: its workers find the study's one MLflow run by it
SPLITS = ("train", "val", "test")
MEASURED = {"samples_per_s", "wall_s"}  # an evaluation's fields that are measured, not computed: under system/
# MLflow's limits on one log_batch call.
BATCH_METRICS, BATCH_PARAMS, BATCH_TAGS = 1000, 100, 100
PARAM_CHARS = 6000
END_WAIT_S = 120.0  # at the end, how long a server that is taking the points is given to take the rest
STOP_WAIT_S = 5.0  # the same for an attempt that stops: within its grace period
RETRY_MAX_S = 60.0
ENDINGS = {0: "FINISHED", 75: "SCHEDULED", 130: "KILLED"}  # by exit code; any other: FAILED


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
        return f"MLflow {self.uri}, experiment {self.experiment}, run {self.run_name}"


def target(cfg: Config, url: str, fresh: bool = False) -> Target | None:
    """The tracking a config asks for (track.mlflow, else the environment's MLFLOW_TRACKING_URI), or None; a
    ConfigError when its URI is malformed or the MLflow client is not installed."""
    uri = cfg.track.mlflow or environment_uri()  # track.mlflow was read when the config was
    if not uri:
        return None
    check_client(uri)
    preload()
    run_url = run_identity(url)
    name = run_url.rsplit("/", 1)[-1] or cfg.name
    return Target(uri, cfg.track.experiment or cfg.name, name, run_url, fresh, cfg.track.parent_run_id)


def environment_uri() -> str:
    """MLFLOW_TRACKING_URI, read as track.mlflow is; '' when unset."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    try:
        return tracking_uri(uri) if uri else ""
    except ValueError as e:
        raise ConfigError(f"MLFLOW_TRACKING_URI {uri!r}: {e}") from None


def experiment_id(client, where: Target) -> str:
    """The id of `where`'s experiment, made when it is new (its files kept where artifacts() says)."""
    exp = client.get_experiment_by_name(where.experiment)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(where.experiment, artifacts(where.uri))
    except Exception:  # another process made it first (two sweep workers starting together)
        if (exp := client.get_experiment_by_name(where.experiment)) is None:
            raise
        return exp.experiment_id


def study_run(where: Target, name: str, study: str) -> str:
    """The MLflow run of a sweep's study, tagged job.study with `study` (an identity safe in a filter): the one run
    every worker of the study agrees on, made by the first. Workers that start together may each make one; each then
    looks again and keeps the earliest made (start time, then run id), a later one deleting its own. (Two whose
    requests cross within one round trip could still each keep their own: both then see both on a later search.)
    '' when the server does not answer: each trial is then tracked alone."""
    from job.console import say

    try:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=where.uri)
        exp = experiment_id(client, where)
        if not (found := study_runs(client, exp, study)):
            made = client.create_run(exp, run_name=name, tags={STUDY_TAG: study, "job.study_name": name}).info.run_id
            found = study_runs(client, exp, study)
            if found[0] != made:
                client.delete_run(made)
        return found[0]
    except Exception as e:  # the client's and the server's errors
        say(f"tracking: no MLflow run for the study ({one_line(e)}); each trial is tracked alone")
        return ""


def study_runs(client, experiment: str, study: str) -> list[str]:
    """The ids of the study's runs not deleted, the earliest made first."""
    runs = client.search_runs([experiment], filter_string=f"tags.`{STUDY_TAG}` = '{study}'")
    return [r.info.run_id for r in sorted(runs, key=lambda r: (r.info.start_time, r.info.run_id))]


def end_study_run(where: Target, run_id: str, best: dict[str, Any]) -> None:
    """The study's MLflow run finished, with the best trial (best.json's) and its metric as best_<name>."""
    from job.console import say

    try:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=where.uri)
        for name, value in best.get("metric", {}).items():
            client.log_metric(run_id, f"best_{name}", value)
        client.set_tag(run_id, "job.best_trial", str(best.get("trial", "")))
        client.set_terminated(run_id)
    except Exception as e:  # the client's and the server's errors
        say(f"tracking: the study's MLflow run could not be ended ({one_line(e)})")


def artifacts(uri: str) -> str | None:
    """Where a new experiment keeps its files: beside a database file (MLflow's default is ./mlruns in whatever
    folder the job runs from); the server's own choice otherwise."""
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///") :]).resolve().parent.joinpath("mlartifacts").as_uri()
    return None


def run_identity(url: str) -> str:
    """The run folder's URL as its MLflow run is tagged with it: a local folder by its absolute path."""
    url = url.rstrip("/") or url
    return url if "://" in url else os.path.abspath(url)


def check_client(uri: str) -> None:
    import importlib.util

    try:
        found = importlib.util.find_spec("mlflow") is not None
    except ValueError:  # marked absent in sys.modules
        found = False
    if not found:
        raise ConfigError(
            f"tracking in MLflow ({uri}) needs its client: pip install mlflow-skinny (or mlflow for a sqlite:// URI)"
        )
    database = uri.split(":", 1)[0] in ("sqlite", "postgresql", "mysql", "mssql")
    if database and importlib.util.find_spec("alembic") is None:
        raise ConfigError(f"tracking in a database ({uri}) needs the whole MLflow package: pip install mlflow")


def ending(exit_code: int, short: bool = False) -> str:
    """The MLflow status of a run whose attempt ended with `exit_code`: SCHEDULED while it waits to be continued
    (stopped by a signal, a time limit, or `short` of its end by its budget)."""
    return "SCHEDULED" if short else ENDINGS.get(exit_code, "FAILED")


def metric_name(name: str) -> str:
    """A name MLflow accepts (letters, digits, _ - . / and spaces); a class named otherwise keeps its place."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in name)


def evaluation_points(record: dict[str, Any]) -> dict[str, float]:
    """An evaluation's metrics.jsonl record as MLflow metrics: named as there, what was measured under system/."""
    out = {}
    for key, value in record.items():
        if key in ("epoch", "step") or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        out[f"system/{key}" if key in MEASURED else key] = float(value)
    return out


def test_points(record: dict[str, Any]) -> dict[str, float]:
    """The end's test record: the test split's metrics and the chosen epoch (system/: a choice, not a score). Its
    val_* fields repeat the chosen evaluation's, already sent at their own step."""
    out = {k: float(v) for k, v in record.items() if k.startswith(("test_", "final_test_"))}
    if "chosen_epoch" in record:
        out["system/chosen_epoch"] = float(record["chosen_epoch"])
    return out


def read_journal(data: bytes | None) -> list[dict[str, Any]]:
    lines = []
    for line in (data or b"").decode(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill
        if isinstance(entry, dict):
            lines.append(entry)
    return lines


class Journal:
    """track.jsonl: appended by the loop (and by the sender, the MLflow run's id), read by the sender."""

    def __init__(self, run_dir: RunDir, upto_step: int | None, fresh: bool = False) -> None:
        """Open the run's journal; a resumed attempt keeps the points up to the step it resumes from (`upto_step`,
        None: all) and every line that has no step; `fresh`: none of it."""
        self.run_dir, self.lock = run_dir, threading.Lock()
        lines = [] if fresh else read_journal(run_dir.read(JOURNAL))
        if upto_step is not None:
            lines = [e for e in lines if e.get("step") is None or e["step"] <= upto_step]
        self.lines = lines
        run_dir.write(JOURNAL, "".join(json.dumps(e) + "\n" for e in lines).encode())

    def add(self, entry: dict[str, Any]) -> None:
        with self.lock:
            self.lines.append(entry)
            with open(self.run_dir.path(JOURNAL), "a") as f:
                f.write(json.dumps(entry) + "\n")

    def since(self, at: int) -> list[dict[str, Any]]:
        with self.lock:
            return self.lines[at:]

    def known(self, key: str) -> Any:
        """The last value a line gave `key` (the MLflow run id, ...), or None."""
        with self.lock:
            return next((e[key] for e in reversed(self.lines) if key in e), None)


class Sender:
    """Sends journal lines to the MLflow server in order. It asks the server what it holds (the run, its params, how
    far each metric got, its artifacts and model versions) and sends only the rest, so any number of senders, in
    any number of processes, one after another, send each point once."""

    def __init__(self, where: Target, run_dir: RunDir, run_id: str | None = None) -> None:
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the sender retries itself, in the background
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
        self.where, self.run_dir, self.run_id = where, run_dir, run_id
        self.client = None
        self.reached: dict[str, int] = {}  # metric -> the last step the server holds
        self.params: dict[str, str] | None = None
        self.artifact_uri = ""

    def connect(self) -> str:
        """The MLflow run of this job run: the one kept, else the one tagged with the run's URL, else a new one."""
        if self.client is None:
            from mlflow import MlflowClient

            for name in ("mlflow", "alembic"):  # set on their import; their notes (tables made, ...) are not the run's
                logging.getLogger(name).setLevel(logging.WARNING)
            self.client = MlflowClient(tracking_uri=self.where.uri)
        c = self.client
        if self.run_id is None:
            exp_id = experiment_id(c, self.where)
            url = self.where.run_url.replace("'", "\\'")
            found = [] if self.where.fresh else c.search_runs([exp_id], f"tags.`{RUN_TAG}` = '{url}'", max_results=1)
            if found:
                self.run_id = found[0].info.run_id
            else:
                tags = {RUN_TAG: self.where.run_url}
                tags |= {"mlflow.parentRunId": self.where.parent_run_id} if self.where.parent_run_id else {}
                made = c.create_run(exp_id, run_name=self.where.run_name, tags=tags)
                self.run_id = made.info.run_id
        if self.params is None:
            run = c.get_run(self.run_id)
            self.params, self.artifact_uri = dict(run.data.params), run.info.artifact_uri
            for key in run.data.metrics:  # how far each metric got; metrics the server lacks start from nothing
                history = c.get_metric_history(self.run_id, key)
                self.reached[key] = max((m.step for m in history), default=-1)
        return self.run_id

    def send(self, lines: list[dict[str, Any]]) -> int:
        """Send `lines` in order; returns how many were sent: all of them, or the client raises and the caller keeps
        them for another try (what the server took by then it holds, and is not sent again)."""
        from mlflow.entities import Metric, Param, RunTag

        self.connect()
        c, run_id = self.client, self.run_id
        batch: list[Metric] = []

        def flush() -> None:
            if batch:
                c.log_batch(run_id, metrics=batch)
                for m in batch:
                    self.reached[m.key] = max(self.reached.get(m.key, -1), m.step)
                batch.clear()

        for entry in lines:
            if "step" in entry:
                step, t = int(entry["step"]), int(entry.get("t", time.time() * 1000))
                for key, value in entry.get("m", {}).items():
                    if step > self.reached.get(key, -1):
                        batch.append(Metric(key, value, t, step))
                        if len(batch) == BATCH_METRICS:
                            flush()
                continue
            flush()
            if "params" in entry:
                new = {k: str(v)[:PARAM_CHARS] for k, v in entry["params"].items() if k not in self.params}
                items = [Param(k, v) for k, v in new.items()]
                for at in range(0, len(items), BATCH_PARAMS):
                    c.log_batch(run_id, params=items[at : at + BATCH_PARAMS])
                self.params.update(new)
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

    def send_files(self, files: list[list[str]]) -> None:
        """The run's files ([rel, the artifact folder it goes to]), each one not already there."""
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


class Tracker:
    """The run's MLflow sink, kept by the process that writes the run: the loop adds lines to the journal and a
    thread sends them."""

    def __init__(self, where: Target, run_dir: RunDir, upto_step: int | None) -> None:
        self.where, self.run_dir = where, run_dir
        self.journal = Journal(run_dir, upto_step, where.fresh)
        self.sender = Sender(where, run_dir, self.journal.known("run_id"))
        self.at, self.problem, self.failures = 0, "", 0
        self.wake, self.quit = threading.Event(), False
        preload()
        self.journal.add({"server": where.uri, "experiment": where.experiment, "run_name": where.run_name})
        self.thread = threading.Thread(target=self.work, name="job-track", daemon=True)
        self.thread.start()

    @property
    def run_id(self) -> str | None:
        return self.sender.run_id

    def point(self, step: int, metrics: dict[str, float]) -> None:
        """Metrics at `step`; sent within seconds (the loop never waits for the server)."""
        if metrics:
            self.journal.add({"step": step, "t": int(time.time() * 1000), "m": metrics})
            self.wake.set()

    def add(self, entry: dict[str, Any]) -> None:
        """Params, tags, a status, files or a registration, in order with the points."""
        self.journal.add(entry)
        self.wake.set()

    def work(self) -> None:
        while True:
            self.wake.wait(self.retry_in() if self.problem else None)
            self.wake.clear()
            sent = self.send_pending()
            if self.quit and (not sent or not self.unsent()):  # at the end a server that fails is not waited for
                return

    def retry_in(self) -> float:
        return min(2.0**self.failures, RETRY_MAX_S)

    def send_pending(self) -> bool:
        lines = self.journal.since(self.at)
        if not lines:
            return True
        kept = self.sender.run_id
        try:
            self.at += self.sender.send(lines)
            self.problem, self.failures = "", 0
        except Exception as e:  # whatever the server or the network says: the lines wait for the next try
            self.problem, self.failures = one_line(e), self.failures + 1
            self.sender.params = None  # a request may have reached it with its answer lost: ask it again what it holds
            return False
        finally:
            if kept is None and self.sender.run_id is not None:  # kept in the run: the next attempt continues it
                self.journal.add({"run_id": self.sender.run_id})
        return True

    def unsent(self) -> list[dict[str, Any]]:
        return [e for e in self.journal.since(self.at) if carries(e)]

    def end(self, status: str, cfg: Config | None = None, metrics: dict[str, Any] | None = None) -> str:
        """The attempt ended (`status`, as ending() names it); a finished run's files (and its model version, as `cfg`
        asks, tagged with `metrics`) and the status are sent, waited for while the server takes them (not at all when
        it is down); one line saying where it went or what still waits."""
        finished = status == "FINISHED"
        if finished and cfg is not None:
            self.add({"files": run_files(self.run_dir, cfg.track.log_model)})
            if cfg.track.register and cfg.track.log_model:
                self.add({"register": cfg.track.register, "version_tags": metrics or {}})
        self.add({"status": status, "t": int(time.time() * 1000)})
        self.run_dir.upload(JOURNAL)
        self.quit = True
        self.wake.set()
        self.thread.join(timeout=END_WAIT_S if finished else STOP_WAIT_S)
        return self.describe_end()

    def describe_end(self) -> str:
        left = self.unsent()
        if not left:
            return f"tracking: sent to {self.where.describe()}"
        points = sum(len(e.get("m", {})) for e in left)
        what = f"{points:,} points" if points else "the run's end"
        why = f" ({self.problem})" if self.problem else ""
        return (
            f"tracking: {what} not yet sent to MLflow {self.where.uri}{why}; kept in {JOURNAL}: "
            f"python -m job track {self.run_dir.url} sends them"
        )


def run_files(run_dir: RunDir, log_model: bool) -> list[list[str]]:
    """[file of the run, artifact folder] of what a finished run sends: its description and reports, and the chosen
    model (model.pt with model.json, as `job predict` reads them) under model/."""
    described = ("model.json", "config.yaml", "data.json", "run.json", "curves.png")
    files = [[rel, ""] for rel in described if run_dir.has(rel)]
    for split in SPLITS:
        files += [[f"report/{split}/{name}", f"report/{split}"] for name in run_dir.list(f"report/{split}")]
    files += [[rel, "model"] for rel in ("model.pt", "model.json") if log_model and run_dir.has(rel)]
    return files


_preloaded = threading.Event()


def preload() -> None:
    """Once a run is tracked: import in this thread what MLflow imports and other libraries look up in sys.modules
    (IPython, which matplotlib reads as it draws, and would find half imported by another thread), then MLflow's
    client on a thread of its own, from the start of the run: its 1.3 s of CPU overlaps reading the data rather
    than the first epoch (a 2-core machine measured 1.027x an untracked epoch with the import inside it)."""
    import importlib.util

    if _preloaded.is_set():
        return
    _preloaded.set()
    if importlib.util.find_spec("IPython") is not None:
        import IPython  # noqa: F401
    threading.Thread(target=importlib.import_module, args=("mlflow",), name="job-track-import", daemon=True).start()


def carries(entry: dict[str, Any]) -> bool:
    """Whether a journal line has something for the server (not only a note of the run's own: its MLflow run id)."""
    return any(k in entry for k in ("step", "params", "tags", "files", "register", "status"))


def one_line(e: BaseException) -> str:
    """What went wrong in words: the client's messages carry whole URLs and retry counts."""
    text = " ".join(str(e).split()) or type(e).__name__
    for sign, said in (("Connection refused", "connection refused"), ("timed out", "no answer in time")):
        if sign in text:
            return f"the server: {said}"
    return text[:200]


def run_of(model_url: str) -> RunDir | None:
    """The tracked run of a model: its run folder, its model.pt, or one of its checkpoints; None if untracked."""
    from job.storage import RunDir

    url = model_url.rstrip("/")
    for candidate in (url, url.rsplit("/", 1)[0], url.rsplit("/", 2)[0]):
        run = RunDir(candidate)
        if run.read(JOURNAL):
            return run
    return None


def send_export(model_url: str, files: list[str]) -> tuple[str, bool]:
    """`job export --track`: the export's files join the run's journal (artifact folder export/) and are sent with
    whatever else the server lacks."""
    run = run_of(model_url)
    if run is None:
        raise ConfigError(f"export --track: {model_url} is not of a run tracked in MLflow (no {JOURNAL} in its folder)")
    journal = run.read(JOURNAL) or b""
    run.send(JOURNAL, journal + (json.dumps({"files": [[f, "export"] for f in files]}) + "\n").encode())
    return send_run(run)


def send_run(run_dir: RunDir, uri: str | None = None) -> tuple[str, bool]:
    """`job track`: send what a run's journal holds that the server lacks; (a line for the user, all sent)."""
    lines = read_journal(run_dir.read(JOURNAL))
    if not lines and not run_dir.has_run():
        raise ConfigError(f"{run_dir.url} holds no run (no config.yaml, no checkpoints): name a run folder")
    if not lines:
        raise ConfigError(f"{run_dir.url} holds no {JOURNAL}: it was not run with track.mlflow or MLFLOW_TRACKING_URI")
    server = next((e for e in reversed(lines) if "server" in e), {})
    uri = uri or server.get("server") or os.environ.get("MLFLOW_TRACKING_URI", "")
    try:
        tracking_uri(uri)
    except ValueError as e:
        raise ConfigError(f"--mlflow {uri!r}: {e}") from None
    check_client(uri)
    run_name = server.get("run_name") or run_dir.url.rstrip("/").rsplit("/", 1)[-1]
    where = Target(uri, server.get("experiment") or "Default", run_name, run_identity(run_dir.url))
    sender = Sender(where, run_dir, next((e["run_id"] for e in reversed(lines) if "run_id" in e), None))
    try:
        sender.connect()
        held = dict(sender.reached)
        sender.send(lines)
    except Exception as e:
        return f"tracking: {run_dir.url} not sent to MLflow {uri}: {one_line(e)}", False
    sent = sum(1 for e in lines if "step" in e for k in e.get("m", {}) if e["step"] > held.get(k, -1))
    return f"tracking: {sent:,} points sent; {run_dir.url} is in {where.describe()} (run id {sender.run_id})", True
