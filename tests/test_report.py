"""sinks/report.py: what a resumed run keeps of the metrics an earlier attempt wrote; the pictures TensorBoard gets."""

from __future__ import annotations

import io
import json

import pytest
import torch

from job.sinks.report import read_records
from job.storage.run_folder import RunDir


def test_a_run_resumed_from_its_last_checkpoint_redoes_its_test_record_once(tmp_path):
    """Killed after the last checkpoint was committed but before the results were written, a run resumes at its last
    step and reports the test split again: the killed attempt's test record is not kept beside the new one."""
    evaluation = {"epoch": 4, "step": 4, "train_loss": 0.5, "val_loss": 0.4, "val_accuracy": 0.9}
    tested = {"epoch": 4, "step": 4, "chosen_epoch": 4, "val_accuracy": 0.9, "test_loss": 0.3, "test_accuracy": 0.95}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (evaluation, tested)))
    assert read_records(RunDir(str(tmp_path)), 5) == [evaluation]


def test_a_process_with_none_of_a_splits_samples_adds_nothing_to_the_merged_report():
    """A held-out split smaller than the group: a process that scored none of it sends an empty part."""
    from job.use.diagnostics import Passed, merged

    def part(n: int, classes: int = 3) -> Passed:
        logits = torch.randn(n, classes) if n else torch.zeros(0, 0)  # an empty pass knows no class count
        z = torch.zeros(n)
        names, sums = [str(i) for i in range(n)], torch.zeros(4 + classes**2 if n else 4)
        return Passed(z, z.long(), z, z.long(), logits, names, torch.arange(n), None, sums)

    joined = merged([part(2), part(0)])
    assert joined.logits.shape == (2, 3) and len(joined.labels) == 2
    assert merged([part(0), part(2)]).logits.shape == (2, 3)


def test_the_pictures_are_drawn_with_pillow_round_ticks_and_gaps_where_a_value_is_missing():
    """job/sinks/pictures.py: ticks at round values, a line broken where a value is missing (an evaluation without its
    held-out loss), a grid that enlarges small inputs by a whole factor, each a real PNG."""
    import numpy as np
    from PIL import Image

    from job.sinks import pictures

    assert pictures.ticks(0, 1.02) == pytest.approx([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    assert pictures.ticks(0.23, 2.31) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    gap = pictures.chart([("val", [1, 2, 3, 4], [1.0, None, float("nan"), 0.5])], "loss", "epoch", "loss")
    whole = pictures.chart([("val", [1, 2, 3, 4], [1.0, 0.8, 0.6, 0.5])], "loss", "epoch", "loss")
    blue = lambda img: int((np.asarray(img) == pictures.COLOURS[0]).all(2).sum())  # noqa: E731
    assert 0 < blue(gap) < blue(whole)  # the dots drawn, the line between them left out
    tiny = np.full((2, 32, 32, 3), 200, dtype=np.uint8)
    grid = pictures.grid(tiny, ["a -> b (0.9)"] * 2, ["x.jpg"] * 2)
    assert grid.width >= 2 * 96 and grid.height >= 96
    again = Image.open(io.BytesIO(pictures.png(grid)))
    assert again.format == "PNG" and again.size == grid.size


def test_a_confusion_matrix_that_has_not_changed_is_not_drawn_again_yet_each_evaluation_has_its_picture(tmp_path):
    """Drawing and encoding the picture is most of a small evaluation; once the matrix stops changing, the picture
    drawn for it goes into TensorBoard again as it was encoded: a picture at every step, drawn twice for three."""
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from job.sinks.report import Report
    from job.use import diagnostics

    report, drawn = Report(RunDir(str(tmp_path / "run")), {}, 3, 1, 0), []

    def draw(confusion):
        drawn.append(confusion.clone())
        return diagnostics.confusion_picture(confusion, ["a", "b"], "test")

    first, second = torch.tensor([[3, 1], [0, 4]]), torch.tensor([[4, 0], [0, 4]])
    for step, confusion in ((1, first), (2, second), (3, second.clone())):
        report.image("test/confusion", lambda c=confusion: draw(c), step, of=confusion)
    report.writer.flush()
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    images = events.Images("test/confusion")
    assert [e.step for e in images] == [1, 2, 3]
    assert len(drawn) == 2 and torch.equal(drawn[1], second)
    assert images[1].encoded_image_string == images[2].encoded_image_string != images[0].encoded_image_string
    pixels = diagnostics.confusion_picture(second, ["a", "b"], "test").numpy()
    assert (Image.open(io.BytesIO(images[2].encoded_image_string)).convert("RGB") == Image.fromarray(pixels)) is True
