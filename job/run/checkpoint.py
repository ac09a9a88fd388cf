"""Checkpoints: the run's state as its components gave it (job/run/state.py), the commit (payload, then manifest,
then pointer), verification on load, the search for the newest good one, and retention.

Payloads hold only tensors and plain values, so they load with torch.load(weights_only=True): loading a
checkpoint never runs code from it.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import re
import time
import zipfile
from typing import Any

import torch

from job.console import say
from job.errors import CheckpointError, StorageError, one_line
from job.storage.cloud import describe_storage_error, filesystem
from job.storage.run_folder import RunDir

FORMAT = 2  # 2: the run's components by name (job/run/state.py); 1, fixed keys, is read as 2 (upgraded)
FOLDER = "checkpoints"
POINTER = f"{FOLDER}/latest.json"
NAME = re.compile(r"e(\d+)-s(\d+)(?:\.|$)")


def checkpoint_name(epoch: int, step: int) -> str:
    """e<epoch>-s<step>, zero-padded for listings; ordered by order(), since past 99,999 epochs the text does not
    sort."""
    return f"e{epoch:05d}-s{step:010d}"


def order(name: str) -> tuple[int, int]:
    """(epoch, step) of a checkpoint's name (with or without its suffix): epochs and steps only grow within a run,
    so this sorts checkpoints by time. A name that is not a checkpoint's sorts first."""
    found = NAME.match(name)
    return (int(found[1]), int(found[2])) if found else (-1, -1)


def weights_bytes(model) -> bytes:
    """The model's weights alone, on the host, as model.pt holds them."""
    return to_bytes({k: v.detach().cpu() for k, v in model.state_dict().items()})


def evaluated_weights(payload: dict) -> dict[str, torch.Tensor]:
    """The weights a checkpoint's run evaluates and saves to model.pt: train.ema's average when it kept one, else the
    model's (model.pt's payload holds these alone, under "model")."""
    return payload["ema"]["module"] if payload.get("ema") else payload["model"]


