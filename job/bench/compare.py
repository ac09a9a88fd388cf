"""`python -m job bench`: one recipe trained by the tutorials' naive loop (job/bench/naive.py) and by the job's own
loop, on each device asked for, measured in one process: seconds per epoch, samples/s, test accuracy and
the speed-ups between them."""

from __future__ import annotations

import contextlib
import os
import platform
import tempfile
import time

import torch

from job.bench.naive import check_tutorial_recipe, train_naive
from job.config import Config
from job.console import say
from job.errors import ConfigError, Interrupted
from job.group.env import cpu_model, pick_device
from job.recipe.build import read_data


def parse_devices(text: str) -> list[torch.device]:
    """`cpu,cuda` as devices, each checked to exist here; empty: the CPU, plus CUDA when there is a GPU."""
    names = [n.strip() for n in text.split(",") if n.strip()] or default_devices()
    devices: list[torch.device] = []
    for name in names:
        try:
            device = pick_device(name)
        except ConfigError as e:  # its message names --device; say which list entry failed
            raise ConfigError(f"--devices {name}: {str(e).partition(': ')[2]}") from None
        if device not in devices:
            devices.append(device)
    return devices


def default_devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def bench(cfg: Config, devices: list[torch.device]) -> dict:
    """Train the recipe with the naive loop, then with the job, on each device in turn; returns the machine,
    the recipe and one row per (device, loop) with its timings, accuracy and speed-ups."""
    data = read_data(cfg)
    check_tutorial_recipe(cfg, data)
    n = data.samples("train")
    batch = n if cfg.data.batch_size == "full" else min(cfg.data.batch_size, n)
    per_epoch = n // batch * batch if cfg.data.drop_last else n
    rows = []
    for device in devices:
        say(f"bench: the naive loop on {device}, {cfg.train.epochs} epochs")
        with kept_torch_settings():
            naive = train_naive(cfg, data, device)
        rows.append(row("naive", device, naive, per_epoch, naive["precision"]))
        say(f"bench: the job on {device}, {cfg.train.epochs} epochs")
        with kept_torch_settings():
            job = train_job(cfg, device)
        rows.append(row("job", device, job, per_epoch, naive["precision"]))  # both decide it alike
    cpu_naive = next((r for r in rows if r["loop"] == "naive" and r["device"] == "cpu"), None)
    for r in rows:
        same = next(n for n in rows if n["loop"] == "naive" and n["device"] == r["device"])
        r["speedup_vs_naive"] = same["seconds_per_epoch"] / r["seconds_per_epoch"]
        r["speedup_vs_naive_cpu"] = cpu_naive["seconds_per_epoch"] / r["seconds_per_epoch"] if cpu_naive else None
    steps_per_epoch = -(-per_epoch // batch)
    recipe = {
        "steps": cfg.train.epochs * steps_per_epoch,
        "name": cfg.name,
        "model": cfg.model.name,
        "data": data.describe(),
        "batch_size": batch,
        "epochs": cfg.train.epochs,
        "precision": cfg.train.precision,
    }
    return {"machine": machine(devices), "recipe": recipe, "rows": rows}


def train_job(cfg: Config, device: torch.device) -> dict:
    """The job's own run of the recipe (data loading, evaluations, checkpoints and all) into a temporary
    folder that is deleted afterwards; returns its summary."""
    from job.run.train import run

    cfg = cfg.model_copy(deep=True)
    cfg.output.staged = False  # a local scratch folder: nothing to copy anywhere
    with tempfile.TemporaryDirectory(prefix="job-bench-") as scratch:
        try:
            return run(cfg, f"{scratch}/run", str(device), resume="never")
        except Interrupted:
            raise Interrupted("bench: stopped by a signal during the job's run; nothing to continue") from None


@contextlib.contextmanager
def kept_torch_settings():
    """Restore the process-wide settings a run may change (threads, cuDNN autotuning), so that one loop's
    choices do not speed up or slow down the next."""
    threads, benchmark = torch.get_num_threads(), torch.backends.cudnn.benchmark
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.backends.cudnn.benchmark = benchmark


def row(loop: str, device: torch.device, result: dict, per_epoch: int, precision: str) -> dict:
    seconds, epochs = result["train_seconds"], result["epochs_run"]
    return {
        "loop": loop,
        "device": str(device),
        "precision": precision,  # what the recipe's setting (auto, say) came to on this device
        "epochs": epochs,
        "train_seconds": round(seconds, 4),
        "seconds_per_epoch": seconds / epochs,
        "samples_per_s": per_epoch * epochs / max(seconds, 1e-9),
        "test_accuracy": result["final_accuracy"],
    }


def machine(devices: list[torch.device]) -> dict:
    """What the numbers were measured on."""
    gpus = sorted({torch.cuda.get_device_name(d) for d in devices if d.type == "cuda"})
    return {
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpus": gpus,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }


FEW_STEPS = 500  # below this, a run's one-time costs are a large share of its time

COLUMNS = ("device", "loop", "precision", "s/epoch", "samples/s", "test acc", "vs naive", "vs naive cpu")


def format_table(result: dict) -> str:
    """The machine, the recipe, then one aligned row per (device, loop)."""
    m, r = result["machine"], result["recipe"]
    gpus = ", ".join(m["gpus"]) or "none used"
    lines = [
        f"machine: {m['cpu']}, {m['cpu_cores']} cores ({m['torch_threads']} torch threads); GPU: {gpus}; "
        f"torch {m['torch']}, python {m['python']}; {m['date']}",
        f"recipe: {r['name']}: model {r['model']} on {r['data']}; batch {r['batch_size']}, {r['epochs']} epochs, "
        f"precision {r['precision']}",
        "",
    ]
    cells = [COLUMNS]
    for row in result["rows"]:
        cpu = row["speedup_vs_naive_cpu"]
        cells.append(
            (
                row["device"],
                row["loop"],
                row["precision"],
                f"{row['seconds_per_epoch']:.4g}",
                f"{row['samples_per_s']:,.0f}",
                f"{row['test_accuracy']:.2%}",
                f"{row['speedup_vs_naive']:.2f}x",
                f"{cpu:.2f}x" if cpu is not None else "-",
            )
        )
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    for c in cells:
        lines.append("  ".join(v.ljust(w) if i < 3 else v.rjust(w) for i, (v, w) in enumerate(zip(c, widths))))
    if r["steps"] < FEW_STEPS:
        lines += [
            "",
            f"note: {r['steps']} steps are few: the job's one-time costs (tracing or capturing its step, cuDNN's "
            f"autotuning) weigh on its s/epoch here; use --epochs for at least {FEW_STEPS} steps to compare speeds",
        ]
    lines += [
        "",
        "s/epoch: seconds in training epochs (test passes excluded) per epoch; vs naive: the naive loop's s/epoch "
        "on the same device over this row's (higher is faster)",
    ]
    return "\n".join(lines)
