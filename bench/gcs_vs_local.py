"""The same training run with its outputs on local disk and on gs:// (a GCS emulator on loopback, optionally
behind a proxy that adds latency or fails a share of requests): wall time of each and the ratio.

    python bench/gcs_vs_local.py [--repeats 3] [--delay 0.05] [--fail-rate 0] [-- extra train args]

The defaults run the CIFAR-10 recipe on generated CIFAR-10 batches (2,000 images, 3 epochs, a checkpoint and
TensorBoard events every epoch), so that uploads happen while the loop runs. Needs gcp-storage-emulator
(requirements-test.txt).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # before gcsfs is imported; see job/storage/cloud.py
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import fsspec  # noqa: E402
from conftest import free_port, start_emulator, write_cifar_batches  # noqa: E402
from faultproxy import FaultProxy  # noqa: E402


def emulator(bucket: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = start_emulator(port, bucket, subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1).read()
            return proc, url
        except OSError:
            time.sleep(0.1)
    raise SystemExit("the GCS emulator did not start")


def timed_run(args: list[str], output: str, env: dict) -> tuple[float, float]:
    """(wall seconds of the whole process, seconds from start to the end of the last evaluation)."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "job", "train", *args, "--output", output], env=env, capture_output=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"run to {output} failed ({r.returncode}): {r.stderr.decode()[-1500:]}")
    with (
        fsspec.open(f"{output}/metrics.jsonl", "r", token="anon")
        if "://" in output
        else open(f"{output}/metrics.jsonl") as f
    ):
        records = [json.loads(line) for line in f if line.strip()]
    if os.environ.get("BENCH_VERBOSE"):
        print(output, [r["wall_s"] for r in records], file=sys.stderr)
    return wall, records[-1]["wall_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--delay", type=float, default=0.05, help="seconds added to every request to the store")
    p.add_argument("--fail-rate", type=float, default=0.0, help="share of requests answered 503 or reset")
    p.add_argument("train_args", nargs="*", help="after --: arguments of `python -m job train`")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-gcs-"))
    data = write_cifar_batches(work / "cifar-10-batches-py", n_train=2000, n_test=500)
    train_args = a.train_args or [
        "--config",
        "cifar10",
        "--device",
        "cpu",
        "--set",
        f"data.path={data}",
        "--set",
        "train.epochs=3",
        "--set",
        "train.log_every_steps=5",
    ]
    server, url = emulator("bench")
    kinds = ("delay",) if a.fail_rate == 0 else ("503", "reset", "delay")
    rate = 1.0 if a.fail_rate == 0 and a.delay > 0 else a.fail_rate
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "JOB_CACHE_DIR": str(work / "cache"),
    }
    local, remote = [], []
    try:
        with FaultProxy(url, fail_rate=rate, kinds=kinds, delay_s=a.delay) as proxy:
            env["STORAGE_EMULATOR_HOST"] = os.environ["STORAGE_EMULATOR_HOST"] = proxy.url  # here too, to read back
            for i in range(a.repeats):  # alternate, so drift on a shared machine hits both alike
                local.append(timed_run(train_args, str(work / f"local-{i}"), env))
                remote.append(timed_run(train_args, f"gs://bench/run-{i}", env))
            requests = proxy.counts["requests"]
    finally:
        server.terminate()
        shutil.rmtree(work, ignore_errors=True)
    lm, rm = statistics.median(t for t, _ in local), statistics.median(t for t, _ in remote)
    ll, rl = statistics.median(t for _, t in local), statistics.median(t for _, t in remote)
    print(f"store: GCS emulator on loopback, {a.delay * 1000:.0f} ms added per request, fail rate {a.fail_rate:.0%}")
    print(f"train args: {' '.join(train_args)}")
    print("| outputs | whole process, s (each) | median | start to last evaluation, s (each) | median |")
    print("| --- | --- | --- | --- | --- |")
    for name, runs, whole, loop in (("local disk", local, lm, ll), ("gs://", remote, rm, rl)):
        each = " / ".join(f"{t:.2f}" for t, _ in runs), " / ".join(f"{t:.2f}" for _, t in runs)
        print(f"| {name} | {each[0]} | {whole:.2f} | {each[1]} | {loop:.2f} |")
    print(f"ratio gs:// / local: whole process {rm / lm:.3f}, training {rl / ll:.3f}")
    print(f"({requests} requests to the store over {a.repeats} runs)")


if __name__ == "__main__":
    main()
