"""bench/eager_overhead.py runs: the job's eager loop on the Iris step against the bare step, timed in one process.
Its numbers are the benchmark's (docs/benchmarks.md); here only that it measures both loops and prints their ratio."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_eager_overhead_benchmark_times_both_loops_and_prints_their_ratio():
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "eager_overhead.py"), "--steps", "40", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["steps"] == 40 and result["goal"] == 1.10
    assert 0 < result["bare_step_us"] < 1e5 and 0 < result["job_step_us"] < 1e5
    assert result["blocks"] == 1 and result["ratio"] == result["fastest_ratio"] > 0  # one pair: the same ratio
    assert "done: 40 epochs" in done.stderr  # the job's loop is a real run of the Iris preset
