"""`job export`: a trained model as a file someone can serve, checked against the model before it is called done.

    onnx  torch.onnx.export's dynamo exporter; the class names and the preprocessing in the file's metadata_props
          (`labels`: a JSON list in index order; `preprocessing`: model.json's object; multi-label: `task`
          "multilabel" and `thresholds`, model.json's object by class, the sigmoid inside: its output, named
          `probabilities`, is each class's probability)
    pt2   torch.export's ExportedProgram, saved with torch.export.save; `labels.json` and `preprocessing.json` (and
          `task.json`, `thresholds.json`) as its extra files

Both take a batch of any size (a dynamic first dimension) of the model's input, float32 NCHW as model.json's
preprocessing makes it. The export is then run with its own runtime (onnxruntime; torch.export.load) on real images,
preprocessed twice: as `job predict` does, and by model.json's documented recipe with Pillow and numpy alone, from
the files (job/use/bundle.py's recipe_input: what a person serving the export does); both are compared with the model.
The largest difference of the logits and whether every label agrees, for each, go to `<output>.check.json`, and a
difference beyond the tolerance, or one label that differs, stops it (exit 1).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem

from job.errors import ConfigError, DataError, JobError, StorageError
from job.storage.cloud import describe_storage_error, filesystem, write_url

FORMATS = ("onnx", "pt2")
# The largest difference of fp32 logits an export may show against the model, on the CPU, relative to the largest
# logit (at least 1): float32 rounding grows with the logits' size, so an absolute bound refuses a confident model.
TOLERANCE = 1e-4
CHECK_IMAGES = 256


def export(model_url: str, fmt: str, output: str | None, check_inputs: list[str], log=print) -> dict:
    from job.use.bundle import load_predictor, model_files, recipe_input
    from job.use.inputs import decode_inputs

    if fmt not in FORMATS:
        raise ConfigError(f"--format: one of {', '.join(FORMATS)}, got {fmt}")
    device = torch.device("cpu")
    p = load_predictor(model_url, device)
    _, card, raw_config = model_files(model_url)
    if p.features is not None:
        raise ConfigError("export: exports image models; a table's model (csv) is used with `job predict`")
    shape = tuple(card["input_shape"])
    output = output or f"{model_url.rstrip('/')}/model.{fmt}"
    images = check_inputs or held_out_images(model_url, raw_config)
    decoded = decode_inputs(p, images, CHECK_IMAGES)
    if decoded is None:
        raise DataError("export: no image to check the export with could be read (--check-images)")
    x, files = decoded
    # A model.json of an earlier version has no exact recipe (input_size, held) to follow: its check is the job's.
    exact = "input_size" in card["preprocessing"]
    theirs = torch.from_numpy(np.stack([recipe_input(card["preprocessing"], data) for data in files])) if exact else x
    # What predict serves: the run's test-time views averaged (the temperature and thresholds were fitted on them),
    # the logits over the temperature (its softmax is predict's), a multi-label model's probabilities.
    model = p.served() if p.thresholds is None else WithSigmoid(p.served()).eval()
    with torch.no_grad():
        want = model(x).float()
    bound = TOLERANCE * max(1.0, float(want.abs().max()))
    example = torch.zeros(2, *shape)
    meta = {
        "labels": json.dumps(card["classes"], ensure_ascii=False),
        "preprocessing": json.dumps(card["preprocessing"]),
    }
    if p.temperature != 1.0:  # inside the graph already; said for a reader of the file
        meta["temperature"] = json.dumps(p.temperature)
    if p.thresholds is not None:
        meta |= {"task": json.dumps("multilabel"), "thresholds": json.dumps(card["thresholds"], ensure_ascii=False)}
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, f"model.{fmt}")
        try:
            both = torch.cat([x, theirs.to(x.device)])  # the job's inputs, then the recipe's: one run of the runtime
            if fmt == "onnx":
                got, by_recipe = to_onnx(model, example, local, meta, both).split(len(x))
            else:
                got, by_recipe = to_pt2(model, example, local, meta, both).split(len(x))
        except (ConfigError, StorageError):
            raise
        except Exception as e:  # the exporters raise many types, with long messages: the first line says why
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"export: {card['model']['name']} cannot be exported to {fmt}: {first[:300]}") from None
        diff, agree = compared(got, want, p.thresholds)
        recipe_diff, recipe_agree = compared(by_recipe, want, p.thresholds)
        check = {"format": fmt, "images": len(x), "max_abs_logit_diff": diff, "labels_agree": agree}
        check |= {
            "recipe_checked": exact,
            "recipe_max_abs_logit_diff": recipe_diff,
            "recipe_labels_agree": recipe_agree,
        }
        check |= {"tolerance": bound, "relative_tolerance": TOLERANCE}
        check["runtime"] = "onnxruntime" if fmt == "onnx" else "torch.export.load"
        check["output"] = output
        if diff > bound or not agree:  # exit 1, and nothing written
            raise JobError(
                f"export: the {fmt} file differs from the model on {len(x)} images (largest logit difference "
                f"{diff:.2e}, tolerance {bound:.2e}; labels agree: {agree}): not written"
            )
        if recipe_diff > bound or not recipe_agree:
            raise JobError(
                f"export: model.json's preprocessing, followed with Pillow, does not reproduce the model's input on "
                f"{len(x)} images (largest logit difference {recipe_diff:.2e}, tolerance {bound:.2e}; labels agree: "
                f"{recipe_agree}): not written"
            )
        put(local, output)
        write_url(f"{output}.check.json", json.dumps(check, indent=1).encode())
    log(
        f"export: {output}, checked on {len(x)} images with {check['runtime']}, preprocessed by the job and by "
        f"model.json's recipe: largest {'probability' if p.thresholds else 'logit'} difference "
        f"{max(diff, recipe_diff):.1e}, {'label sets over the thresholds' if p.thresholds else 'top-1'} agreement 100%"
    )
    return check


def compared(got: torch.Tensor, want: torch.Tensor, thresholds: list[float] | None = None) -> tuple[float, bool]:
    """The largest difference of two sets of logits (multi-label: of probabilities), and whether every top-1 label
    (multi-label: every label set over the thresholds) agrees."""
    diff = float((got - want).abs().max())
    if thresholds is not None:
        t = torch.tensor(thresholds)
        return diff, bool(((got > t) == (want > t)).all())
    return diff, bool((got.argmax(1) == want.argmax(1)).all())


class WithSigmoid(torch.nn.Module):
    """A multi-label model with its sigmoid inside: each class's probability out, as predict gives it."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.model(x))


