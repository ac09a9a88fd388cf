"""The run and its loop: open the run folder, set the recipe up (job/recipe/build.py), continue from a checkpoint when
there is one, then epochs of steps, evaluations and checkpoints, and the results at the end.

Inside an epoch nothing waits for the device: losses are summed on the device and copied to the host N steps at a
time without blocking (job/run/meters.py); the host reads numbers only at evaluations and checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from job.config import Config, to_yaml
from job.console import say
from job.data.placement import restored
from job.errors import Interrupted, StorageError, exit_code
from job.group import distributed
from job.group.env import describe_device, pick_device, seed_everything
from job.group.memory import is_out_of_memory, memory_guard, out_of_memory_error
from job.group.stop import StopRequest
from job.recipe import build as recipe
from job.recipe.models import describe as describe_model
from job.recipe.plan import make_step, set_cpu_threads
from job.recipe.weights import at_hand as weights_at_hand
from job.run import checkpoint, reporting
from job.run.attempts import Attempt
from job.run.choose import Chooser
from job.run.commit import Decision, accumulated, latest_metrics, register, save
from job.run.evaluations import evaluation_fields, test_and_report
from job.run.loop import Loop
from job.run.meters import LossLog, TrainClock
from job.run.progress import Progress, position
from job.run.reporting import Judge
from job.run.results import end_by_budget, finish, model_json
from job.run.resume import Request, Resumption, check_split, decide, preflight, replan_schedule
from job.run.state import Components, Kept, Stateful
from job.sinks.sink import EpochEnd, Sink
from job.storage.run_folder import RunDir, cache_dir
from job.use import bundle

if TYPE_CHECKING:
    from job.sinks.track_server import Target


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
    sinks: Sequence[Sink] = (),
    components: Mapping[str, Stateful] | None = None,
) -> dict:
    """Train as the config says, writing the run to `output`; returns the final summary. `stop` is the caller's
    signal watch when it installed one early (the command line does, before the slow imports); `began`: when the
    attempt began, as time.time() (the command line: its process's start; default: now); `judge`: given each
    evaluation's record on rank 0, returns why the run should stop there (a sweep's pruner), or None; `sinks`: the
    caller's own, subscribed to rank 0's reporter after the run's (job/sinks/sink.py); `components`: the caller's own
    state, by name, saved with every checkpoint and handed back on resume (job/run/state.py)."""
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
            summary = train_rank(cfg, req, stop, t_start, began, judge, sinks, components)
            together = True
            return summary
        except Interrupted:
            together = True  # a stop the processes agreed on: they leave the group together, as after a finish
            raise
        finally:
            distributed.finish(together)
            torch.set_num_threads(threads)  # train.cpu_threads holds for the run, not for a notebook's kernel after


def train_rank(
    cfg: Config,
    req: Request,
    stop: StopRequest,
    t_start: float,
    began: float,
    judge: Judge | None = None,
    sinks: Sequence[Sink] = (),
    components: Mapping[str, Stateful] | None = None,
) -> dict:
    # Rank 0 checks and opens the run folder; the other processes of a group only name it and never write to it.
    with distributed.writer_first() as writer:
        run_dir = preflight(cfg, req) if writer else RunDir(req.output)
    attempt = Attempt(run_dir if distributed.is_writer() else None, began)
    try:
        return train_loop(cfg, run_dir, req, stop, t_start, attempt, judge, sinks, components)
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
    sinks: Sequence[Sink] = (),
    components: Mapping[str, Stateful] | None = None,
) -> dict:
    """The run from where its folder stands: set up, then epochs of steps, each evaluated and committed as the config
    says, and the results at the end. What it reports goes to loop.report, whose sinks it never names."""
    device = pick_device(req.device)
    cfg = recipe.resolved(cfg)  # the defaults that follow from other settings, as config.yaml records them
    seed_everything(cfg.seed, cfg.train.deterministic)
    where = reporting.destination(cfg, run_dir, fresh=req.overwrite)
    resumption = decide(run_dir, req, cfg, device, where)
    if resumption.ended is not None:  # a finished run, or one that spent its budget: left as it is
        return resumption.ended
    loop = set_up(cfg, run_dir, req, stop, t_start, attempt, device, resumption, where, judge, sinks, components)
    state, found = loop.state, resumption.found
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
        loop.report.epoch_done(epoch_end(loop, saved))
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


def set_up(
    cfg: Config,
    run_dir: RunDir,
    req: Request,
    stop: StopRequest,
    t_start: float,
    attempt: Attempt,
    device: torch.device,
    resumption: Resumption,
    where: Target | None,
    judge: Judge | None,
    sinks: Sequence[Sink],
    components: Mapping[str, Stateful] | None = None,
) -> Loop:
    """What the epochs share: the data and recipe, the state (restored from the checkpoint found), the step and the
    reporter (job/run/reporting.py subscribes its sinks)."""
    found, started = resumption.found, resumption.started
    if started is None:  # the weights are at hand before the data is read: a failed download takes seconds to find
        weights_at_hand(cfg.model, cache_dir("weights"))
    parts = Components()  # what a checkpoint holds (job/run/commit.py registers them), restored as they are added
    placement = parts.add("placement", Decision(restored))  # read back before the data is
    if started is not None:
        parts.restore(started)
    with stop.at_once():
        data = recipe.read_data(cfg, placement.restored)
    check_split(started, data.inventory)
    r = recipe.build(cfg, device, data, rank=distributed.rank(), world=distributed.world(), started=started)
    distributed.seed_own(cfg.seed, cfg.train.deterministic)  # the model is built alike everywhere: now each its own
    reporting.check(cfg, evaluation_fields(r))  # every rank refuses a setting a sink cannot take alike
    resumption.begin()
    set_cpu_threads(cfg, r)
    say(f"device {describe_device(device)}; data {data.describe()}, {r.feed.describe()}")
    chooser = Chooser(cfg.train, r.evaluated_on, r.multilabel, evaluation_fields(r))
    params, stem = sum(p.numel() for p in r.model.parameters()), describe_model(cfg.model, r.input_shape)
    say(f"model {cfg.model.name}{stem}: {params:,} parameters; output {run_dir.url}")
    state, log = Progress(run_id=uuid.uuid4().hex[:12]), LossLog(device, cfg.train.log_every_steps)
    placement.made = r.feed.streaming_choice
    register(parts, cfg, r, state, log, chooser)
    if found is not None:
        replanned = replan_schedule(cfg, r, state)
        source = (found[1] or {}).get("file") or req.resume  # a bare .pt given by URL has no manifest
        into = f" ({state.epoch_step} steps into epoch {state.epoch + 1})" if state.epoch_step else ""
        say(f"resuming {cfg.name} from epoch {state.epoch}, step {state.step}{into} ({source}){replanned}")
    stop.sync()
    if stop.signal is not None:  # stopped while setting up: nothing new to save, nothing written yet
        raise stop.unstarted()
    if distributed.is_writer():
        run_dir.write("config.yaml", to_yaml(cfg).encode())
        if data.inventory is not None:  # which files the run learns from, chooses on and tests on
            run_dir.write("data.json", json.dumps(data.inventory.to_json(), indent=1, ensure_ascii=False).encode())
    fields, resumed = evaluation_fields(r), found is not None
    report = reporting.open_report(cfg, run_dir, len(r.train), fields, state, resumed, where, stop, judge, sinks)
    step = make_step(cfg, r, log.sums)
    if step.accumulator is not None:
        accumulated(parts, step.accumulator, state, r.device)
    attempt.begin(state, distributed.world(), device, cfg.train.price_per_device_hour, cfg.train.epochs * len(r.train))
    decided = {"device": describe_device(device), "world_size": distributed.world(), "precision": r.precision}
    decided |= {"step": step.description, "data": data.describe(), "feed": r.feed.describe(), "parameters": params}
    reporting.describe_attempt(report, attempt, cfg, decided)
    clock, now, budget = TrainClock(device), time.perf_counter(), resumption.budget
    loop = Loop(cfg, run_dir, r, step, state, log, report, stop, clock, t_start, now, attempt, chooser, budget)
    loop.parts = parts
    parts.add("sinks", report)  # what each sink has sent, by sink: MLflow's marks per server (restored as it is added)
    parts.add("model_json", Kept(lambda: model_json(loop, latest_metrics(loop), at=state)))  # as model.json would
    for name, component in (components or {}).items():
        parts.add(name, component)
    parts.settled()  # set up: what the run continued from is let go
    return loop


def epoch_end(loop: Loop, saved: bool) -> EpochEnd:
    """An epoch's end as the sinks take it: its evaluation's record, if it had one, and how to write the weights
    held now as a model bundle (model.pt, model.json) into a folder."""
    state, records = loop.state, loop.report.records
    record = records[-1] if records and records[-1].get("step") == state.step else {}

    def write_bundle(folder: Path, metrics: dict) -> None:
        (folder / "model.pt").write_bytes(checkpoint.weights_bytes(loop.r.evaluated))
        described = json.dumps(model_json(loop, metrics, at=state), indent=1, ensure_ascii=False)
        (folder / bundle.MODEL_JSON).write_text(described)

    return EpochEnd(state.epoch, state.step, saved, record, write_bundle)


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
