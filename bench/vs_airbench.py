"""The cifar10-fast preset against airbench94, the CIFAR-10 speed record, on the same pixels, the same GPU, in the
same run, runs interleaved.

    python bench/vs_airbench.py --baselines DIR --airbench DIR --cifar-python DIR --cifar-pt DIR [--runs 3]

--airbench: a folder holding the `airbench` package (PyPI's airbench 0.1.8 unpacked); --cifar-pt: the folder
prep_cifar.py writes (train.pt, test.pt), which airbench reads; --cifar-python: the same images in CIFAR-10's
python layout (acceptance/lib/cifar_fixture.py), which the job reads. airbench reports its own training time
(whitening, the epochs and its final test-time-augmented evaluation, timed with CUDA events, after a warm-up run);
the job's is the same stretch by its own clock, CUDA events too: its training epochs and its one test pass at the
end (train.eval_every_epochs=10; its whitening, a few milliseconds done while the run is set up, and its
checkpoints are left out). Both whole processes are timed too (airbench's includes its warm-up run). Prints each
run, then medians, the job/airbench time ratio (lower is better) and the accuracy difference in points.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vs_tutorials import JOB

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], cwd: Path | None = None, pythonpath: str = "") -> tuple[float, str, str]:
    paths = [pythonpath, str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)
    seconds = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return seconds, r.stdout, r.stderr


def airbench_once(args: argparse.Namespace, work: Path) -> dict:
    """One airbench94 run (after its warm-up run), in its own process: accuracy with TTA and its own timing."""
    seconds, out, _ = run([sys.executable, str(args.baselines / "airbench_run.py"), "1"], work, str(args.airbench))
    # Its table's columns: run, epoch, train_loss, train_acc, val_acc, tta_val_acc, total_time_seconds.
    rows = [cells for line in out.splitlines() if len(cells := [c.strip() for c in line.split("|")[1:-1]]) == 7]
    final = [cells for cells in rows if cells[1] == "eval"]
    if not final:
        sys.exit(f"airbench printed no final row:\n{out[-2000:]}")
    return {"accuracy": float(final[-1][5]), "seconds": float(final[-1][6]), "process": seconds}


def job_once(args: argparse.Namespace, out: Path) -> dict:
    """One cifar10-fast run of the job in a fresh process, as `python -m job train` runs it: its accuracy, and the
    time of its training epochs and its test pass (its own clock)."""
    sets = [f"data.path={args.cifar_python}", "train.eval_every_epochs=10"]
    cmd = [sys.executable, "-c", JOB, "cifar10-fast", str(out), "cuda", *sets]
    seconds, stdout, stderr = run(cmd)
    summary = json.loads(stdout.strip().splitlines()[-1])
    return {
        "accuracy": summary["final_accuracy"],
        "seconds": summary["train_seconds"] + summary["test_seconds"],
        "epochs": summary.get("epoch_seconds"),  # the first holds the set-up paid inside it
        "process": seconds,
        "step": next((line for line in stderr.splitlines() if line.startswith("step:")), ""),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baselines", type=Path, required=True)
    ap.add_argument("--airbench", type=Path, required=True)
    ap.add_argument("--cifar-python", type=Path, required=True)
    ap.add_argument("--cifar-pt", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vs-airbench-"))
    (work / "cifar10").symlink_to(args.cifar_pt.resolve())  # airbench reads ./cifar10/{train,test}.pt
    ours, theirs = [], []
    for i in range(args.runs):
        theirs.append(airbench_once(args, work))
        ours.append(job_once(args, work / f"run{i}"))
        print(f"run {i}: airbench {theirs[-1]}; job {ours[-1]}", flush=True)

    import torch

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, {args.runs} runs")
    print(ours[0]["step"])
    print(f"{'what':36s} {'job':>9s} {'airbench':>9s} {'job/air':>9s}")
    for key, what in (("seconds", "training and final test, s"), ("process", "whole process, s")):
        j, a = [r[key] for r in ours], [r[key] for r in theirs]
        ratio = statistics.median(x / y for x, y in zip(j, a))
        print(f"{what:36s} {statistics.median(j):9.3f} {statistics.median(a):9.3f} {ratio:9.2f}")
    j, a = [r["accuracy"] for r in ours], [r["accuracy"] for r in theirs]
    print(f"{'test accuracy with TTA (median)':36s} {statistics.median(j):9.4f} {statistics.median(a):9.4f} ", end="")
    print(f"{100 * (statistics.median(j) - statistics.median(a)):+8.2f} pt")
    print(f"{'test accuracy, each run':36s} {' '.join(f'{x:.4f}' for x in j)} | {' '.join(f'{x:.4f}' for x in a)}")


if __name__ == "__main__":
    main()
