"""A run's checkpoint: the components a resume needs registered as the run sets up (each handed its part of the
checkpoint the run continues from as it is registered), then gathered and committed at a step boundary (an epoch's
end, a signal, the budget). The commit and the restore know the components only by name (job/run/state.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from job.errors import CheckpointError
from job.group import distributed
from job.group.env import rng_state, set_rng_state
from job.recipe import build as recipe
from job.run import checkpoint
from job.run.progress import is_best
from job.run.state import Components, Kept

if TYPE_CHECKING:
    import torch

    from job.config import Config
    from job.recipe.accumulate import Accumulator
    from job.recipe.build import Recipe
    from job.run.choose import Chooser
    from job.run.loop import Loop
    from job.run.meters import LossLog
    from job.run.progress import Progress


class Decision:
    """A decision made once as a run begins (where its data is held): `restored`, what the checkpoint it continues
    from recorded, read back (by `read`) before what it decides is set up; then `made`, the decision taken (it has
    saved()), which every checkpoint records."""

    def __init__(self, read: Callable[[Any], Any]) -> None:
        self.read, self.restored, self.made = read, None, None

    def state_dict(self) -> Any:
        return self.made.saved() if self.made is not None else None

    def load_state_dict(self, saved: Any) -> None:
        self.restored = self.read(saved)


def register(parts: Components, cfg: Config, r: Recipe, state: Progress, log: LossLog, chooser: Chooser) -> None:
    """The recipe's and the loop's state as components, in the order a restore needs them: the weights before the
    optimizer that steps them and the choice that copies them, the position before the loader's place in it, the
    RNGs last (nothing set up after draws from them). What a checkpoint records only for others to read (its config,
    its split's digest, its normalization) is saved and never restored here."""
    parts.add("model", r.model)
    parts.add("optimizer", Kept(r.optimizer.state_dict, lambda saved: checkpoint.load_optimizer(r.optimizer, saved)))
    parts.add("scheduler", Kept(lambda: scheduler_state(r), lambda saved: load_scheduler(r, saved)))
    scaler = Kept(lambda: r.scaler.state_dict() if r.scaler.is_enabled() else None, lambda s: load_scaler(r, s))
    parts.add("scaler", scaler)
    if r.lookahead is not None:
        parts.add("lookahead", r.lookahead)
    if r.ema is not None:
        parts.add("ema", r.ema)
    parts.add("progress", state)
    parts.add("loss_sums", log, per_rank=True)
    place = Kept(lambda: r.train.position() if state.epoch_step else None, lambda saved: resume_at(r, state, saved))
    parts.add("places", place, per_rank=True)
    parts.add("chooser", Kept(lambda: chooser.saved(state), lambda saved: chooser.restore(saved, r.evaluated, state)))
    rng = Kept(rng_state, lambda saved: load_rng(saved, cfg.seed, state.step))
    parts.add("rng", rng, per_rank=True)
    parts.add("config", Kept(cfg.model_dump))
    parts.add("precision", Kept(r.precision_began.saved))  # read back by recipe.build, which decides it
    if r.feed.inventory is not None:
        parts.add("split", Kept(r.feed.inventory.digest))  # checked by resume.check_split
    if r.feed.mean is not None:  # read back by recipe.build
        parts.add("normalization", Kept(lambda: {"mean": r.feed.mean.tolist(), "std": r.feed.std.tolist()}))
    if parts.restoring is not None:
        check_restored(parts)
        recipe.prime_momentum(r.optimizer)  # a fused SGD's buffers the checkpoint did not hold yet


def check_restored(parts: Components) -> None:
    """CheckpointError where the checkpoint lacks what the run cannot go on without."""
    if "ema" in parts.missing:
        raise CheckpointError(
            "checkpoint does not fit this model or optimizer: it holds no train.ema average; resume with "
            "train.ema=0, as it was taken"
        )
    if lacking := [n for n in ("model", "optimizer", "progress") if n in parts.missing]:
        raise CheckpointError(f"checkpoint holds no {', '.join(lacking)}: not a checkpoint this run can continue")


def scheduler_state(r: Recipe) -> dict | None:
    return r.scheduler.state_dict() if r.scheduler is not None else None


def load_scheduler(r: Recipe, saved: dict) -> None:
    if r.scheduler is not None:  # re-planned afterwards where the run's length changed (resume.replan_schedule)
        r.scheduler.load_state_dict(saved)


def load_scaler(r: Recipe, saved: dict) -> None:
    if r.scaler.is_enabled():
        r.scaler.load_state_dict(saved)


def resume_at(r: Recipe, state: Progress, saved: dict) -> None:
    """Every process's place in the epoch the checkpoint was taken in, by rank, for the loader to continue from."""
    if state.epoch_step:
        r.train.resume_at(state.epoch, state.epoch_step, saved["by_rank"])


def load_rng(saved: dict, seed: int, step: int) -> None:
    """Rank 0's random streams, then each process's own: its saved one where a group of this size saved them."""
    by_rank = saved["by_rank"]
    set_rng_state(by_rank[0])
    distributed.seed_own(seed, False, step, by_rank)


def accumulated(parts: Components, accumulator: Accumulator, state: Progress, device: torch.device) -> None:
    """The gradient sums of a group of batches a checkpoint was taken inside (train.accumulate_steps)."""
    saved_sums = Kept(lambda: accumulator.saved(state.epoch_step) or None)
    saved_sums.load = lambda saved: accumulator.restore(saved.get("accumulated"), device)
    parts.add("accumulator", saved_sums)


def save(loop: Loop) -> None:
    """Commit a checkpoint of the state as it stands, with each process's own parts (loss sums, place, RNGs), so
    that every one of them resumes with exactly what it had. Rank 0 flushes the logs and writes it."""
    loop.pause()
    own = loop.parts.gather_ranks()  # a collective: every process's per-rank parts, on rank 0
    loop.over_budget = distributed.shared_line(lambda: commit(loop, own))


def commit(loop: Loop, own: dict[str, Any] | None = None) -> str:
    """Rank 0 commits the checkpoint: its components' state after the logs are flushed (`own`: the per-rank parts,
    gathered). Returns why the run stops here to keep within its budget (empty: it goes on)."""
    cfg, state, report = loop.cfg, loop.state, loop.report
    for window in loop.log.ready(wait=True):
        report.loss(*window)
    report.flush()
    payload = {"format": checkpoint.FORMAT} | loop.parts.gather(own)
    t = cfg.train
    checkpoint.commit(
        loop.run_dir,
        payload,
        epoch=state.epoch,
        step=state.step,
        metrics=latest_metrics(loop),
        keep_last=t.keep_last,
        keep_best=t.keep_best,
        run_id=state.run_id,
        chosen=(state.best_epoch, is_best(state)),
    )
    loop.run_dir.check()  # the store gave up: stop here, the checkpoint just committed kept locally
    loop.attempt.committed(state.epoch, state.step)
    return loop.attempt.over(loop.budget) if loop.budget is not None else ""


def latest_metrics(loop: Loop) -> dict:
    """The evaluation taken at the step the run stands at, or nothing."""
    records = loop.report.records
    return records[-1] if records and records[-1]["step"] == loop.state.step else {}
