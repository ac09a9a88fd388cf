"""run.json: every attempt of a run (each invocation that got as far as training), appended when it starts and
completed when it ends, so a run preempted five times shows six attempts: when and where each ran, with what
versions and devices, from which epoch and step to which, and how it ended (its exit code; none when the machine
went away before it could say)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import sys
from pathlib import Path
from typing import Any

import torch

from job.env import cpus
from job.storage import RunDir

RUN_JSON = "run.json"
# Variables that name the platform's job, task or session, where the job runs on one.
PLATFORM_VARIABLES = (
    "CLOUD_ML_JOB_ID",  # Vertex AI custom training
    "CLOUD_ML_TRIAL_ID",
    "BATCH_TASK_INDEX",  # Cloud Batch
    "BATCH_TASK_RETRY_ATTEMPT",
    "SKYPILOT_TASK_ID",  # SkyPilot
    "SKYPILOT_NODE_RANK",
    "COLAB_RELEASE_TAG",  # Colab
    "COLAB_GPU",
)


def platform_name() -> str:
    """The platform the job runs on, as its variables name it ('' on a machine of one's own)."""
    names = {"CLOUD_ML_JOB_ID": "Vertex AI", "BATCH_TASK_INDEX": "Cloud Batch", "SKYPILOT_TASK_ID": "SkyPilot"}
    names |= {"SKYPILOT_NODE_RANK": "SkyPilot", "COLAB_RELEASE_TAG": "Colab", "COLAB_GPU": "Colab"}
    return next((name for var, name in names.items() if os.environ.get(var)), "")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class Attempt:
    """This invocation's entry in run.json. Only the process that writes the run keeps one (`run_dir` None: the
    others); end() before begin() does nothing (a run that failed while setting up is no attempt)."""

    def __init__(self, run_dir: RunDir | None) -> None:
        self.run_dir, self.entry, self.state = run_dir, None, None
        self.number = 0  # this attempt's place in run.json, from 1
        self.tracker = None  # the run's MLflow sink (job/track.py), told how the attempt ends
        self.cfg, self.metrics = None, {}

    def begin(self, state, world: int, device: torch.device) -> None:
        """Training starts from `state` (its epoch and step are read again at the end)."""
        if self.run_dir is None:
            return
        self.state = state
        self.entry = {
            "started": now(),
            "ended": None,
            "exit_code": None,
            "argv": sys.argv,
            "host": socket.gethostname(),
            "platform": {k: os.environ[k] for k in PLATFORM_VARIABLES if os.environ.get(k)},
            "versions": versions(),
            "devices": devices(device),
            "world_size": world,
            "from": {"epoch": state.epoch, "step": state.step},
            "to": None,
        }
        self.write()

    def track(self, tracker, cfg, params: dict[str, Any]) -> None:
        """The run is tracked: the MLflow run gets the settings and decisions as params, this attempt as tags."""
        self.tracker, self.cfg = tracker, cfg
        tags = {"job.version": self.entry["versions"]["job"], "job.git_commit": self.entry["versions"]["git_commit"]}
        tags |= {"job.platform": platform_name(), "job.attempts": self.number, "job.host": self.entry["host"]}
        tracker.add({"params": params})
        tracker.add({"tags": {k: v for k, v in tags.items() if v is not None}})
        tracker.add({"status": "RUNNING"})

    def end(self, exit_code: int, metrics: dict[str, Any] | None = None) -> None:
        """The attempt ended with `exit_code`; a finished run's `metrics` tag its registered model version."""
        if self.entry is None or self.entry["ended"] is not None:
            return
        self.entry.update(ended=now(), exit_code=exit_code, to={"epoch": self.state.epoch, "step": self.state.step})
        self.write()
        if self.tracker is not None:
            from job.console import say

            said = self.tracker.end(exit_code, self.cfg, metrics)
            if self.tracker.run_id is not None:  # known once the server answered, maybe only now
                self.entry["mlflow_run_id"] = self.tracker.run_id
                self.write()
            say(said)

    def write(self) -> None:
        """run.json with this attempt as its last entry (appended the first time, replaced after)."""
        attempts = read_attempts(self.run_dir)
        if self.number:
            attempts[self.number - 1 : self.number] = [self.entry]
        else:
            attempts.append(self.entry)
            self.number = len(attempts)
        self.run_dir.write(RUN_JSON, (json.dumps({"attempts": attempts}, indent=1) + "\n").encode())


def read_attempts(run_dir: RunDir) -> list[dict[str, Any]]:
    """The attempts run.json holds; none when it is missing or unreadable (a run from before it existed)."""
    data = run_dir.read(RUN_JSON)
    return (attempts_in(data) or []) if data else []


def attempts_in(data: bytes) -> list[dict[str, Any]] | None:
    """The attempts list of run.json's bytes; None when they are not such a file."""
    try:
        attempts = json.loads(data)["attempts"]
    except (ValueError, KeyError, TypeError):
        return None
    return attempts if isinstance(attempts, list) else None


def versions() -> dict[str, str | None]:
    import torchvision

    import job

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": str(torch.backends.cudnn.version()) if torch.cuda.is_available() else None,
        "torchvision": torchvision.__version__,
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
        return [{"type": device.type, "name": platform.processor() or platform.machine(), "cpus": cpus()}]
    props = torch.cuda.get_device_properties(device)
    return [{"type": "cuda", "name": props.name, "memory_gib": round(props.total_memory / 1024**3, 2)}]
