"""What the epochs of a run share (job/train.py sets it up once; its evaluations, job/evaluations.py, read it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from job.attempts import Attempt
    from job.choose import Chooser
    from job.config import Config
    from job.cost import Budget
    from job.diagnostics import Passed
    from job.meters import LossLog, TrainClock
    from job.progress import Progress
    from job.ray_report import RayReport
    from job.recipe import Recipe
    from job.report import FollowerReport, Report
    from job.step import EagerStep
    from job.stop import StopRequest
    from job.storage import RunDir


@dataclass
class Loop:
    """What the epochs share, set up once by train_loop."""

    cfg: Config
    run_dir: RunDir
    r: Recipe
    step: EagerStep
    state: Progress
    log: LossLog
    report: Report | FollowerReport
    stop: StopRequest
    clock: TrainClock
    t_start: float
    t_eval: float  # when the last evaluation ended: throughput is measured from there
    attempt: Attempt  # this invocation's entry in run.json
    chooser: Chooser  # the best evaluation and its weights
    budget: Budget | None = None  # train.budget, read
    over_budget: str = ""  # why the run stops at the checkpoint just committed, to keep within train.budget
    ray: RayReport | None = None  # in a Ray Train worker: what reports to Ray
    kept: dict[str, Passed] = field(default_factory=dict)  # the last passes over splits on the weights now held

    def pause(self) -> None:
        """The training clock stopped for an evaluation or a checkpoint, and every process given rank 0's averaged
        batch-norm statistics (train.ema): where batch norm is not synchronised (CPU groups), each process's average
        follows its own batches' statistics between two of them, while the checkpoint and model.pt hold rank 0's."""
        self.clock.stop()
        self.log.system.pause()
        if self.r.ema is not None:
            from job import distributed

            distributed.same_buffers(self.r.ema.module)