def to_bytes(obj: Any) -> bytes:
    """What torch.save writes for tensors and plain values (a zip archive), in memory."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def commit(
    run: RunDir,
    payload: dict,
    epoch: int,
    step: int,
    metrics: dict,
    keep_last: int,
    keep_best: bool = False,
    run_id: str = "",
    chosen: tuple[int, bool] | None = None,
) -> str:
    """Write the payload, then its manifest, then the pointer; delete checkpoints beyond keep_last afterwards.
    `chosen`: the epoch of the model the run has chosen so far, and whether these are its weights (keep_best keeps
    that checkpoint)."""
    data = to_bytes(payload)
    name = checkpoint_name(epoch, step)
    manifest = {
        "format": FORMAT,
        "file": f"{name}.pt",
        "sha256": hashlib.sha256(data).hexdigest(),
        "size": len(data),
        "epoch": epoch,
        "step": step,
        "metrics": metrics,
        "run": run_id,
        "components": payload.get("components", []),  # what the payload holds, by name
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    } | ({"chosen": {"epoch": chosen[0], "here": chosen[1]}} if chosen is not None else {})
    text = json.dumps(manifest, indent=1).encode()
    run.write(f"{FOLDER}/{name}.pt", data)
    run.write(f"{FOLDER}/{name}.json", text)
    run.write(POINTER, text)
    prune(run, keep_last, keep_best)
    return name


def recover(run: RunDir) -> str | None:
    """Send what an earlier attempt on this machine committed locally but never got into the store (the store was
    down, or the machine stopped first), pointer last; then clear the staging copy. Returns the checkpoint sent.
    Staging left by another run at the same URL (the store's pointer names another run) is discarded."""
    if not run.remote:
        return None
    staged = run.staged_files()
    local = read_pointer(run.path(POINTER).read_bytes() if POINTER in staged else None)
    stored = read_pointer(run.read(POINTER, store_only=True)) if local else None
    if local is not None and stored is not None and stored.get("run") not in (None, "", local.get("run")):
        say(f"warning: {run.url} now holds another run; discarding what an earlier run left in {run.local}")
        local = None
    if local is None or (stored is not None and order(stored["file"]) >= order(local["file"])):
        run.clear_staging()
        return None
    name = local["file"][: -len(".pt")]
    say(f"uploading {len(staged)} files of checkpoint {name} that an earlier attempt left on this machine")
    first = [r for r in staged if not r.startswith(f"{FOLDER}/")]
    payloads = [r for r in staged if r.startswith(f"{FOLDER}/") and r.endswith(".pt")]
    manifests = [r for r in staged if r.startswith(f"{FOLDER}/") and r.endswith(".json") and r != POINTER]
    for rel in [*first, *payloads, *manifests, POINTER]:
        try:
            run.send(rel, run.path(rel).read_bytes())
        except Exception as e:  # the stores' clients raise many types
            raise StorageError(
                f"{run.url}: cannot upload {rel} left by an earlier attempt ({one_line(e)}); "
                f"it stays in {run.local} for the next try"
            ) from None
    run.clear_staging()
    return name


def read_pointer(pointer: bytes | None) -> dict | None:
    """A pointer's manifest ("file", "run", ...), or None when there is none or it is unreadable."""
    try:
        manifest = json.loads(pointer) if pointer else None
        return manifest if isinstance(manifest, dict) and isinstance(manifest.get("file"), str) else None
    except ValueError:
        return None


def prune(run: RunDir, keep_last: int, keep_best: bool = False) -> None:
    """Delete all but the newest keep_last committed checkpoints (and the most accurate one, with keep_best),
    each manifest before its payload so no manifest ever names a missing file; then leftovers of commits
    that a crash cut short."""
    listed = run.list(FOLDER)
    names = sorted((n[: -len(".json")] for n in listed if is_manifest(n)), key=order)
    keep = set(names[-keep_last:])
    if keep_best:
        keep |= {best_checkpoint(run, names)} - {None}
    for name in names:
        if name not in keep:
            run.delete(f"{FOLDER}/{name}.json")
            run.delete(f"{FOLDER}/{name}.pt")
    newest = order(names[-1]) if names else (-1, -1)
    for n in listed:
        orphan = n.endswith(".pt") and n[: -len(".pt")] not in names and order(n) < newest
        if orphan or n.startswith("."):  # temporary files of an interrupted write
            run.delete(f"{FOLDER}/{n}")


def best_checkpoint(run: RunDir, names: list[str]) -> str | None:
    """The checkpoint of the model the run chose (its newest manifest names the epoch: with early stopping's
    min_delta, not always the highest accuracy); where that epoch has none, or the manifests are an earlier
    version's, the one recording the highest val accuracy (test accuracy, for a run without val)."""
    scored, manifests = [], {}
    for name in names:
        try:
            manifests[name] = json.loads(run.read(f"{FOLDER}/{name}.json") or b"{}")
        except ValueError:
            continue
        metrics = manifests[name].get("metrics", {})
        accuracy = metrics.get("val_accuracy", metrics.get("test_accuracy"))
        if isinstance(accuracy, (int, float)):
            scored.append((accuracy, name))
    newest = manifests.get(names[-1], {}).get("chosen") if names else None
    if isinstance(newest, dict):
        here = [n for n, m in manifests.items() if m.get("chosen") == {"epoch": newest["epoch"], "here": True}]
        if here:
            return here[-1]
    return max(scored, key=lambda s: (s[0], order(s[1])))[1] if scored else None  # ties: the newer


def is_manifest(name: str) -> bool:
    return name.endswith(".json") and not name.startswith(".") and name != "latest.json"


def load_latest(run: RunDir) -> tuple[dict, dict] | None:
    """The newest checkpoint of a run that verifies, as (payload, manifest); None when the run has none.

    The pointer names the newest commit and the run; when it or its payload is missing or corrupt, older
    manifests of that run are tried in turn, each failure reported in one line (another run's are never
    taken). Checkpoints that exist but none of which verifies are an error: a run never silently starts again
    from scratch. A payload that no manifest or pointer names was never committed, and is no checkpoint.
    """
    pointed, run_id = None, None
    pointer = run.read(POINTER)
    if pointer is not None:
        try:
            manifest = json.loads(pointer)
            pointed, run_id = manifest["file"][: -len(".pt")], manifest.get("run") or None
        except (ValueError, KeyError, TypeError):
            say(f"warning: {run.url}/{POINTER} is unreadable; looking for the newest checkpoint by its manifest")
    listed = run.list(FOLDER)
    names = {n[: -len(".json")] for n in listed if is_manifest(n)} | ({pointed} if pointed else set())
    problems: list[str] = []
    for name in sorted(names, key=order, reverse=True):  # newest first, within the pointer's run
        try:
            manifest = read_manifest(run.read(f"{FOLDER}/{name}.json"), name)
            if run_id and manifest.get("run") != run_id:
                continue  # another run's checkpoint in this folder: never continued from
            payload = load_payload(run.read(f"{FOLDER}/{name}.pt"), manifest, f"{run.url}/{FOLDER}/{name}.pt")
        except CheckpointError as e:
            problems.append(str(e))
            continue
        for problem in problems:
            say(f"warning: {problem}; using an older checkpoint")
        return payload, manifest
    if problems:
        more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
        raise CheckpointError(
            f"{run.url}/{FOLDER}: no checkpoint verifies ({problems[0]}{more}); refusing to start over in this folder"
        )
    # A payload no manifest names was never committed (a stop between the two): not a checkpoint.
    if uncommitted := sorted(n for n in listed if n.endswith(".pt")):
        say(f"{run.url}/{FOLDER}: {', '.join(uncommitted)} never committed (no manifest): starting afresh")
    return None


def read_manifest(data: bytes | None, name: str) -> dict:
    if data is None:
        raise CheckpointError(f"checkpoint {name}: manifest missing")
    try:
        manifest = json.loads(data)
        manifest["sha256"], manifest["size"], manifest["epoch"], manifest["step"]  # noqa: B018
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"checkpoint {name}: manifest unreadable") from None
    return manifest


