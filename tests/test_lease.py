"""lease.json: one run writes a folder at a time. Real files and the GCS emulator; the holders that are not this
process are real leases as another machine or an ended process would have left them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import psutil
import pytest
from conftest import Bucket

from job.errors import StorageError
from job.storage.lease import LEASE, Lease, check, machine
from job.storage.run_folder import RunDir


def left_by(folder, **changes) -> dict:
    """A lease as another holder left it in `folder` (this process's record, changed)."""
    me = psutil.Process()
    record = {
        "host": "elsewhere",
        "machine": machine(),
        "pid": me.pid,
        "pid_started": me.create_time(),
        "started": "2026-01-01T00:00:00+00:00",
        "heartbeat": time.time(),
        "every": 30.0,
        "token": "theirs",
    } | changes
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LEASE).write_text(json.dumps(record))
    return record


def ended_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def test_a_live_holder_refuses_a_second_run_before_it_writes_anything(tmp_path):
    run = tmp_path / "run"
    left_by(run, host="trainer-7", heartbeat=time.time() - 5)
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}
    held_by = r"being written by another run \(host trainer-7, pid \d+, heartbeat 5 s ago\)"
    with pytest.raises(StorageError, match=held_by):
        RunDir(str(run)).prepare()
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == before
    assert json.loads((run / LEASE).read_text())["token"] == "theirs"


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"pid": "ended"}, r"its process \(pid \d+\) has ended"),  # this machine, an ended process
        ({"pid_started": 1.0}, r"its process \(pid \d+\) has ended"),  # its pid now another process's
        ({"machine": "other-host", "every": 0.1}, r"heartbeat did not change for 0.4 s \(4 beats\) as seen here"),
    ],
)
def test_a_stale_lease_is_taken_over(tmp_path, changes, why):
    run = tmp_path / "run"
    left_by(run, **{k: ended_pid() if v == "ended" else v for k, v in changes.items()})
    held = RunDir(str(run))
    held.prepare()
    assert held.lease is not None and held.lease.taken_from.startswith("host elsewhere")
    assert re.search(why, held.lease.taken_from), held.lease.taken_from
    assert json.loads((run / LEASE).read_text())["token"] == held.lease.record["token"]
    held.finish()
    assert not (run / LEASE).exists()


def test_the_holder_beats_and_lets_go_only_of_its_own_lease(tmp_path, monkeypatch):
    monkeypatch.setenv("JOB_LEASE_HEARTBEAT_S", "0.1")
    run = tmp_path / "run"
    lease = Lease(str(run)).take()
    first = json.loads((run / LEASE).read_text())["heartbeat"]
    deadline = time.time() + 60
    while json.loads((run / LEASE).read_text())["heartbeat"] == first:
        assert time.time() < deadline, "the heartbeat was never refreshed"
        time.sleep(0.05)
    with pytest.raises(StorageError, match=f"pid {psutil.Process().pid}"):
        Lease(str(run)).take()  # this process is live: a second taker is refused even here
    lease._stop.set()
    lease._thread.join()
    left_by(run, token="theirs")
    lease.release()
    assert json.loads((run / LEASE).read_text())["token"] == "theirs"


def test_a_lease_in_a_bucket(gcs_server):
    bucket = Bucket("lease-bucket")
    url = bucket.url("runs/one")
    run = RunDir(url)
    run.prepare()
    assert LEASE in bucket.names("runs/one")
    with pytest.raises(StorageError, match=f"{url} is being written by another run"):
        RunDir(url, staged=True).prepare()
    run.finish()
    assert LEASE not in bucket.names("runs/one")
    Lease(url).take().release()  # free again


def test_a_holder_elsewhere_that_stopped_is_waited_out_then_taken_over_saying_so(tmp_path, capsys):
    """A container restarted after its run was killed: the lease names another machine (a new container is one) and
    a heartbeat that no longer changes. Refusing it would leave the user nothing to do but wait; the same command
    watches it for STALE_BEATS heartbeats, saying so, and takes over."""
    run = tmp_path / "run"
    left_by(run, machine="another-container", heartbeat=time.time(), every=0.5)
    check(str(run))  # not refused before the run's own take has watched it
    t0 = time.monotonic()
    lease = Lease(str(run)).take()
    try:
        assert 2.0 <= time.monotonic() - t0 < 30 and "heartbeat did not change" in lease.taken_from
        assert json.loads((run / LEASE).read_text())["token"] == lease.record["token"]
    finally:
        lease.release()
    assert "on another machine: watching its heartbeat" in capsys.readouterr().err


def test_a_holder_killed_and_not_yet_reaped_is_gone(tmp_path):
    """A SIGKILLed holder whose parent has not reaped it (a zombie: its pid and start time still answer) has ended:
    the same command takes the folder over at once."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = psutil.Process(proc.pid).create_time()
        proc.kill()
        while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:  # dead, not yet waited for
            time.sleep(0.01)
        run = tmp_path / "run"
        left_by(run, pid=proc.pid, pid_started=started)
        held = RunDir(str(run))
        held.prepare()
        assert held.lease is not None and f"its process (pid {proc.pid}) has ended" in held.lease.taken_from
        held.finish()
    finally:
        proc.wait()


HOLDER = """
import sys, time
import job.storage.lease as lease
skew, real = float(sys.argv[2]), time.time
time.time = lambda: real() + skew  # this machine's clock, skew seconds off the test's
lease.machine = lambda: "another-machine"  # its pids mean nothing to the test's machine
lease.Lease(sys.argv[1]).take()
print("held", flush=True)
time.sleep(300)
"""


def holder_elsewhere(run, skew: float) -> subprocess.Popen:
    """A real holder of the folder in another process, as another machine whose clock is `skew` seconds off this
    one's would hold it: its heartbeat thread beats every 0.2 s."""
    env = {**os.environ, "JOB_LEASE_HEARTBEAT_S": "0.2"}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run), str(skew)], stdout=subprocess.PIPE, env=env)
    assert proc.stdout.readline().strip() == b"held"
    return proc


@pytest.mark.parametrize("skew", [-3600.0, 3600.0])
def test_a_holder_elsewhere_that_beats_is_live_whatever_its_clock_says(tmp_path, skew):
    """Its heartbeat an hour old (or an hour ahead) by this machine's clock, but changing: live, refused."""
    run = tmp_path / "run"
    proc = holder_elsewhere(run, skew)
    try:
        with pytest.raises(StorageError, match="being written by another run"):
            Lease(str(run)).take()
        assert proc.poll() is None  # the holder still holds it: nothing took it over
        assert json.loads((run / LEASE).read_text())["machine"] == "another-machine"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("skew", [3600.0, -3600.0])
def test_a_holder_elsewhere_whose_heartbeat_stopped_is_taken_over_whatever_its_clock_says(tmp_path, skew):
    """Killed, its last heartbeat an hour ahead of this machine's clock (or behind it): taken over once its
    heartbeat has not changed for 4 beats as this machine sees it, neither refused for ever nor taken at once."""
    run = tmp_path / "run"
    proc = holder_elsewhere(run, skew)
    proc.kill()
    proc.wait()
    t0 = time.monotonic()
    held = RunDir(str(run))
    held.prepare()
    try:
        assert 4 * 0.2 <= time.monotonic() - t0 < 30
        assert "heartbeat did not change" in held.lease.taken_from, held.lease.taken_from
        assert json.loads((run / LEASE).read_text())["token"] == held.lease.record["token"]
    finally:
        held.finish()
