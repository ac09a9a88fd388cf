"""job/report.py: what a resumed run keeps of the metrics an earlier attempt wrote."""

from __future__ import annotations

import json

import torch

from job.report import read_records
from job.storage import RunDir


def test_a_run_resumed_from_its_last_checkpoint_redoes_its_test_record_once(tmp_path):
    """Killed after the last checkpoint was committed but before the results were written, a run resumes at its last
    step and reports the test split again: the killed attempt's test record is not kept beside the new one."""
    evaluation = {"epoch": 4, "step": 4, "train_loss": 0.5, "val_loss": 0.4, "val_accuracy": 0.9}
    tested = {"epoch": 4, "step": 4, "chosen_epoch": 4, "val_accuracy": 0.9, "test_loss": 0.3, "test_accuracy": 0.95}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (evaluation, tested)))
    assert read_records(RunDir(str(tmp_path)), 5) == [evaluation]


def test_a_process_with_none_of_a_splits_samples_adds_nothing_to_the_merged_report():
    """A held-out split smaller than the group: a process that scored none of it sends an empty part."""
    from job.diagnostics import Passed, merged

    def part(n: int, classes: int = 3) -> Passed:
        logits = torch.randn(n, classes) if n else torch.zeros(0, 0)  # an empty pass knows no class count
        z = torch.zeros(n)
        return Passed(z, z.long(), z, z.long(), logits, [str(i) for i in range(n)], torch.arange(n), None)

    joined = merged([part(2), part(0)])
    assert joined.logits.shape == (2, 3) and len(joined.labels) == 2
    assert merged([part(0), part(2)]).logits.shape == (2, 3)
