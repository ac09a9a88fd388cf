"""metrics.jsonl, the run's one journal: a JSON object per evaluation and one for the test split at the end, kept in
the run folder and committed with every checkpoint; curves.png drawn from it at the end."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from job.sinks.sink import EVALUATION, TESTED, Record, Sink

if TYPE_CHECKING:
    from job.storage.run_folder import RunDir

METRICS = "metrics.jsonl"
CURVES = "curves.png"


class MetricsJournal(Sink):
    """metrics.jsonl: `records`, the earlier attempts' evaluations up to the step resumed from (read_records), then
    each new one as it comes. `records` is the reporter's list, which it appends to: curves.png is drawn from it."""

    def __init__(self, run: RunDir, records: list[dict[str, Any]]) -> None:
        self.run, self.records = run, records
        self.run.write(METRICS, "".join(json.dumps(r) + "\n" for r in self.records).encode())

    def take(self, record: Record) -> None:
        if record.kind in (EVALUATION, TESTED):
            with open(self.run.path(METRICS), "a") as f:
                f.write(json.dumps(record.values) + "\n")

    def flush(self) -> None:
        self.run.upload(METRICS)

    def close(self) -> None:
        self.run.write(CURVES, plot_curves(self.records))


def read_records(run: RunDir, upto_step: int) -> list[dict[str, Any]]:
    """The run's earlier evaluations up to the step resumed from (later ones are redone, and so is the test split's
    record at the end: an attempt killed after its last commit wrote it, and the next writes it again)."""
    data = run.read(METRICS)
    if not data or not upto_step:
        return []
    return [r for r in records_in(data.decode()) if r.get("step", 0) <= upto_step and "chosen_epoch" not in r]


def records_in(text: str) -> list[dict[str, Any]]:
    """The records of metrics.jsonl's text; a line cut short by a crash, or one being written, is none."""
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def evaluated(record: dict[str, Any]) -> str:
    """The split an evaluation's record reports: val, or test."""
    return "val" if "val_loss" in record else "test"


def chosen_metric(record: dict[str, Any], on: str) -> str:
    """What an evaluation's record chooses on: map (multi-label), else accuracy."""
    return "map" if f"{on}_map" in record else "accuracy"


def plot_curves(records: list[dict[str, Any]]) -> bytes:
    """PNG of training and held-out loss, and held-out accuracy, over the run's evaluations (val, or test when the
    run has no val split)."""
    from job.sinks import pictures

    records = [r for r in records if "train_loss" in r]  # the evaluations, not the test split's report at the end
    on = evaluated(records[-1]) if records else "test"
    epochs = [r["epoch"] for r in records]
    losses = [
        ("train", epochs, [r["train_loss"] for r in records]),
        (on, epochs, [r.get(f"{on}_loss") for r in records]),
    ]
    metric = chosen_metric(records[-1], on) if records else "accuracy"
    scores = [("", epochs, [r.get(f"{on}_{metric}") for r in records])]
    return pictures.png(pictures.side_by_side([
        pictures.chart(losses, "loss", "epoch", "loss"),
        pictures.chart(scores, f"{on} {metric}", "epoch", metric, ylim=(0, 1)),
    ]))  # fmt: skip
