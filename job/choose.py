"""A run's evaluations, what it chooses on them, and what it reports at the end.

Every evaluation reports the val split when the data has one; the run chooses on it: the best val accuracy and its
epoch, its weights (kept on the host, and in checkpoints while the model has moved past them, so a resumed run
chooses exactly as an uninterrupted one), train.keep_best, and early stopping. The test split is then only
reported, once, at the end: on the chosen model (which model.pt holds), and on the final one when they differ.

Without a val split every evaluation reports the test split as it always has, the final weights are the run's
result, and the summary says that its best test accuracy was picked on the test split itself.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from job import distributed
from job.errors import ConfigError
from job.evaluate import test_sums
from job.memory import memory_guard

if TYPE_CHECKING:
    from job.config import Config
    from job.train import Loop, Progress


class Chooser:
    """The best evaluation so far and its weights. `on`: the split evaluations report (val, or test)."""

    def __init__(self, cfg: Config, on: str) -> None:
        t = cfg.train
        if t.early_stopping_patience and on != "val":
            raise ConfigError(
                "train.early_stopping_patience: stops on the val split's accuracy, and this data has none; hold some "
                "images out with data.val_split (stopping on the test split would report a score chosen on it)"
            )
        self.on, self.patience, self.min_delta = on, t.early_stopping_patience, t.early_stopping_min_delta
        self.weights: dict[str, torch.Tensor] | None = None  # the best model's, on the host; None: the model's own

    def judge(self, state, accuracy: float, model: torch.nn.Module) -> str:
        """Record an evaluation's accuracy in the run's state (best_accuracy, best_epoch, evals_since_best); the
        reason to stop early, or ''."""
        if accuracy > state.best_accuracy + (self.min_delta if state.best_epoch else 0.0):
            state.best_accuracy, state.best_epoch, state.evals_since_best = accuracy, state.epoch, 0
            if self.on == "val":
                self.weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            return ""
        state.evals_since_best += 1
        if self.patience and state.evals_since_best >= self.patience:
            gain = f" by more than {self.min_delta:g}" if self.min_delta else ""
            return (
                f"early stopping: val accuracy has not improved{gain} in {state.evals_since_best} evaluations "
                f"(best {state.best_accuracy:.4f} at epoch {state.best_epoch})"
            )
        return ""

    def saved(self, state) -> dict:
        """What a checkpoint holds of the choice: the best weights while the model has moved past them."""
        if self.on != "val" or self.weights is None or is_best(state):
            return {}
        return {"best_model": self.weights}

    def restore(self, payload: dict, model: torch.nn.Module) -> None:
        """The best weights from the checkpoint a run continues from: its own copy, or the model's where the
        checkpoint was taken at the best evaluation."""
        if self.on != "val":
            return
        best, progress = payload.get("best_model"), payload.get("progress", {})
        if best is not None:
            self.weights = best
        elif progress.get("best_epoch") and is_best(progress):
            self.weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    def choose(self, state, model: torch.nn.Module) -> bool:
        """Put the chosen (best-on-val) weights into the model; whether they differ from the final ones."""
        if self.on != "val" or self.weights is None or is_best(state):
            return False
        model.load_state_dict(self.weights)
        return True


def is_best(state) -> bool:
    """Whether the model stands where its best evaluation was taken (a Progress, or a checkpoint's dict of one)."""
    get = state.get if isinstance(state, dict) else lambda k: getattr(state, k)
    return get("best_epoch") == get("epoch") and not get("epoch_step")


def test_and_report(loop: Loop) -> str:
    """Evaluate the model on val (test when there is none) and report it with the training loss and throughput since
    the previous evaluation; the reason to stop early, or ''."""
    loop.clock.stop()
    loop.log.system.pause()
    r, state, log, on = loop.r, loop.state, loop.log, loop.r.evaluated_on
    loss, correct, train_sum = evaluate_split(loop, on, extra=log.sums[1:])
    now = time.perf_counter()
    for window in log.ready(wait=True):
        loop.report.loss(*window)
    log.sums[1:].zero_()
    record = {
        "epoch": state.epoch,
        "step": state.step,
        "train_loss": train_sum / max(state.steps_since_eval, 1),
        f"{on}_loss": loss,
        f"{on}_accuracy": correct,
        "samples_per_s": state.samples_since_eval / max(now - loop.t_eval, 1e-9),
        "wall_s": round(now - loop.t_start, 3),
    }
    reason = loop.chooser.judge(state, record[f"{on}_accuracy"], r.model)
    state.steps_since_eval = state.samples_since_eval = 0
    loop.report.evaluation(record)
    loop.t_eval = now
    return reason


def evaluate_split(loop: Loop, split: str, extra: torch.Tensor | None = None) -> list[float]:
    """[mean loss, accuracy] of the model on a held-out split over the whole group, and `extra`'s totals after
    them (the evaluation's one host sync)."""
    loader, r = loop.r.held_out[split], loop.r
    with memory_guard(f"data.eval_batch_size={loader.batch_size}", r.device), loop.clock.testing():
        sums = test_sums(r.model, loader, r.amp, loop.cfg.train.test_time_augmentation)
    loss, correct, counted, *rest = distributed.totals(sums, sums[:0] if extra is None else extra).tolist()
    return [loss / max(counted, 1), correct / max(counted, 1), *rest]


def final_test(loop: Loop) -> dict:
    """With a val split: the chosen (best-on-val) weights put into the model, and the test split, when there is one,
    reported once on them (and on the final weights, when they differ)."""
    r, state, chooser = loop.r, loop.state, loop.chooser
    if r.evaluated_on != "val":
        return {}
    tested = "test" in r.held_out
    final = evaluate_split(loop, "test") if tested and not is_best(state) else None
    chooser.choose(state, r.model)
    if not tested:
        return {}
    loss, accuracy = evaluate_split(loop, "test")
    record = {"epoch": state.epoch, "step": state.step, "chosen_epoch": state.best_epoch}
    record |= {"val_accuracy": state.best_accuracy, "test_loss": loss, "test_accuracy": accuracy}
    record |= {"final_test_loss": final[0], "final_test_accuracy": final[1]} if final else {}
    loop.report.tested(record)
    return record


def outcome(on: str, final: dict, state: Progress) -> str:
    """The run's result in words: what it chose on, and what the test split says of the choice."""
    best = f"best {on} accuracy {state.best_accuracy:.4f} (epoch {state.best_epoch})"
    if on == "test":  # no val split: the test split is all there is, and the best epoch was picked on it
        return f"{best}, final {final['final_accuracy']:.4f} (no val split: evaluations report the test split)"
    tested = f"; test accuracy {final['test_accuracy']:.4f}" if "test_accuracy" in final else ""
    return f"{best}, its weights in model.pt{tested}"
