"""The run's end: the chosen weights and their description written (model.pt, model.json), the reporter closed,
the summary and its last lines; or the end a budget sets, at the checkpoint just committed."""

from __future__ import annotations

import json
import math
import time

from job.console import say
from job.group import distributed
from job.recipe import calibrate
from job.run import checkpoint
from job.run.choose import chosen_lines, outcome
from job.run.cost import describe as describe_cost
from job.run.evaluations import final_test, write_reports
from job.run.loop import Loop
from job.run.progress import Progress, position
from job.use import bundle


def model_json(loop: Loop, metrics: dict, temperature: float | None = None, at: Progress | None = None) -> dict:
    """model.json's description of the model: `at`, the run's state, for a checkpoint's weights as they stand (its
    multi-label thresholds are its own evaluation's); without it, model.pt's, the chosen model's."""
    r = loop.r
    card = bundle.describe(loop.cfg, r.classes, r.input_shape, r.feed.stats_cpu(), r.feed.features, metrics)
    card |= {"temperature": temperature} if temperature is not None else {}  # calibrated probabilities (calibrate.py)
    # Multi-label: a class is in an image's label set where its probability is above its threshold.
    thresholds = loop.chooser.model_thresholds(len(r.classes), at) if r.multilabel else None
    return card | (bundle.multilabel_entry(r.classes, thresholds) if r.multilabel else {})


def write_results(loop: Loop, final: dict, temperature: float | None) -> None:
    loop.run_dir.write("model.pt", checkpoint.weights_bytes(loop.r.evaluated))
    described = json.dumps(model_json(loop, final, temperature), indent=1, ensure_ascii=False)
    loop.run_dir.write(bundle.MODEL_JSON, described.encode())
    loop.report.close(final, loop.attempt.settle())
    loop.attempt.end(0, metrics=final)


def finish(loop: Loop, first_epoch: int, resumed: dict) -> dict:
    """The chosen weights, hparams and curves written and uploaded; returns the run's summary. `resumed`: the metrics
    of the checkpoint the run continued from, for a process that evaluated nothing since (a group's other ranks
    keep no records of earlier attempts)."""
    run_dir, state, report, stop, on = loop.run_dir, loop.state, loop.report, loop.stop, loop.r.evaluated_on
    last = next((r for r in reversed(report.records) if "train_loss" in r), resumed)
    tested = final_test(loop)
    temperature, calibration = write_reports(loop)
    metric = loop.chooser.metric_key
    final = {
        f"best_{metric}": state.best_accuracy,
        **({f"best_{on}_loss": state.best_loss} if math.isfinite(state.best_loss) else {}),  # the chosen model's
        f"final_{metric}": last.get(f"{on}_{metric}"),
        f"final_{on}_loss": last.get(f"{on}_loss"),
    } | {k: v for k, v in tested.items() if k.startswith(("test_", "final_test_"))}
    final |= calibration  # each split's expected calibration error, before and after the temperature
    distributed.on_writer(lambda: write_results(loop, final, temperature))
    if not distributed.is_writer():  # rank 0 has written the results and uploads them
        return {"rank": distributed.rank(), "epochs": state.epoch, "steps": state.step}
    if run_dir.remote:
        say(f"uploading the run's last files to {run_dir.url}")
    run_dir.finish()
    cost = loop.attempt.cost()
    summary = {
        **final,
        "best_epoch": state.best_epoch,
        "chosen_on": on,
        "epochs": state.epoch,
        "steps": state.step,
        "seconds": round(time.perf_counter() - loop.t_start, 2),
        **loop.clock.summary(),  # in this process's training epochs, and its test passes
        "epochs_run": state.epoch - first_epoch,
        "output": run_dir.url,
        "attempt": loop.attempt.number,
        "cost": cost,
    } | ({"stopped_early": state.stopped_early} if state.stopped_early else {})
    if stop.signal or stop.received:  # it came during the last step or while the results were written
        reason = stop.describe(stop.signal or stop.received)
        say(f"{reason} came as the run was ending: it finished, there is nothing to continue")
    for line in chosen_lines(loop.chooser, loop.r.classes, state.best_epoch):
        say(line)  # before the last line, which says where the outputs are
    if said := calibrate.describe(temperature, final):
        say(said)
    say(
        f"done: {state.epoch} epochs, {state.step} steps in {summary['seconds']:.1f} s; "
        f"{outcome(on, final, state, metric, loop.r.multilabel)}; "
        f"{describe_cost(cost)}; outputs in {run_dir.url}"
        + (f" (attempt {loop.attempt.number}: run.json)" if loop.attempt.number > 1 else "")
    )
    return summary


def end_by_budget(loop: Loop) -> dict:
    """The checkpoint just committed is the last within train.budget: the run ends there (exit 0), and the same
    command with a larger budget continues it."""
    run_dir, state, where = loop.run_dir, loop.state, position(loop.state)
    note = f"stopped {where} by {loop.over_budget}; a larger train.budget continues it"
    summary = {"stopped": "budget", "epochs": state.epoch, "steps": state.step, "output": run_dir.url}
    if not distributed.is_writer():
        return summary
    cost = loop.attempt.settle()
    loop.report.cost(cost, state.step)
    loop.attempt.end(0, loop.budget, note)
    run_dir.finish()
    say(
        f"stopped by the budget {where}: {loop.over_budget}; {describe_cost(cost)}; checkpoint committed to "
        f"{run_dir.url}: the same command with a larger train.budget continues it"
    )
    return summary | {"attempt": loop.attempt.number, "cost": cost}
