"""The resume policy: which checkpoint a run continues from (--resume auto, never, or a URL), which settings may
change when it does, and what --overwrite clears."""

from __future__ import annotations

from job import checkpoint
from job.config import Config, flat_items
from job.errors import ConfigError
from job.storage import RunDir

# Keys a resumed run may change: they do not alter what the checkpoint's state means.
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
}


def find_checkpoint(run_dir: RunDir, resume: str, overwrite: bool, cfg: Config) -> tuple[dict, dict] | None:
    """The checkpoint to continue from, per --resume: auto (the run's newest), never, or a URL."""
    if resume == "never":
        if run_dir.has_run() and not overwrite:
            raise ConfigError(f"{run_dir.url} already holds a run: --resume auto continues it, --overwrite replaces it")
        return None
    found = checkpoint.load_latest(run_dir) if resume == "auto" else checkpoint.load_url(resume)
    if found is not None:
        check_compatible(found[0]["config"], cfg)
        if resume != "auto" and not overwrite:
            check_same_run(run_dir, found[0])
    return found


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


def check_compatible(saved: dict, cfg: Config) -> None:
    """Refuse to resume when a setting that changes what the checkpoint means differs."""
    old = flat_items(Config.model_validate(saved))
    new = flat_items(cfg)
    changed = sorted(k for k in new if k not in RESUME_SAFE and old.get(k) != new[k])
    if changed:
        detail = ", ".join(f"{k}: {old.get(k)!r} -> {new[k]!r}" for k in changed[:4])
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
