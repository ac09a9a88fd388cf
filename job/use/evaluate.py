"""Testing a model: the test loop the training run uses at every evaluation, and the `evaluate` command, which
tests a saved checkpoint with the data and model its config names."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from job.config import apply_override, load_config, validate
from job.data.augment import viewed_logits
from job.data.batches import Loader
from job.data.placement import restored
from job.errors import CheckpointError, DataError
from job.group import distributed
from job.group.env import pick_device
from job.group.memory import memory_guard
from job.recipe import build as recipe
from job.recipe.multilabel import MultiScored, multilabel_outputs
from job.recorded import TOP5, split_scores
from job.run import checkpoint
from job.run.attempts import RUN_JSON, attempts_in
from job.storage.cloud import check_input, filesystem
from job.storage.sync import send
from job.use import scores


@torch.no_grad()
def test_sums(model, loader: Loader, amp, augmentation: str = "none", classes: int = 0) -> torch.Tensor:
    """[summed loss, correct predictions, samples counted] over this process's samples of the split, left on the
    device; padding (a batch with no samples of this process's own) and streamed samples that could not be decoded
    (labelled IGNORED) are never counted. `augmentation`: train.test_time_augmentation, the logits averaged over
    views of each image. With `classes` (their number), then [top-5 correct, the classes x classes confusion
    matrix], counted on the device without the host waiting (scores.count)."""
    model.eval()
    sums = torch.zeros(3 + (1 + classes * classes if classes else 0), device=loader.device)
    for batch in loader.batches():
        if not batch.own:
            continue
        with amp():
            out = viewed_logits(model, batch.x, augmentation)
        scores.count(sums, out, batch.y, classes)
    model.train()
    return sums


def multilabel_scored(
    sums: torch.Tensor,
    probs: torch.Tensor,
    ys: torch.Tensor,
    extra: torch.Tensor | None = None,
    thresholds: list[float] | None = None,
) -> MultiScored:
    """The group's multi-label scores: the sums (and `extra`) reduced, every process's probabilities and targets
    gathered (each of their order: AP does not depend on it)."""
    from job.recipe import multilabel

    totals = distributed.totals(sums, sums[:0] if extra is None else extra).cpu()
    y, p = multilabel.joined(distributed.gather_objects((probs.cpu().numpy(), ys.cpu().numpy())))
    loss, counted = totals[:2].tolist()
    return multilabel.scored(y, p, loss / max(counted, 1), thresholds, totals[2:].tolist())


def evaluate_checkpoint(
    url: str, config: str | None, overrides: list[str], device_name: str, report: str | None = None
) -> dict:
    """Test loss and accuracy of a checkpoint (or a run folder's newest) on the test split."""
    payload, _ = checkpoint.load_url(url, weights=True)
    if config:
        cfg = load_config(config, overrides)
    else:
        raw = payload.get("config")
        if "config" not in payload:  # a run's model.pt: the weights alone, the config in model.json beside them
            from job.use.bundle import model_files

            try:
                raw = model_files(url)[2]
            except CheckpointError:
                raise CheckpointError(f"{url}: the weights alone, with no config beside it: pass --config") from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"{url}: holds no config; pass --config")
        for item in overrides:
            apply_override(raw, item)
        cfg = validate(raw)
    device = pick_device(device_name)
    check_data_path(cfg.data)
    data = recipe.read_data(cfg, restored(payload.get("placement")))  # read as the run read it
    r = recipe.build(cfg, device, data, pretrained=False, started=payload)  # the checkpoint holds the weights
    try:
        r.evaluated.load_state_dict(checkpoint.evaluated_weights(payload))
    except RuntimeError as e:
        raise CheckpointError(f"{url}: weights do not fit model {cfg.model.name}: {str(e).splitlines()[0]}") from None
    split = "test" if "test" in r.held_out else "val"  # class folders held out for val alone: val
    loader = r.held_out[split]
    progress = payload.get("progress", {})
    if r.multilabel:  # scored at the thresholds the checkpoint's model had chosen on val
        from job.use.bundle import thresholds_of

        thresholds = thresholds_of(payload.get("model_json") or {})
        if report:
            write_report(r, report, cfg.train.test_time_augmentation, thresholds)
        sums, probs, ys = multilabel_outputs(
            r.evaluated, loader, r.amp, len(r.classes), cfg.train.test_time_augmentation
        )
        s = multilabel_scored(sums, probs, ys, None, thresholds)
        head = {"checkpoint": url, "epoch": progress.get("epoch"), "step": progress.get("step"), "split": split}
        return head | s.record(split) | {"samples": len(probs), "device": str(device)} | run_record(url)
    if report:
        write_report(r, report, cfg.train.test_time_augmentation)
    loss_sum, correct, counted = test_sums(r.evaluated, loader, r.amp, cfg.train.test_time_augmentation).tolist()
    return {
        "checkpoint": url,
        "epoch": progress.get("epoch"),
        "step": progress.get("step"),
        "split": split,
        f"{split}_loss": loss_sum / max(counted, 1),
        f"{split}_accuracy": correct / max(counted, 1),
        "samples": int(counted),
        "device": str(device),
    } | run_record(url)


def check_data_path(d) -> None:
    """The run's data.path, there from here: a relative path is read from where the command runs, which may not be
    where the run was trained."""
    if not d.path or d.download:
        return
    try:
        check_input(d.path, "data.path")
    except DataError:
        raise DataError(
            f"the run's data.path {d.path}: no such file or folder from here ({os.getcwd()}); a relative path is read "
            "from where the command runs: --set data.path=PATH, or score other data with --model RUN --data PATH"
        ) from None


def write_report(r, folder: str, augmentation: str, thresholds: list[float] | None = None) -> None:
    """DIR/<split>/ for each held-out split (job/use/diagnostics.py), at any URL, scored with the run's test-time views
    (`augmentation`) as its metrics are; multi-label at `thresholds`."""
    from job.use import diagnostics

    put = lambda split, name, data: put_file(f"{folder.rstrip('/')}/{split}/{name}", data)  # noqa: E731
    diagnostics.write_splits(r, put, thresholds=thresholds, augmentation=augmentation)


def put_file(url: str, data: bytes) -> None:
    """One whole report file at any URL (written atomically in a local folder, its folder made)."""
    send(*filesystem(url), data)


def run_record(url: str) -> dict:
    """The run.json of the run a checkpoint belongs to (the folder given, or the one holding the file or its
    checkpoints/ folder): its URL and how many attempts it lists; None for both where there is none."""
    folder = url.rstrip("/")
    for _ in range(3):
        fs, path = filesystem(f"{folder}/{RUN_JSON}")
        try:
            attempts = attempts_in(fs.cat_file(path))
        except Exception:  # no record here: the stores' clients raise many types
            attempts = None
        if attempts is not None:
            return {"run_json": f"{folder}/{RUN_JSON}", "attempts": len(attempts)}
        if "/" not in folder:
            break
        folder = folder.rsplit("/", 1)[0]
    return {"run_json": None, "attempts": None}


def evaluate_on(model_url: str, data_path: str, device_name: str, report: str | None = None) -> dict:
    """Loss and accuracy of a model (a run folder's chosen weights, its model.pt, or a checkpoint) on any labelled
    images, preprocessed as its own evaluation was (brought to its input size where the run fixed none, as predict
    does): class folders (every image), a folder of train/ val/ test/
    class folders (its test, else its val), a .tar/.tar.gz of either, or the files of any format that holds
    labelled images (job/data/formats.py). `report`: a folder for its report (DIR/<split>/, job/use/diagnostics.py)."""
    from job.data.formats import found
    from job.recipe.build import resolved
    from job.use.bundle import load_predictor, model_files

    device = pick_device(device_name)
    p = load_predictor(model_url, device)
    _, _, raw = model_files(model_url)
    cfg = resolved(validate(raw))
    d = cfg.data.model_copy(update={"path": data_path, "val_split": 0.0, "test_split": None, "cache": False})
    if p.thresholds is not None:  # a multi-label model's table of images: a row of one name is a list of one
        d = d.model_copy(update={"task": "multilabel"})
    lines: list[str] = []
    if found(data_path).streams:  # streamed: its held-out split alone is read, a few batches in memory at a time
        loader, split, skipped = streamed_split(d, data_path, device, p, lines.append, model_url)
    else:
        data = labelled(d, data_path, p, lines.append)
        check_task(p, data.multilabel, data_path, model_url)
        split = next(s for s in ("test", "val", "train") if data.split(s) is not None and data.samples(s))
        from job.data.loader import BatchLoader

        loader = BatchLoader(data.split(split), 256, device, torch.device("cpu"), mean=p.mean, std=p.std, view=p.view)
        split = "all" if split == "train" else split  # class folders with no split: every image scored
        found = len(data.inventory.skipped) if data.inventory is not None else 0
        skipped = lambda: found  # noqa: E731 (read after the pass, as a stream's count is)
    if p.thresholds is not None:  # multi-label: at the model's thresholds
        sums, probs, ys = multilabel_outputs(p.served(), loader, contextlib.nullcontext, len(p.classes))
        s = multilabel_scored(sums, probs, ys, None, p.thresholds)
        if report:
            from job.use import diagnostics

            put = lambda name, data: put_file(f"{report.rstrip('/')}/{split}/{name}", data)  # noqa: E731
            parts = [(probs.cpu().numpy(), ys.cpu().numpy())]
            diagnostics.write_multilabel(put, parts, p.classes, split, p.thresholds)
        head = {"model": model_url, "data": data_path, "split": split}
        return head | s.record(split) | {"samples": len(probs), "skipped": skipped(), "device": str(device)}
    if report:  # one pass: the report's per-sample losses and predictions give the totals too
        from job.use import diagnostics

        stats = (p.mean.flatten().cpu(), p.std.flatten().cpu()) if p.mean is not None else (None, None)
        scored = diagnostics.per_sample(p.served(), loader, contextlib.nullcontext, stats)
        diagnostics.write(lambda name, data: put_file(f"{report.rstrip('/')}/{split}/{name}", data), scored, split,
                          p.classes)  # fmt: skip
        loss_sum, correct, counted = scored.totals()
    else:
        loss_sum, correct, counted = test_sums(p.served(), loader, contextlib.nullcontext).tolist()  # fp32
    return {
        "model": model_url,
        "data": data_path,
        "split": split,
        f"{split}_loss": loss_sum / max(counted, 1),
        f"{split}_accuracy": correct / max(counted, 1),
        "samples": int(counted),
        "skipped": skipped(),
        "device": str(device),
    }


def check_task(p, multilabel: bool, data_url: str, model_url: str) -> None:
    """A DataError where the labels are of the other kind than the model's (lists against one class an image)."""
    if (p.thresholds is not None) != multilabel:
        want = "lists of labels (multi-label)" if p.thresholds is not None else "one class an image"
        raise DataError(f"{data_url}: the model {model_url} was trained on {want}, and these labels are not")


def streamed_split(d, url: str, device: torch.device, p, log, model_url: str) -> tuple[Loader, str, Callable[[], int]]:
    """The loader of a shard folder's test split (else its val) as the model's evaluation read it, the split's
    name, and how many of its samples were skipped (packing's, and those found undecodable as it is read)."""
    from job.data.shard_sets import open_shards
    from job.data.split import Inventory
    from job.data.stream import StreamLoader, held_decoder
    from job.errors import DataError
    from job.storage.run_folder import cache_dir

    shards = open_shards(url, cache_dir("data"), log)  # other tools' shards: counted once, as a run counts them
    if shards.classes != p.classes:
        raise DataError(f"{url}: its classes {shards.classes[:5]} are not the model's {p.classes[:5]}")
    check_task(p, shards.multilabel, url, model_url)
    split = "test" if shards.samples("test") else "val"
    decoder = held_decoder(d, device, p.pre)
    loader = StreamLoader(shards.splits[split], 256, device, decoder, mean=p.mean, std=p.std, view=p.view, log=log)
    packed = len(Inventory.from_json(shards.inventory).skipped) if shards.inventory is not None else 0
    return loader, split, lambda: packed + len(loader.skipped.names)


def labelled(d, url: str, p, log):
    """Labelled images held in memory for scoring, read by the format that holds them (job/data/formats.py)."""
    from job.data.formats import found
    from job.errors import DataError

    fmt = found(url)
    if fmt.scored is None:
        raise DataError(f"{url}: data.kind {fmt.name} holds no labelled images to score")
    return fmt.scored(d.model_copy(update={"kind": fmt.name}), log, p.classes, p.pre)


@dataclass
class Scored:
    """An evaluation over the whole group: mean loss, accuracy, top-5 accuracy, the confusion matrix (rows: true
    class), and the totals of what was reduced with it."""

    loss: float
    accuracy: float
    top5: float
    confusion: torch.Tensor
    extra: list[float]

    def record(self, on: str) -> dict:
        """metrics.jsonl's fields of it: loss, accuracy, macro and weighted F1 (and precision, recall), top-5."""
        values = {"loss": self.loss, "accuracy": self.accuracy, TOP5: self.top5, **scores.averages(self.confusion)}
        return {f"{on}_{k}": values[k] for k in split_scores(False, len(self.confusion))}  # top5, not *acc*: top-1


def score_split(
    model,
    loader: Loader,
    amp,
    classes: int,
    augmentation: str,
    clock,
    extra: torch.Tensor | None = None,
    multilabel: bool = False,
    thresholds: list[float] | None = None,
) -> Scored | MultiScored:
    """A model on a held-out split over the whole group (test_sums on each process's part, then their totals), and
    `extra`'s totals reduced with them: the evaluation's one host sync. `clock`: times the pass (meters.TrainClock).
    `multilabel`: scored by job/recipe/multilabel.py, at `thresholds` (default: the best-F1 ones of this split)."""
    guard = memory_guard(f"data.eval_batch_size={loader.batch_size}", next(model.parameters()).device)
    if multilabel:
        with guard, clock.testing():
            sums, probs, ys = multilabel_outputs(model, loader, amp, classes, augmentation)
        return multilabel_scored(sums, probs, ys, extra, thresholds)
    with guard, clock.testing():
        sums = test_sums(model, loader, amp, augmentation, classes=classes)
    return scored_sums(sums, classes, extra)


def score_kept(model, loader: Loader, amp, classes: int, augmentation: str, clock, stats, extra=None):
    """score_split's evaluation from a pass that keeps every sample (diagnostics.per_sample; `stats`: as it takes
    them): the end of a run writes its report from this pass instead of passing over the split again. Returns the
    Scored and this process's Passed."""
    from job.use import diagnostics

    guard = memory_guard(f"data.eval_batch_size={loader.batch_size}", next(model.parameters()).device)
    with guard, clock.testing():
        passed = diagnostics.per_sample(model, loader, amp, stats, augmentation)
    sums = passed.sums if len(passed.sums) > 4 else torch.zeros(4 + classes * classes, device=loader.device)
    return scored_sums(sums, classes, extra), passed  # (a process with no sample of the split counted nothing)


def scored_sums(sums: torch.Tensor, classes: int, extra: torch.Tensor | None) -> Scored:
    """A Scored from this process's test_sums (and `extra`), reduced over the group: the evaluation's host sync."""
    totals = distributed.totals(sums, sums[:0] if extra is None else extra).cpu()
    loss, correct, counted, top5 = totals[:4].tolist()
    confusion = totals[4 : 4 + classes * classes].round().long().view(classes, classes)
    n = max(counted, 1)
    return Scored(loss / n, correct / n, top5 / n, confusion, totals[4 + classes * classes :].tolist())
