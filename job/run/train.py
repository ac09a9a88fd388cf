"""The run and its loop: open the run folder, set the recipe up (job/recipe/build.py), continue from a checkpoint when
there is one, then epochs of steps, evaluations and checkpoints, and the results at the end.

Inside an epoch nothing waits for the device: losses are summed on the device and copied to the host N steps at a
time without blocking (job/run/meters.py); the host reads numbers only at evaluations and checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from job.config import Config, flat_items, to_yaml
from job.console import say
from job.data.placement import restored
from job.errors import Interrupted, StorageError, exit_code
from job.group import distributed, platforms
from job.group.env import describe_device, pick_device, seed_everything
from job.group.memory import is_out_of_memory, memory_guard, out_of_memory_error
from job.group.stop import StopRequest
from job.recipe import build as recipe
from job.recipe import calibrate
from job.recipe.models import describe as describe_model
from job.recipe.plan import make_step, set_cpu_threads
from job.recipe.weights import at_hand as weights_at_hand
from job.run import checkpoint
from job.run.attempts import Attempt
from job.run.choose import Chooser, chosen_lines, outcome
from job.run.cost import describe as describe_cost
from job.run.evaluations import evaluation_fields, final_test, test_and_report, write_reports
from job.run.loop import Loop
from job.run.meters import LossLog, TrainClock
from job.run.progress import Progress, is_best, position
from job.run.resume import Request, check_split, decide, preflight, replan_schedule, restore
from job.sinks import hypertune, track
from job.sinks.ray_report import RayReport
from job.sinks.report import FollowerReport, Report
from job.storage.run_folder import RunDir, cache_dir
from job.use import bundle

Judge = Callable[[dict[str, Any]], "str | None"]  # an evaluation's record -> why the run should stop there, or None


def run(
    cfg: Config,
    output: str,
    device_name: str = "auto",
    resume: str = "auto",
    overwrite: bool = False,
    stop: StopRequest | None = None,
    routes: dict[str, str] | None = None,
    began: float | None = None,
    judge: Judge | None = None,
) -> dict:
    """Train as the config says, writing the run to `output`; returns the final summary. `stop` is the caller's
    signal watch when it installed one early (the command line does, before the slow imports); `began`: when the
    attempt began, as time.time() (the command line: its process's start; default: now); `judge`: given each
    evaluation's record on rank 0, returns why the run should stop there (a sweep's pruner), or None."""
    with contextlib.nullcontext(stop) if stop is not None else StopRequest(cfg.train.grace_seconds) as stop:
        stop.grace_seconds = cfg.train.grace_seconds
        stop.limit(cfg.train.time_limit)
        if overwrite and resume == "auto":  # --overwrite alone: this folder, from scratch
            resume = "never"
        t_start, threads, began = time.perf_counter(), torch.get_num_threads(), began or time.time()
        distributed.start(device_name, stop)  # under torchrun: join the process group; otherwise nothing
        together = False
        try:
            req = Request(output, device_name, resume, overwrite, routes)
            summary = train_rank(cfg, req, stop, t_start, began, judge)
            together = True
            return summary
        except Interrupted:
            together = True  # a stop the processes agreed on: they leave the group together, as after a finish
            raise
        finally:
            distributed.finish(together)
            torch.set_num_threads(threads)  # train.cpu_threads holds for the run, not for a notebook's kernel after


def train_rank(
    cfg: Config, req: Request, stop: StopRequest, t_start: float, began: float, judge: Judge | None = None
) -> dict:
    # Rank 0 checks and opens the run folder; the other processes of a group only name it and never write to it.
    with distributed.writer_first() as writer:
        run_dir = preflight(cfg, req) if writer else RunDir(req.output)
    attempt = Attempt(run_dir if distributed.is_writer() else None, began)
    try:
        return train_loop(cfg, run_dir, req, stop, t_start, attempt, judge)
    except Interrupted as e:
        attempt.end(e.exit_code)
        try:
            run_dir.finish()  # the grace period's timer ends the process if this takes too long
        except StorageError as failed:  # still exit 75: a retry continues from what the store holds
            raise Interrupted(f"{e}; but {failed}") from None
        run_dir.remove_if_empty()
        raise
    except BaseException as e:
        attempt.end(exit_code(e))
        with contextlib.suppress(Exception):  # send what was committed before the failure, for a retry elsewhere
            run_dir.finish(timeout=30)
        run_dir.abandon()
        run_dir.remove_if_empty()
        if is_out_of_memory(e):  # the loop names its batch sizes itself: this is setting up (data, model)
            raise out_of_memory_error("while setting up the run", pick_device(req.device)) from None
        if lost := distributed.peer_lost(e):
            raise lost from None
        raise


def train_loop(
    cfg: Config,
    run_dir: RunDir,
    req: Request,
    stop: StopRequest,
    t_start: float,
    attempt: Attempt,
    judge: Judge | None = None,
) -> dict:
    device = pick_device(req.device)
    cfg = recipe.resolved(cfg)  # the defaults that follow from other settings, as config.yaml records them
    seed_everything(cfg.seed, cfg.train.deterministic)
    where = track.target(cfg, run_dir.url, fresh=req.overwrite) if distributed.is_writer() else None
    resumption = decide(run_dir, req, cfg, device, where)
    if resumption.ended is not None:  # a finished run, or one that spent its budget: left as it is
        return resumption.ended
    found, started, budget = resumption.found, resumption.started, resumption.budget
    if started is None:  # the weights are at hand before the data is read: a failed download takes seconds to find
        weights_at_hand(cfg.model, cache_dir("weights"))
    with stop.at_once():
        data = recipe.read_data(cfg, restored((started or {}).get("placement")))
    check_split(started, data.inventory)
    r = recipe.build(cfg, device, data, rank=distributed.rank(), world=distributed.world(), started=started)
    distributed.seed_own(cfg.seed, cfg.train.deterministic)  # the model is built alike everywhere: now each its own
    tuning = hypertune.trial(cfg.track.hp_metric_tag, evaluation_fields(r))  # every rank refuses a bad tag alike
    resumption.begin()
    step_flops = set_cpu_threads(cfg, r)
    say(f"device {describe_device(device)}; data {data.describe()}, {r.feed.describe()}")
    chooser = Chooser(cfg.train, r.evaluated_on, r.multilabel, evaluation_fields(r))
    params, stem = sum(p.numel() for p in r.model.parameters()), describe_model(cfg.model, r.input_shape)
    say(f"model {cfg.model.name}{stem}: {params:,} parameters; output {run_dir.url}")
    state, log = Progress(run_id=uuid.uuid4().hex[:12]), LossLog(device, cfg.train.log_every_steps)
    if found is not None:
        state = restore(found, r, log, state.run_id, cfg.seed)
        chooser.restore(found[0], r.evaluated)
        replanned = replan_schedule(cfg, r, state)
        source = (found[1] or {}).get("file") or req.resume  # a bare .pt given by URL has no manifest
        into = f" ({state.epoch_step} steps into epoch {state.epoch + 1})" if state.epoch_step else ""
        say(f"resuming {cfg.name} from epoch {state.epoch}, step {state.step}{into} ({source}){replanned}")
    stop.sync()
    if stop.signal is not None:  # stopped while setting up: nothing new to save, nothing written yet
        raise stop.unstarted()
    report = FollowerReport()
    if distributed.is_writer():
        run_dir.write("config.yaml", to_yaml(cfg).encode())
        if data.inventory is not None:  # which files the run learns from, chooses on and tests on
            run_dir.write("data.json", json.dumps(data.inventory.to_json(), indent=1, ensure_ascii=False).encode())
        tracker = track.Tracker(where, run_dir, state.step if found else -1) if where is not None else None
        start = state.step + 1 if found else 0
        # A stop asked at an evaluation is acted on right after it: the run commits that evaluation's step.
        asks = (lambda record: stop.ask(judge(record))) if judge is not None else None
        report = Report(run_dir, flat_items(cfg), cfg.train.epochs, len(r.train), start, tracker, tuning, asks)
    state.planned_steps = state.planned_steps or cfg.train.epochs * len(r.train)  # kept when train.epochs changes
    step = make_step(cfg, r, log, step_flops, state.planned_steps)
    if step.accumulator is not None and found is not None:
        step.accumulator.restore(found[0]["progress"].get("accumulated"), r.device)
    clock, now = TrainClock(device), time.perf_counter()
    loop = Loop(cfg, run_dir, r, step, state, log, report, stop, clock, t_start, now, attempt, chooser, budget)
    loop.ray = RayReport() if platforms.current().joined else None
    attempt.begin(state, distributed.world(), device, cfg.train.price_per_device_hour, cfg.train.epochs * len(r.train))
    if report.tracker is not None:
        decided = {"device": describe_device(device), "world_size": distributed.world(), "precision": r.precision}
        decided |= {"step": step.description}
        decided |= {"data": data.describe(), "feed": r.feed.describe(), "parameters": params}
        attempt.track(report.tracker, cfg, flat_items(cfg) | {f"decided.{k}": v for k, v in decided.items()})
        say(f"tracking: {where.describe()}")
    first_epoch = state.epoch
    for epoch in range(state.epoch, state.epoch if state.stopped_early else cfg.train.epochs):
        finished = train_epoch(loop, epoch)
        last = state.epoch == cfg.train.epochs
        if finished and (state.epoch % cfg.train.eval_every_epochs == 0 or last):
            state.stopped_early = test_and_report(loop, last)
            last = last or bool(state.stopped_early)
        stopping = stop.signal is not None and not last
        if stopping:
            say(f"{stop.describe()}: stopping {position(state)}; committing a checkpoint")
        saved = stopping or last or (finished and state.epoch % cfg.train.checkpoint_every_epochs == 0)
        if saved:
            save(loop)
        if loop.ray is not None:  # in Ray Train's worker: the evaluation and the checkpoint reported to Ray
            args = state, loop.report.records, saved, loop.r.evaluated, run_dir.url
            loop.ray.after_epoch(*args, lambda metrics: model_json(loop, metrics, at=state))
        if state.stopped_early:
            say(state.stopped_early)
            break
        if stopping:
            raise Interrupted(
                f"stopped by {stop.describe()} {position(state)}; "
                f"checkpoint committed to {run_dir.url}: run the same command again to continue"
            )
        if loop.over_budget and not last:
            return end_by_budget(loop)
    if req.overwrite and req.resume != "auto" and not loop.report.records:  # a finished checkpoint, folder cleared
        test_and_report(loop)
    stop.finishing()
    return finish(loop, first_epoch, (found[1] or {}).get("metrics") or {} if found else {})


def train_epoch(loop: Loop, epoch: int) -> bool:
    """One epoch from where the state says it stands; False when a stop was requested before its end."""
    state, log, report, stop, loader = loop.state, loop.log, loop.report, loop.stop, loop.r.train
    fallback, every, accumulator = loop.step.fallback, log.every, loop.step.accumulator
    report.start_epoch(epoch, state.epoch_step)
    loop.clock.start()
    log.system.resume(state.step)
    with memory_guard(f"data.batch_size={loop.cfg.data.batch_size}", loop.r.device):
        for batch in log.system.timed(loader.batches(epoch, state.epoch_step)):
            if accumulator is not None:
                accumulator.plan(loader, state.epoch_step)
            x, y = (batch.x, batch.y) if loop.r.mix is None else loop.r.mix(batch.x, batch.y, epoch, state.epoch_step)
            loop.step(x, y, batch.weight)
            state.samples_since_eval += batch.samples  # the global batch's: every process's
            state.step += 1
            state.epoch_step += 1
            state.steps_since_eval += 1
            if state.step % every == 0:
                window = min(every, state.steps_since_eval)  # an evaluation logs the window open before it
                log.close_window(state.step, loop.r.optimizer.param_groups[0]["lr"], window)
                for done in log.ready():
                    report.loss(*done)
                report.advance(every)
            stop.step()  # in a group: whether any process was sent a signal, learnt one step later by all
            if stop.signal is not None:
                break
        stop.settle()
    if loop.step.fallback != fallback:  # a fallback found on the first batch: say so once
        say(f"step: {loop.step.description}")
    finished = state.epoch_step == len(loader)
    if finished:
        state.epoch, state.epoch_step = epoch + 1, 0
    report.end_epoch()
    return finished


def save(loop: Loop) -> None:
    """Commit a checkpoint of the state as it stands, with each process's own loss sums, so that every one of them
    resumes with exactly what it had. Rank 0 flushes the logs and writes it."""
    loop.pause()
    sums = distributed.gather(loop.log.sums).tolist()  # one row per process
    places = distributed.gather_objects(loop.r.train.position()) if loop.state.epoch_step else None
    rngs = distributed.gather_objects(checkpoint.rng_state()) if distributed.world() > 1 else []
    loop.over_budget = distributed.shared_line(lambda: commit(loop, sums, places, rngs))


def commit(loop: Loop, loss_sums: list[list[float]], places: list | None = None, rngs: list | None = None) -> str:
    """Rank 0 commits the checkpoint: `rngs`, every process's RNG state in a group (kept by rank). Returns why the
    run stops here to keep within its budget (empty: it goes on)."""
    cfg, r, state, report = loop.cfg, loop.r, loop.state, loop.report
    for window in loop.log.ready(wait=True):
        report.loss(*window)
    report.flush()
    progress = {**asdict(state), "loss_sums": loss_sums, **({"places": places} if places else {})}
    progress |= loop.step.accumulator.saved(state.epoch_step) if loop.step.accumulator is not None else {}
    metrics = report.records[-1] if report.records and report.records[-1]["step"] == state.step else {}
    state_of = (r.model, r.optimizer, r.scheduler, r.scaler, progress, cfg.model_dump(), r.lookahead, r.ema)
    payload = checkpoint.snapshot(*state_of)
    payload |= {"rng_ranks": rngs} if rngs else {}
    payload |= loop.chooser.saved(state)
    payload |= {"placement": r.feed.streaming_choice.saved(), "precision": r.precision_began.saved()}
    payload |= {"split": r.feed.inventory.digest()} if r.feed.inventory is not None else {}
    payload |= {"model_json": model_json(loop, metrics, at=state)}  # any checkpoint describes its model as model.json
    payload |= {"mlflow_run_id": report.tracker.run_id} if report.tracker is not None else {}
    if r.feed.mean is not None:
        payload |= {"normalization": {"mean": r.feed.mean.tolist(), "std": r.feed.std.tolist()}}
    t = cfg.train
    checkpoint.commit(
        loop.run_dir,
        payload,
        epoch=state.epoch,
        step=state.step,
        metrics=metrics,
        keep_last=t.keep_last,
        keep_best=t.keep_best,
        run_id=state.run_id,
        chosen=(state.best_epoch, is_best(state)),
    )
    loop.run_dir.check()  # the store gave up: stop here, the checkpoint just committed kept locally
    loop.attempt.committed(state.epoch, state.step)
    return loop.attempt.over(loop.budget) if loop.budget is not None else ""


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
