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
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from job.config import tracking_uri
from job.errors import ConfigError
from job.retry import Backoff
from job.sinks.sink import CLASSES, COST, EVALUATION, TESTED, WINDOW, Record, Sink
from job.sinks.track_journal import JOURNAL, Journal, carries, destination, read_journal
from job.sinks.track_server import Sender, Target

if TYPE_CHECKING:
    from job.config import Config
    from job.storage.run_folder import RunDir

SPLITS = ("train", "val", "test")
MEASURED = {"samples_per_s", "wall_s"}  # an evaluation's fields that are measured, not computed: under system/
END_WAIT_S = 120.0  # at the end, how long a server that is taking the points is given to take the rest
STOP_WAIT_S = 5.0  # the same for an attempt that stops: within its grace period
SEND_BACKOFF = Backoff(2.0, 60.0)  # seconds before the sender tries a server that failed again (new points: at once)
PROBE_S = 2.0  # how long the start's look at the server waits for an answer
ENDINGS = {0: "FINISHED", 75: "SCHEDULED", 130: "KILLED"}  # by exit code; any other: FAILED
__all__ = ["JOURNAL", "Target", "Tracker", "send_run", "send_export"]


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


class Tracker(Sink):
    """The run's MLflow sink, kept by the process that writes the run: the records it takes are lines of the journal,
    which a thread sends."""

    def __init__(self, where: Target, run_dir: RunDir, upto_step: int | None) -> None:
        """The journal opened (cut back to `upto_step`, the step the attempt resumes from) and the sender started, at
        the MLflow run and the place the journal's marks of `where`'s server name; a server that refuses or answers
        404 is said at once."""
        self.where, self.run_dir, self.upto_step = where, run_dir, upto_step
        self.journal = Journal(run_dir, upto_step, where.fresh)
        mark = self.journal.destination(where.uri)
        self.sender = Sender(where, run_dir, mark.get("run_id"), mark.get("through", (-1, 0)))
        self.at, self.problem, self.failures = 0, "", 0
        self.wake, self.quit = threading.Event(), False
        preload()
        header = {"server": where.uri, "experiment": where.experiment, "run_name": where.run_name}
        self.journal.add(header | {"t": int(time.time() * 1000)})
        self.sender.started_ms = min(e["t"] for e in self.journal.since(0) if "t" in e)
        if said := probe(where.uri, where.experiment):
            from job.console import say

            say(f"tracking: MLflow {where.uri} {said}; the run goes on, its points kept in {JOURNAL} until it answers")
        self.thread = threading.Thread(target=self.work, name="job-track", daemon=True)
        self.thread.start()

    name = "mlflow"  # its part of the reporter's state

    @property
    def run_id(self) -> str | None:
        return self.sender.run_id

    def state_dict(self) -> dict[str, Any]:
        """What each server took, by tracking URI (the journal's marks): a checkpoint keeps them."""
        return {"sent": self.journal.marks()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's marks, where they say more than the journal's. The sender running goes by the server's
        own job.sent tag, never behind a mark; the next sender (`job track`, an attempt) reads these."""
        self.journal.merge(state.get("sent", {}))

    def take(self, record: Record) -> None:
        """A record as MLflow metrics: named as metrics.jsonl and TensorBoard name them, what was measured (and the
        cost) under system/, each class's F1 as <split>_f1/<class>."""
        if record.kind == WINDOW:
            self.point(record.step, record.values)
        elif record.kind == EVALUATION:
            self.point(record.step, evaluation_points(record.values))
        elif record.kind == TESTED:
            self.point(record.step, test_points(record.values))
        elif record.kind == CLASSES:
            named = {metric_name(f"{record.split}_f1/{name}"): value for name, value in record.values.items()}
            self.point(record.step, named)
        elif record.kind == COST:
            self.point(record.step, {f"system/cost_{k.split('/')[-1]}": float(v) for k, v in record.values.items()})

    def flush(self) -> None:
        self.run_dir.upload(JOURNAL)

    def point(self, step: int, metrics: dict[str, float]) -> None:
        """Metrics at `step`; sent within seconds (the loop never waits for the server)."""
        if metrics:
            self.journal.add({"step": step, "t": int(time.time() * 1000), "m": metrics})
            self.wake.set()

    def add(self, entry: dict[str, Any]) -> None:
        """Params, tags, a status, files or a registration, in order with the points, stamped with the time and the
        step the attempt began at (what a param changed on resume is recorded with)."""
        self.journal.add({"t": int(time.time() * 1000), "at": max(self.upto_step or 0, 0)} | entry)
        self.wake.set()

    def work(self) -> None:
        while True:
            self.wake.wait(SEND_BACKOFF.delay(self.failures) if self.problem else None)
            self.wake.clear()
            sent = self.send_pending()
            if self.quit and (not sent or not self.unsent()):  # at the end a server that fails is not waited for
                return

    def send_pending(self) -> bool:
        lines = self.journal.since(self.at)
        if not lines:
            return True
        kept, through = self.sender.run_id, self.sender.through
        try:
            self.at += self.sender.send(lines)
            self.problem, self.failures = "", 0
        except Exception as e:  # whatever the server or the network says: the lines wait for the next try
            self.problem, self.failures = one_line(e), self.failures + 1
            return False
        finally:  # the marks of this server, kept in the run: the next attempt, or `job track`, goes on from them
            if kept is None and self.sender.run_id is not None:
                self.journal.add({"run_id": self.sender.run_id, "sent": self.where.uri})
            if self.sender.through > through:
                self.journal.add({"sent": self.where.uri, "through": list(self.sender.through)})
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
            return f"tracking: sent to {self.where.describe()}{self.sender.describe_missing()}"
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


def one_line(e: BaseException) -> str:
    """What went wrong in words: the client's messages carry whole URLs and retry counts."""
    text = " ".join(str(e).split()) or type(e).__name__
    for sign, said in (("Connection refused", "connection refused"), ("timed out", "no answer in time")):
        if sign in text:
            return f"the server: {said}"
    return text[:200]


def run_of(model_url: str) -> RunDir | None:
    """The tracked run of a model: its run folder, its model.pt, or one of its checkpoints; None if untracked."""
    from job.storage.run_folder import RunDir

    url = model_url.rstrip("/")
    for candidate in (url, url.rsplit("/", 1)[0], url.rsplit("/", 2)[0]):
        run = RunDir(candidate)
        if run.read(JOURNAL):
            return run
    return None


def send_export(model_url: str, files: list[str]) -> tuple[str, bool]:
    """`job export --track`: the export's files join the run's journal (artifact folder export/), a local one by its
    absolute path (the run's files are named relative to its folder, an export's as the command was given them), and
    are sent with whatever else the server lacks."""
    run = run_of(model_url)
    if run is None:
        raise ConfigError(f"export --track: {model_url} is not of a run tracked in MLflow (no {JOURNAL} in its folder)")
    journal = run.read(JOURNAL) or b""
    named = [[f if "://" in f else os.path.abspath(f), "export"] for f in files]
    run.send(JOURNAL, journal + (json.dumps({"files": named}) + "\n").encode())
    return send_run(run)


def send_run(run_dir: RunDir, uri: str | None = None) -> tuple[str, bool]:
    """`job track`: send what a run's journal holds that the server lacks, to `uri`, else the server the run's
    config names (track.mlflow; the one it was last tracked in when the environment named it); (a line for the
    user, all sent)."""
    lines = read_journal(run_dir.read(JOURNAL))
    if not lines and not run_dir.has_run():
        raise ConfigError(f"{run_dir.url} holds no run (no config.yaml, no checkpoints): name a run folder")
    if not lines:
        raise ConfigError(f"{run_dir.url} holds no {JOURNAL}: it was not run with track.mlflow or MLFLOW_TRACKING_URI")
    headers = [e for e in lines if "server" in e and "run_name" in e]
    uri = uri or configured(run_dir, "mlflow") or (headers[-1]["server"] if headers else "")
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    try:
        tracking_uri(uri)
    except ValueError as e:
        raise ConfigError(f"--mlflow {uri!r}: {e}") from None
    check_client(uri)
    header = next((e for e in reversed(headers) if e["server"] == uri), headers[-1] if headers else {})
    run_name = header.get("run_name") or run_dir.url.rstrip("/").rsplit("/", 1)[-1]
    parent = configured(run_dir, "parent_run_id")  # a sweep's trial: its study's run, where the server holds it
    where = Target(uri, header.get("experiment") or "Default", run_name, run_identity(run_dir.url), False, parent)
    mark = destination(lines, uri)
    sender = Sender(where, run_dir, mark.get("run_id"), mark.get("through", (-1, 0)))
    sender.started_ms = min((e["t"] for e in lines if "t" in e), default=None)
    try:
        sender.send(lines)
    except Exception as e:
        return f"tracking: {run_dir.url} not sent to MLflow {uri}: {one_line(e)}", False
    said = f"tracking: {sender.sent_points:,} points sent; {run_dir.url} is in {where.describe()}"
    return f"{said} (run id {sender.run_id}){sender.describe_missing()}", True


def configured(run_dir: RunDir, key: str) -> str:
    """track.<key> of the run's config.yaml (mlflow, parent_run_id); '' when it names none (or cannot be read)."""
    import yaml

    try:
        cfg = yaml.safe_load(run_dir.read("config.yaml") or b"") or {}
        return str((cfg.get("track") or {}).get(key) or "")
    except (yaml.YAMLError, AttributeError):
        return ""


def probe(uri: str, experiment: str) -> str:
    """'' or what is wrong with an http(s) tracking URI, found by one request at the start: a refused connection,
    or a 404 that is not MLflow's answer for an experiment it does not hold yet (a typo is likelier than an outage).
    A server that answers late or with another error is left to the sender's retries."""
    import urllib.error
    import urllib.parse
    import urllib.request

    if not uri.startswith(("http://", "https://")):
        return ""
    query = urllib.parse.urlencode({"experiment_name": experiment})
    try:
        urllib.request.urlopen(f"{uri.rstrip('/')}/api/2.0/mlflow/experiments/get-by-name?{query}", timeout=PROBE_S)
    except urllib.error.HTTPError as e:
        if e.code == 404 and b"RESOURCE_DOES_NOT_EXIST" not in e.read()[:4096]:
            return "answers 404: no MLflow tracking API there (a typo in the URI?)"
    except urllib.error.URLError as e:
        if isinstance(e.reason, ConnectionRefusedError):
            return "refused the connection (connection refused: a typo in the URI, or the server is down)"
    except (OSError, ValueError):  # no answer in time, a reset (the sender retries), a URL urllib cannot take
        pass
    return ""
