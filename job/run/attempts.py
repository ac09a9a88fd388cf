"""run.json: every attempt of a run (each invocation that got as far as training), appended when it starts and
completed when it ends, so a run preempted five times shows six attempts: when and where each ran, with what
versions and devices, from which epoch and step to which, and how it ended (its exit code; none when the machine
went away before it could say). Each attempt also says what it cost and what its stop threw away: `device_hours`
(devices x its wall time, from its process's start), `startup_s` (process start to its first step) and `lost_s`
(the training after its last commit that the next attempt redoes); run.json's `cost` holds the totals (job/run/cost.py).

An attempt killed without notice cannot say when it stopped: the writing process keeps a sign of life, a file in the
run folder (its staging copy, for a remote run) rewritten every PULSE_S seconds by a thread, and the next attempt
bounds the kill by it, else by the stale lease's heartbeat (job/storage/lease.py), else by the last time the attempt
wrote run.json."""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from job.errors import ConfigError
from job.group import platforms
from job.group.env import cpu_model, cpus, torchvision_version
from job.run.cost import Budget, Price, in_budget_unit, price_of, spent_of, totals
from job.storage.cloud import read_url, write_url
from job.storage.run_folder import PULSE, RunDir

RUN_JSON = "run.json"
PULSE_S = 0.5  # a killed attempt's stop is known to within this (plus a busy machine's delay)


def now() -> str:
    return iso(time.time())


def iso(t: float) -> str:
    """A moment in UTC, to the millisecond (lost seconds are reported to within one)."""
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="milliseconds")


def moment(text: str) -> float:
    return datetime.datetime.fromisoformat(text).timestamp()


