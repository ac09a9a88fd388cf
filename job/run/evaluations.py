"""The loop's evaluations: val (or test) at its evaluated epochs, with the training loss and throughput since the
last one; the chosen model tested at the end; the per-class table, confusion picture and report folders. The one host
sync of an evaluation is in job/use/evaluate.py's score_split."""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from job.console import say
from job.group import distributed
from job.recipe import multilabel
from job.recipe.multilabel import MultiScored
from job.run.progress import is_best
from job.use import diagnostics, scores
from job.use.evaluate import Scored, score_kept, score_split

if TYPE_CHECKING:
    from job.recipe.build import Recipe
    from job.run.loop import Loop


def test_and_report(loop: Loop, last: bool = False) -> str:
    """Evaluate the model on val (test when there is none) and report it with the training loss and throughput since
    the previous evaluation; the reason to stop early, or ''. `last`: the run's last evaluation, whose samples the
    end's report reads (Loop.kept)."""
    loop.pause()
    r, state, log, on = loop.r, loop.state, loop.log, loop.r.evaluated_on
    if state.step % log.every and state.steps_since_eval:  # the open window is logged: every evaluated epoch has one
        log.close_window(
            state.step, r.optimizer.param_groups[0]["lr"], min(state.step % log.every, state.steps_since_eval)
        )
    fitted = loop.chooser.fitted_thresholds(len(r.classes))  # multi-label: fitted on val, never on test
    scored = score(loop, on, extra=log.sums[1:], thresholds=fitted, keep=last)
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
    show(loop, on, scored)
    thresholds = scored.thresholds if isinstance(scored, MultiScored) else None
    value = record[f"{on}_{loop.chooser.metric_key}"]  # what the run chooses on (train.choose_on)
    reason = loop.chooser.judge(state, value, scored.loss, r.evaluated, scored.confusion, thresholds)
    state.steps_since_eval = state.samples_since_eval = 0
    loop.report.evaluation(record)
    if scored.confusion is not None and (only := scores.one_class(scored.confusion)) is not None:  # under its epoch
        say(f"warning: the model predicts {r.classes[only]} for every {on} sample: it tells no class from another")
    loop.t_eval = now
    return reason


def evaluation_fields(r: Recipe) -> list[str]:
    """The metrics each evaluation's record holds (test_and_report), known before the first one."""
    k = len(r.classes)
    blank = multilabel.scored(np.zeros((0, k)), np.zeros((0, k)), 0.0) if r.multilabel else None
    blank = blank or Scored(0.0, 0.0, 0.0, torch.zeros(k, k), [])
    return ["train_loss", *blank.record(r.evaluated_on), "samples_per_s", "wall_s"]


def show(loop: Loop, split: str, scored: Scored | MultiScored) -> None:
    """An evaluation's per-class table and confusion picture in TensorBoard (multi-label: the per-class AP table)."""
    classes, step, confusion = loop.r.classes, loop.state.step, scored.confusion
    if isinstance(scored, MultiScored):
        f1 = dict(zip(classes, scored.f1))
        loop.report.class_table(split, multilabel_table(scored, classes), f1, step)
        return
    f1 = dict(zip(classes, scores.per_class(confusion)["f1"].tolist()))
    loop.report.class_table(split, scores.table(confusion, classes), f1, step)
    draw = functools.partial(diagnostics.confusion_picture, confusion, classes, split)
    loop.report.image(f"{split}/confusion", draw, step, of=confusion)


def multilabel_table(scored: MultiScored, classes: list[str]) -> str:
    """Each class's AP, threshold, precision, recall, F1 and support, as a Markdown table."""
    head = "| class | AP | threshold | precision | recall | F1 | support |\n|---|---|---|---|---|---|---|\n"
    return head + "".join(
        f"| {c} | {ap:.4f} | {t:.4f} | {p:.4f} | {rc:.4f} | {f:.4f} | {n} |\n"
        for c, ap, t, p, rc, f, n in scored.table(classes)
    )


def score(
    loop: Loop, split: str, extra: torch.Tensor | None = None, thresholds: list[float] | None = None, keep: bool = False
):
    """The model on a split (multi-label: at `thresholds`, default the split's own best-F1 ones). `keep`: the pass
    keeps every sample, for the end's report (Loop.kept; one class a sample)."""
    r = loop.r
    augmentation = loop.cfg.train.test_time_augmentation
    held = r.held_out[split]
    loop.kept.pop(split, None)  # a pass on other weights than the kept one's
    if keep and not r.multilabel:
        stats = r.feed.stats_cpu() if r.feed.is_image else None
        args = r.evaluated, held, r.amp, len(r.classes), augmentation, loop.clock, stats, extra
        scored, loop.kept[split] = score_kept(*args)
        return scored
    return score_split(
        r.evaluated, held, r.amp, len(r.classes), augmentation, loop.clock, extra, r.multilabel, thresholds
    )


def final_test(loop: Loop) -> dict:
    """With a val split: the chosen (best-on-val) weights put into the model, and the test split, when there is one,
    reported once on them (and on the final weights, when they differ)."""
    r, state, chooser = loop.r, loop.state, loop.chooser
    if r.evaluated_on != "val":
        return {}
    tested = "test" in r.held_out
    final = score(loop, "test") if tested and not is_best(state) else None
    if not is_best(state):  # the chosen weights are put back: the last evaluation's samples are not theirs
        loop.kept.clear()
    chooser.choose(state, r.evaluated)
    if not tested:
        return {}
    scored = score(loop, "test", thresholds=chooser.thresholds, keep=True)  # multi-label: at the val's thresholds
    chooser.test_confusion = scored.confusion  # the weakest classes are the chosen model's on test
    show(loop, "test", scored)
    metric, shown = chooser.metric_key, "map" if r.multilabel else "accuracy"
    record = {"epoch": state.epoch, "step": state.step, "chosen_epoch": state.best_epoch}
    record |= {f"val_{metric}": state.best_accuracy, **scored.record("test")}
    if final:  # the final model's loss, the score chosen on, and the one the console shows
        named = {f"test_{k}" for k in ("loss", metric, shown)}
        record |= {f"final_{k}": v for k, v in final.record("test").items() if k in named}
    loop.report.tested(record)
    return record


def write_reports(loop: Loop) -> tuple[float | None, dict[str, float]]:
    """report/<split>/ in the run folder for each held-out split, of the model the run ends with (use/diagnostics.py):
    every process scores its part, rank 0 writes the files. Returns, on rank 0, the temperature fitted on val and
    the expected calibration errors (diagnostics.calibrated; None and none for multi-label and on the other ranks)."""

    def put(split: str, name: str, data: bytes) -> None:
        loop.run_dir.write(f"report/{split}/{name}", data)

    group = (distributed.rank(), distributed.world())
    views = loop.cfg.train.test_time_augmentation
    chosen = loop.chooser.model_thresholds(len(loop.r.classes)) if loop.r.multilabel else None
    kept, loop.kept = loop.kept, {}
    calibration = diagnostics.write_splits(loop.r, put, group, distributed.gather_to_writer, chosen, views, kept) or {}
    return calibration.pop("temperature", None), calibration
