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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from job.group import distributed
from job.run import checkpoint
from job.use import bundle

if TYPE_CHECKING:
    from job.run.progress import Progress


class RayReport:
    def __init__(self) -> None:
        import ray.train  # the worker runs inside Ray: it is there

        self.train = ray.train

    def after_epoch(
        self, state: Progress, records: list[dict], saved: bool, model, run_url: str, describe: Callable[[dict], dict]
    ) -> None:
        """At the end of an epoch that evaluated (`records[-1]` is this step's) or committed a checkpoint (`saved`),
        every process alike; `describe`: the model.json of the model with these metrics."""
        record = records[-1] if records and records[-1].get("step") == state.step else {}
        if not record and not saved:
            return
        metrics = {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        metrics |= {"epoch": state.epoch, "step": state.step}
        if not (saved and distributed.is_writer()):
            self.train.report(metrics)
            return
        with tempfile.TemporaryDirectory(prefix="job-ray-") as folder:
            root = Path(folder)
            (root / "model.pt").write_bytes(checkpoint.weights_bytes(model))
            (root / bundle.MODEL_JSON).write_text(json.dumps(describe(record), indent=1, ensure_ascii=False))
            (root / "checkpoint.json").write_text(
                json.dumps({"run": run_url, "epoch": state.epoch, "step": state.step})
            )
            self.train.report(metrics, checkpoint=self.train.Checkpoint.from_directory(folder))
