"""What the epochs of a run share (run/train.py sets it up once; its evaluations, run/evaluations.py, read it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from job.run.state import Components

if TYPE_CHECKING:
    from job.config import Config
    from job.group.stop import StopRequest
    from job.recipe.build import Recipe
    from job.recipe.step import EagerStep
    from job.run.attempts import Attempt
    from job.run.choose import Chooser
    from job.run.cost import Budget
    from job.run.meters import LossLog, TrainClock
    from job.run.progress import Progress
    from job.sinks.report import FollowerReport, Report
    from job.storage.run_folder import RunDir
    from job.use.diagnostics import Passed


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
    kept: dict[str, Passed] = field(default_factory=dict)  # the last passes over splits on the weights now held
    parts: Components = field(default_factory=Components)  # what a checkpoint saves and restores (run/state.py)

    def pause(self) -> None:
        """The training clock stopped for an evaluation or a checkpoint, and every process given rank 0's averaged
        batch-norm statistics (train.ema): where batch norm is not synchronised (CPU groups), each process's average
        follows its own batches' statistics between two of them, while the checkpoint and model.pt hold rank 0's."""
        self.clock.stop()
        self.log.system.pause()
        if self.r.ema is not None:
            from job.group import distributed

            distributed.same_buffers(self.r.ema.module)
