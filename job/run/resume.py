"""Opening a run folder: the checks before any work, the checkpoint a run continues from (--resume auto, never, or a
URL) and the settings that may change when it does, what --overwrite clears, a finished run left as it is, and a
schedule re-planned over a new length (the state itself comes back through the run's components: run/commit.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from job.config import Config, flat_items
from job.config.budget import Budget, parse_budget
from job.console import say
from job.errors import ConfigError, DataError
from job.group import distributed
from job.recipe import build as recipe
from job.recipe import schedule
from job.run import checkpoint
from job.run.attempts import budget_spent
from job.run.progress import Progress
from job.sinks import track
from job.storage import cloud
from job.storage.run_folder import RunDir

if TYPE_CHECKING:
    import torch

    from job.data.split import Inventory
    from job.recipe.build import Recipe
    from job.sinks.track import Target

# Keys a resumed run may change: they do not alter what the checkpoint's state means.
# train.choose_on's auto is val_accuracy, or val_map for multi-label (a run checks the one it is named is written): a
# checkpoint begun on auto, or before the key, continues when named either (a sweep's trials name their metric).
AUTO_CHOICE = {"auto", "val_accuracy", "val_map"}
RESUME_SAFE = {
    "name",
    "output.dir",
    "output.staged",
    "output.sync_every_seconds",
    "output.upload_timeout_seconds",
    "data.cache",
    "data.path",
    "data.placement",
    "data.device_share",
    "data.eval_batch_size",
    "train.epochs",
    "train.log_every_steps",
    "track.mlflow",
    "track.experiment",
    "track.log_model",
    "track.register",
    "track.hp_metric_tag",
    "track.parent_run_id",
    "train.eval_every_epochs",
    "train.checkpoint_every_epochs",
    "train.keep_last",
    "train.precision",
    "train.channels_last",
    "train.step_capture",
    "train.compile",
    "train.cpu_threads",
    "train.time_limit",
    "train.grace_seconds",
    "train.keep_best",
    "train.deterministic",  # cuDNN's choice of kernels, not the state
    "train.price_per_device_hour",
    "train.budget",
}


@dataclass(frozen=True)
class Request:
    """How the run was asked for besides its config: where it goes, on which device, and what to do with a run
    already in the folder."""

    output: str
    device: str = "auto"
    resume: str = "auto"  # auto, never, or a checkpoint's URL
    overwrite: bool = False
    routes: dict[str, str] | None = None  # some of the run's files elsewhere (Vertex AI's folders)


@dataclass(frozen=True)
class Resumption:
    """What an attempt does with its run folder, decided once (decide) before the data is read: the checkpoint it
    continues from (None: it starts), the settings changed since that checkpoint, the run's budget, and, where the
    attempt trains nothing (the run is finished, or has spent its budget), the summary it ends with. Rank 0 begins
    it (begin) once the data and model are known good, so that a fault before leaves the folder as it was."""

    run_dir: RunDir
    req: Request
    found: tuple[dict, dict] | None  # (payload, manifest), verified
    changed: dict[str, tuple]  # changed_settings against the checkpoint's config (none without one)
    budget: Budget | None = None  # train.budget
    ended: dict | None = None  # the attempt ends at once with this summary

    @property
    def started(self) -> dict | None:
        """The checkpoint's payload a resumed run continues from."""
        return self.found[0] if self.found is not None else None

    def begin(self) -> None:
        """Rank 0 checks the checkpoint against the run, clears an overwritten run and starts the uploads; the
        group's others wait until it is done (its fault is theirs)."""
        with distributed.writer_first() as writer:
            if writer:
                check_resumable(self.run_dir, self.req, self.found, self.changed)
                if self.req.overwrite and (self.found is None or self.req.resume != "auto"):  # afresh, or as given
                    clear_run(self.run_dir)
                self.run_dir.start_sync()


