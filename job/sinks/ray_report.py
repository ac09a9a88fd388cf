"""Reports to Ray Train, where the job runs in a TorchTrainer's worker (job.cli.app called in process, in the group
Ray made): each evaluation's metrics as metrics.jsonl records them, and with each committed checkpoint a folder that
Ray copies to its storage: model.pt (the weights alone, as the run's model.pt: torch.load(weights_only=True) reads
it), model.json, and checkpoint.json naming the run folder and step the job resumes from. The run folder stays the
run's record; Ray's copy is what a Ray user's Result.checkpoint holds.

Every process reports at the same points (a report is a barrier across Ray's workers); rank 0's metrics and folder
are the ones Ray keeps, so the others send no folder."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from job.group import distributed
from job.sinks.sink import EpochEnd, Sink


class RayReport(Sink):
    """Ray Train's report, in every process of the group: `run_url`, the run folder the job resumes from."""

    def __init__(self, run_url: str) -> None:
        import ray.train  # the worker runs inside Ray: it is there

        self.train, self.run_url = ray.train, run_url

    def epoch_done(self, end: EpochEnd) -> None:
        """At the end of an epoch that evaluated (`end.record`) or committed a checkpoint (`end.saved`), every process
        alike."""
        if not end.record and not end.saved:
            return
        metrics = {k: v for k, v in end.record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        metrics |= {"epoch": end.epoch, "step": end.step}
        if not (end.saved and distributed.is_writer()):
            self.train.report(metrics)
            return
        with tempfile.TemporaryDirectory(prefix="job-ray-") as folder:
            root = Path(folder)
            end.bundle(root, end.record)  # model.pt and model.json
            (root / "checkpoint.json").write_text(
                json.dumps({"run": self.run_url, "epoch": end.epoch, "step": end.step})
            )
            self.train.report(metrics, checkpoint=self.train.Checkpoint.from_directory(folder))
