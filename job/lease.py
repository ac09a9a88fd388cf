"""One writer per run folder: lease.json in the folder (local or in a bucket) names the process that writes the run
(its machine, pid and start) and a heartbeat that a thread of that process refreshes every JOB_LEASE_HEARTBEAT_S
seconds (30). Another run starting on the folder is refused while the lease is live, before it writes anything; it is
taken over when stale: its holder on this machine is gone (the pid ended, or now names another process), or its
heartbeat is older than STALE_BEATS of the holder's heartbeats (a holder on another machine, or one that went
silent). A run releases it when it ends, whatever its exit, short of being killed."""

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

from job.cloud import describe_storage_error, filesystem
from job.errors import ConfigError, StorageError
from job.sync import create, send

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


def gone(held: dict, now: float) -> str:
    """Why the lease's holder is taken for gone (empty: it is live)."""
    if not {"machine", "pid", "pid_started", "heartbeat", "every"} <= held.keys():
        return "an unreadable lease"
    if held["machine"] == machine():
        try:
            p = psutil.Process(held["pid"])
            # A killed holder its parent has not yet reaped (a zombie) still answers with its pid and start time.
            alive = abs(p.create_time() - held["pid_started"]) < 1 and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            alive = False
        return "" if alive else f"its process (pid {held['pid']}) has ended"
    silent = now - held["heartbeat"]
    limit = STALE_BEATS * held["every"]
    return f"its heartbeat stopped {silent:.0f} s ago (more than {limit:.0f} s)" if silent > limit else ""


def overdue(held: dict, now: float) -> bool:
    """Whether a live holder on another machine has missed a heartbeat: it may be gone (a container killed and
    started again is another machine), which only its staleness will tell."""
    return held.get("machine") != machine() and now - held["heartbeat"] > 1.5 * held["every"]


def holder(held: dict, now: float) -> str:
    beat = f"heartbeat {max(0.0, now - held['heartbeat']):.0f} s ago" if "heartbeat" in held else "no heartbeat yet"
    return f"host {held.get('host', '?')}, pid {held.get('pid', '?')}, {beat}"


def refusal(url: str, held: dict, now: float) -> StorageError:
    return StorageError(
        f"{url} is being written by another run ({holder(held, now)}): let it end or stop it, or use another "
        "--output; a run whose process is gone is taken over by the same command (at once on its machine, once "
        f"its heartbeat has stopped for {STALE_BEATS} beats elsewhere)"
    )


def check(url: str) -> None:
    """Refuse, writing nothing, when a live run holds the folder at `url`."""
    fs, path = where(url)
    held, now = read(fs, path, url), time.time()
    if held and not gone(held, now) and not overdue(held, now):  # an overdue holder: the run's own take waits it out
        raise refusal(url, held, now)


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
        held, now = read(self.fs, self.path, self.url), time.time()
        if held and not gone(held, now) and overdue(held, now):
            held, now = self._wait_out(held)
        if held is not None:
            why = gone(held, now)
            if not why:
                raise refusal(self.url, held, now)
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

    def _wait_out(self, held: dict) -> tuple[dict | None, float]:
        """A holder elsewhere that missed a heartbeat, watched until it beats again (live: refused), goes stale
        (taken over) or lets go; at most STALE_BEATS of its heartbeats."""
        from job.console import say

        stale_at = held["heartbeat"] + STALE_BEATS * held["every"]
        say(
            f"storage: {self.url} is held by host {held.get('host', '?')}, pid {held.get('pid', '?')}, whose heartbeat "
            f"stopped {time.time() - held['heartbeat']:.0f} s ago: waiting up to "
            f"{max(0, stale_at - time.time()):.0f} s "
            "for it to beat again or go stale"
        )
        while True:
            time.sleep(min(held["every"], 5.0))
            now = time.time()
            again = read(self.fs, self.path, self.url)
            if not again or gone(again, now) or not overdue(again, now) or again.get("token") != held.get("token"):
                return again, now

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
                send(self.fs, self.path, self._bytes())
            except Exception:  # noqa: BLE001 (a store that fails now: the next beat tries again)
                continue


def remove(fs, path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(path)
