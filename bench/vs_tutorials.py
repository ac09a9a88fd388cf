"""The job against the tutorials' own loops (the baseline scripts seed_iris.py and seed_cifar.py), on the same
machine in the same run, interleaved, as whole processes and per training epoch.

    python bench/vs_tutorials.py --baselines ../shared/baselines [--device cpu|cuda] [--repeats 3]
        [--cifar-python DIR --cifar-pt DIR] [--cifar-epochs 1]

Iris: the iris preset (20,000 full-batch epochs) against `seed_iris.py DEVICE every200`, wall time of each whole
process and its CPU seconds (user + system, which a busy machine's waiting does not swell). CIFAR-10 (when both data
folders are given: CIFAR-10's python-version folder for the job, the folder prep_cifar.py writes for the seed
script): the cifar10 preset against `seed_cifar.py`, seconds per training epoch (the job's from its own clock, which
leaves out evaluation and checkpoints; the seed's from its output) and whole processes (wall and CPU), and both
programs' final test accuracy. Prints medians and ratios job/seed (lower is better), and the accuracy difference in
points. On a CPU with AMX the job's epoch is also timed with `train.precision=auto` (bf16 autocast there; the preset
computes in fp32, as the seed does), on its own row.

Start-up (with --device cpu): the CPU seconds of a 1-epoch Iris run over those of `python -c "import torch"`, and
over `import torch` plus making an SGD optimizer, which every training script pays (torch.optim imports torch._dynamo
on first use: over a second of CPU; the job's own optimizers do not, so this one is below zero). The last line puts
the ratios and the start-up overhead together.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The job in a fresh process, as `python -m job train` runs it, printing the run's summary as JSON.
JOB = (
    "import json, sys; from job.config import load_config; from job.run.train import run; "
    "cfg = load_config(sys.argv[1], sys.argv[4:]); print(json.dumps(run(cfg, sys.argv[2], sys.argv[3], 'never', True)))"
)


TORCH_ALONE = "import torch"
TORCH_AND_OPTIMIZER = "import torch; torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)"


def measured(cmd: list[str]) -> tuple[float, float, str]:
    """Wall seconds, CPU seconds (user + system of the process and its children) and the last line of its output."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = r.stdout.strip().splitlines()
    return seconds, cpu, lines[-1] if lines else ""


