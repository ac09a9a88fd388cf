"""What MLflow tracking costs a run: the cifar10 preset's CPU epoch untracked, tracked in a live MLflow server, and
tracked with the server down for the whole run, interleaved in one run on one machine.

    python bench/tracking.py --data DIR [--repeats 2] [--epochs 1]

DIR is CIFAR-10's python-version folder (cifar-10-batches-py). The server is started here (`python -m mlflow server`,
SQLite backend, on 127.0.0.1) at the lowest priority: it stands for a server on another machine, and its own CPU
(0.4-0.9 s a tracked run, measured here) is not the run's to pay on a 2-core machine. "Down" points the run at a port
nothing listens on. Prints the medians of seconds per training epoch (the job's own clock) and of whole processes,
and the ratios tracked/untracked (goal: at most 1.02).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = (
    "import json, sys; from job.config import load_config; from job.run.train import run; "
    "cfg = load_config(sys.argv[1], sys.argv[3:]); print(json.dumps(run(cfg, sys.argv[2], 'cpu', 'never', True)))"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server(root: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = ["--backend-store-uri", f"sqlite:///{root}/mlflow.db", "--artifacts-destination", str(root / "art")]
    args += ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    log = open(root / "server.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        ["nice", "-n", "19", sys.executable, "-m", "mlflow", "server", *args],
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return proc, url
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.5)
    sys.exit(f"the MLflow server did not start: {(root / 'server.log').read_text()[-500:]}")


def epoch(out: Path, data: Path, epochs: int, uri: str) -> tuple[float, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    sets = [f"data.path={data}", f"train.epochs={epochs}", "track.experiment=bench"]
    sets += [f"track.mlflow={uri}"] if uri else []
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", JOB, "cifar10", str(out), *sets], capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"failed ({uri or 'untracked'}):\n{r.stderr[-2000:]}")
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    return summary["train_seconds"] / summary["epochs_run"], seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=1)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-tracking-"))
    proc, live = server(tmp)
    down = f"http://127.0.0.1:{free_port()}"
    kinds = {"untracked": "", "tracked, server up": live, "tracked, server down": down}
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    try:
        for i in range(args.repeats):
            for kind, uri in kinds.items():  # interleaved: a machine that slows down slows all three alike
                times[kind].append(epoch(tmp / f"{i}-{len(times[kind])}-{kind[:9]}", args.data, args.epochs, uri))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    base_epoch = statistics.median(e for e, _ in times["untracked"])
    base_whole = statistics.median(w for _, w in times["untracked"])
    when = time.strftime("%Y-%m-%d")
    print(f"{os.cpu_count()}-core CPU, {when}, cifar10 {args.epochs} epoch(s), {args.repeats} repeat(s)")
    print(f"{'':24s} {'epoch s':>9s} {'ratio':>7s} {'process s':>10s} {'ratio':>7s}")
    for kind, pairs in times.items():
        e, w = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        print(f"{kind:24s} {e:9.2f} {e / base_epoch:7.3f} {w:10.2f} {w / base_whole:7.3f}")


if __name__ == "__main__":
    main()
