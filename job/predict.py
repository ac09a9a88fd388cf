"""`job predict`: labels and probabilities for new images from a trained model, at any URL in and out.

The model comes from a run folder (model.pt, the chosen weights, with model.json and config.yaml beside it), its
model.pt, or any checkpoint (which carries its config and model.json): nothing of the training data is read. Each
image is made into the model's input exactly as the run's evaluation made it: the same decoding
(job/data/image.py: EXIF turn, HEIC, every mode to RGB), the same held size, the same centre view and
normalisation (job/data/augment.py's to_float), so `predict` on the run's own test files gives `evaluate`'s logits.

Inputs: image files, folders (recursive), glob patterns, and .tar/.tar.gz archives, local or at any URL. They are
listed first, then read, decoded and predicted a batch at a time, decoding a few batches ahead of the model (in
data.workers processes, as streamed training decodes), so memory stays flat in the number of inputs. A file that
cannot be read gets a row with its error and the rest go on.
"""

from __future__ import annotations

import contextlib
import csv
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
from fsspec.implementations.local import LocalFileSystem

from job import bundle, checkpoint
from job.cloud import describe_storage_error, filesystem
from job.config import read_yaml, validate
from job.data.augment import to_float
from job.data.decode import Decoder, decoder_for
from job.data.files import fetch_named, is_archive, is_manifest, iter_archive
from job.data.preprocess import Preprocess
from job.data.split import kind_of
from job.errors import CheckpointError, ConfigError, DataError, StorageError, one_line
from job.models import build_model

AHEAD = 3  # batches decoded ahead of the model
T = TypeVar("T")