def decide(run_dir: RunDir, req: Request, cfg: Config, device: torch.device, where: Target | None) -> Resumption:
    """How the attempt goes on, by --resume, the folder and train.budget, decided without reading the data: the
    checkpoint found (by rank 0, shared with the group); a finished run left exactly as it is (what its tracking
    lacks sent to `where`), and a run that has spent its budget left as it is, each ending at once with its summary."""
    found = share_checkpoint(lambda: find_checkpoint(run_dir, req.resume))
    changed = changed_settings(found[0]["config"], cfg) if found is not None else {}
    resumption = Resumption(run_dir, req, found, changed)
    if left_alone(run_dir, req, cfg.train.epochs, found, changed):
        if where is not None:  # what a killed or cut-off end did not send, this command sends
            say(track.send_run(run_dir, where.uri)[0])
        resumption.begin()  # checks, no change
        return replace(resumption, ended=complete(cfg.name, cfg.train.epochs, run_dir, found))
    budget = parse_budget(cfg.train.budget) if cfg.train.budget else None
    price = cfg.train.price_per_device_hour
    if budget is not None and (spent := distributed.shared_line(lambda: budget_spent(run_dir, budget, price, device))):
        return replace(resumption, budget=budget, ended=nothing_left(run_dir, spent))
    return replace(resumption, budget=budget)


def find_checkpoint(run_dir: RunDir, resume: str) -> tuple[dict, dict] | None:
    """The checkpoint to continue from, per --resume: auto (the run's newest), never, or a URL; verified, not yet
    checked against the run (check_resumable, once the data and model are known good)."""
    if resume == "never":
        return None
    return checkpoint.load_latest(run_dir) if resume == "auto" else checkpoint.load_url(resume)


def share_checkpoint(find: Callable[[], tuple[dict, dict | None] | None]) -> tuple[dict, dict | None] | None:
    """The checkpoint to resume from, found and verified by rank 0 and sent to the others as the bytes torch.save
    writes (loaded with weights_only=True, like any checkpoint: nothing is unpickled)."""

    def encode(found):
        return ({"manifest": found[1]}, checkpoint.to_bytes(found[0])) if found is not None else ({}, b"")

    got = distributed.on_writer(find, encode)
    if distributed.is_writer() or got is None:
        return got
    header, blob = got
    if "manifest" not in header:
        return None
    return checkpoint.load_payload(blob, None, "the checkpoint sent by rank 0"), header["manifest"]


def check_resumable(run_dir: RunDir, req: Request, found: tuple[dict, dict] | None, changed: dict[str, tuple]) -> None:
    """ConfigError where the folder or the checkpoint cannot be continued as asked: a run already there with
    --resume never, settings that change what the checkpoint means, another run's checkpoint into this folder."""
    if req.resume == "never":
        if run_dir.has_run() and not req.overwrite:
            raise ConfigError(f"{run_dir.url} already holds a run: --resume auto continues it, --overwrite replaces it")
        return
    if found is not None:
        check_compatible(changed)
        if req.resume != "auto" and not req.overwrite:
            check_same_run(run_dir, found[0])


def check_same_run(run_dir: RunDir, payload: dict) -> None:
    """--resume URL continues a checkpoint into an empty folder or its own run's; never into another run's, where
    two runs' checkpoints would mix."""
    if not run_dir.has_run():
        return
    here = checkpoint.read_pointer(run_dir.read(checkpoint.POINTER)) or {}
    if not here.get("run") or here.get("run") != payload.get("progress", {}).get("run_id"):
        raise ConfigError(
            f"{run_dir.url} holds another run: --resume URL continues a checkpoint into its own run's folder or an "
            "empty one; use another --output, or --overwrite to replace the run there"
        )