class Attempt:
    """This invocation's entry in run.json. Only the process that writes the run keeps one (`run_dir` None: the
    others); end() before begin() does nothing (a run that failed while setting up is no attempt). Device hours count
    the group's processes (world_size): a GPU each, and on a CPU each process is one device as torch places it."""

    def __init__(self, run_dir: RunDir | None, began: float | None = None) -> None:
        """`began`: when the attempt began, as time.time() (its process's start, where the process is its own):
        start-up and device time count from there."""
        self.run_dir, self.entry, self.state = run_dir, None, None
        self.number = 0  # this attempt's place in run.json, from 1
        self.tracker = None  # the run's MLflow sink (job/sinks/track.py), told how the attempt ends
        self.cfg = None
        self.process_started = began or time.time()
        self.price: Price = None
        self.total_steps: int | None = None
        self.t_mark = 0.0  # the last commit (or the start of training): what a stop now would lose from
        self.interval_s = 0.0  # the time between the last two commits (the first: from the start of training)
        self.t_end: float | None = None  # the attempt's end, once settled
        self.note: str | None = None  # run.json's top-level note: why the run stopped short of its end
        self._pulse = threading.Event()
        self._thread: threading.Thread | None = None

    def begin(
        self, state, world: int, device: torch.device, price: Price = None, total_steps: int | None = None
    ) -> None:
        """Training starts from `state` (its epoch and step are read again at the end) and goes to `total_steps`."""
        if self.run_dir is None:
            return
        self.state, self.price, self.total_steps = state, price, total_steps
        self.t_mark = time.time()
        self.entry = {
            "started": iso(self.t_mark),
            "ended": None,
            "exit_code": None,
            "argv": sys.argv,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "platform": platforms.current().record(),
            "versions": versions(),
            "devices": devices(device),
            "world_size": world,
            "from": {"epoch": state.epoch, "step": state.step},
            "to": None,
            "startup_s": round(self.t_mark - self.process_started, 3),
            "device_hours": 0.0,
            "lost_s": None,
            "committed": None,
        }
        self.write(history(self.run_dir))
        self._thread = threading.Thread(target=self._beat, name="job-attempt-pulse", daemon=True)
        self._thread.start()

    def committed(self, epoch: int, step: int) -> None:
        """A checkpoint of this epoch and step was committed: a stop from now on loses only what follows."""
        if self.entry is None:
            return
        t = time.time()
        self.interval_s, self.t_mark = t - self.t_mark, t
        self.entry["committed"] = {"time": iso(t), "epoch": epoch, "step": step}
        self.write()

    def track(self, tracker, cfg, params: dict[str, Any]) -> None:
        """The run is tracked: the MLflow run gets the settings and decisions as params, this attempt as tags."""
        self.tracker, self.cfg = tracker, cfg
        tags = {"job.version": self.entry["versions"]["job"], "job.git_commit": self.entry["versions"]["git_commit"]}
        tags |= {"job.platform": platforms.current().name, "job.attempts": self.number, "job.host": self.entry["host"]}
        tracker.add({"params": params})
        tracker.add({"tags": {k: v for k, v in tags.items() if v is not None}})
        tracker.add({"status": "RUNNING"})

    def settle(self) -> dict[str, Any]:
        """The attempt's end fixed at now, for the figures shown before end() writes them; returns the run's cost."""
        self.t_end = self.t_end or time.time()
        return self.cost()

    def cost(self) -> dict[str, Any]:
        """run.json's cost block as it stands now (this attempt counted up to now, or its settled end)."""
        if self.entry is None:
            return totals([], self.price)
        self._count(self.t_end or time.time())
        return totals(self._attempts(read_attempts(self.run_dir)), self.price, self.state.step, self.total_steps)

    def over(self, budget: Budget) -> str:
        """Why the run stops at the checkpoint just committed (empty: it goes on): going on to the next would pass
        the budget, estimated from the time the interval since the previous one took at this attempt's price."""
        if self.entry is None:
            return ""
        spent = spent_of(self.cost(), budget) or 0.0
        next_one = self.entry["world_size"] * self.interval_s / 3600 * (self.own_price() if budget.money else 1.0)
        if spent + next_one <= budget.amount:
            return ""
        return (
            f"{budget.describe()}: {in_budget_unit(spent, budget)} spent of {in_budget_unit(budget.amount, budget)}, "
            f"and the next checkpoint would pass it"
        )

    def own_price(self) -> float:
        """This attempt's price of a device hour (a money budget has one: checked before training)."""
        return price_of(self.price, self.entry["devices"][0]) or 0.0

    def end(
        self, exit_code: int, budget: Budget | None = None, note: str = "", metrics: dict[str, Any] | None = None
    ) -> None:
        """The attempt ended with `exit_code`; `budget`: it stopped there, short of the run's end, as `note` (run.json's
        top-level note) says; a finished run's `metrics` tag its registered model version."""
        if self.entry is None or self.entry["ended"] is not None:
            return
        self._pulse.set()
        t = self.t_end = self.t_end or time.time()
        step = self.state.step
        mark = (self.entry["committed"] or {}).get("step", self.entry["from"]["step"])
        self.entry.update(ended=iso(t), exit_code=exit_code, to={"epoch": self.state.epoch, "step": step})
        self.entry["lost_s"] = 0.0 if step == mark else round(max(0.0, t - self.t_mark), 3)  # all committed: none
        if budget is not None:
            self.entry |= {"stopped": "budget", "budget": budget.text}
            self.note = note
        self.write()
        if self._thread is not None:
            self._thread.join()
        Path(self.run_dir.path(PULSE)).unlink(missing_ok=True)
        if self.tracker is not None:
            from job.console import say
            from job.sinks.track import ending

            said = self.tracker.end(ending(exit_code, short=budget is not None), self.cfg, metrics)
            if self.tracker.run_id is not None:  # known once the server answered, maybe only now
                self.entry["mlflow_run_id"] = self.tracker.run_id
                self.write()
            say(said)

    def write(self, attempts: list[dict[str, Any]] | None = None) -> None:
        """run.json with this attempt as its last entry (appended the first time, replaced after), its cost to now,
        and what else the file holds kept."""
        data = self.run_dir.read(RUN_JSON)
        doc = document(data) if data else {}
        attempts = self._attempts(attempts if attempts is not None else attempts_of(doc))
        self._count(self.t_end or time.time())
        doc["attempts"] = attempts
        doc["cost"] = totals(attempts, self.price, self.state.step, self.total_steps)
        doc.pop("note", None)
        doc |= {"note": self.note} if self.note else {}
        self.run_dir.write(RUN_JSON, (json.dumps(doc, indent=1) + "\n").encode())

    def _attempts(self, attempts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.number:
            attempts[self.number - 1 : self.number] = [self.entry]
        else:
            attempts.append(self.entry)
            self.number = len(attempts)
        return attempts

    def _count(self, t: float) -> None:
        """This attempt's device hours up to `t`, from its process's start (the devices are held while it sets up)."""
        self.entry["device_hours"] = round(self.entry["world_size"] * max(0.0, t - self.process_started) / 3600, 6)

    def _beat(self) -> None:
        """Rewrite the sign of life until the attempt ends: a small local file, no fsync (a killed process's writes
        survive it; a machine that goes away takes the file with it, and the lease's heartbeat bounds the stop)."""
        path = Path(self.run_dir.path(PULSE))
        me = {"host": self.entry["host"], "pid": self.entry["pid"], "started": self.entry["started"]}
        while True:
            try:
                tmp = path.with_name(f"{PULSE}.tmp")
                tmp.write_text(json.dumps({**me, "alive": time.time()}))
                os.replace(tmp, path)
            except OSError:  # a full or vanished disk: the commits' times bound the stop instead
                pass
            if self._pulse.wait(PULSE_S):
                return


def history(run_dir: RunDir) -> list[dict[str, Any]]:
    """The attempts run.json holds, with those killed without notice completed: when each was last seen alive (its
    sign of life, the lease it left, or the last time it wrote run.json), its device hours up to then and the
    training it lost, from its last commit (or its start of training) to then."""
    attempts = read_attempts(run_dir)
    pulse = read_json(run_dir.path(PULSE))
    left = run_dir.lease.taken if run_dir.lease is not None else {}
    for a in attempts:
        if a.get("ended") is not None or a.get("lost_s") is not None or not a.get("started"):
            continue
        mark = moment((a.get("committed") or {}).get("time") or a["started"])
        seen = [(mark, "run.json")]
        if same_process(pulse, a) and pulse.get("started") == a["started"] and "alive" in pulse:
            seen.append((float(pulse["alive"]), "heartbeat"))
        if same_process(left, a) and "heartbeat" in left:
            seen.append((float(left["heartbeat"]), "lease"))
        alive, by = max(seen)
        start = moment(a["started"]) - (a.get("startup_s") or 0.0)
        a["device_hours"] = round(a.get("world_size", 1) * max(0.0, alive - start) / 3600, 6)
        a["lost_s"] = round(max(0.0, alive - mark), 3)
        a["last_seen"] = {"time": iso(alive), "by": by}
    return attempts


def same_process(record: dict[str, Any], attempt: dict[str, Any]) -> bool:
    return record.get("pid") == attempt.get("pid") and record.get("host") == attempt.get("host")


def budget_spent(run_dir: RunDir, budget: Budget, price: Price, device: torch.device) -> str:
    """The line saying the run has spent its budget (empty: it may go on): what its attempts spent reaches it, or its
    last attempt stopped at a budget this one does not raise. Raises ConfigError where a money budget has no price for
    this device."""
    if budget.money and price_of(price, devices(device)[0]) is None:
        name = devices(device)[0]["name"]
        raise ConfigError(
            f"{budget.describe()}: train.price_per_device_hour has no price for this device ({name}, type "
            f"{device.type}): add it, or give the budget as device time (2h30m)"
        )
    attempts = history(run_dir)
    spent = spent_of(totals(attempts, price), budget) or 0.0
    last = attempts[-1] if attempts else {}
    earlier = last.get("budget") if last.get("stopped") == "budget" else None
    if spent < budget.amount and budget.raises(earlier):
        return ""
    return (
        f"the run has spent its budget ({budget.describe()}: {in_budget_unit(spent, budget)} spent): nothing to do; "
        "a larger train.budget continues it"
    )


def read_json(path: Path) -> dict[str, Any]:
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def read_attempts(run_dir: RunDir) -> list[dict[str, Any]]:
    """The attempts run.json holds; none when it is missing or unreadable (a run from before it existed)."""
    data = run_dir.read(RUN_JSON)
    return (attempts_in(data) or []) if data else []


def document(data: bytes) -> dict[str, Any]:
    """run.json's bytes as a mapping; empty when they are not such a file (rewritten whole)."""
    try:
        doc = json.loads(data)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) and isinstance(doc.get("attempts", []), list) else {}


