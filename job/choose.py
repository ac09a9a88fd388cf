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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from job import diagnostics, distributed, scores
from job.errors import ConfigError
from job.evaluate import test_sums
from job.memory import memory_guard
from job.report import say

if TYPE_CHECKING:
    from job.config import TrainConfig
    from job.train import Loop, Progress


class Chooser:
    """The best evaluation so far, its weights and its confusion matrix. `on`: the split evaluations report (val, or
    test). A model that predicts one class for every sample is never chosen over one that tells classes apart,
    whatever their accuracies (always saying the largest class can score the higher)."""

    def __init__(self, t: TrainConfig, on: str) -> None:
        if t.early_stopping_patience and on != "val":
            raise ConfigError(
                "train.early_stopping_patience: stops on the val split's accuracy, and this data has none; hold some "
                "images out with data.val_split (stopping on the test split would report a score chosen on it)"
            )
        self.on, self.patience, self.min_delta = on, t.early_stopping_patience, t.early_stopping_min_delta
        self.weights: dict[str, torch.Tensor] | None = None  # the best model's, on the host; None: the model's own
        self.best_confusion: torch.Tensor | None = None  # the best evaluation's
        self.latest_confusion: torch.Tensor | None = None
        self.test_confusion: torch.Tensor | None = None  # the chosen model's on test, at the end

    def judge(self, state, accuracy: float, model: torch.nn.Module, confusion: torch.Tensor) -> str:
        """Record an evaluation (its accuracy and confusion matrix) in the run's state (best_accuracy, best_epoch,
        best_one_class, evals_since_best); the reason to stop early, or ''."""
        self.latest_confusion = confusion
        one = scores.one_class(confusion) is not None
        better = accuracy > state.best_accuracy + (self.min_delta if state.best_epoch else 0.0)
        if state.best_epoch and one != state.best_one_class:
            better = not one  # telling classes apart beats any accuracy of saying one class
        if better:
            state.best_accuracy, state.best_epoch, state.evals_since_best = accuracy, state.epoch, 0
            state.best_one_class, self.best_confusion = one, confusion
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
        """What a checkpoint holds of the choice: the best evaluation's confusion matrix, and the best weights while
        the model has moved past them."""
        out = {"best_confusion": self.best_confusion} if self.best_confusion is not None else {}
        if self.on != "val" or self.weights is None or is_best(state):
            return out
        return out | {"best_model": self.weights}

    def restore(self, payload: dict, model: torch.nn.Module) -> None:
        """The best weights from the checkpoint a run continues from: its own copy, or the model's where the
        checkpoint was taken at the best evaluation."""
        self.best_confusion = payload.get("best_confusion")
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

    def chosen_confusion(self) -> torch.Tensor | None:
        """The confusion matrix of the model the run ends with: the chosen one's on test when tested, else on val;
        without a val split, the final model's latest."""
        if self.test_confusion is not None:
            return self.test_confusion
        return self.best_confusion if self.on == "val" else self.latest_confusion

    def chosen_one_class(self) -> int | None:
        """The class the chosen model predicts for every val sample, when it tells no class from another."""
        if self.on != "val" or self.best_confusion is None:
            return None
        return scores.one_class(self.best_confusion)


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
    if state.step % log.every and state.steps_since_eval:  # the open window is logged: every evaluated epoch has one
        log.close_window(
            state.step, r.optimizer.param_groups[0]["lr"], min(state.step % log.every, state.steps_since_eval)
        )
    scored = evaluate_split(loop, on, extra=log.sums[1:])
    (train_sum,) = scored.extra
    now = time.perf_counter()
    for window in log.ready(wait=True):
        loop.report.loss(*window)
    log.sums[1:].zero_()
    record = {
        "epoch": state.epoch,
        "step": state.step,
        "train_loss": train_sum / max(state.steps_since_eval, 1),
        **scored.record(on),
        "samples_per_s": state.samples_since_eval / max(now - loop.t_eval, 1e-9),
        "wall_s": round(now - loop.t_start, 3),
    }
    show(loop, on, scored.confusion)
    reason = loop.chooser.judge(state, record[f"{on}_accuracy"], r.model, scored.confusion)
    state.steps_since_eval = state.samples_since_eval = 0
    loop.report.evaluation(record)
    if (only := scores.one_class(scored.confusion)) is not None:  # under the epoch line it belongs to
        say(f"warning: the model predicts {r.classes[only]} for every {on} sample: it tells no class from another")
    loop.t_eval = now
    return reason


