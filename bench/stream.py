"""Streaming shards (or parquet) against data held in memory, in the same run.

    python bench/stream.py SHARDS [--epochs 2]
    python bench/stream.py --parquet DIR [--epochs 2]

SHARDS: a shard folder (`python -m job shard <cifar10 image folder> SHARDS`). DIR: the same images as parquet (a
.parquet file, a folder of them, or the hub's data/<split>-*.parquet layout, e.g. written by the `datasets` package),
32x32 RGB pictures as the cifar10 recipe takes them. Prints, for SHARDS
  - the cifar10 recipe's steady-state epoch (the last epoch's wall time, test pass included) streamed from the
    shards, and decoded into host memory from the same shards, and their ratio (goal: at most 1.25); the two
    runs alternate `--repeat` times and the fastest of each counts, so a busy moment of the machine does not
    decide the ratio;
  - the peak resident memory of the whole process tree (the run and its decoding processes) streaming five
    shards for ten epochs, and fifty (the five, ten times over, listed in a second folder) for one: the same
    steps, ten times the data, and their ratio (goal: within a few percent);
and for DIR, the recipe's steady-state epoch streamed from local disk (data.placement=stream: the rows packed into
shards in a cache of this bench's own, once, before the first epoch; CIFAR's 32x32 pictures kept decoded there, as
any images of at most 64x64 pixels are) and held in memory from the same files, and
their ratio (goal: at most 1.10), the runs alternating `--repeat` times, the fastest of each counting.
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

from job.group.memory import peak_tree_rss  # noqa: E402


def train(
    data: Path, out: Path, placement: str, epochs: int, kind: str = "shards", env: dict | None = None
) -> tuple[float, int]:
    """(last epoch's seconds, peak memory of the process tree)."""
    args = ["--device", "cpu", "--config", "cifar10", "--output", str(out)]
    for item in (f"data.kind={kind}", f"data.placement={placement}", f"data.path={data}", f"train.epochs={epochs}"):
        args += ["--set", item]
    run = [sys.executable, "-m", "job", "train", *args]
    proc = subprocess.Popen(run, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    peak = peak_tree_rss(proc)
    if proc.wait() != 0:
        sys.exit(proc.stderr.read()[-2000:])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]["wall_s"] - records[-2]["wall_s"] if len(records) > 1 else records[-1]["wall_s"]
    return last, peak


def parquet_ratio(parquet: Path, work: Path, epochs: int, repeat: int) -> None:
    """The parquet goal: an epoch streamed from local disk within 1.10x of the same rows held in memory."""
    env = {"JOB_CACHE_DIR": str(work / "cache")}  # the pack is made once, by the first streamed run, and kept
    walls: dict[str, list[float]] = {"host": [], "stream": []}
    for i in range(repeat):
        for placement in walls:
            out = work / f"parquet-{placement}{i}"
            walls[placement].append(train(parquet, out, placement, epochs, "parquet", env)[0])
    memory, streamed = min(walls["host"]), min(walls["stream"])
    print(
        f"cifar10 recipe on parquet, last epoch (fastest of {repeat}): in memory {memory:.1f} s, streamed from local "
        f"disk {streamed:.1f} s, ratio {streamed / memory:.2f} (goal <= 1.10); all: {walls}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shards", type=Path, nargs="?")
    ap.add_argument("--parquet", type=Path, help="the same images as parquet: the parquet case alone")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    if (a.shards is None) == (a.parquet is None):
        ap.error("give SHARDS or --parquet DIR")
    if a.parquet is not None:
        with tempfile.TemporaryDirectory() as tmp:
            parquet_ratio(a.parquet, Path(tmp), a.epochs, a.repeat)
        return
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