def startup(py: str, out: Path, repeats: int) -> tuple[float, float]:
    """The median CPU seconds of a 1-epoch Iris run over `import torch`, and over `import torch` and an optimizer;
    the three programs interleaved."""
    over_torch, over_optimizer = [], []
    for i in range(repeats):
        cli = [py, "-m", "job", "train", "--config", "iris", "--device", "cpu", "--set", "train.epochs=1"]
        job = measured([*cli, "--output", str(out / f"iris-1-epoch{i}")])[1]
        over_torch.append(job - measured([py, "-c", TORCH_ALONE])[1])
        over_optimizer.append(job - measured([py, "-c", TORCH_AND_OPTIMIZER])[1])
    return statistics.median(over_torch), statistics.median(over_optimizer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baselines", type=Path, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cifar-python", type=Path)
    ap.add_argument("--cifar-pt", type=Path)
    ap.add_argument("--cifar-epochs", type=int, default=1)
    args = ap.parse_args()
    py, out = sys.executable, Path(tempfile.mkdtemp(prefix="vs-tutorials-"))
    rows = []

    job_s, seed_s, job_cpu, seed_cpu = [], [], [], []
    for i in range(args.repeats):
        cli = [py, "-m", "job", "train", "--config", "iris", "--device", args.device, "--output", str(out / f"iris{i}")]
        seed = [py, str(args.baselines / "seed_iris.py"), args.device, "every200"]
        for seconds, cpu, cmd in ((job_s, job_cpu, cli), (seed_s, seed_cpu, seed)):
            wall, used, _ = measured(cmd)
            seconds.append(wall)
            cpu.append(used)
    rows.append(("iris, whole process", job_s, seed_s))
    rows.append(("iris, whole process, CPU s", job_cpu, seed_cpu))
    # On the CPU only: a GPU session's minutes are scarce (bench/gpu_check.sh), and start-up is the same there.
    over = startup(py, out, args.repeats) if args.device == "cpu" else None

    if args.cifar_python and args.cifar_pt:
        epochs = args.cifar_epochs
        job_epoch, seed_epoch, job_s, seed_s, job_acc, seed_acc = [], [], [], [], [], []
        job_cpu, seed_cpu = [], []
        for i in range(args.repeats if args.device != "cpu" else 1):
            sets = [f"data.path={args.cifar_python}", f"train.epochs={epochs}"]
            s, cpu, line = measured([py, "-c", JOB, "cifar10", str(out / f"cifar{i}"), args.device, *sets])
            summary = json.loads(line)
            job_s.append(s)
            job_cpu.append(cpu)
            job_epoch.append(summary["train_seconds"] / summary["epochs_run"])
            job_acc.append(summary["final_accuracy"])
            s, cpu, line = measured(
                [py, str(args.baselines / "seed_cifar.py"), str(args.cifar_pt), str(epochs), args.device, str(out)]
            )
            seed_s.append(s)
            seed_cpu.append(cpu)
            seed_epoch.append(statistics.median(json.loads(line)["train_epoch_s"]))
            seed_acc.append(json.loads(line)["test_acc"][-1])
        rows.append(("cifar10, seconds per training epoch", job_epoch, seed_epoch))
        from job.recipe.plan import cpu_computes_bf16

        if args.device == "cpu" and cpu_computes_bf16():  # precision auto would be bf16 here: timed on its own row
            sets = [f"data.path={args.cifar_python}", f"train.epochs={epochs}", "train.precision=auto"]
            summary = json.loads(measured([py, "-c", JOB, "cifar10", str(out / "cifar-auto"), "cpu", *sets])[2])
            rows.append(("cifar10 bf16 (auto), s per epoch", [summary["train_seconds"] / epochs], seed_epoch[:1]))
        rows.append((f"cifar10 {epochs} epoch(s), whole process", job_s, seed_s))
        rows.append((f"cifar10 {epochs} epoch(s), whole process, CPU s", job_cpu, seed_cpu))
        accuracy = (f"cifar10 test accuracy after {epochs} epoch(s)", job_acc, seed_acc)

    import torch

    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{os.cpu_count()}-core CPU"
    print(f"{where}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, {args.repeats} repeat(s)")
    print(f"{'what':40s} {'job s':>9s} {'seed s':>9s} {'job/seed':>9s}")
    for what, job, seed in rows:
        ratios = [j / s for j, s in zip(job, seed)]
        print(
            f"{what:40s} {statistics.median(job):9.3f} {statistics.median(seed):9.3f} {statistics.median(ratios):9.2f}"
        )
    if args.cifar_python and args.cifar_pt:  # the same recipe must reach the same accuracy: a difference, in points
        what, job, seed = accuracy
        print(f"{what:40s} {statistics.median(job):9.4f} {statistics.median(seed):9.4f} ", end="")
        print(f"{100 * (statistics.median(job) - statistics.median(seed)):+8.1f} pt")
    ratio = {what: statistics.median(j / s for j, s in zip(job, seed)) for what, job, seed in rows}
    cifar = ratio.get("cifar10, seconds per training epoch")
    print(
        f"iris job/seed {ratio['iris, whole process']:.2f}"
        + (f"; cifar10 epoch job/seed {cifar:.2f}" if cifar is not None else "")
        + (
            f"; start-up of a 1-epoch Iris run over `import torch` {over[0]:.2f} s CPU"
            f" (over `import torch` and an optimizer {over[1]:.2f} s)"
            if over is not None
            else ""
        )
    )


if __name__ == "__main__":
    main()
