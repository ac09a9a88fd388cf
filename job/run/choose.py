"""What a run chooses on its evaluations, and what it says of the chosen model at the end.

Every evaluation reports the val split when the data has one; the run chooses on it, on train.choose_on (val
accuracy by default, mAP for multi-label; val_loss lowest, any other score highest): the best value and its epoch,
its weights (kept on the host, and in checkpoints while the model has moved past them, so a resumed run chooses
exactly as an uninterrupted one), its multi-label thresholds, train.keep_best, and early stopping, which counts the
evaluations since that value was last bettered. The test split is then only reported, once, at the end: on the
chosen model (which model.pt holds), and on the final one when they differ.

Without a val split every evaluation reports the test split as it always has, the final weights are the run's
result, and the summary says that its best test accuracy was picked on the test split itself. Nothing is fitted on
test: multi-label thresholds stay at 0.5 (UNFITTED).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from job.errors import ConfigError, MetricNotWritten
from job.run.progress import Progress, is_best
from job.use import scores

if TYPE_CHECKING:
    from job.config import TrainConfig

UNFITTED = 0.5  # a multi-label class's threshold where no val split fits one: the sigmoid's midpoint


class Chooser:
    """The best evaluation so far, its weights and its confusion matrix. `on`: the split evaluations report (val, or
    test). A model that predicts one class for every sample is never chosen over one that tells classes apart,
    whatever their scores (always saying the largest class can score the higher). `written`: the fields of the run's
    evaluation records (evaluations.evaluation_fields), which train.choose_on must name."""

    def __init__(self, t: TrainConfig, on: str, multilabel: bool = False, written: list[str] | None = None) -> None:
        if t.early_stopping_patience and on != "val":
            raise ConfigError(
                "train.early_stopping_patience: stops on the val split's scores, and this data has none; hold some "
                "images out with data.val_split (stopping on the test split would report a score chosen on it)"
            )
        self.metric_key = chosen_metric(t.choose_on, on, multilabel, written)  # accuracy, map, loss, macro_f1, ...
        self.lowest = self.metric_key == "loss"  # the one score that is better lower
        self.on, self.patience, self.min_delta = on, t.early_stopping_patience, t.early_stopping_min_delta
        self.weights: dict[str, torch.Tensor] | None = None  # the best model's, on the host; None: the model's own
        self.best_confusion: torch.Tensor | None = None  # the best evaluation's
        self.latest_confusion: torch.Tensor | None = None
        self.test_confusion: torch.Tensor | None = None  # the chosen model's on test, at the end
        self.multilabel = multilabel
        self.thresholds: list[float] | None = None  # multi-label: the best evaluation's, each class's best F1 there
        self.latest_thresholds: list[float] | None = None  # the latest evaluation's: a checkpoint's weights' own

    def fitted_thresholds(self, classes: int) -> list[float] | None:
        """The thresholds an evaluation scores a multi-label model at: None to fit each class's best-F1 cut on the
        split (val), or UNFITTED for all where the split is test, which only reports."""
        return None if self.on == "val" else [UNFITTED] * classes

    def model_thresholds(self, classes: int, state=None) -> list[float] | None:
        """Multi-label: the thresholds of the weights the model holds. At the end (no `state`), model.pt's: the
        chosen evaluation's. At a checkpoint (the run's `state`), its weights' own: the chosen one's where the model
        stands at its best, else the latest evaluation's (mid-epoch: the one before). UNFITTED without val, and
        before any evaluation (never a split's own cut at the end: the test split would be fitted)."""
        if self.on != "val":
            return [UNFITTED] * classes
        held = self.thresholds if state is None or is_best(state) else self.latest_thresholds or self.thresholds
        return held or [UNFITTED] * classes

    def judge(
        self,
        state,
        value: float,
        loss: float,
        model: torch.nn.Module,
        confusion: torch.Tensor | None,
        thresholds: list[float] | None = None,
    ) -> str:
        """Record an evaluation (`value`: its score of metric_key; its loss, confusion matrix, None for multi-label,
        and multi-label thresholds) in the run's state (best_accuracy holds the best value, best_loss, best_epoch,
        best_one_class, evals_since_best); the reason to stop early, or ''. A tie in a score (a small val split is
        often right on every sample from the first epochs on) goes to the lower loss, unless
        early_stopping_min_delta asks for a gain; early stopping counts the evaluations since the value improved. A
        value that is not a number is never chosen."""
        self.latest_confusion, self.latest_thresholds = confusion, thresholds
        one = confusion is not None and scores.one_class(confusion) is not None
        delta, best = (self.min_delta if state.best_epoch else 0.0), state.best_accuracy
        if not state.best_epoch:
            better = value == value  # the first evaluation, unless NaN
        else:
            better = value < best - delta if self.lowest else value > best + delta
        # min_delta asks that only a gain of that much counts: no tie then
        tie = bool(state.best_epoch) and not self.min_delta and value == best and loss < state.best_loss
        if state.best_epoch and one != state.best_one_class:
            better, tie = not one, False  # telling classes apart beats any accuracy of saying one class
        if better or tie:
            state.best_accuracy, state.best_loss, state.best_epoch = value, loss, state.epoch
            state.best_one_class, self.best_confusion, self.thresholds = one, confusion, thresholds
            if self.on == "val":
                self.weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        if better:
            state.evals_since_best = 0
            return ""
        state.evals_since_best += 1
        if self.patience and state.evals_since_best >= self.patience:
            gain = f" by more than {self.min_delta:g}" if self.min_delta else ""
            return (
                f"early stopping: val {said(self.metric_key)} has not improved{gain} in {state.evals_since_best} "
                "evaluations "
                f"(best {state.best_accuracy:.4f} at epoch {state.best_epoch})"
            )
        return ""

    def saved(self, state) -> dict:
        """What a checkpoint holds of the choice: the best and the latest evaluations' confusion matrices, and the
        best weights while the model has moved past them."""
        kept = {"best_confusion": self.best_confusion, "latest_confusion": self.latest_confusion}
        kept |= {"best_thresholds": self.thresholds, "latest_thresholds": self.latest_thresholds}
        out = {k: v for k, v in kept.items() if v is not None}
        if self.on != "val" or self.weights is None or is_best(state):
            return out
        return out | {"best_model": self.weights}

    def restore(self, payload: dict, model: torch.nn.Module, progress=None) -> None:
        """The choice from the checkpoint a run continues from (what saved() gave): the best weights, its own copy or
        the model's where the checkpoint was taken at the best evaluation. `progress`: the run's, restored (a
        Progress, or its dict; default: the payload's "progress")."""
        self.best_confusion, self.latest_confusion = payload.get("best_confusion"), payload.get("latest_confusion")
        self.thresholds, self.latest_thresholds = payload.get("best_thresholds"), payload.get("latest_thresholds")
        if self.on != "val":  # an earlier version fitted them on test: not kept
            self.thresholds = self.latest_thresholds = None
            return
        best, progress = payload.get("best_model"), payload.get("progress", {}) if progress is None else progress
        best_epoch = progress.get("best_epoch") if isinstance(progress, dict) else progress.best_epoch
        if best is not None:
            self.weights = best
        elif best_epoch and is_best(progress):
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


def chosen_metric(choose_on: str, on: str, multilabel: bool, written: list[str] | None) -> str:
    """What a run chooses on, as its records name it after the split: train.choose_on's (auto: accuracy, or map for
    multi-label), checked against what its evaluations write (`written`, when known)."""
    if choose_on == "auto":
        return "map" if multilabel else "accuracy"
    if on != "val":
        raise MetricNotWritten(
            f"train.choose_on={choose_on}: chooses on the val split, and this data has none; hold some out with "
            "data.val_split, or leave train.choose_on at auto (the final weights are kept)"
        )
    if written is not None and choose_on not in written:
        may = ", ".join(k for k in written if k.startswith("val_"))
        raise MetricNotWritten(
            f"train.choose_on: this run's evaluations never write {choose_on}; it may choose on {may}"
        )
    return choose_on.removeprefix("val_")


def said(metric: str) -> str:
    """A metric's name in a sentence: mAP, accuracy, loss, macro_f1."""
    return "mAP" if metric == "map" else metric


def outcome(on: str, final: dict, state: Progress, metric: str = "accuracy", multilabel: bool = False) -> str:
    """The run's result in words: what it chose on (`metric`: accuracy, map, loss, ...), and what the test split says
    of the choice."""
    best = f"best {on} {said(metric)} {state.best_accuracy:.4f} (epoch {state.best_epoch})"
    if on == "test":  # no val split: the test split is all there is, and the best epoch was picked on it
        unfitted = f"; multi-label thresholds {UNFITTED} (none fitted without val)" if multilabel else ""
        return (
            f"{best}, final {final[f'final_{metric}']:.4f} (no val split: evaluations report the test split{unfitted})"
        )
    tested = f"; test {said(metric)} {final[f'test_{metric}']:.4f}" if f"test_{metric}" in final else ""
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
