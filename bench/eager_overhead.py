"""The job's eager training loop against a bare eager step, on the Iris preset's step, measured in one run.

The job's loop is `python -m job train --config iris` run in this process, with an evaluation and a checkpoint at
its end only: its epochs (one full batch each) are timed in blocks of BLOCK, from one block's first epoch's start to
the next block's (job/run/train.py's train_epoch, and what the run does between two epochs), so every cost the loop
adds to a step is counted. Before each block, BLOCK steps of the bare loop are timed: the tutorials' step and
nothing else (zero_grad, forward, loss, backward, optimizer step) on a copy of the run's model made at its start
and trained alongside, with an optimizer of the same settings, on the run's batch, on the threads the run takes.

Each block of the job's loop is set against the bare block just before it, as a machine shared with other work
changes speed from one second to the next, and the median of those ratios is the ratio printed (goal: at most
1.10). Each loop's fastest block is printed beside it (timeit's way: a block is slowed by other work, never sped
up); their ratio swings more, as the two fastest blocks need not come from the same quiet second.

    python bench/eager_overhead.py [--steps 2000] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.nn.functional as F  # noqa: E402

import job.run.train  # noqa: E402
from job.config import load_config  # noqa: E402
from job.recipe.optimizer import make_optimizer  # noqa: E402

GOAL = 1.10
BLOCK = 20  # steps of each loop in a block


class Paired:
    """Wraps the run's train_epoch: times its epochs in blocks, and a block of the bare loop before each."""

    def __init__(self, train_epoch) -> None:
        self.train_epoch, self.bare = train_epoch, None
        self.bare_s: list[float] = []  # seconds a step, per block
        self.job_s: list[float] = []
        self.started: float | None = None

    def __call__(self, loop, epoch: int) -> bool:
        now = time.perf_counter()
        if epoch % BLOCK == 0:
            if self.started is not None:
                self.job_s.append((now - self.started) / BLOCK)
            self.bare_s.append(self.bare_block(loop))
            self.started = time.perf_counter()
        return self.train_epoch(loop, epoch)

    def bare_block(self, loop) -> float:
        """Seconds a step of BLOCK bare steps, on a copy of the run's model made at its start, trained alongside (the
        run's own state is not touched)."""
        if self.bare is None:
            model = copy.deepcopy(loop.r.model)
            batch = next(iter(loop.r.train.batches(0)))
            self.bare = model, make_optimizer(loop.cfg, model), batch.x, batch.y
        model, optimizer, x, y = self.bare
        t0 = time.perf_counter()
        for _ in range(BLOCK):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        return (time.perf_counter() - t0) / BLOCK


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000, help="the run's steps (Iris: one an epoch)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = p.parse_args(argv)
    n = args.steps
    sets = [f"train.epochs={n}", f"train.eval_every_epochs={n}", f"train.checkpoint_every_epochs={n}"]
    cfg = load_config("iris", sets)
    paired = Paired(job.run.train.train_epoch)
    job.run.train.train_epoch = paired
    try:
        with tempfile.TemporaryDirectory() as tmp:
            job.run.train.run(cfg, f"{tmp}/run", "cpu", "never", True)
    finally:
        job.run.train.train_epoch = paired.train_epoch
    pairs = list(zip(paired.job_s, paired.bare_s))
    ratios = [j / b for j, b in pairs]
    looped, bare = min(j for j, _ in pairs), min(b for _, b in pairs)
    result = {
        "steps": n,
        "blocks": len(pairs),
        "ratio": round(statistics.median(ratios), 3),
        "bare_step_us": round(bare * 1e6, 1),
        "job_step_us": round(looped * 1e6, 1),
        "fastest_ratio": round(looped / bare, 3),
        "goal": GOAL,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"Iris step, {n} steps in {len(pairs)} blocks of {BLOCK}, each after {BLOCK} bare steps: the job's loop / "
            f"the bare step {result['ratio']:.3f}, the pairs' median (goal: at most {GOAL}); fastest blocks: bare "
            f"eager {result['bare_step_us']} us a step, the job's loop {result['job_step_us']} us "
            f"({result['fastest_ratio']:.3f})"
        )
    return result


if __name__ == "__main__":
    main()