@dataclass
class Predictor:
    """A trained model and what makes its inputs."""

    model: torch.nn.Module
    classes: list[str]
    pre: Preprocess  # how an image file is held: the run's evaluation's, brought to the model's input size
    view: object  # the centre view of evaluation, or None
    mean: torch.Tensor | None
    std: torch.Tensor | None
    device: torch.device
    features: dict | None = None  # a table's model: its feature columns and scaler (model.json's)

    @torch.no_grad()
    def table_probabilities(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of raw feature values, in the model's column order, scaled as in training."""
        low, span = torch.tensor(self.features["min"]), torch.tensor(self.features["span"])
        return torch.softmax(self.model(((x - low) / span).to(self.device)).float(), dim=1).cpu()

    @torch.no_grad()
    def probabilities(self, images: torch.Tensor) -> torch.Tensor:
        x = to_float(images.to(self.device), torch.contiguous_format, self.mean, self.std, self.view)
        return torch.softmax(self.model(x).float(), dim=1).cpu()


def load_predictor(url: str, device: torch.device) -> Predictor:
    """The model at `url` (a run folder, its model.pt, or a checkpoint) on `device`, in evaluation mode."""
    from job.recipe import model_input, resolved

    payload, card, raw_config = model_files(url)
    cfg = resolved(validate(raw_config))
    pre = card.get("preprocessing")
    shape = tuple(card["input_shape"])
    if pre is None:  # a table's model: its features' columns and scaler instead
        model = build_model(cfg.model, shape, len(card["classes"]))
        model.load_state_dict(payload["model"])
        model.to(device).eval()
        return Predictor(model, list(card["classes"]), Preprocess(), None, None, None, device, card["features"])
    # A run that fixed no size held its images as they were (one size): every image is brought to that size here,
    # so that a photo of another size is labelled, not refused in the model or with its whole batch.
    held = Preprocess.of(cfg.data, shape)
    _, view = model_input(cfg, (3, *held.size), True)
    model = build_model(cfg.model, shape, len(card["classes"]))
    try:
        model.load_state_dict(payload["model"])
    except RuntimeError as e:
        raise CheckpointError(f"{url}: weights do not fit model {cfg.model.name}: {str(e).splitlines()[0]}") from None
    model.to(device).eval()
    stats = [
        None if pre["mean"] is None else torch.tensor(pre[k]).view(1, -1, 1, 1).to(device) for k in ("mean", "std")
    ]
    return Predictor(model, list(card["classes"]), held, view, *stats, device)


def model_files(url: str) -> tuple[dict, dict, dict]:
    """(weights payload, model.json's content, config) of a run folder, its model.pt, or a checkpoint."""
    fs, path = filesystem(url)
    try:
        folder = fs.isdir(path)
        chosen = folder and fs.exists(f"{path.rstrip('/')}/model.pt")
    except Exception as e:  # the stores' clients raise many types
        raise StorageError(f"cannot read the model: {describe_storage_error(url, e)}") from None
    weights_url = f"{url.rstrip('/')}/model.pt" if chosen else url
    payload, _ = checkpoint.load_url(weights_url, weights=True)
    if "model_json" in payload and "config" in payload:
        return payload, payload["model_json"], payload["config"]
    beside = weights_url.rsplit("/", 1)[0] if "/" in weights_url else "."
    card, config_url = read_json(f"{beside}/{bundle.MODEL_JSON}"), f"{beside}/config.yaml"
    if card is None or not exists(config_url):
        raise CheckpointError(
            f"{url}: weights with no model.json and config.yaml beside them (runs of earlier versions wrote none): "
            "pass the run's checkpoint instead (--model RUN/checkpoints/<name>.pt)"
        )
    return payload, card, read_yaml(config_url)


def exists(url: str) -> bool:
    """Whether there is a file at `url`; a store that fails to say is a StorageError."""
    fs, path = filesystem(url)
    try:
        return fs.exists(path)
    except Exception as e:  # the stores' clients raise many types
        raise StorageError(f"cannot read the model: {describe_storage_error(url, e)}") from None


def read_json(url: str) -> dict | None:
    if not exists(url):
        return None
    fs, path = filesystem(url)
    try:
        return json.loads(fs.cat_file(path))
    except ValueError:
        raise CheckpointError(f"{url}: not JSON") from None
    except Exception as e:  # the stores' clients raise many types
        raise StorageError(f"cannot read the model: {describe_storage_error(url, e)}") from None


def listed(inputs: list[str]) -> list[tuple[str, str | None]]:
    """(name, url) of every image an input names: a file, a folder's images (recursive), a glob's; (archive, None)
    for an archive, read as it is iterated. Names are as given, or folder-relative under a folder."""
    found: list[tuple[str, str | None]] = []
    for item in inputs:
        fs, path = filesystem(item)
        try:
            if any(c in path for c in "*?[") and not fs.exists(path):  # a file named scan[1].png is a name
                matches = [p for p in sorted(fs.glob(path)) if not fs.isdir(p)]
                # named in the form given: a local path stays a path, a store's a URL
                found += [(fs.unstrip_protocol(p) if "://" in item else p,) * 2 for p in matches]
                if not matches:
                    raise DataError(f"{item}: no file matches")
            elif fs.isdir(path):
                root = path.rstrip("/") + "/"
                for p in sorted(fs.find(path)):
                    rel = p[len(root) :]
                    if kind_of(rel) == "image":
                        found.append((f"{item.rstrip('/')}/{rel}", fs.unstrip_protocol(p)))
                    elif is_archive(rel) and not rel.startswith("."):  # a folder of shards: each read as it comes
                        found.append((f"{item.rstrip('/')}/{rel}", None))
            elif is_archive(path):
                found.append((item, None))
            elif is_manifest(path):
                found += manifest_paths(item)
            elif fs.exists(path):
                found.append((item, item))
            else:
                raise DataError(f"{item}: no such file or folder")
        except (DataError, StorageError):
            raise
        except Exception as e:  # the stores' clients raise many types
            raise StorageError(f"cannot list {item}: {describe_storage_error(item, e)}") from None
    return found


def predict_tables(p: Predictor, inputs: list[str], rows: Rows, log, index: int = 0, count: int = 1) -> dict:
    """A table's model over CSV tables: each row's feature columns (by name, in the model's order); a row that
    lacks one or is not a number gets its error. This part's rows only (share)."""
    done, failed = 0, 0
    for name, n, values in share(table_rows(inputs, p.features["columns"]), index, count):
        try:
            x = torch.tensor([[float(v) for v in values]])
        except ValueError:
            rows.row(name, [], f"row {n}: not a number in the feature columns")
            failed += 1
            continue
        probs = p.table_probabilities(x)[0]
        top = probs.topk(rows.k)
        rows.row(name, [(p.classes[int(c)], float(v)) for v, c in zip(top.values, top.indices)], "")
        done += 1
    rows.close()
    log(f"predict: {done} rows labelled, {failed} could not be read")
    if done == 0 and failed:
        raise DataError(f"no row could be read ({failed} tried): see the error column")
    return {"labelled": done, "errors": failed}


def table_rows(inputs: list[str], columns: list[str]) -> Iterator[tuple[str, int, list[str]]]:
    """Every row of the CSV tables, in order: its name (url:line), its line, its values of `columns`."""
    from job.data.files import read_bytes
    from job.data.tabular import parse_csv

    for url in inputs:
        header, table = parse_csv(read_bytes(url, None, lambda _: None).decode("utf-8-sig"), url)
        missing = [c for c in columns if c not in header]
        if missing:
            raise DataError(f"{url}: no column {missing[0]!r} of the model's features ({', '.join(columns)})")
        at = [header.index(c) for c in columns]
        for n, row in enumerate(table, start=2):
            yield f"{url}:{n}", n, [row[i] for i in at]


def manifest_paths(url: str) -> list[tuple[str, str]]:
    """(path as written, its URL) of a manifest's rows: its `path` column, beside the manifest (files.beside)."""
    from job.data.files import beside, read_bytes
    from job.data.manifest import read_rows

    rows = read_rows(url, read_bytes(url, None, lambda _: None))
    if rows and "path" not in rows[0]:
        raise DataError(f"{url}: no column 'path' (columns: {', '.join(rows[0])})")
    paths = [str(r["path"]).strip() for r in rows if r.get("path")]
    return [(p, beside(url, p)) for p in paths]


Read = tuple[str, bytes, str]  # an input's name, its bytes, and why it could not be read ("" when it was)


GONE = "not found (moved or removed since it was listed?)"


def why(url: str, error: Exception) -> str:
    """A row's words for a file that could not be read."""
    if isinstance(error, FileNotFoundError):
        return GONE
    if "://" not in url or url.startswith("file://"):
        return f"cannot read it: {one_line(error)}"
    return describe_storage_error(url, error)


def read(found: list[tuple[str, str | None]], chunk: int) -> Iterator[list[Read]]:
    """The inputs' bytes, `chunk` files at a time (each store's fetched concurrently: files.fetch_named); an
    archive's images as its members come. A file that cannot be read says why, and the rest go on."""
    pending: list[tuple[str, str]] = []

    def flush() -> list[Read]:
        got = fetch_named([url for _, url in pending])
        batch = [(name, b"", why(url, data)) if isinstance(data, Exception) else (name, data, "")
                 for (name, url), data in zip(pending, got)]  # fmt: skip
        pending.clear()
        return batch

    for name, url in found:
        if url is None:
            batch = []
            for member, data in iter_archive(name):
                if kind_of(member) == "image":
                    batch.append((f"{name}:{member}", data, ""))
                    if len(batch) == chunk:
                        yield batch
                        batch = []
            if batch:
                yield batch
            continue
        pending.append((name, url))
        if len(pending) == chunk:
            yield flush()
    if pending:
        yield flush()


def predict(
    model_url: str,
    inputs: list[str],
    output: str | None,
    top_k: int,
    batch_size: int,
    device: torch.device,
    workers: int | str = "auto",
    log=print,
    decode: str = "auto",
) -> dict:
    """Predict every input image; rows written to `output` (.csv or .jsonl, any URL; None: CSV on standard
    output); `decode`: where images are decoded (auto, host, device: decode.decoder_for). Returns the counts."""
    if output is not None and not output.lower().endswith((".csv", ".jsonl")):
        raise ConfigError(f"--output: a .csv or .jsonl file, got {output}")
    index, count = part()
    jsonl = output is not None and output.lower().endswith(".jsonl")  # by the name asked for, not its part's
    if count > 1:
        if output is None:
            raise ConfigError("predict split over tasks or processes: each writes a part; give --output")
        output = f"{output}.part-{index}-of-{count}"
    p = load_predictor(model_url, device)
    k = max(1, min(top_k, len(p.classes)))
    if p.features is not None:
        return predict_tables(p, inputs, Rows(output, k, jsonl), log, index, count)
    found = list(share(listed(inputs), index, count))
    try:
        decoder = decoder_for(decode, workers, device, p.pre, skip=True)
    except ConfigError as e:
        raise ConfigError(f"--decode {decode}: {e}") from None
    if count > 1:
        log(f"predict: part {index + 1} of {count} on {torch.get_num_threads()} CPU threads, decoding in "
            f"{decoder.workers} processes")  # fmt: skip
    rows = Rows(output, k, jsonl)
    t0, done, failed = time.perf_counter(), 0, 0
    from tqdm import tqdm

    with tqdm(total=len(found), unit=" images", disable=None, file=sys.stderr, mininterval=1) as bar:
        queue: deque = deque()
        for batch in read(found, batch_size):
            queue.append((batch, decoder.submit([(n, n.rsplit(".", 1)[-1].lower(), b) for n, b, _ in batch])))
            if len(queue) > AHEAD:
                done, failed = rows.emit(p, *queue.popleft(), done, failed)
                bar.update(len(batch))
        while queue:
            batch, future = queue.popleft()
            done, failed = rows.emit(p, batch, future, done, failed)
            bar.update(len(batch))
    rows.close()
    seconds = time.perf_counter() - t0
    rate = done / max(seconds, 1e-9)
    log(f"predict: {done} images labelled, {failed} could not be read, in {seconds:.1f} s ({rate:.0f} images/s)")
    if done == 0 and failed:
        raise DataError(f"no input could be read ({failed} tried): see the error column")
    return {"labelled": done, "errors": failed}


def decode_inputs(p: Predictor, inputs: list[str], limit: int) -> tuple[torch.Tensor, list[bytes]] | None:
    """Up to `limit` of the inputs' images as the model's inputs (float, on the predictor's device), those that can
    be read, and their files' bytes in the same order; None when none can."""
    from job.data.decode import IGNORED, decoded

    decoder, kept, files, n = Decoder(0, p.pre, skip=True), [], [], 0
    for batch in read(listed(inputs), limit):
        marks = torch.zeros(len(batch), dtype=torch.int64)
        try:
            images = decoded(decoder.submit([(name, "", data) for name, data, _ in batch]), ("", ""), marks)
        except DataError:
            continue
        good = images[marks != IGNORED][: limit - n]
        files += [data for (_, data, _), mark in zip(batch, marks) if mark != IGNORED][: limit - n]
        kept.append(to_float(good.to(p.device), torch.contiguous_format, p.mean, p.std, p.view))
        n += len(good)
        if n >= limit:
            break
    return (torch.cat(kept), files) if kept else None


PART = "JOB_PREDICT_PART"  # "i/n": the part of the inputs one of --nproc-per-node's processes takes


def part() -> tuple[int, int]:
    """(index, count) of the inputs' parts this process predicts: a Cloud Batch task array's task
    (BATCH_TASK_INDEX of BATCH_TASK_COUNT), times --nproc-per-node's processes on each; (0, 1): all of them."""
    task, tasks = int(os.environ.get("BATCH_TASK_INDEX", 0)), int(os.environ.get("BATCH_TASK_COUNT", 1))
    local, per_task = (int(v) for v in os.environ.get(PART, "0/1").split("/"))
    if not (0 <= task < tasks and 0 <= local < per_task):
        raise ConfigError(f"predict: task {task} of {tasks}, process {local} of {per_task}: not a part")
    return task * per_task + local, tasks * per_task


def share(inputs: Iterable[T], index: int, count: int) -> Iterator[T]:
    """Part `index` of `count` of the inputs (files or a table's rows): every count-th from its own, so the parts
    together take each input once; an iterator's items are taken as they come."""
    return itertools.islice(inputs, index, None, count)


def spread(argv: list[str], nproc: int) -> int:
    """--nproc-per-node: this command again in `nproc` processes, each predicting its part (the option is read
    only where PART is unset) with its share of the CPUs; the worst exit code, a process ended by a signal counting
    128 + its number, as a shell says it. They run in sessions of their own, as training's workers do, and a SIGTERM
    or Ctrl-C to this process goes on to each (launch.forwarding_signals): a preempted predict stops whole."""
    import subprocess

    from job.env import cpu_share
    from job.launch import forwarding_signals

    env = {**os.environ, "LOCAL_WORLD_SIZE": str(nproc)}  # env.cpu_share's count: decoding takes the share
    env.setdefault("OMP_NUM_THREADS", str(cpu_share(nproc)))  # and so does the model, as torchrun sets it
    with forwarding_signals():
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "job", *argv], env={**env, PART: f"{i}/{nproc}"}, start_new_session=True
            )
            for i in range(nproc)
        ]
        codes = [proc.wait() for proc in procs]
    return max(128 - code if code < 0 else code for code in codes)