def to_onnx(model, example, path: str, meta: dict[str, str], x: torch.Tensor) -> torch.Tensor:
    try:
        import onnx
        import onnxruntime as ort
        import onnxscript  # noqa: F401  (torch.onnx's dynamo exporter writes through it)
    except ImportError as e:
        raise ConfigError(f"--format onnx: needs {e.name}: pip install onnx onnxscript onnxruntime") from None

    batch = torch.export.Dim("batch", min=1)
    names = ["probabilities"] if isinstance(model, WithSigmoid) else None
    program = torch.onnx.export(
        model, (example,), dynamo=True, dynamic_shapes=({0: batch},), verbose=False, output_names=names
    )
    program.save(path)
    proto = onnx.load(path)
    for key, value in meta.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(proto, path)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return torch.from_numpy(session.run(None, {name: x.numpy()})[0]).float()


def to_pt2(model, example, path: str, meta: dict[str, str], x: torch.Tensor) -> torch.Tensor:
    batch = torch.export.Dim("batch", min=1)
    program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
    torch.export.save(program, path, extra_files={f"{key}.json": value for key, value in meta.items()})
    loaded = torch.export.load(path)
    with torch.no_grad():
        out = loaded.module()(x)
    return (out[0] if isinstance(out, (tuple, list)) else out).float()


def held_out_images(model_url: str, raw_config: dict, limit: int = CHECK_IMAGES) -> list[str]:
    """The run's val (else test) images, sorted into splits as the run sorted them (job/data/split.py), to check an
    export with, where the run's data format names them (job/data/formats.py: an image folder's, a manifest's, at
    any URL); other data (an archive, shards, a table) needs --check-images."""
    from job.config import validate
    from job.data.formats import format_named

    cfg = validate(raw_config).data
    where = "export: name real images to check the export with: --check-images FOLDER"
    fmt = format_named(cfg.kind)
    if fmt.held_out is None or not cfg.path:
        raise ConfigError(f"{where} (the run's data, data.kind {cfg.kind}, names no images to check with)")
    try:
        held = fmt.held_out(cfg, limit)
    except DataError as e:
        raise ConfigError(f"{where} (the run's {cfg.path} from here: {e})") from None
    if not held:
        raise ConfigError(f"{where} (the run held no images out)")
    return held


def put(local: str, url: str) -> None:
    fs, path = filesystem(url)
    try:
        if isinstance(fs, LocalFileSystem):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        fs.put_file(local, path)
    except Exception as e:  # the stores' clients raise many types
        raise StorageError(f"cannot write {url}: {describe_storage_error(url, e)}") from None
