"""What a run chooses on its evaluations, and what it says of the chosen model at the end.

Every evaluation reports the val split when the data has one; the run chooses on it: the best val accuracy and its
epoch, its weights (kept on the host, and in checkpoints while the model has moved past them, so a resumed run
chooses exactly as an uninterrupted one), train.keep_best, and early stopping. The test split is then only
reported, once, at the end: on the chosen model (which model.pt holds), and on the final one when they differ.

Without a val split every evaluation reports the test split as it always has, the final weights are the run's
result, and the summary says that its best test accuracy was picked on the test split itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from job import scores
from job.errors import ConfigError
from job.progress import Progress, is_best

if TYPE_CHECKING:
    from job.config import TrainConfig


class Chooser:
    """The best evaluation so far, its weights and its confusion matrix. `on`: the split evaluations report (val, or
    test). A model that predicts one class for every sample is never chosen over one that tells classes apart,
    whatever their accuracies (always saying the largest class can score the higher)."""

    def __init__(self, t: TrainConfig, on: str, multilabel: bool = False) -> None:
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
        self.multilabel = multilabel  # chooses on mAP (state.best_accuracy holds it), not accuracy
        self.thresholds: list[float] | None = None  # multi-label: the best evaluation's, each class's best F1 there

    @property
    def metric_key(self) -> str:
        """What the run chooses on, as metrics.jsonl names it after the split: map (multi-label) or accuracy."""
        return "map" if self.multilabel else "accuracy"

    def judge(
        self,
        state,
        accuracy: float,
        loss: float,
        model: torch.nn.Module,
        confusion: torch.Tensor | None,
        thresholds: list[float] | None = None,
    ) -> str:
        """Record an evaluation (its accuracy, or multi-label its mAP with its thresholds, loss and confusion matrix,
        None for multi-label) in the run's state (best_accuracy,
        best_loss, best_epoch, best_one_class, evals_since_best); the reason to stop early, or ''. A tie in accuracy
        (a small val split is often right on every sample from the first epochs on) goes to the lower loss, unless
        early_stopping_min_delta asks for a gain; early stopping counts the evaluations since the accuracy improved."""
        self.latest_confusion = confusion
        one = confusion is not None and scores.one_class(confusion) is not None
        better = accuracy > state.best_accuracy + (self.min_delta if state.best_epoch else 0.0)
        # min_delta asks that only a gain of that much counts: no tie then
        tie = (
            bool(state.best_epoch) and not self.min_delta and accuracy == state.best_accuracy and loss < state.best_loss
        )
        if state.best_epoch and one != state.best_one_class:
            better, tie = not one, False  # telling classes apart beats any accuracy of saying one class
        if better or tie:
            state.best_accuracy, state.best_loss, state.best_epoch = accuracy, loss, state.epoch
            state.best_one_class, self.best_confusion, self.thresholds = one, confusion, thresholds
            if self.on == "val":
                self.weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        if better:
            state.evals_since_best = 0
            return ""
        state.evals_since_best += 1
        if self.patience and state.evals_since_best >= self.patience:
            gain = f" by more than {self.min_delta:g}" if self.min_delta else ""
            said = "mAP" if self.multilabel else "accuracy"
            return (
                f"early stopping: val {said} has not improved{gain} in {state.evals_since_best} evaluations "
                f"(best {state.best_accuracy:.4f} at epoch {state.best_epoch})"
            )
        return ""

    def saved(self, state) -> dict:
        """What a checkpoint holds of the choice: the best and the latest evaluations' confusion matrices, and the
        best weights while the model has moved past them."""
        kept = {"best_confusion": self.best_confusion, "latest_confusion": self.latest_confusion}
        kept |= {"best_thresholds": self.thresholds}
        out = {k: v for k, v in kept.items() if v is not None}
        if self.on != "val" or self.weights is None or is_best(state):
            return out
        return out | {"best_model": self.weights}

    def restore(self, payload: dict, model: torch.nn.Module) -> None:
        """The best weights from the checkpoint a run continues from: its own copy, or the model's where the
        checkpoint was taken at the best evaluation."""
        self.best_confusion, self.latest_confusion = payload.get("best_confusion"), payload.get("latest_confusion")
        self.thresholds = payload.get("best_thresholds")
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


def outcome(on: str, final: dict, state: Progress, metric: str = "accuracy") -> str:
    """The run's result in words: what it chose on (`metric`: accuracy, or map), and what the test split says of
    the choice."""
    said = "mAP" if metric == "map" else metric
    best = f"best {on} {said} {state.best_accuracy:.4f} (epoch {state.best_epoch})"
    if on == "test":  # no val split: the test split is all there is, and the best epoch was picked on it
        return f"{best}, final {final[f'final_{metric}']:.4f} (no val split: evaluations report the test split)"
    tested = f"; test {said} {final[f'test_{metric}']:.4f}" if f"test_{metric}" in final else ""
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
    weakest = scores.weakest(confusion, classes) if confusion is not None and len(classes) >= 2 else []
    if weakest and weakest[0][1] < 1.0:  # every class perfect: no weakest to name
        lines.append("weakest classes by F1: " + ", ".join(f"{name} {f1:.2f}" for name, f1 in weakest))
    return lines
