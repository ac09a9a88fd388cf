"""Vertex AI hyperparameter tuning's metric file, written as Google's cloudml-hypertune writes it (a library not
installable here): one JSON line per report, appended to $CLOUD_ML_HP_METRIC_FILE, which the service reads."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from job.errors import ConfigError
from job.sinks.sink import EVALUATION, TESTED, Record, Sink

DEFAULT_FILE = "/tmp/hypertune/output.metrics"  # cloudml-hypertune's default, where the service looks


def metric_file(environ: Mapping[str, str] = os.environ) -> str | None:
    """The metric file when running as a Vertex AI tuning trial (CLOUD_ML_TRIAL_ID or CLOUD_ML_HP_METRIC_FILE
    set), else None."""
    if not (environ.get("CLOUD_ML_TRIAL_ID") or environ.get("CLOUD_ML_HP_METRIC_FILE")):
        return None
    return environ.get("CLOUD_ML_HP_METRIC_FILE") or DEFAULT_FILE


def metric_line(tag: str, value: float, step: int, trial: str, timestamp: float) -> str:
    """One report in cloudml-hypertune's format: the value and step as text, the time in seconds. repr keeps the
    value's every digit, so float() of it gives the number metrics.jsonl holds."""
    return json.dumps({tag: repr(value), "global_step": str(step), "timestamp": timestamp, "trial": trial})


def check_tag(tag: str, written: Iterable[str]) -> None:
    """Refuse a tag that no evaluation of the run reports, naming those it does."""
    written = list(written)
    if tag not in written:
        raise ConfigError(
            f"track.hp_metric_tag {tag}: the run never writes it (under Vertex AI tuning it reports its metric at "
            f"each evaluation); its evaluations write {', '.join(written)}"
        )


class MetricFile(Sink):
    """The trial's metric file: rank 0 appends the tag's value at each evaluation and for the chosen model (the test
    record at the end holds its value, which the trial's result should be)."""

    def __init__(self, path: str, tag: str, trial: str) -> None:
        self.path, self.tag, self.trial = Path(path), tag, trial

    def take(self, record: Record) -> None:
        if record.kind in (EVALUATION, TESTED):
            self.report(record.values)

    def report(self, record: dict[str, Any]) -> None:
        """The tag's value of an evaluation (or of the test record at the end), when the record has it."""
        if self.tag in record:
            line = metric_line(self.tag, record[self.tag], record["step"], self.trial, time.time())
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(line + "\n")


def trial(tag: str, written: Iterable[str]) -> MetricFile | None:
    """The metric file of a Vertex AI tuning trial, its tag checked against what the run's evaluations write; None
    outside tuning."""
    path = metric_file()
    if path is None:
        return None
    check_tag(tag, written)
    return MetricFile(path, tag, os.environ.get("CLOUD_ML_TRIAL_ID", "0"))
