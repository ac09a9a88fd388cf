"""Where a run is: saved in every checkpoint, so a resumed run carries on from exactly there; and in words."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class Progress:
    """Where a run is: saved in every checkpoint, so a resumed run carries on from exactly here."""

    epoch: int = 0  # epochs finished
    epoch_step: int = 0  # steps done in the current epoch (0 at an epoch boundary)
    step: int = 0  # optimizer steps in the whole run
    steps_since_eval: int = 0
    samples_since_eval: int = 0
    best_accuracy: float = -1.0  # the best value of what the run chooses on (train.choose_on; job/run/choose.py)
    best_loss: float = float("inf")  # the best evaluation's loss: what breaks a tie in accuracy
    best_epoch: int = 0
    best_one_class: bool = False  # whether the best evaluation's model predicted one class for every sample
    evals_since_best: int = 0
    stopped_early: str = ""  # why early stopping ended the run; empty while it goes on
    run_id: str = ""  # one per run, kept across resumes: tells this run's checkpoints from another's
    planned_steps: int = 0  # the steps its first attempt planned (all epochs'): a resumed run steps as it began

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, saved: dict) -> None:
        """Where the checkpoint stood, its run's id included; a key this version does not know is left out."""
        for f in fields(self):
            if f.name in saved:
                setattr(self, f.name, saved[f.name])


def is_best(state) -> bool:
    """Whether the model stands where its best evaluation was taken (a Progress, or a checkpoint's dict of one)."""
    get = state.get if isinstance(state, dict) else lambda k: getattr(state, k)
    return get("best_epoch") == get("epoch") and not get("epoch_step")


def position(state: Progress) -> str:
    """Where the run stands, in words: during an epoch, or at the end of one."""
    if state.epoch_step:
        return f"in epoch {state.epoch + 1} at step {state.step}"
    return f"after epoch {state.epoch} at step {state.step}"
