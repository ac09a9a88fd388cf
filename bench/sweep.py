"""What a sweep costs over its runs: a study of N short iris trials run by one `job sweep` worker, against the same
N runs (the trials' own config.yaml files) launched one by one as `job train`, on one machine in one run.

    python bench/sweep.py [--trials 8] [--epochs 2000]

Prints both wall times and their ratio (goal: at most 1.05): the sweep's bookkeeping (the study in SQLite, the
heartbeat, the results) against what its trials' runs cost on their own.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--device", "cpu", "--config", "iris", "--set", "data.val_split=0.2"]


def timed(argv: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "job", *argv], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"failed: job {' '.join(argv)}\n{r.stderr[-2000:]}")
    return time.perf_counter() - t0


def write_space(path: Path, trials: int) -> None:
    """The benches' study: TPE (seed 0) on the Iris run's learning rate and momentum, best val accuracy."""
    space = {
        "metric": "val_accuracy",
        "direction": "maximize",
        "trials": trials,
        "sampler": {"name": "tpe", "seed": 0},
        "space": {"optim.lr": {"low": 0.01, "high": 1.0, "log": True}, "optim.momentum": {"low": 0.0, "high": 0.9}},
    }
    path.write_text(yaml.safe_dump(space))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=2000)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-sweep-"))
    write_space(tmp / "space.yaml", args.trials)
    epochs = ["--set", f"train.epochs={args.epochs}"]
    sweep_s = timed(["sweep", str(tmp / "space.yaml"), "--output", str(tmp / "S"), *COMMON, *epochs])
    configs = sorted((tmp / "S" / "trials").glob("*/config.yaml"), key=lambda p: int(p.parent.name))
    runs_s = sum(
        timed(["train", "--device", "cpu", "--config", str(c), "--output", str(tmp / f"run-{c.parent.name}")])
        for c in configs
    )
    print(f"{os.cpu_count()}-core CPU, {time.strftime('%Y-%m-%d')}, {len(configs)} iris trials of {args.epochs} epochs")
    print(f"one sweep worker {sweep_s:8.2f} s; the same runs one by one {runs_s:8.2f} s; ratio {sweep_s / runs_s:.3f}")


if __name__ == "__main__":
    main()