def part_device(name: str) -> torch.device:
    """The device a part predicts on: as asked; with auto, one of --nproc-per-node's processes takes the GPU of its
    own index (of those there are)."""
    from job.env import pick_device

    local = int(os.environ.get(PART, "0/1").split("/")[0])
    if name == "auto" and PART in os.environ and torch.cuda.is_available():
        return torch.device("cuda", local % torch.cuda.device_count())
    return pick_device(name)


class Rows:
    """The output file: CSV (path, label, probability, label_2, probability_2, ..., error) or JSONL."""

    def __init__(self, output: str | None, k: int, jsonl: bool) -> None:
        self.output, self.k, self.jsonl = output, k, jsonl
        # Rows go to a local file as they come (memory stays flat), copied to a remote URL at the end.
        part = None if output is None else tempfile.NamedTemporaryFile("w", suffix=".part", delete=False)  # noqa: SIM115
        self.local = part  # closed by close()
        self.buf = self.local if self.local is not None else sys.stdout
        self.csv = None if self.jsonl else csv.writer(self.buf)
        if self.csv is not None:
            head = ["path", "label", "probability"]
            for i in range(2, k + 1):
                head += [f"label_{i}", f"probability_{i}"]
            self.csv.writerow([*head, "error"])

    def emit(self, p: Predictor, batch: list, future, done: int, failed: int) -> tuple[int, int]:
        from job.data.decode import IGNORED, decoded

        marks = torch.zeros(len(batch), dtype=torch.int64)
        errors: list[str] = []
        try:
            images = decoded(future, (batch[0][0], batch[-1][0]), marks, errors)
        except DataError as e:  # not one image of the batch could be decoded
            for name, _, unread in batch:
                self.row(name, [], unread or str(e))
            return done, failed + len(batch)
        good = (marks != IGNORED).nonzero().flatten()
        kept = images if len(good) == len(batch) else images[good]  # an index is a copy to the device
        probs = p.probabilities(kept) if len(good) else torch.empty(0, len(p.classes))
        top = probs.topk(self.k, dim=1) if len(good) else None
        why = iter(errors)
        at = {int(i): j for j, i in enumerate(good)}
        for i, (name, _, unread) in enumerate(batch):
            if i in at:
                j = at[i]
                pairs = [(p.classes[int(c)], float(v)) for v, c in zip(top.values[j], top.indices[j])]
                self.row(name, pairs, "")
                done += 1
            else:
                said = next(why, "cannot decode")  # the decoder's words of each, taken in order
                self.row(name, [], unread or said)
                failed += 1
        return done, failed

    def row(self, name: str, pairs: list[tuple[str, float]], error: str) -> None:
        if self.jsonl:
            first = pairs[0] if pairs else (None, None)
            entry = {"path": name, "label": first[0], "probability": first[1], "top_k": pairs, "error": error or None}
            self.buf.write(json.dumps(entry, ensure_ascii=False) + "\n")
            return
        cells = [name]
        for i in range(self.k):
            cells += [pairs[i][0], f"{pairs[i][1]:.6f}"] if i < len(pairs) else ["", ""]
        self.csv.writerow([*cells, error])

    def close(self) -> None:
        if self.local is None:
            sys.stdout.flush()
            return
        self.local.close()
        fs, path = filesystem(self.output)
        try:
            if isinstance(fs, LocalFileSystem):
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                shutil.move(self.local.name, path)
            else:
                fs.put_file(self.local.name, path)
        except Exception as e:  # the stores' clients raise many types
            raise StorageError(f"cannot write {self.output}: {describe_storage_error(self.output, e)}") from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.local.name)
