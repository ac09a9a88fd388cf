"""One writer per run folder: lease.json in the folder (local or in a bucket) names the process that writes the run
(its machine, pid and start) and a heartbeat that a thread of that process refreshes every JOB_LEASE_HEARTBEAT_S
seconds (30). Another run starting on the folder is refused while the lease is live; it is taken over when stale: its
holder on this machine is gone (the pid ended, or now names another process), or, for a holder on another machine,
its heartbeat has not changed for STALE_BEATS of its beats as this machine's own monotonic clock counts them. Another
machine's clock is never compared with this one's: its heartbeat time says only that it beat, not when by our clock.
A run releases it when it ends, whatever its exit, short of being killed."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any

import psutil

from job.errors import ConfigError, StorageError
from job.storage.cloud import describe_storage_error, filesystem
from job.storage.sync import create, send

LEASE = "lease.json"
STALE_BEATS = 4  # heartbeats a holder elsewhere may miss (a slow store, a busy machine) before it is taken for gone


def heartbeat_s() -> float:
    """Seconds between heartbeats: JOB_LEASE_HEARTBEAT_S, else 30."""
    value = os.environ.get("JOB_LEASE_HEARTBEAT_S", "").strip()
    try:
        seconds = float(value) if value else 30.0
    except ValueError:
        seconds = 0.0
    if seconds <= 0:
        raise ConfigError(f"JOB_LEASE_HEARTBEAT_S={value!r}: expected a positive number of seconds")
    return seconds


def machine() -> str:
    """This machine as a pid means something on it: the host name and, on Linux, the pid namespace (two containers
    with the host's name, --network host, number their processes apart)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()} {namespace}".strip()


def where(url: str) -> tuple[Any, str]:
    fs, root = filesystem(url)
    return fs, f"{root.rstrip('/')}/{LEASE}"


def read(fs, path: str, url: str) -> dict | None:
    """The lease at `path`; None when there is none; {} when it cannot be read as one (taken for stale: a lease is
    written whole, so only damage leaves it so)."""
    try:
        data = fs.cat_file(path)
    except (FileNotFoundError, NotADirectoryError):  # no folder, or a file where it would be: prepare() says so
        return None
    except Exception as e:  # the stores' clients raise many types
        raise StorageError(f"cannot read the run's lease: {describe_storage_error(url, e)}") from None
    try:
        held = json.loads(data)
    except ValueError:
        return {}
    return held if isinstance(held, dict) else {}


def gone(held: dict) -> str | None:
    """Why the lease's holder is taken for gone (empty: it is live); None for a holder on another machine, which only
    watching its heartbeat tells (Lease._watch)."""
    if not {"machine", "pid", "pid_started", "heartbeat", "every"} <= held.keys():
        return "an unreadable lease"
    if not isinstance(held["every"], (int, float)) or not held["every"] > 0:
        return "an unreadable lease"
    if held["machine"] != machine():
        return None
    try:
        p = psutil.Process(held["pid"])
        # A killed holder its parent has not yet reaped (a zombie) still answers with its pid and start time.
        alive = abs(p.create_time() - held["pid_started"]) < 1 and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        alive = False
    return "" if alive else f"its process (pid {held['pid']}) has ended"


def beat(held: dict) -> tuple:
    """What changes at each of a holder's heartbeats (its count, and its time on its own clock)."""
    return held.get("token"), held.get("beats"), held.get("heartbeat")


def holder(held: dict, now: float) -> str:
    if held.get("machine") not in (None, machine()):
        return f"host {held.get('host', '?')}, pid {held.get('pid', '?')}, on another machine, its heartbeat beating"
    last = f"heartbeat {max(0.0, now - held['heartbeat']):.0f} s ago" if "heartbeat" in held else "no heartbeat yet"
    return f"host {held.get('host', '?')}, pid {held.get('pid', '?')}, {last}"  # one machine, one clock


def refusal(url: str, held: dict, now: float) -> StorageError:
    return StorageError(
        f"{url} is being written by another run ({holder(held, now)}): let it end or stop it, or use another "
        "--output; a run whose process is gone is taken over by the same command (at once on its machine, once "
        f"its heartbeat has not changed for {STALE_BEATS} beats elsewhere)"
    )


def check(url: str) -> None:
    """Refuse, writing nothing, when a live run on this machine holds the folder at `url` (a holder elsewhere is
    watched by the run's own take)."""
    fs, path = where(url)
    held = read(fs, path, url)
    if held and gone(held) == "":
        raise refusal(url, held, time.time())


class Lease:
    """This process's hold on a run folder, kept alive by a heartbeat thread until release()."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.fs, self.path = where(url)
        me = psutil.Process()
        self.record = {
            "host": socket.gethostname(),
            "machine": machine(),
            "pid": me.pid,
            "pid_started": me.create_time(),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "heartbeat": time.time(),
            "beats": 0,
            "every": heartbeat_s(),
            "token": uuid.uuid4().hex,
        }
        self.taken_from = ""  # the stale holder this lease replaced, in words
        self.taken: dict = {}  # the stale lease this one replaced: its holder's last heartbeat bounds when it stopped
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self) -> Lease:
        """Hold the folder, or raise naming its live holder. Where the store creates a file only if absent (a local
        folder, GCS) two runs starting at once cannot both create it; replacing a stale lease is a delete, then such a
        create, and the read-back below catches most of what is left: two takers of one stale lease within the same
        moment may both pass it, and the next heartbeat of the one that lost stops it (beat)."""
        held = read(self.fs, self.path, self.url)
        why = gone(held) if held is not None else ""
        if held is not None and why is None:
            held, why = self._watch(held)
        if held is not None:
            if not why:
                raise refusal(self.url, held, time.time())
            self.taken_from = f"host {held.get('host', '?')}, pid {held.get('pid', '?')}: {why}"  # said by the caller
            self.taken = held
            self._call(remove, self.fs, self.path)
        self._call(create, self.fs, self.path, self._bytes())  # False: another run created it first
        self._refuse_if_other()
        self._thread = threading.Thread(target=self._beat, name="job-lease", daemon=True)
        self._thread.start()
        return self

    def release(self) -> None:
        """Stop the heartbeat and remove the lease if it is still this process's (a store that fails now leaves it
        to go stale)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            if (read(self.fs, self.path, self.url) or {}).get("token") == self.record["token"]:
                remove(self.fs, self.path)
        except Exception:  # noqa: BLE001 (ending anyway: a lease left behind goes stale)
            pass

    def _watch(self, held: dict) -> tuple[dict | None, str]:
        """A holder on another machine, watched until its heartbeat changes (live: '' with the lease), it lets go
        (None), or its heartbeat has not changed for STALE_BEATS of its beats by this machine's monotonic clock (why
        it is taken for gone). A lease put there by a third run meanwhile is judged afresh."""
        from job.console import say

        seen, since = beat(held), time.monotonic()
        limit = STALE_BEATS * float(held["every"])
        say(
            f"storage: {self.url} is held by host {held.get('host', '?')}, pid {held.get('pid', '?')}, on another "
            f"machine: watching its heartbeat, taken over if it does not change for {limit:g} s ({STALE_BEATS} beats)"
        )
        while True:
            time.sleep(min(float(held["every"]) / 2, 5.0))
            again = read(self.fs, self.path, self.url)
            if again is None:
                return None, ""
            if again.get("token") != held.get("token"):  # another run's lease now
                why = gone(again)
                return (again, why) if why is not None else self._watch(again)
            if beat(again) != seen:
                return again, ""
            if time.monotonic() - since > limit:
                return again, f"its heartbeat did not change for {limit:g} s ({STALE_BEATS} beats) as seen here"

    def _bytes(self) -> bytes:
        return json.dumps(self.record, indent=1).encode()

    def _refuse_if_other(self) -> None:
        held, now = read(self.fs, self.path, self.url), time.time()
        if (held or {}).get("token") != self.record["token"]:
            raise refusal(self.url, held or {}, now)

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # the stores' clients raise many types
            raise StorageError(f"cannot write the run's lease: {describe_storage_error(self.url, e)}") from None

    def _beat(self) -> None:
        """Refresh the heartbeat until released. A lease found in another run's name means this one went silent long
        enough to be taken over: this process ends at once, before it writes over that run (a group's other
        processes follow, as they do any process that dies)."""
        while not self._stop.wait(self.record["every"]):
            try:
                held = read(self.fs, self.path, self.url)
                if held is not None and held.get("token") != self.record["token"]:
                    print(
                        f"error: {self.url} was taken over by another run ({holder(held, time.time())}) after this "
                        "one's heartbeat went silent; stopping so that one run writes it",
                        file=sys.stderr,
                        flush=True,
                    )
                    os._exit(StorageError.exit_code)
                self.record["heartbeat"] = time.time()
                self.record["beats"] += 1  # what a watcher elsewhere sees change, whatever this machine's clock says
                send(self.fs, self.path, self._bytes())
            except Exception:  # noqa: BLE001 (a store that fails now: the next beat tries again)
                continue


def remove(fs, path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(path)