def changed_settings(saved: dict, cfg: Config) -> dict[str, tuple]:
    """The settings that change what a checkpoint means (not RESUME_SAFE) and differ between it and `cfg`, in name
    order: each as (the checkpoint's value, `cfg`'s)."""
    old, new = flat_items(Config.model_validate(saved)), flat_items(cfg)
    same = {k: old.get(k) == new[k] or (k == "train.choose_on" and {old.get(k), new[k]} <= AUTO_CHOICE) for k in new}
    return {k: (old.get(k), new[k]) for k in sorted(new) if k not in RESUME_SAFE and not same[k]}


def check_compatible(changed: dict[str, tuple]) -> None:
    """Refuse to resume when a setting that changes what the checkpoint means differs (changed_settings)."""
    if changed:
        detail = ", ".join(f"{k}: {was!r} -> {now!r}" for k, (was, now) in list(changed.items())[:4])
        raise ConfigError(
            f"cannot resume: the checkpoint was trained with other settings ({detail}); keep them to continue this "
            "run, use another --output for a new one, or --overwrite to start this folder afresh"
        )


def clear_run(run_dir: RunDir) -> None:
    """--overwrite: remove an earlier run's checkpoints, logs and results from the folder."""
    for rel in run_dir.list("checkpoints"):
        run_dir.delete(f"checkpoints/{rel}")
    for rel in run_dir.list("tensorboard"):
        run_dir.delete(f"tensorboard/{rel}")
    for rel in ("metrics.jsonl", "model.pt", "curves.png", "config.yaml"):
        run_dir.delete(rel)


def preflight(cfg: Config, req: Request) -> RunDir:
    """Before any work: the credentials in use, the inputs there, every output location writable."""
    urls = [u for u in (cfg.data.path, cfg.data.test_path, req.output, *(req.routes or {}).values()) if u]
    if req.resume not in ("auto", "never"):
        urls.append(req.resume)
    if any(cloud.is_gcs(u) for u in urls):
        say(f"storage: gs:// as {cloud.gcs_credentials()[1]}")
    for key, url in (("data.path", cfg.data.path), ("data.test_path", cfg.data.test_path)):
        if url and not (key == "data.path" and cfg.data.download):  # a download makes it
            cloud.check_input(url, key)
    o = cfg.output
    run_dir = RunDir(req.output, req.routes, o.upload_timeout_seconds, o.sync_every_seconds, staged=o.staged)
    run_dir.prepare()
    try:
        if run_dir.lease is not None and run_dir.lease.taken_from:
            say(f"taking the run folder over from {run_dir.lease.taken_from}")
        recover_staging(run_dir, req)
    except BaseException:
        run_dir.abandon()
        run_dir.remove_if_empty()
        raise
    return run_dir


def recover_staging(run_dir: RunDir, req: Request) -> None:
    """What an earlier attempt left on this machine: uploaded (--resume auto) or dropped (never)."""
    if req.resume == "never" and run_dir.staged_files() and not req.overwrite:
        raise ConfigError(
            f"{run_dir.url}: an earlier attempt left files on this machine ({run_dir.local}): --resume auto "
            "uploads them and continues, --overwrite discards them"
        )
    if req.resume == "never":
        run_dir.clear_staging()
    else:
        checkpoint.recover(run_dir)
    if run_dir.remote:  # the store's checkpoints and their manifests, read now rather than from the loop
        for name in run_dir.list(checkpoint.FOLDER):
            if checkpoint.is_manifest(name):
                run_dir.read(f"{checkpoint.FOLDER}/{name}")


def check_split(started: dict | None, inventory: Inventory | None) -> None:
    """A resumed run learns from, chooses on and tests on the files it started with: files added, removed or
    unreadable since would change its split (and its results) in the middle of it."""
    saved = (started or {}).get("split")
    if started is not None and saved is None and inventory is not None and any(inventory.held_out.values()):
        raise ConfigError(
            "cannot resume: the checkpoint was written by an earlier version, which held no val split out of the "
            "training images; continue it with data.val_split=0 (its split), or start a new run"
        )
    if saved is None or inventory is None or saved == inventory.digest():
        return
    raise DataError(
        "cannot resume: the data's files, or the settings that split them (data.val_split, data.test_split, "
        "data.split_seed), differ from those the run started with (its train/val/test split would change): resume "
        "with the same files and settings, or start a new run (another --output, or --overwrite)"
    )


