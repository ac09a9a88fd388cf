"""Kubeflow Trainer's TrainJob progress: where the Trainer's status plugin puts its variables in the pod, the process
that writes the run POSTs the run's progress, its estimated time left and its latest metrics to the status server,
which writes them to the TrainJob's status.trainerStatus (`kubectl get trainjob` shows the progress and ETA).

The contract (Kubeflow Trainer KEP-2779, its status server, and the Kubeflow SDK's update_runtime_status):
KUBEFLOW_TRAINER_STATUS_URL, an https URL (.../namespaces/{namespace}/trainjobs/{name}/status);
KUBEFLOW_TRAINER_STATUS_TOKEN, the path of a projected service account token, sent as a bearer token (read at each
update: the kubelet rotates it); KUBEFLOW_TRAINER_STATUS_CA_CERT, the path of the CA certificate the server's TLS is
checked against. The body: {"trainerStatus": {"progressPercentage": 0-100, "estimatedRemainingSeconds": >= 0,
"metrics": [{"name": ..., "value": "<a string>"}], "lastUpdatedTime": RFC 3339}}.

A thread sends, at most one update per EVERY_S (the server rate-limits, as the SDK throttles), so a slow or absent
server never slows a step; an update that fails is said once and replaced by the next one."""

from __future__ import annotations

import json
import os
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from job.console import say
from job.sinks.sink import EVALUATION, TESTED, WINDOW, Record, Sink

STATUS_URL = "KUBEFLOW_TRAINER_STATUS_URL"
STATUS_TOKEN = "KUBEFLOW_TRAINER_STATUS_TOKEN"
STATUS_CA = "KUBEFLOW_TRAINER_STATUS_CA_CERT"
EVERY_S = 5.0  # seconds between two updates at most as often: the Kubeflow SDK's throttle
TIMEOUT_S = 5.0  # how long one update waits for the server's answer
LEFT_OUT = {"epoch", "step", "chosen_epoch", "wall_s"}  # a record's numbers that are no metric of the model


def from_environment(
    total_steps: int, start_step: int, epochs: int, environ: Mapping[str, str] = os.environ
) -> TrainJobProgress | None:
    """The TrainJob's progress sink where the Trainer's status plugin set its variables, else None. `total_steps`:
    the run's optimizer steps, all attempts'; `start_step`: where this attempt begins."""
    url = environ.get(STATUS_URL)
    if not url:
        return None
    return TrainJobProgress(
        url, environ.get(STATUS_TOKEN, ""), environ.get(STATUS_CA, ""), total_steps, start_step, epochs
    )


class TrainJobProgress(Sink):
    """The run's progress as the TrainJob's status: the step's share of the run's steps, the time left at this
    attempt's pace, and the last value of each metric."""

    def __init__(self, url: str, token_file: str, ca_file: str, total_steps: int, start_step: int, epochs: int) -> None:
        self.url, self.token_file, self.ca_file = url, token_file, ca_file
        self.total_steps, self.start_step, self.step = max(total_steps, 1), start_step, start_step
        self.metrics: dict[str, str] = {"totalEpochs": str(epochs)}
        self.t_start, self.sent_at, self.problem = time.monotonic(), -EVERY_S, ""
        self.lock, self.wake, self.closing = threading.Lock(), threading.Event(), threading.Event()
        first = self.status()  # the run has begun: its first update is sent at once, as it stands now
        self.thread = threading.Thread(target=self.work, args=(first,), name="job-kubeflow-progress", daemon=True)
        self.thread.start()

    def take(self, record: Record) -> None:
        if record.kind not in (WINDOW, EVALUATION, TESTED):
            return
        values = {"train_loss": record.values["train/loss"]} if record.kind == WINDOW else record.values
        with self.lock:
            self.step = max(self.step, record.step)
            if record.epoch is not None:
                self.metrics["currentEpoch"] = str(record.epoch)
            for name, value in values.items():
                if name not in LEFT_OUT and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.metrics[name] = f"{value:.6g}"
        self.wake.set()

    def status(self, done: bool = False) -> dict[str, Any]:
        """The body of one update: `done`, the run has ended (all its steps are done, or it stopped early)."""
        with self.lock:
            step, metrics = self.step, dict(self.metrics)
        if done:
            progress, left = 100, 0
        else:
            progress = min(100, 100 * step // self.total_steps)
            done_here = step - self.start_step  # this attempt's steps: its pace
            left = (time.monotonic() - self.t_start) / done_here * (self.total_steps - step) if done_here > 0 else None
        status: dict[str, Any] = {"progressPercentage": progress}
        if left is not None:
            status["estimatedRemainingSeconds"] = max(0, round(left))
        status["metrics"] = [{"name": name, "value": value} for name, value in metrics.items()]
        status["lastUpdatedTime"] = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return {"trainerStatus": status}

    def work(self, first: dict[str, Any]) -> None:
        self.post(first)
        while True:
            self.wake.wait()
            if self.closing.wait(max(0.0, self.sent_at + EVERY_S - time.monotonic())):
                return  # the last update is close()'s
            self.wake.clear()
            self.post(self.status())

    def post(self, body: dict[str, Any]) -> bool:
        """One update; False, and said once per kind of fault, where the server did not take it."""
        self.sent_at = time.monotonic()
        try:
            with open(self.token_file) as f:
                token = f.read().strip()
            context = ssl.create_default_context(cafile=self.ca_file or None)
            headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
            request = urllib.request.Request(self.url, json.dumps(body).encode(), headers, method="POST")
            with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as answer:
                answer.read()
            self.problem = ""
            return True
        except urllib.error.HTTPError as e:
            problem = f"the server answered {e.code} {e.reason}"
        except (OSError, ValueError) as e:  # a token file missing, a refused connection, a certificate refused
            problem = " ".join(str(getattr(e, "reason", e)).split())[:200] or type(e).__name__
        if problem != self.problem:
            say(f"Kubeflow Trainer progress: not sent to {self.url} ({problem}); the run goes on")
        self.problem = problem
        return False

    def close(self) -> None:
        """The run has ended: the thread stopped, and the last update (100%, no time left) sent now."""
        self.closing.set()
        self.wake.set()
        self.thread.join(timeout=TIMEOUT_S + 1)
        self.post(self.status(done=True))
