"""What a run reports, and what takes it: the loop hands the reporter (job/sinks/report.py) each Record once; every
sink subscribed to it is given the same Record and takes what it needs. A new sink is a subclass of Sink given to
the reporter: the loop does not change."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WINDOW = "window"  # a log window: train/loss, train/lr and system/... at its last step
EVALUATION = "evaluation"  # an evaluation of val (or of test, with no val): its metrics.jsonl record
TESTED = "tested"  # the test split's one report at the end, on the chosen model: its metrics.jsonl record
CLASSES = "classes"  # an evaluation's per-class scores: `text` a Markdown table, `values` each class's F1
PICTURE = "picture"  # a picture of an evaluation (the confusion matrix): `picture`
COST = "cost"  # what the run has cost so far: device_hours, and spent where there is a price
FINAL = "final"  # the run's final metrics, once, at its end


@dataclass(frozen=True)
class Picture:
    """A picture to show: `draw()` gives its HWC uint8 pixels, drawn only by a sink that shows it; `of`, the tensor
    it shows, tells a sink whether it changed since the tag's last one."""

    tag: str
    draw: Callable[[], Any]
    of: Any


@dataclass(frozen=True)
class Record:
    """One thing the run reports, at `step` (optimizer steps of the whole run)."""

    kind: str
    step: int
    values: dict[str, Any] = field(default_factory=dict)
    epoch: int | None = None
    split: str = ""  # the held-out split it is of (val, test); '' when none
    text: str = ""
    picture: Picture | None = None


@dataclass(frozen=True)
class EpochEnd:
    """An epoch's end, after its evaluation and checkpoint: `saved`, a checkpoint was committed at `step`;
    `record`, the evaluation at this step ({} when none); `bundle(folder, metrics)` writes model.pt and model.json
    of the weights held now into a folder."""

    epoch: int
    step: int
    saved: bool
    record: dict[str, Any]
    bundle: Callable[[Path, dict[str, Any]], None]


class Sink:
    """Where a run's records go. Each method does nothing unless a sink overrides it."""

    def take(self, record: Record) -> None:
        """A record of the run, as every sink gets it."""

    def epoch_started(self, epoch: int, done_steps: int) -> None:
        """An epoch (0-based) begins, `done_steps` of its steps done already (a resumed attempt)."""

    def stepped(self, steps: int) -> None:
        """`steps` more steps of the epoch done."""

    def epoch_ended(self) -> None:
        """The epoch's steps are done (or stopped), before its evaluation."""

    def epoch_done(self, end: EpochEnd) -> None:
        """The epoch's evaluation and checkpoint are done."""

    def flush(self) -> None:
        """A checkpoint is being committed: make what was taken whole where it is kept."""

    def close(self) -> None:
        """The run has ended: what is kept is written a last time."""


class EachEvaluation(Sink):
    """A caller's function given each evaluation's record (a sweep's pruning judge): a sink the caller brings."""

    def __init__(self, call: Callable[[dict[str, Any]], None]) -> None:
        self.call = call

    def take(self, record: Record) -> None:
        if record.kind == EVALUATION:
            self.call(record.values)