def attempts_of(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return list(doc.get("attempts") or [])


def attempts_in(data: bytes) -> list[dict[str, Any]] | None:
    """The attempts list of run.json's bytes; None when they are not such a file."""
    try:
        attempts = json.loads(data)["attempts"]
    except (ValueError, KeyError, TypeError):
        return None
    return attempts if isinstance(attempts, list) else None


def write_note(run: str, why: str) -> None:
    """Say in the run's run.json (its top-level note) why it ended where it did (a sweep's pruned trial)."""
    data = read_url(f"{run}/{RUN_JSON}")
    doc = document(data) if data else {}
    write_url(f"{run}/{RUN_JSON}", (json.dumps(doc | {"note": why}, indent=1) + "\n").encode())


def versions() -> dict[str, str | None]:
    import job

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": str(torch.backends.cudnn.version()) if torch.cuda.is_available() else None,
        "torchvision": torchvision_version(),
        "job": job.__version__,
        "git_commit": git_commit(Path(job.__file__).resolve().parents[1]),
    }


def git_commit(root: Path) -> str | None:
    """The commit of a checkout the job runs from (read from .git, no git needed); None when installed."""
    head = root / ".git" / "HEAD"
    try:
        ref = head.read_text().strip()
        if not ref.startswith("ref: "):
            return ref
        name = ref[5:]
        loose = root / ".git" / name
        if loose.is_file():
            return loose.read_text().strip()
        for line in (root / ".git" / "packed-refs").read_text().splitlines():
            if line.endswith(f" {name}"):
                return line.split()[0]
    except OSError:
        return None
    return None


def devices(device: torch.device) -> list[dict[str, Any]]:
    if device.type != "cuda":
        return [{"type": device.type, "name": cpu_model(), "cpus": cpus()}]
    props = torch.cuda.get_device_properties(device)
    return [{"type": "cuda", "name": props.name, "memory_gib": round(props.total_memory / 1024**3, 2)}]
