"""Work lost to kills: a study of N short iris trials run by one `job sweep` worker that is killed outright (SIGKILL)
mid-trial K times and started again, against the same study never interrupted, on one machine in one run.

    python bench/sweep_kills.py [--trials 3] [--epochs 6000] [--kills 2]

Every optimizer step of every process is counted as it happens (a global step hook in each worker, one byte per step
appended to a file of its own, which a kill leaves as it was). A kill loses the steps since its trial's last commit:
those are the killed process's steps less what its run.json attempts committed. Goal: the study's steps at most the
uninterrupted study's plus the steps since each kill's last commit (its trials continued, never restarted).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sweep import write_space  # bench/sweep.py, beside this script (its folder is on sys.path when run)

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--device", "cpu", "--config", "iris", "--set", "data.val_split=0.2"]


def counted_job(steps_dir: str, argv: list[str]) -> None:
    """`python -m job ARGV` in this process, each optimizer step appending a byte to steps_dir/<pid>."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    fd = os.open(Path(steps_dir) / str(os.getpid()), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    register_optimizer_step_post_hook(lambda *_: os.write(fd, b"."))
    sys.argv = ["job", *argv]
    runpy.run_module("job", run_name="__main__", alter_sys=True)


def worker(space: Path, out: Path, steps: Path, epochs: int) -> subprocess.Popen:
    argv = ["sweep", str(space), "--output", str(out), *COMMON, "--set", f"train.epochs={epochs}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    log = open(out.parent / f"{out.name}-worker.log", "a")  # noqa: SIM115 (the child holds it)
    cmd = [sys.executable, __file__, "--count-steps", str(steps), "--", *argv]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def attempts(out: Path) -> list[dict]:
    found = []
    for run in (out / "trials").glob("*"):
        try:
            found += json.loads((run / "run.json").read_text())["attempts"]
        except (OSError, ValueError, KeyError):
            continue  # not begun, or run.json being replaced
    return found


def mid_trial(out: Path, pid: int) -> bool:
    """The worker `pid` is inside a trial that has committed a checkpoint since it began."""
    return any(a.get("pid") == pid and a.get("ended") is None and a.get("committed") for a in attempts(out))


def counts(steps: Path) -> dict[int, int]:
    return {int(p.name): p.stat().st_size for p in steps.iterdir()}


def main() -> None:
    if sys.argv[1:2] == ["--count-steps"]:
        return counted_job(sys.argv[2], sys.argv[4:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=6000)
    ap.add_argument("--kills", type=int, default=2)
    ap.add_argument("--after", type=float, default=0.5, help="seconds past a commit before the kill")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-sweep-kills-"))
    write_space(tmp / "space.yaml", args.trials)  # bench/sweep.py's study
    results = {}
    for name, kills in (("uninterrupted", 0), ("killed", args.kills)):
        out, steps = tmp / name, tmp / f"{name}-steps"
        steps.mkdir()
        w, lost = worker(tmp / "space.yaml", out, steps, args.epochs), []
        for _ in range(kills):
            while not mid_trial(out, w.pid):
                if w.poll() is not None:
                    sys.exit(f"the worker ended before the kill ({w.returncode}): see {tmp}")
                time.sleep(0.05)
            time.sleep(args.after)
            os.killpg(w.pid, signal.SIGKILL)
            w.wait()
            done = [a for a in attempts(out) if a.get("pid") == w.pid]
            finished = sum(a["to"]["step"] - a["from"]["step"] for a in done if a.get("to"))
            (cut,) = [a for a in done if not a.get("to")]
            ran = counts(steps)[w.pid] - finished  # the killed attempt's steps, committed or not
            lost.append(ran - (cut["committed"]["step"] - cut["from"]["step"]))
            w = worker(tmp / "space.yaml", out, steps, args.epochs)
        if w.wait() != 0:
            sys.exit(f"the {name} study failed: see {tmp}")
        results[name] = (sum(counts(steps).values()), lost, len(counts(steps)))
    (plain, _, _), (total, lost, processes) = results["uninterrupted"], results["killed"]
    print(
        f"{os.cpu_count()}-core CPU, {time.strftime('%Y-%m-%d')}, {args.trials} iris trials of {args.epochs} steps, "
        f"one worker killed {args.kills} times (SIGKILL, {args.after} s past a commit)"
    )
    print(f"uninterrupted study: {plain} optimizer steps")
    print(f"killed study: {total} optimizer steps in {processes} processes; lost since each kill's last commit: {lost}")
    bound = plain + sum(lost)
    print(f"bound (uninterrupted + lost) {bound}; study/bound {total / bound:.4f}; over the bound by {total - bound}")


if __name__ == "__main__":
    main()
