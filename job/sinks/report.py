"""What a run tells the user: TensorBoard scalars and hparams, metrics.jsonl, curves.png, and the console
(a progress bar on a terminal, one plain line per evaluation otherwise, a final summary)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from job.console import say
from job.sinks.track import JOURNAL, evaluation_points, metric_name, test_points

if TYPE_CHECKING:
    from job.sinks.hypertune import MetricFile
    from job.sinks.track import Tracker
    from job.storage.run_folder import RunDir

METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
CURVES = "curves.png"


class Report:
    """The run's TensorBoard writer, metrics file and console progress. Values arrive as Python numbers:
    the loop reads device tensors itself, at the few points where it syncs anyway."""

    def __init__(
        self,
        run: RunDir,
        hparams: dict[str, Any],
        epochs: int,
        steps_per_epoch: int,
        start_step: int,
        tracker: Tracker | None = None,
        hypertune: MetricFile | None = None,
        judge: Callable[[dict[str, Any]], None] | None = None,
    ):
        from torch.utils.tensorboard import SummaryWriter

        self.run, self.hparams, self.epochs, self.steps_per_epoch = run, hparams, epochs, steps_per_epoch
        self.tracker = tracker  # the MLflow sink (job/sinks/track.py), given the same values
        self.hypertune = hypertune  # a Vertex AI tuning trial's metric file (job/sinks/hypertune.py), the same again
        self.judge = judge  # the caller's judge of each evaluation (a sweep's pruner), which may ask the run to stop
        # purge_step makes TensorBoard drop what an interrupted attempt logged after the checkpoint resumed from.
        self.writer = SummaryWriter(str(run.path(TENSORBOARD)), purge_step=start_step or None)
        self.records = read_records(run, start_step)
        self.run.write(METRICS, "".join(json.dumps(r) + "\n" for r in self.records).encode())
        self.interactive = sys.stderr.isatty()
        self.bar = None
        self.pictures: dict[str, tuple[Any, Any]] = {}  # tag: (what its last picture showed, that picture encoded)

    def loss(self, step: int, loss: float, lr: float, system: dict[str, float] | None = None) -> None:
        """One log window: its mean training loss, the learning rate, and what the machine did (system/...)."""
        self.writer.add_scalar("train/loss", loss, step)
        self.writer.add_scalar("train/lr", lr, step)
        for name, value in (system or {}).items():
            self.writer.add_scalar(f"system/{name}", value, step)
        if self.tracker is not None:
            system = {f"system/{name}": value for name, value in (system or {}).items()}
            self.tracker.point(step, {"train/loss": loss, "train/lr": lr, **system})
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def start_epoch(self, epoch: int, done_steps: int) -> None:
        """A progress bar per epoch on a terminal (short epochs too: a CPU may take minutes over a few steps)."""
        if self.interactive:
            from tqdm import tqdm

            self.bar = tqdm(
                total=self.steps_per_epoch,
                initial=done_steps,
                desc=f"epoch {epoch + 1}/{self.epochs}",
                leave=False,
                dynamic_ncols=True,
                file=sys.stderr,
            )

    def advance(self, steps: int) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def end_epoch(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def evaluation(self, record: dict[str, Any]) -> None:
        """One evaluation (of val, or of test when there is no val): TensorBoard, a line of metrics.jsonl, a line on
        the console."""
        step, on = record["step"], evaluated(record)
        self.scalars(record, on, step)
        self.writer.add_scalar("train/throughput", record["samples_per_s"], step)
        self.append(record)
        if self.tracker is not None:
            self.tracker.point(step, evaluation_points(record))
        if self.hypertune is not None:
            self.hypertune.report(record)
        metric = chosen_metric(record, on)
        say(
            f"epoch {record['epoch']}/{self.epochs}  step {step}  train_loss {record['train_loss']:.4f}  "
            f"{on}_loss {record[f'{on}_loss']:.4f}  {on}_{metric} {record[f'{on}_{metric}']:.4f}  "
            f"{record['samples_per_s']:.0f} samples/s"
        )
        if self.judge is not None:
            self.judge(record)

    def tested(self, record: dict[str, Any]) -> None:
        """The test split's one report, at the end, on the model the run chose on val (and on the final one)."""
        step, metric = record["step"], chosen_metric(record, "test")
        self.scalars(record, "test", step)
        if f"final_test_{metric}" in record:
            self.writer.add_scalar(f"test/final_model_{metric}", record[f"final_test_{metric}"], step)
        self.append(record)
        if self.tracker is not None:
            self.tracker.point(step, test_points(record))
        if self.hypertune is not None:  # the chosen model's value, which the trial's result should be
            self.hypertune.report(record)
        final = record.get(f"final_test_{metric}")
        also = f"; the final model's {final:.4f}" if final is not None else ""
        say(
            f"test: the model chosen on val (epoch {record['chosen_epoch']}): test_loss {record['test_loss']:.4f}  "
            f"test_{metric} {record[f'test_{metric}']:.4f}{also}"
        )

    def image(self, tag: str, draw: Callable[[], Any], step: int, of: Any) -> None:
        """A picture in TensorBoard's images tab at every evaluation: `draw()` gives its HWC uint8 pixels, drawn only
        where a report is written, and only when `of`, the tensor it shows (a confusion matrix), differs from what
        the tag's last picture showed; else that picture goes in again as it was encoded (drawing and encoding take
        4-5 ms: most of a small evaluation, and the matrix stops changing early in most runs)."""
        import torch
        from PIL import Image
        from tensorboard.compat.proto.summary_pb2 import Summary

        from job.sinks import pictures

        last = self.pictures.get(tag)
        if last is None or not torch.equal(last[0], of):
            pixels = draw().numpy()
            encoded = pictures.png(Image.fromarray(pixels))
            picture = Summary.Image(
                height=pixels.shape[0], width=pixels.shape[1], colorspace=3, encoded_image_string=encoded
            )
            last = self.pictures[tag] = (of.clone(), picture)
        # add_image would encode the picture again: the summary goes to the writer's file writer as add_image's goes
        self.writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=last[1])]), step)

    def class_table(self, on: str, table: str, f1: dict[str, float], step: int) -> None:
        """The per-class scores of an evaluation, as a Markdown table in TensorBoard's text tab; each class's F1 to
        the tracker, as <split>_f1/<class>."""
        self.writer.add_text(f"{on}/classes", table, step)
        if self.tracker is not None:
            self.tracker.point(step, {metric_name(f"{on}_f1/{name}"): value for name, value in f1.items()})

    def scalars(self, record: dict[str, Any], on: str, step: int) -> None:
        """An evaluation's scores as <split>/<name> scalars: loss, accuracy, macro_f1, top5_accuracy, ..."""
        for key, value in record.items():
            if key.startswith(f"{on}_"):
                name = key[len(on) + 1 :]
                self.writer.add_scalar(f"{on}/{'top5_accuracy' if name == 'top5' else name}", value, step)

    def append(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        with open(self.run.path(METRICS), "a") as f:
            f.write(json.dumps(record) + "\n")

    def flush(self) -> None:
        """Make the event and metrics files whole on disk and mirror them to the run's URL."""
        self.writer.flush()
        self.run.upload(METRICS, *([JOURNAL] if self.tracker is not None else []))
        self.run.upload_tree(TENSORBOARD)

    def cost(self, cost: dict[str, Any], step: int) -> None:
        """What the run has cost so far (job/run/cost.py), as cost/device_hours and cost/spent (with a price)."""
        known = {name: cost[name] for name in ("device_hours", "spent") if cost.get(name) is not None}
        for name, value in known.items():
            self.writer.add_scalar(f"cost/{name}", value, step)
        if self.tracker is not None:
            self.tracker.point(step, {f"system/cost_{name}": float(value) for name, value in known.items()})
        self.flush()

    def close(self, final: dict[str, float], cost: dict[str, Any] | None = None) -> None:
        """The hparams summary with the run's final metrics, its cost, curves.png, and a last upload."""
        from torch.utils.tensorboard.summary import hparams

        metrics = {f"hparam/{k}": v for k, v in final.items()}
        for summary in hparams(self.hparams, metrics):
            self.writer.file_writer.add_summary(summary)
        step = self.records[-1]["step"] if self.records else 0
        for tag, value in metrics.items():  # the HPARAMS tab reads its metric columns from these scalars
            self.writer.add_scalar(tag, value, step)
        if cost is not None:
            self.cost(cost, step)
        self.writer.close()
        self.run.write(CURVES, plot_curves(self.records))
        self.flush()


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


class FollowerReport:
    """What ranks other than 0 report: nothing. They keep the evaluation records, which every rank computes alike."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.tracker = None  # rank 0 alone talks to the tracking server

    def evaluation(self, record: dict) -> None:
        self.records.append(record)

    def tested(self, record: dict) -> None:
        self.records.append(record)

    def class_table(self, *args) -> None:
        pass

    def image(self, *args, **kwargs) -> None:
        pass

    def loss(self, *args) -> None:
        pass

    def start_epoch(self, *args) -> None:
        pass

    def advance(self, *args) -> None:
        pass

    def end_epoch(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def cost(self, *args) -> None:
        pass

    def close(self, *args) -> None:
        pass
