"""A trial's evaluations judged as they come: each reported to the study at its epoch (so that trials sweeping the
batch size, accumulation or a split are compared at the same point of training), the pruner asked, and a run whose
loss is no longer a number stopped there. The run stays unaware of Optuna: it hands each evaluation's record to a
judge and stops where the judge says why."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

NOT_FINITE = "not finite"  # the start of a trial's note when its loss or metric went NaN or infinite


class Judge:
    """A trial's evaluations reported to the study, each judged by its pruner: given each evaluation's record, says
    why the run should stop there, or None. `stopped`: why the trial was stopped, and where, for its note."""

    def __init__(self, trial, metric: str, pruner: str, run: str) -> None:
        self.trial, self.metric, self.pruner, self.run = trial, metric, pruner, run
        self.reported: set[int] = set()
        self.stopped = ""

    def __call__(self, record: dict[str, Any]) -> str | None:
        metric, epoch = self.metric, record.get("epoch")
        if self.stopped or metric not in record or epoch is None or epoch in self.reported:
            return None
        self.reported.add(epoch)
        value = float(record[metric])
        loss = float(record.get("train_loss", 0.0))
        if not (math.isfinite(value) and math.isfinite(loss)):  # trains on to its end for nothing otherwise
            self.stopped = f"{NOT_FINITE} at epoch {epoch} (step {record['step']}): train_loss {loss}, {metric} {value}"
            return f"the sweep: train_loss {loss} at epoch {epoch}"
        self.trial.report(value, epoch)
        if self.pruner == "none" or not self.trial.should_prune():
            return None
        self.stopped = (
            f"pruned by the {self.pruner} pruner at epoch {epoch} (step {record['step']}): {metric} {value:.4g}"
        )
        return f"the sweep's pruner ({self.pruner}, at epoch {epoch})"

    def records(self) -> list[dict[str, Any]]:
        """The evaluations in the trial's metrics.jsonl."""
        return [r for r in self.lines() if "train_loss" in r]

    def lines(self) -> list[dict[str, Any]]:
        """The trial's metrics.jsonl, where the run writes it on this machine (a remote run's staging copy, else the
        store's once the run is over), whole lines only: its evaluations, and the chosen model's test at the end."""
        from job.sinks.report import METRICS, records_in
        from job.storage.cloud import read_url
        from job.storage.run_folder import RunDir

        try:
            text = RunDir(self.run).path(METRICS).read_text()
        except (OSError, UnicodeDecodeError):
            text = (read_url(f"{self.run}/{METRICS}") or b"").decode(errors="replace")
        return records_in(text[: text.rfind("\n") + 1])


class Watch:
    """A thread that judges a child process's evaluations as its metrics.jsonl grows, and asks it to stop when
    judged."""

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
