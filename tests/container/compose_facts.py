"""What the container check asserts about the compose file, from `docker compose config --format json` (all
profiles) and a dry run of `docker compose up train-gpu`. Prints each problem; exits 1 if there is any.

    python3 compose_facts.py COMPOSE_JSON DRY_RUN_LOG PROJECT
"""

from __future__ import annotations

import json
import re
import sys

JOB_GRACE_SECONDS = 20  # train.grace_seconds: the job's own limit after SIGTERM


def seconds(duration: str) -> float:
    """Compose's normalised durations: '1m0s', '90s', '1h2m3.5s'."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)(ms|h|m|s)", duration))


def train_problems(name: str, svc: dict, target: str, profile: str) -> list[str]:
    found = []
    if (svc.get("build") or {}).get("target") != target:
        found.append(f"{name}: builds target {(svc.get('build') or {}).get('target')!r}, want {target!r}")
    if profile not in (svc.get("profiles") or []):
        found.append(f"{name}: not in profile {profile!r}")
    if svc.get("init") is not True:
        found.append(f"{name}: no init: true (SIGTERM must reach the job)")
    grace = seconds(svc.get("stop_grace_period", "10s"))
    if grace <= JOB_GRACE_SECONDS:
        found.append(f"{name}: stop_grace_period {grace:g} s, not longer than the job's {JOB_GRACE_SECONDS} s grace")
    if int(svc.get("shm_size") or 0) < 1 << 30:
        found.append(f"{name}: shm_size {svc.get('shm_size')} under 1 GiB")
    mounts = {v["target"]: v for v in svc.get("volumes") or []}
    if not (mounts.get("/data") or {}).get("read_only"):
        found.append(f"{name}: /data is not mounted read-only")
    if "/runs" not in mounts or mounts["/runs"].get("read_only"):
        found.append(f"{name}: /runs is not mounted writable")
    key = (svc.get("environment") or {}).get("GOOGLE_APPLICATION_CREDENTIALS")
    if not key:  # the check renders the file with a key file named on the host
        found.append(f"{name}: GOOGLE_APPLICATION_CREDENTIALS does not point at the mounted key")
    keys = [v for v in mounts.values() if v["target"].startswith("/run/secrets/")]
    if not keys or not all(v.get("read_only") for v in keys) or key not in mounts:
        found.append(f"{name}: the credentials are not mounted read-only where GOOGLE_APPLICATION_CREDENTIALS points")
    return found


def problems(services: dict, dry_run: str, project: str) -> list[str]:
    missing = [s for s in ("train-gpu", "train-cpu", "tensorboard") if s not in services]
    if missing:
        return [f"no service {s}" for s in missing]
    gpu, cpu, board = services["train-gpu"], services["train-cpu"], services["tensorboard"]
    found = train_problems("train-gpu", gpu, "cuda", "gpu") + train_problems("train-cpu", cpu, "cpu", "cpu")
    devices = gpu.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    if not any(d.get("driver") == "nvidia" and "gpu" in (d.get("capabilities") or []) for d in devices):
        found.append(f"train-gpu: reserves no nvidia device with capabilities [gpu]: {devices}")
    entry = board.get("entrypoint") or []
    if entry[:1] != ["tensorboard"] or "/runs" not in entry:
        found.append(f"tensorboard: entrypoint {entry} does not serve /runs")
    # A service named on the command line starts although its profile is not enabled, and nothing else does.
    started = set(re.findall(rf"Container {re.escape(project)}-([\w-]+)-\d+\s+Created", dry_run))
    if started != {"train-gpu"}:
        found.append(f"'docker compose up train-gpu' (dry run) would create {sorted(started) or 'nothing'}")
    return found


def main() -> int:
    compose_json, dry_run_log, project = sys.argv[1:4]
    with open(compose_json) as f:
        services = json.load(f)["services"]
    with open(dry_run_log) as f:
        found = problems(services, f.read(), project)
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
