"""The commands on a trained model, each calling job/use/: `evaluate`, `predict` and `export`."""

from __future__ import annotations

import json
import os
import sys

import typer

from job.cli.faults import user_errors
from job.cli.options import SET_HELP
from job.errors import ConfigError


def evaluate(
    checkpoint: str = typer.Option("", "--checkpoint", help="A run folder (its newest checkpoint), or a .pt file."),
    model: str = typer.Option("", "--model", "-m", help="As predict takes it: a run folder (model.pt), or a .pt."),
    data: str = typer.Option(
        "",
        "--data",
        help="Labelled images to score instead of the run's split: class folders, an archive, or a data format's.",
    ),
    config: str = typer.Option("", "--config", "-c", help="Config to evaluate with; default: the checkpoint's."),
    overrides: list[str] = typer.Option([], "--set", "-s", help=SET_HELP),
    device: str = typer.Option("auto", "--device", "-d", help="auto, cpu, cuda, cuda:N."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    report: str = typer.Option(
        "",
        "--report",
        help="Write the report (confusion, classes, worst) of each held-out split, or of --data, to DIR/<split>/.",
    ),
) -> None:
    """Loss and accuracy of a saved run, model or checkpoint: on its test split (val when it has none), or on any
    labelled images (--data) preprocessed as its evaluation was."""
    with user_errors():
        from job.use.evaluate import evaluate_checkpoint, evaluate_on

        if not (checkpoint or model):
            raise ConfigError("evaluate: name the model: --model URL (or --checkpoint URL)")
        if data:
            result = evaluate_on(model or checkpoint, data, device, report or None)
            result["checkpoint"], result["epoch"] = model or checkpoint, None
        else:
            url = checkpoint or chosen_weights(model)
            result = evaluate_checkpoint(url, config or None, overrides, device, report or None)
        if as_json:
            print(json.dumps(result))
        else:
            where = f": epoch {result['epoch']}, step {result['step']}" if result["epoch"] is not None else ""
            s = result["split"]
            metric = "map" if f"{s}_map" in result else "accuracy"  # multi-label: mean average precision
            print(
                f"{result['checkpoint']}{where}: {s}_loss {result[f'{s}_loss']:.4f}  "
                f"{s}_{metric} {result[f'{s}_{metric}']:.4f} ({result['samples']} {s} samples)"
            )


def predict(
    inputs: list[str] = typer.Argument(
        ...,
        metavar="INPUT",
        help="Images: files, folders (recursive), glob patterns, .tar/.tar.gz archives, folders of shards, "
        "the files of data formats that name or hold images (each row's image), at any URL; "
        "for a model of a table, tables.",
    ),
    model: str = typer.Option(..., "--model", "-m", help="A run folder, its model.pt, or a checkpoint, at any URL."),
    output: str = typer.Option("", "--output", "-o", help="A .csv or .jsonl file at any URL; default: CSV on stdout."),
    top_k: int = typer.Option(1, "--top-k", min=1, help="Labels and probabilities per image."),
    batch_size: int = typer.Option(64, "--batch-size", min=1, help="Images per batch."),
    device: str = typer.Option("auto", "--device", "-d", help="auto, cpu, cuda, cuda:N, mps."),
    nproc_per_node: int = typer.Option(
        1, "--nproc-per-node", min=1, help="Processes on this machine, each predicting its part (<output>.part-i-of-n)."
    ),
    decode: str = typer.Option(
        "auto",
        "--decode",
        metavar="auto|host|device",
        help="Where images are decoded: host (processes), or device: JPEG images by the CUDA device's nvJPEG, other "
        "formats on the host; auto: host.",
    ),
) -> None:
    """Labels and probabilities for new images from a trained model, preprocessed as its evaluation was; a file that
    cannot be read gets a row with its error (exit 3 when none could be read). In a Cloud Batch task array each task
    predicts its part (BATCH_TASK_INDEX of BATCH_TASK_COUNT) into <output>.part-<i>-of-<n>."""
    with user_errors():
        from job.use.parts import PART, part_device, spread

        if nproc_per_node > 1 and PART not in os.environ:
            if not output:  # said once here, not by each process
                raise ConfigError(
                    "--nproc-per-node: each process writes a part, <output>.part-<i>-of-<n>: give --output"
                )
            raise typer.Exit(spread(sys.argv[1:], nproc_per_node))
        from job.console import say
        from job.use.predict import predict as run_predict

        if decode not in ("auto", "host", "device"):
            raise ConfigError(f"--decode {decode}: expected auto, host or device")
        run_predict(model, inputs, output or None, top_k, batch_size, part_device(device), log=say, decode=decode)


def export(
    model: str = typer.Option(..., "--model", "-m", help="A run folder, its model.pt, or a checkpoint, at any URL."),
    fmt: str = typer.Option(..., "--format", "-f", help="onnx or pt2."),
    output: str = typer.Option("", "--output", "-o", help="The file to write; default: model.<format> in the run."),
    check_images: list[str] = typer.Option(
        [], "--check-images", help="Images to check the export on; default: the run's val (or test) images."
    ),
    track: bool = typer.Option(False, "--track", help="Send the export to the run's MLflow run (export/)."),
) -> None:
    """The model as an ONNX or torch.export (pt2) file, with its class names and preprocessing, run with its own
    runtime on real images and compared with the model before it is called done (<output>.check.json)."""
    with user_errors():
        from job.console import say
        from job.use.export import export as run_export

        check = run_export(model, fmt, output or None, check_images, log=say)
        if track:
            from job.errors import StorageError
            from job.sinks.track import send_export

            line, sent = send_export(model, [check["output"], f"{check['output']}.check.json"])
            if not sent:
                raise StorageError(f"{line}; python -m job track RUN sends it later")
            say(line)


def chosen_weights(url: str) -> str:
    """--model's run folder is its model.pt (the weights it chose), as predict reads it; anything else as given."""
    from job.storage.cloud import filesystem

    fs, path = filesystem(url)
    beside = f"{path.rstrip('/')}/model.pt"
    return f"{url.rstrip('/')}/model.pt" if fs.isdir(path) and fs.exists(beside) else url
