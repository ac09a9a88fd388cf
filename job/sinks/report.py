"""The run's one reporter: the loop hands it what happened (a log window, an evaluation, the test split at the end,
a picture, the cost) once, as a Record (job/sinks/sink.py), and every sink subscribed to it takes the same Record.
The process that writes the run reports to metrics.jsonl, TensorBoard and the console, and to whatever else the run
is given (MLflow, Vertex AI's metric file, Ray Train, Kubeflow Trainer's progress, a sweep's judge: job/run/
reporting.py subscribes them); the other processes of a group report only to what every process reports to."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from job.sinks.console_lines import ConsoleLines
from job.sinks.journal import CURVES, METRICS, MetricsJournal, evaluated, read_records, records_in
from job.sinks.sink import CLASSES, COST, EVALUATION, FINAL, PICTURE, TESTED, WINDOW, EpochEnd, Picture, Record, Sink
from job.sinks.tensorboard_events import TENSORBOARD, TensorBoardEvents

if TYPE_CHECKING:
    from job.storage.run_folder import RunDir

__all__ = ["CURVES", "METRICS", "TENSORBOARD", "FollowerReport", "Report", "read_records", "records_in"]


class Report:
    """The reporter of the process that writes the run: metrics.jsonl (from the evaluations of earlier attempts up to
    `start_step`), TensorBoard and the console, then `sinks`. `records`: the run's evaluations, as metrics.jsonl
    holds them."""

    def __init__(
        self,
        run: RunDir,
        hparams: dict[str, Any],
        epochs: int,
        steps_per_epoch: int,
        start_step: int,
        sinks: Iterable[Sink] = (),
    ) -> None:
        self.records: list[dict[str, Any]] = read_records(run, start_step)
        self.board = TensorBoardEvents(run, hparams, start_step)
        base = [MetricsJournal(run, self.records), self.board, ConsoleLines(epochs, steps_per_epoch)]
        self.sinks: list[Sink] = [*base, *sinks]

    @property
    def writer(self):
        """The run's TensorBoard SummaryWriter."""
        return self.board.writer

    def state_dict(self) -> dict[str, Any]:
        """What each sink that keeps state says of itself (MLflow's: what each server took), by the sink's name: the
        reporter is one of the run's components (job/run/state.py), saved with every checkpoint."""
        return {named(sink): sink.state_dict() for sink in self.sinks if hasattr(sink, "state_dict")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Each sink that keeps state given its part of a checkpoint's; a sink the checkpoint knew nothing of keeps
        its own."""
        for sink in self.sinks:
            if hasattr(sink, "load_state_dict") and named(sink) in state:
                sink.load_state_dict(state[named(sink)])

    def subscribe(self, sink: Sink) -> Sink:
        """`sink` takes every record from now on, after those subscribed before it."""
        self.sinks.append(sink)
        return sink

    def give(self, record: Record) -> None:
        for sink in self.sinks:
            sink.take(record)

    def loss(self, step: int, loss: float, lr: float, system: dict[str, float] | None = None) -> None:
        """One log window: its mean training loss, the learning rate, and what the machine did (system/...)."""
        system = {f"system/{name}": value for name, value in (system or {}).items()}
        self.give(Record(WINDOW, step, {"train/loss": loss, "train/lr": lr, **system}))

    def start_epoch(self, epoch: int, done_steps: int) -> None:
        for sink in self.sinks:
            sink.epoch_started(epoch, done_steps)

    def advance(self, steps: int) -> None:
        for sink in self.sinks:
            sink.stepped(steps)

    def end_epoch(self) -> None:
        for sink in self.sinks:
            sink.epoch_ended()

    def evaluation(self, record: dict[str, Any]) -> None:
        """One evaluation (of val, or of test when there is no val)."""
        self.records.append(record)
        self.give(Record(EVALUATION, record["step"], record, record["epoch"], evaluated(record)))

    def tested(self, record: dict[str, Any]) -> None:
        """The test split's one report, at the end, on the model the run chose on val (and on the final one)."""
        self.records.append(record)
        self.give(Record(TESTED, record["step"], record, record["epoch"], "test"))

    def class_table(self, on: str, table: str, f1: dict[str, float], step: int) -> None:
        """The per-class scores of an evaluation of split `on`: a Markdown table, and each class's F1."""
        self.give(Record(CLASSES, step, f1, split=on, text=table))

    def image(self, tag: str, draw: Callable[[], Any], step: int, of: Any) -> None:
        """A picture of an evaluation, tagged <split>/<name>: `draw()` gives its HWC uint8 pixels, drawn only by a
        sink that shows it; `of`, the tensor it shows."""
        self.give(Record(PICTURE, step, split=tag.split("/")[0], picture=Picture(tag, draw, of)))

    def epoch_done(self, end: EpochEnd) -> None:
        """The epoch's evaluation and checkpoint are done."""
        for sink in self.sinks:
            sink.epoch_done(end)

    def flush(self) -> None:
        """Make every sink's files whole and mirror them to the run's URL (a checkpoint is being committed)."""
        for sink in self.sinks:
            sink.flush()

    def cost(self, cost: dict[str, Any], step: int) -> None:
        """What the run has cost so far (job/run/cost.py): device_hours, and spent with a price."""
        known = {f"cost/{name}": cost[name] for name in ("device_hours", "spent") if cost.get(name) is not None}
        self.give(Record(COST, step, known))
        self.flush()

    def close(self, final: dict[str, float], cost: dict[str, Any] | None = None) -> None:
        """The run's final metrics and its cost, each sink's last writing (curves.png, hparams), a last upload."""
        step = self.records[-1]["step"] if self.records else 0
        if cost is not None:
            self.cost(cost, step)
        self.give(Record(FINAL, step, final))
        for sink in self.sinks:
            sink.close()
        self.flush()


def named(sink: Sink) -> str:
    """A sink's name in the reporter's state: its `name`, else its class's."""
    return getattr(sink, "name", None) or type(sink).__name__


class FollowerReport(Report):
    """The reporter of a group's other processes: they keep the evaluation records, which every rank computes alike,
    and report only to `sinks`, those every process reports to (Ray Train's)."""

    def __init__(self, sinks: Iterable[Sink] = ()) -> None:
        self.records = []
        self.sinks = list(sinks)
