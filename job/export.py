"""`job export`: a trained model as a file someone can serve, checked against the model before it is called done.

    onnx  torch.onnx.export's dynamo exporter; the class names and the preprocessing in the file's metadata_props
          (`labels`: a JSON list in index order; `preprocessing`: model.json's object)
    pt2   torch.export's ExportedProgram, saved with torch.export.save; `labels.json` and `preprocessing.json` as
          its extra files

Both take a batch of any size (a dynamic first dimension) of the model's input, float32 NCHW as model.json's
preprocessing makes it. The export is then run with its own runtime (onnxruntime; torch.export.load) on real images,
preprocessed as `job predict` does, and compared with the model: the largest difference of the logits and whether
every label agrees go to `<output>.check.json`, and a difference beyond the tolerance stops it (exit 1).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from fsspec.implementations.local import LocalFileSystem

from job.cloud import describe_storage_error, filesystem
from job.errors import ConfigError, DataError, JobError, StorageError

FORMATS = ("onnx", "pt2")
TOLERANCE = 1e-4  # the largest difference of fp32 logits an export may show against the model, on the CPU
CHECK_IMAGES = 256


def export(model_url: str, fmt: str, output: str | None, check_inputs: list[str], log=print) -> dict:
    from job.predict import decode_inputs, load_predictor, model_files

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
    x = decode_inputs(p, images, CHECK_IMAGES)
    if x is None:
        raise DataError("export: no image to check the export with could be read (--check-images)")
    with torch.no_grad():
        want = p.model(x).float()
    example = torch.zeros(2, *shape)
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, f"model.{fmt}")
        labels, pre = json.dumps(card["classes"], ensure_ascii=False), json.dumps(card["preprocessing"])
        try:
            if fmt == "onnx":
                got = to_onnx(p.model, example, local, labels, pre, x)
            else:
                got = to_pt2(p.model, example, local, labels, pre, x)
        except (ConfigError, StorageError):
            raise
        except Exception as e:  # the exporters raise many types, with long messages: the first line says why
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"export: {card['model']['name']} cannot be exported to {fmt}: {first[:300]}") from None
        diff = float((got - want).abs().max())
        agree = bool((got.argmax(1) == want.argmax(1)).all())
        check = {"format": fmt, "images": len(x), "max_abs_logit_diff": diff, "labels_agree": agree}
        check |= {"tolerance": TOLERANCE, "runtime": "onnxruntime" if fmt == "onnx" else "torch.export.load"}
        if diff > TOLERANCE or not agree:  # exit 1, and nothing written
            raise JobError(
                f"export: the {fmt} file differs from the model on {len(x)} images (largest logit difference "
                f"{diff:.2e}, tolerance {TOLERANCE:g}; labels agree: {agree}): not written"
            )
        put(local, output)
        put_text(json.dumps(check, indent=1), f"{output}.check.json")
    log(
        f"export: {output}, checked on {len(x)} images with {check['runtime']}: largest logit difference {diff:.1e}, "
        "top-1 agreement 100%"
    )
    return check


def to_onnx(model, example, path: str, labels: str, pre: str, x: torch.Tensor) -> torch.Tensor:
    try:
        import onnx
        import onnxruntime as ort
        import onnxscript  # noqa: F401  (torch.onnx's dynamo exporter writes through it)
    except ImportError as e:
        raise ConfigError(f"--format onnx: needs {e.name}: pip install onnx onnxscript onnxruntime") from None

    batch = torch.export.Dim("batch", min=1)
    program = torch.onnx.export(model, (example,), dynamo=True, dynamic_shapes=({0: batch},), verbose=False)
    program.save(path)
    proto = onnx.load(path)
    for key, value in (("labels", labels), ("preprocessing", pre)):
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(proto, path)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return torch.from_numpy(session.run(None, {name: x.numpy()})[0]).float()


def to_pt2(model, example, path: str, labels: str, pre: str, x: torch.Tensor) -> torch.Tensor:
    batch = torch.export.Dim("batch", min=1)
    program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
    torch.export.save(program, path, extra_files={"labels.json": labels, "preprocessing.json": pre})
    loaded = torch.export.load(path)
    with torch.no_grad():
        out = loaded.module()(x)
    return (out[0] if isinstance(out, (tuple, list)) else out).float()


def held_out_images(model_url: str, raw_config: dict) -> list[str]:
    """The run's val (else test) images, sorted into splits as the run sorted them (job/data/split.py), to check an
    export with: an image folder's, at any URL; other data (an archive, shards, a table) needs --check-images."""
    from job.config import validate
    from job.data.split import HoldOut, kind_of, sort_files

    cfg = validate(raw_config).data
    where = "export: name real images to check the export with: --check-images FOLDER"
    if cfg.kind != "folder" or not cfg.path:
        raise ConfigError(f"{where} (the run's data is not an image folder)")
    fs, path = filesystem(cfg.path)
    try:
        if not fs.isdir(path):
            raise ConfigError(f"{where} (the run's {cfg.path} is not a folder here)")
        root = path.rstrip("/") + "/"
        names = [p[len(root) :] for p in fs.find(path) if kind_of(p[len(root) :]) == "image"]
    except ConfigError:
        raise
    except Exception as e:  # the stores' clients raise many types
        raise StorageError(f"cannot list {cfg.path}: {describe_storage_error(cfg.path, e)}") from None
    files = sort_files(names, HoldOut.of(cfg))
    held = [n for n, _ in files.roles["val"] or files.roles["test"]]
    if not held:
        raise ConfigError(f"{where} (the run held no images out)")
    return [f"{cfg.path.rstrip('/')}/{n}" for n in held[:CHECK_IMAGES]]


def put(local: str, url: str) -> None:
    fs, path = filesystem(url)
    try:
        if isinstance(fs, LocalFileSystem):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        fs.put_file(local, path)
    except Exception as e:  # the stores' clients raise many types
        raise StorageError(f"cannot write {url}: {describe_storage_error(url, e)}") from None


def put_text(text: str, url: str) -> None:
    fs, path = filesystem(url)
    try:
        with fs.open(path, "w") as f:
            f.write(text)
    except Exception as e:  # the stores' clients raise many types
        raise StorageError(f"cannot write {url}: {describe_storage_error(url, e)}") from None