def show(loop: Loop, split: str, confusion: torch.Tensor) -> None:
    """An evaluation's per-class table and confusion picture in TensorBoard."""
    classes, step = loop.r.classes, loop.state.step
    loop.report.class_table(split, scores.table(confusion, classes), step)
    loop.report.image(f"{split}/confusion", lambda: diagnostics.confusion_picture(confusion, classes, split), step)


@dataclass
class Scored:
    """An evaluation over the whole group: mean loss, accuracy, top-5 accuracy, the confusion matrix (rows: true
    class), and the totals of what was reduced with it."""

    loss: float
    accuracy: float
    top5: float
    confusion: torch.Tensor
    extra: list[float]

    def record(self, on: str) -> dict:
        """metrics.jsonl's fields of it: loss, accuracy, macro and weighted F1 (and precision, recall), top-5."""
        out = {f"{on}_loss": self.loss, f"{on}_accuracy": self.accuracy}
        out |= {f"{on}_{k}": v for k, v in scores.averages(self.confusion).items()}
        return out | ({f"{on}_top5": self.top5} if len(self.confusion) > 5 else {})  # not *acc*: accuracy is top-1


def evaluate_split(loop: Loop, split: str, extra: torch.Tensor | None = None) -> Scored:
    """The model on a held-out split over the whole group, and `extra`'s totals (the evaluation's one host sync)."""
    loader, r = loop.r.held_out[split], loop.r
    k = len(r.classes)
    with memory_guard(f"data.eval_batch_size={loader.batch_size}", r.device), loop.clock.testing():
        sums = test_sums(r.model, loader, r.amp, loop.cfg.train.test_time_augmentation, classes=k)
    totals = distributed.totals(sums, sums[:0] if extra is None else extra).cpu()
    loss, correct, counted, top5 = totals[:4].tolist()
    confusion = totals[4 : 4 + k * k].round().long().view(k, k)
    n = max(counted, 1)
    return Scored(loss / n, correct / n, top5 / n, confusion, totals[4 + k * k :].tolist())


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
    scored = evaluate_split(loop, "test")
    chooser.test_confusion = scored.confusion  # the weakest classes are the chosen model's on test
    show(loop, "test", scored.confusion)
    record = {"epoch": state.epoch, "step": state.step, "chosen_epoch": state.best_epoch}
    record |= {"val_accuracy": state.best_accuracy, **scored.record("test")}
    record |= {"final_test_loss": final.loss, "final_test_accuracy": final.accuracy} if final else {}
    loop.report.tested(record)
    return record


def outcome(on: str, final: dict, state: Progress) -> str:
    """The run's result in words: what it chose on, and what the test split says of the choice."""
    best = f"best {on} accuracy {state.best_accuracy:.4f} (epoch {state.best_epoch})"
    if on == "test":  # no val split: the test split is all there is, and the best epoch was picked on it
        return f"{best}, final {final['final_accuracy']:.4f} (no val split: evaluations report the test split)"
    tested = f"; test accuracy {final['test_accuracy']:.4f}" if "test_accuracy" in final else ""
    return f"{best}, its weights in model.pt{tested}"


def chosen_lines(chooser: Chooser, classes: list[str], best_epoch: int) -> list[str]:
    """What the end of a run says of the model it ends with: that it tells no class from another, when so; the three
    classes of its lowest F1 (on test when tested, else on val)."""
    lines = []
    if (only := chooser.chosen_one_class()) is not None:
        lines.append(
            f"warning: the chosen model (epoch {best_epoch}) predicts {classes[only]} for every val sample: it tells "
            "no class from another (more epochs, another learning rate, or class weights: train.class_weights=balanced)"
        )
    confusion = chooser.chosen_confusion()
    if confusion is not None and len(classes) >= 2:
        shown = ", ".join(f"{name} {f1:.2f}" for name, f1 in scores.weakest(confusion, classes))
        lines.append(f"weakest classes by F1: {shown}")
    return lines


def write_reports(loop: Loop) -> None:
    """report/<split>/ in the run folder for each held-out split, of the model the run ends with (job/diagnostics.py):
    every process scores its part, rank 0 writes the files."""

    def put(split: str, name: str, data: bytes) -> None:
        loop.run_dir.write(f"report/{split}/{name}", data)

    group = (distributed.rank(), distributed.world())
    diagnostics.write_splits(loop.r, put, group, distributed.gather_to_writer)