def load_payload(data: bytes | None, manifest: dict | None, where: str, weights: bool = False) -> dict:
    """Verify size and sha256 against the manifest (when there is one), then load weights-only. `weights`: a
    run's model.pt (a state dict alone) is taken too, as {"model": state dict}."""
    if data is None:
        raise CheckpointError(f"{where}: missing")
    if manifest is not None:
        if len(data) != manifest["size"]:
            raise CheckpointError(f"{where}: {len(data)} bytes, the manifest says {manifest['size']} (truncated?)")
        if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
            raise CheckpointError(f"{where}: sha256 differs from its manifest (corrupt)")
    if not zipfile.is_zipfile(io.BytesIO(data)):  # torch.save writes a zip archive
        raise CheckpointError(f"{where}: not a readable checkpoint (not a torch.save file)")
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{where}: holds more than tensors and plain values; refusing to load it ({one_line(e)[:120]})"
        ) from None
    except Exception as e:  # a damaged zip or pickle raises many types
        raise CheckpointError(f"{where}: not a readable checkpoint: {one_line(e)}") from None
    if weights and is_state_dict(payload):
        return {"model": payload}
    if not isinstance(payload, dict) or payload.get("format") not in (1, FORMAT) or "model" not in payload:
        raise CheckpointError(f"{where}: not a checkpoint of this job (format {FORMAT})")
    return upgraded(payload)


def is_state_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def load_url(url: str, weights: bool = False) -> tuple[dict, dict | None]:
    """A checkpoint given by URL: a run folder (its newest good checkpoint) or a .pt file (checked against
    its manifest beside it when there is one); with `weights`, a run's model.pt too."""
    fs, path = filesystem(url)
    try:
        is_dir = fs.isdir(path)
        exists = is_dir or fs.exists(path)
    except Exception as e:  # the stores' clients raise many types
        raise StorageError(f"cannot read the checkpoint: {describe_storage_error(url, e)}") from None
    if not exists:
        raise CheckpointError(f"{url}: no such checkpoint")
    if is_dir:
        found = load_latest(RunDir(url, store_only=True))
        if found is None:
            raise CheckpointError(f"{url}: no checkpoints in this folder")
        return found
    manifest = None
    try:
        committed = NAME.match(path.rsplit("/", 1)[-1])  # e<epoch>-s<step>.pt, not model.pt (whose model.json
        if committed and path.endswith(".pt") and fs.exists(path[: -len(".pt")] + ".json"):  # describes, not checks)
            manifest = read_manifest(fs.cat_file(path[: -len(".pt")] + ".json"), url)
        data = fs.cat_file(path)
    except CheckpointError:
        raise
    except Exception as e:
        raise StorageError(f"cannot read the checkpoint: {describe_storage_error(url, e)}") from None
    return load_payload(data, manifest, url, weights), manifest


HOW_KEYS = ("fused", "foreach", "capturable")


def load_optimizer(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """A checkpoint's optimizer state into a freshly built optimizer. How it runs (fused kernels, or not) belongs to
    this device, not to the one that saved; it is set before loading, since loading places the state (AdamW's step
    counts) by it."""
    how = [{k: g[k] for k in HOW_KEYS if k in g} for g in optimizer.param_groups]
    groups = [{**group, **kept} for group, kept in zip(saved["param_groups"], how)]
    optimizer.load_state_dict({**saved, "param_groups": groups + saved["param_groups"][len(how) :]})


CHOOSER_KEYS = ("best_confusion", "latest_confusion", "best_thresholds", "latest_thresholds", "best_model")


def upgraded(payload: dict) -> dict:
    """A checkpoint of format 1 (its state in fixed keys, the loop's per-process state inside "progress") in the
    components' shape (job/run/train.py registers them): the chooser's keys under "chooser", the loss sums, the
    loader's places and the RNGs per process ({"by_rank": [...]}), the accumulator's sums its own."""
    if payload.get("format") != 1:
        return payload
    p, progress = dict(payload), dict(payload["progress"])
    sums, places, earlier = progress.pop("loss_sums", None), progress.pop("places", None), progress.pop("stream", None)
    accumulated = progress.pop("accumulated", None)
    rng, ranks = p.pop("rng", None), p.pop("rng_ranks", None)
    p |= {
        "format": FORMAT,
        "progress": progress,
        "loss_sums": {"by_rank": sums} if sums is not None else None,
        "places": {"by_rank": places or earlier or []},  # earlier versions' name for them: stream
        "accumulator": {"accumulated": accumulated} if accumulated is not None else None,
        "rng": {"by_rank": ranks or [rng]} if rng is not None else None,
        "chooser": {k: p.pop(k) for k in CHOOSER_KEYS if k in p},
    }
    return p | {"components": [k for k, v in p.items() if v is not None and k != "format"]}
