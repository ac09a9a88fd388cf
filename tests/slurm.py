"""A single-host Slurm of the tests' own: munged, slurmctld and slurmd started as processes (no systemd), on free
ports, with every file in one folder, and ended by their pids. Needs Debian's slurm-wlm and munge and root (the
daemons run as root: SlurmUser=root); `available()` says why not where they are missing."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol", "squeue", "sinfo", "scancel")
PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/bin"])


def available() -> str:
    """'' when a cluster can start here, else why not (for pytest.skip)."""
    missing = [b for b in DAEMONS if not shutil.which(b, path=PATH)]
    if missing:
        return f"no Slurm here ({', '.join(missing)} missing: apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "the tests' Slurm runs its daemons as root (SlurmUser=root)"
    try:
        socket.gethostbyname(socket.gethostname())
    except OSError:
        return f"this machine's name {socket.gethostname()} does not resolve (Slurm's node list names it)"
    return ""


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Slurm:
    """A running cluster: `env` is what a client command needs (SLURM_CONF), `run` runs one."""

    def __init__(self, root: Path) -> None:
        self.root, self.procs = root, []
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "PATH": PATH, "SLURM_CONF": str(self.conf)}

    def run(self, *args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(
            list(args), env=kw.pop("env", self.env), capture_output=True, text=True, timeout=timeout, **kw
        )

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, Restarts, Reason, ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def start(self) -> None:
        s = self.root
        for d in ("munge", "state", "spool", "log"):
            (s / d).mkdir(parents=True, exist_ok=True)
        (s / "munge").chmod(0o700)
        key = s / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = s / "munge" / "munge.sock"
        m = s / "munge"
        self.daemon(
            "munged",
            "--foreground",
            "--force",
            f"--socket={sock}",
            f"--key-file={key}",
            f"--pid-file={m / 'munged.pid'}",
            f"--log-file={m / 'munged.log'}",
            f"--seed-file={m / 'seed'}",
        )
        self.wait(sock.exists, f"munged did not start: {tail(m / 'munged.log')}")
        host, (cport, dport) = socket.gethostname().split(".")[0], free_ports(2)
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=tests",
                    f"SlurmctldHost={host}",
                    f"SlurmctldPort={cport}",
                    f"SlurmdPort={dport}",
                    "SlurmUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={sock},cred_expire=10",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SchedulerType=sched/backfill",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    f"StateSaveLocation={s / 'state'}",
                    f"SlurmdSpoolDir={s / 'spool'}",
                    f"SlurmctldPidFile={s / 'slurmctld.pid'}",
                    f"SlurmdPidFile={s / 'slurmd.pid'}",
                    f"SlurmctldLogFile={s / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={s / 'log' / 'slurmd.log'}",
                    "SlurmdParameters=config_overrides",
                    "ReturnToService=2",
                    "MpiDefault=none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "JobRequeue=1",
                    "MailProg=/bin/true",
                    f"FirstJobId={10000 + int.from_bytes(os.urandom(2), 'big') % 50000}",
                    f"NodeName={host} CPUs={max(2, os.cpu_count() or 2)} State=UNKNOWN",
                    f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        self.daemon("slurmctld", "-D", "-f", str(self.conf))
        self.daemon("slurmd", "-D", "-f", str(self.conf))
        self.wait(
            lambda: self.run("sinfo", "-h", "-o", "%T").stdout.strip() == "idle",
            f"Slurm did not come up: {tail(s / 'log' / 'slurmctld.log')} / {tail(s / 'log' / 'slurmd.log')}",
        )

    def daemon(self, *args: str) -> None:
        with open(self.root / "log" / f"{args[0]}.out", "wb") as log:  # the daemon keeps its own copy of the file
            self.procs.append(subprocess.Popen(list(args), env=self.env, stdout=log, stderr=subprocess.STDOUT))

    def wait(self, ready, why: str, seconds: float = 30) -> None:
        deadline = time.time() + seconds
        while time.time() < deadline:
            if ready():
                return
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.2)
        raise RuntimeError(why)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            ours = self.run("squeue", "-h", "-o", "%i", timeout=10).stdout.split()
            if ours:
                self.run("scancel", *ours, timeout=10)
            deadline = time.time() + 40
            while time.time() < deadline and self.run("squeue", "-h", "-o", "%i", timeout=10).stdout.strip():
                time.sleep(0.5)
        for p in reversed(self.procs):  # by pid, never by name: other clusters may run here
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def tail(path: Path, n: int = 200) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def cluster(root: Path) -> Iterator[Slurm]:
    slurm = Slurm(root)
    try:
        slurm.start()
        yield slurm
    finally:
        slurm.stop()