def left_alone(
    run_dir: RunDir, req: Request, epochs: int, found: tuple[dict, dict] | None, changed: dict[str, tuple]
) -> bool:
    """Whether the run in the folder is finished and stays exactly as it is: its checkpoint has train.epochs done
    with the same settings and its results are written, and --overwrite --resume URL did not ask for the folder
    afresh. Decided without reading the data; a run with other settings reads it first, so that bad data is named
    before the settings are (their error comes once the data and model are known good)."""
    if found is None or (req.overwrite and req.resume != "auto"):
        return False
    progress = found[0]["progress"]
    done = progress["epoch"] >= epochs or progress.get("stopped_early")
    if not done or changed:
        return False
    return has_results(run_dir)


def has_results(run_dir: RunDir) -> bool:
    """Whether the run wrote its results (an attempt stopped after its last checkpoint has them still to write).
    Asked by every process of a group, which must all take the same way: rank 0 asks, the others are told."""
    got = distributed.on_writer(lambda: run_dir.has("model.pt"), lambda has: ({"has": has}, b""))
    return got[0]["has"] if isinstance(got, tuple) else got


def complete(name: str, epochs: int, run_dir: RunDir, found: tuple[dict, dict]) -> dict:
    """The run in the folder has done train.epochs (`epochs`) or more already: it is left exactly as it is."""
    progress, manifest = found[0]["progress"], found[1]
    done, stopped = progress["epoch"], progress.get("stopped_early")
    why = f"{done} of {done} epochs done; nothing to do (a larger train.epochs trains it longer)"
    if stopped:
        why = f"{stopped}; nothing to do (another --output, or --overwrite, trains it again)"
    elif done > epochs:
        why = f"{done} epochs done, more than train.epochs={epochs}; nothing to do"
    if distributed.is_writer():
        run_dir.finish()  # nothing was queued: this only stops the uploader
    say(f"{name} in {run_dir.url} is complete: {why}")
    metrics = manifest.get("metrics") or {}
    on = "val" if "val_loss" in metrics else "test"  # what its evaluations reported, as the run's summary says
    return {
        "complete": True,
        "epochs": done,
        "steps": progress["step"],
        "best_accuracy": progress.get("best_accuracy"),
        "best_epoch": progress.get("best_epoch"),
        "final_accuracy": metrics.get(f"{on}_accuracy"),
        f"final_{on}_loss": metrics.get(f"{on}_loss"),
        "epochs_run": 0,
        "output": run_dir.url,
    } | ({"stopped_early": stopped} if stopped else {})


def nothing_left(run_dir: RunDir, spent: str) -> dict:
    """The run has spent its budget: it is left exactly as it is, and the command says so."""
    if distributed.is_writer():
        run_dir.finish()  # nothing was queued: this only stops the uploader and lets the folder go
    say(spent)
    return {"stopped": "budget", "epochs_run": 0, "output": run_dir.url}


def replan_schedule(cfg: Config, r: Recipe, state: Progress) -> str:
    """A resumed run of another length: its schedule re-planned over the new length, from where it stands; says
    so. Schedules count optimizer steps (batches / train.accumulate_steps)."""
    total = recipe.optimizer_steps(cfg, len(r.train))
    if r.scheduler is None or schedule.planned_steps(r.scheduler) == total:
        return ""
    done = recipe.optimizer_steps(cfg, len(r.train), state.epoch) + state.epoch_step // cfg.train.accumulate_steps
    r.scheduler = schedule.replan(cfg, r.optimizer, total, done)
    return f"; the {cfg.optim.schedule} schedule re-planned over {cfg.train.epochs} epochs"
