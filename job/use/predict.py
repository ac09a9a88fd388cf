"""`job predict`: labels and probabilities for new images (or a table's rows) from a trained model, at any URL in
and out, as stages: the model (job/use/bundle.py's load_predictor: a run folder, its model.pt or any checkpoint; nothing
of the training data is read), its part of the inputs (use/parts.py), the inputs listed and read (use/inputs.py),
decoded a few batches ahead of the model (in data.workers processes, as streamed training decodes), predicted, and
written as rows. Each image is made into the model's input exactly as the run's evaluation made it (the one
preprocessing value, job/data/preprocess.py; the same centre view and normalisation), so `predict` on the run's own
test files gives `evaluate`'s logits. Memory stays flat in the number of inputs; a file that cannot be read gets a
row with its error and the rest go on.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import sys
import tempfile
import time
from collections import deque

import torch
from fsspec.implementations.local import LocalFileSystem

from job.data.decode import decoder_for
from job.errors import ConfigError, DataError, StorageError
from job.storage.cloud import describe_storage_error, filesystem
from job.storage.sync import FILE_MODE
from job.use.bundle import Predictor, load_predictor
from job.use.inputs import listed, read, table_rows
from job.use.parts import part, share

AHEAD = 3  # batches decoded ahead of the model


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
        return predict_tables(p, inputs, Rows(output, k, jsonl, p), log, index, count)
    found = list(share(listed(inputs), index, count))
    try:
        decoder = decoder_for(decode, workers, device, p.pre, skip=True)
    except ConfigError as e:
        raise ConfigError(f"--decode {decode}: {e}") from None
    if count > 1:
        threads, workers = torch.get_num_threads(), decoder.workers
        on = f"{threads} CPU thread{'s' if threads != 1 else ''}"
        decoding = f"decoding in {workers} process{'es' if workers != 1 else ''}" if workers else "decoding in it"
        log(f"predict: writing {output} on {on}, {decoding}")
    rows = Rows(output, k, jsonl, p)
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
    said = f"{done} image{'s' if done != 1 else ''} labelled"
    served = [f"the run's test-time views ({p.augmentation})"] if p.augmentation != "none" else []
    served += [f"its temperature {p.temperature:.3g}"] if p.temperature != 1.0 and p.thresholds is None else []
    how = f"; scored with {' and '.join(served)}" if served else ""  # as the run's evaluations scored its test split
    log(f"predict: {said}, {failed} could not be read, in {seconds:.1f} s ({rate:.0f} images/s){how}")
    if done == 0 and failed:
        raise DataError(f"no input could be read ({failed} tried): see the error column")
    return {"labelled": done, "errors": failed}


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
        rows.scored(name, p.table_probabilities(x)[0])
        done += 1
    rows.close()
    log(f"predict: {done} rows labelled, {failed} could not be read")
    if done == 0 and failed:
        raise DataError(f"no row could be read ({failed} tried): see the error column")
    return {"labelled": done, "errors": failed}


class Rows:
    """The output file: CSV (path, label, probability, label_2, probability_2, ..., error) or JSONL. Multi-label
    (a model with thresholds): CSV path, labels (joined by |), one probability column a class, error; JSONL "labels"
    (the classes above their thresholds) and "probabilities" (every class's, by name)."""

    def __init__(self, output: str | None, k: int, jsonl: bool, p: Predictor | None = None) -> None:
        self.output, self.k, self.jsonl = output, k, jsonl
        self.classes = p.classes if p is not None else []
        self.multi = p if p is not None and p.thresholds is not None else None
        # Rows go to a local file as they come (memory stays flat), copied to a remote URL at the end.
        part = None if output is None else tempfile.NamedTemporaryFile("w", suffix=".part", delete=False)  # noqa: SIM115
        self.local = part  # closed by close()
        self.buf = self.local if self.local is not None else sys.stdout
        self.csv = None if self.jsonl else csv.writer(self.buf)
        if self.csv is not None and self.multi is not None:
            self.csv.writerow(["path", "labels", *self.multi.classes, "error"])
        elif self.csv is not None:
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
        why = iter(errors)
        at = {int(i): j for j, i in enumerate(good)}
        for i, (name, _, unread) in enumerate(batch):
            if i in at:
                self.scored(name, probs[at[i]])
                done += 1
            else:
                said = next(why, "cannot decode")  # the decoder's words of each, taken in order
                self.row(name, [], unread or said)
                failed += 1
        return done, failed

    def scored(self, name: str, probs: torch.Tensor) -> None:
        """One input's row from its probabilities: the top k classes, or (multi-label) its label set and every
        class's probability."""
        p = self.multi
        if p is None:
            top = probs.topk(self.k)
            self.row(name, [(self.classes[int(c)], float(v)) for v, c in zip(top.values, top.indices)], "")
        elif self.jsonl:
            entry = {"path": name, "labels": p.label_set(probs), "probabilities": dict(zip(p.classes, probs.tolist()))}
            self.buf.write(json.dumps(entry | {"error": None}, ensure_ascii=False) + "\n")
        else:
            self.csv.writerow([name, "|".join(p.label_set(probs)), *(f"{v:.6f}" for v in probs.tolist()), ""])

    def row(self, name: str, pairs: list[tuple[str, float]], error: str) -> None:
        if self.multi is not None:  # an input that could not be read
            if self.jsonl:
                entry = {"path": name, "labels": [], "probabilities": None, "error": error}
                self.buf.write(json.dumps(entry, ensure_ascii=False) + "\n")
            else:
                self.csv.writerow([name, "", *([""] * len(self.multi.classes)), error])
            return
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
                os.chmod(self.local.name, FILE_MODE)  # a temporary file is private; the rows are the user's file
                shutil.move(self.local.name, path)
            else:
                fs.put_file(self.local.name, path)
        except Exception as e:  # the stores' clients raise many types
            raise StorageError(f"cannot write {self.output}: {describe_storage_error(self.output, e)}") from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.local.name)
