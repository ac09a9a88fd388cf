"""TensorBoard's event files in <run>/tensorboard: scalars train/*, val/*, test/*, system/*, cost/*; the per-class
tables in the text tab; the confusion pictures in the images tab; hparams with the final metrics at the end."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from job.sinks.journal import chosen_metric
from job.sinks.sink import CLASSES, COST, EVALUATION, FINAL, PICTURE, TESTED, WINDOW, Picture, Record, Sink

if TYPE_CHECKING:
    from job.storage.run_folder import RunDir

TENSORBOARD = "tensorboard"


class TensorBoardEvents(Sink):
    """The run's SummaryWriter. Values arrive as Python numbers: the loop reads device tensors itself, at the few
    points where it syncs anyway."""

    def __init__(self, run: RunDir, hparams: dict[str, Any], start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.run, self.hparams = run, hparams
        # purge_step makes TensorBoard drop what an interrupted attempt logged after the checkpoint resumed from.
        self.writer = SummaryWriter(str(run.path(TENSORBOARD)), purge_step=start_step or None)
        self.pictures: dict[str, tuple[Any, Any]] = {}  # tag: (what its last picture showed, that picture encoded)

    def take(self, record: Record) -> None:
        step, values = record.step, record.values
        if record.kind in (WINDOW, COST):
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)
        elif record.kind == EVALUATION:
            self.scalars(values, record.split, step)
            self.writer.add_scalar("train/throughput", values["samples_per_s"], step)
        elif record.kind == TESTED:
            self.scalars(values, "test", step)
            metric = chosen_metric(values, "test")
            if f"final_test_{metric}" in values:
                self.writer.add_scalar(f"test/final_model_{metric}", values[f"final_test_{metric}"], step)
        elif record.kind == CLASSES:
            self.writer.add_text(f"{record.split}/classes", record.text, step)
        elif record.kind == PICTURE:
            self.image(record.picture, step)
        elif record.kind == FINAL:
            self.final(values, step)

    def scalars(self, record: dict[str, Any], on: str, step: int) -> None:
        """An evaluation's scores as <split>/<name> scalars: loss, accuracy, macro_f1, top5_accuracy, ..."""
        for key, value in record.items():
            if key.startswith(f"{on}_"):
                name = key[len(on) + 1 :]
                self.writer.add_scalar(f"{on}/{'top5_accuracy' if name == 'top5' else name}", value, step)

    def image(self, picture: Picture, step: int) -> None:
        """A picture in the images tab at every evaluation, drawn and encoded only when what it shows differs from
        what the tag's last picture showed; else that picture goes in again as it was encoded (drawing and encoding
        take 4-5 ms: most of a small evaluation, and the matrix stops changing early in most runs)."""
        import torch
        from PIL import Image
        from tensorboard.compat.proto.summary_pb2 import Summary

        from job.sinks import pictures

        last = self.pictures.get(picture.tag)
        if last is None or not torch.equal(last[0], picture.of):
            pixels = picture.draw().numpy()
            encoded = pictures.png(Image.fromarray(pixels))
            shown = Summary.Image(
                height=pixels.shape[0], width=pixels.shape[1], colorspace=3, encoded_image_string=encoded
            )
            last = self.pictures[picture.tag] = (picture.of.clone(), shown)
        # add_image would encode the picture again: the summary goes to the writer's file writer as add_image's goes
        self.writer.file_writer.add_summary(Summary(value=[Summary.Value(tag=picture.tag, image=last[1])]), step)

    def final(self, final: dict[str, float], step: int) -> None:
        """The hparams summary with the run's final metrics."""
        from torch.utils.tensorboard.summary import hparams

        metrics = {f"hparam/{k}": v for k, v in final.items()}
        for summary in hparams(self.hparams, metrics):
            self.writer.file_writer.add_summary(summary)
        for tag, value in metrics.items():  # the HPARAMS tab reads its metric columns from these scalars
            self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        self.writer.flush()
        self.run.upload_tree(TENSORBOARD)

    def close(self) -> None:
        self.writer.close()
        self.run.upload_tree(TENSORBOARD)
