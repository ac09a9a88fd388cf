"""The machine: `info` (the device report, job/group/env.py) and `bench` (the tutorials' loop against the job's,
job/bench/)."""

from __future__ import annotations

import json

import typer

from job.cli.faults import user_errors
from job.cli.options import CONFIG_HELP, SET_HELP


def info(as_json: bool = typer.Option(False, "--json", help="Print the report as JSON.")) -> None:
    """The machine as training sees it: torch, CUDA, cuDNN, GPUs and their memory, CPU cores, /dev/shm, and the
    platform and group its variables describe (Slurm, Kubeflow, Vertex AI, ...)."""
    from job.group.env import format_info
    from job.group.env import info as gather

    report = gather()
    print(json.dumps(report, indent=1) if as_json else format_info(report))


def bench(
    config: str = typer.Option("iris", "--config", "-c", help=CONFIG_HELP),
    overrides: list[str] = typer.Option([], "--set", "-s", help=SET_HELP),
    devices: str = typer.Option("", "--devices", help="Comma list, e.g. cpu,cuda; default: cpu, and cuda if present."),
    epochs: int = typer.Option(0, "--epochs", min=0, help="Train this many epochs in both loops; 0: the config's."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
) -> None:
    """The recipe trained by the tutorials' naive loop and by this job, on each device: s/epoch, samples/s,
    test accuracy and the speed-ups."""
    with user_errors():
        from job.bench.compare import bench as measure
        from job.bench.compare import format_table, parse_devices
        from job.config import load_config

        cfg = load_config(config, [*overrides, *([f"train.epochs={epochs}"] if epochs else [])])
        result = measure(cfg, parse_devices(devices))
        print(json.dumps(result, indent=1) if as_json else format_table(result))
