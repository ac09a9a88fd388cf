"""The job's eager training loop against a bare eager step, on the Iris preset's step, measured in one run.

The bare step is the tutorials' loop and nothing else: zero_grad, forward, loss, backward, optimizer step, on the
Iris training split as one batch, on the same model and optimizer the job builds, on the threads the job takes for
it. The job's loop is `python -m job train --config iris` run in this process with an evaluation and a checkpoint at
its end only: its epochs are timed from the first one's start to the last one's end (job/run/train.py's
train_epoch, and what the run does between two epochs), so every cost the loop adds to a step is counted; the
evaluation and checkpoint after the last epoch are not. Rounds alternate the two, and the ratio of their medians is
printed (goal: at most 1.10).

    python bench/eager_overhead.py [--steps 2000] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import job.run.train  # noqa: E402
from job.config import load_config  # noqa: E402
from job.recipe import build as recipe  # noqa: E402
from job.recipe.plan import set_cpu_threads  # noqa: E402

GOAL = 1.10


def bare_step_s(cfg, steps: int) -> float:
    """Seconds a step of the bare loop takes, on the job's model, optimizer and training batch."""
    torch.manual_seed(cfg.seed)
    r = recipe.build(cfg, torch.device("cpu"), recipe.read_data(cfg))
    set_cpu_threads(cfg, r)  # as the run does: one thread for a step this small
    batch = next(iter(r.train.batches(0)))
    x, y, model, optimizer = batch.x, batch.y, r.model, r.optimizer
    for _ in range(20):  # the optimizer's first step imports what it needs; the allocator warms up
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return (time.perf_counter() - t0) / steps


def job_step_s(cfg, out: str) -> float:
    """Seconds a step of the job's loop takes: from the first epoch's start to the last epoch's end, per step."""
    marks: list[float] = []
    epoch_of_the_run = job.run.train.train_epoch

    def timed(loop, epoch):
        if not marks:
            marks.append(time.perf_counter())
        finished = epoch_of_the_run(loop, epoch)
        marks[1:] = [time.perf_counter()]
        return finished

    job.run.train.train_epoch = timed
    try:
        job.run.train.run(cfg, out, "cpu", "never", True)
    finally:
        job.run.train.train_epoch = epoch_of_the_run
    return (marks[1] - marks[0]) / cfg.train.epochs  # one full batch an epoch


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000, help="steps a round times, of each loop")
    p.add_argument("--rounds", type=int, default=5, help="rounds, the two loops alternating")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = p.parse_args(argv)
    n = args.steps
    sets = [f"train.epochs={n}", f"train.eval_every_epochs={n}", f"train.checkpoint_every_epochs={n}"]
    sets += [f"train.log_every_steps={min(200, n)}"]
    cfg = load_config("iris", sets)
    threads = torch.get_num_threads()
    bare, looped = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            looped.append(job_step_s(cfg, f"{tmp}/run{i}"))  # the run sets the threads a step of this size takes
            bare.append(bare_step_s(cfg, n))
            torch.set_num_threads(threads)
    result = {
        "steps": n,
        "rounds": args.rounds,
        "bare_step_us": round(statistics.median(bare) * 1e6, 1),
        "job_step_us": round(statistics.median(looped) * 1e6, 1),
        "ratio": round(statistics.median(looped) / statistics.median(bare), 3),
        "goal": GOAL,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"Iris step, {n} steps x {args.rounds} rounds, medians: bare eager {result['bare_step_us']} us, ", end="")
        print(f"the job's loop {result['job_step_us']} us a step: {result['ratio']:.3f} of the bare step (goal {GOAL})")
    return result


if __name__ == "__main__":
    main()
