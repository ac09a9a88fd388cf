"""Streaming shards against data held in memory, in the same run.

    python bench/stream.py SHARDS [--epochs 2]

SHARDS: a shard folder (`python -m job shard <cifar10 image folder> SHARDS`). Prints
  - the cifar10 recipe's steady-state epoch (the last epoch's wall time, test pass included) streamed from the
    shards, and decoded into host memory from the same shards, and their ratio (goal: at most 1.25); the two
    runs alternate `--repeat` times and the fastest of each counts, so a busy moment of the machine does not
    decide the ratio;
  - the peak resident memory of the whole process tree (the run and its decoding processes) streaming five
    shards for ten epochs, and fifty (the five, ten times over, listed in a second folder) for one: the same
    steps, ten times the data, and their ratio (goal: within a few percent).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from job.memory import peak_tree_rss  # noqa: E402


def train(shards: Path, out: Path, placement: str, epochs: int) -> tuple[float, int]:
    """(last epoch's seconds, peak memory of the process tree)."""
    args = ["--device", "cpu", "--config", "cifar10", "--output", str(out)]
    for item in ("data.kind=shards", f"data.placement={placement}", f"data.path={shards}", f"train.epochs={epochs}"):
        args += ["--set", item]
    proc = subprocess.Popen([sys.executable, "-m", "job", "train", *args], stderr=subprocess.PIPE, text=True)
    peak = peak_tree_rss(proc)
    if proc.wait() != 0:
        sys.exit(proc.stderr.read()[-2000:])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]["wall_s"] - records[-2]["wall_s"] if len(records) > 1 else records[-1]["wall_s"]
    return last, peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shards", type=Path)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        walls: dict[str, list[float]] = {"host": [], "stream": []}
        for i in range(a.repeat):
            for placement in walls:
                walls[placement].append(train(a.shards, work / f"{placement}{i}", placement, a.epochs)[0])
        memory, streamed = min(walls["host"]), min(walls["stream"])
        print(
            f"cifar10 recipe, last epoch (fastest of {a.repeat}): in memory {memory:.1f} s, streamed {streamed:.1f} s, "
            f"ratio {streamed / memory:.2f} (goal <= 1.25); all: {walls}"
        )
        peaks = {}
        first = sorted((a.shards / "train").glob("*.tar"))[:5]
        for times in (1, 10):
            folder = work / f"x{times}"
            shutil.copytree(a.shards / "test", folder / "test")
            (folder / "train").mkdir()
            for copy in range(times):
                for t in first:
                    os.link(t, folder / "train" / f"{copy}-{t.name}")
            _, peaks[times] = train(folder, work / f"run{times}", "stream", 10 // times)
        print(
            f"peak memory of the process tree, streaming {len(first)} shards for 10 epochs and 10x as many for 1: "
            f"{peaks[1] / 1e6:.0f} MB and {peaks[10] / 1e6:.0f} MB, ratio {peaks[10] / peaks[1]:.3f}"
        )


if __name__ == "__main__":
    main()
