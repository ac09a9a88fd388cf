"""track.jsonl: the run's journal of what it tells its tracking servers, committed with every checkpoint as
metrics.jsonl is, and the marks of what each server took (per tracking URI: its MLflow run and how far its points
went), so that a tracker that connects again knows what it sent from the run's own record.

A point line holds its step, its time and its metrics, and `n`, its place among the point lines of its step: resume
is exact, so a point line an attempt makes again after a kill has the step and the place it had before, and a mark
"through [step, n]" says which of them a server holds however often the journal was cut back. A metric given again
at a step the journal already holds (a resumed end evaluating the test split again) is not journaled twice."""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from job.storage.run_folder import RunDir

JOURNAL = "track.jsonl"
START = (-1, 0)  # a cursor before every point


def read_journal(data: bytes | None) -> list[dict[str, Any]]:
    lines = []
    for line in (data or b"").decode(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill
        if isinstance(entry, dict):
            lines.append(entry)
    return numbered(lines)


class Places:
    """The running count of point lines per step and the last step of each metric: what numbers a new point line
    and drops the points the journal already holds."""

    def __init__(self) -> None:
        self.step, self.count = START
        self.reached: dict[str, int] = {}

    def place(self, entry: dict[str, Any]) -> dict[str, Any] | None:
        """`entry` numbered (`n`), without the metrics already journaled at its step or later; None when none is
        left. A line numbered already (read back) keeps its number."""
        step = int(entry["step"])
        metrics = {k: v for k, v in entry.get("m", {}).items() if step > self.reached.get(k, -1)}
        if not metrics:
            return None
        self.reached.update(dict.fromkeys(metrics, step))
        if step != self.step:
            self.step, self.count = step, 0
        entry = {**entry, "m": metrics, "n": entry.get("n", self.count)}
        self.count = entry["n"] + 1
        return entry


def numbered(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The journal's lines, each point line numbered (a journal written before numbers were kept gets them)."""
    places, out = Places(), []
    for entry in lines:
        if "step" in entry:
            entry = places.place(entry)
        if entry is not None:
            out.append(entry)
    return out


class Journal:
    """track.jsonl: appended by the loop (and by the sender, its marks), read by the sender."""

    def __init__(self, run_dir: RunDir, upto_step: int | None, fresh: bool = False) -> None:
        """Open the run's journal; a resumed attempt keeps the points up to the step it resumes from (`upto_step`,
        None: all) and every line that has no step; `fresh`: none of it."""
        self.run_dir, self.lock = run_dir, threading.Lock()
        lines = [] if fresh else read_journal(run_dir.read(JOURNAL))
        if upto_step is not None:
            lines = [e for e in lines if e.get("step") is None or e["step"] <= upto_step]
        self.lines, self.places = lines, Places()
        for entry in lines:
            if "step" in entry:
                self.places.place(entry)
        run_dir.write(JOURNAL, "".join(json.dumps(e) + "\n" for e in lines).encode())

    def add(self, entry: dict[str, Any]) -> None:
        with self.lock:
            if "step" in entry and (entry := self.places.place(entry)) is None:
                return
            self.lines.append(entry)
            with open(self.run_dir.path(JOURNAL), "a") as f:
                f.write(json.dumps(entry) + "\n")

    def since(self, at: int) -> list[dict[str, Any]]:
        with self.lock:
            return self.lines[at:]

    def destination(self, uri: str) -> dict[str, Any]:
        with self.lock:
            return destination(self.lines, uri)

    def marks(self) -> dict[str, dict[str, Any]]:
        """What the journal's marks say of every server it was sent to, by tracking URI: {"run_id", "through"}."""
        with self.lock:
            uris = dict.fromkeys(e["sent"] for e in self.lines if "sent" in e)
            return {uri: destination(self.lines, uri) for uri in uris}

    def merge(self, marks: dict[str, dict[str, Any]]) -> None:
        """Marks kept elsewhere (a checkpoint's) added where they say more than the journal's: a server's MLflow run
        where the journal names none, a place further than the journal's. A mark is never taken back: what a server
        took, it holds."""
        for uri, mark in marks.items():
            have = self.destination(uri)
            if mark.get("run_id") and not have.get("run_id"):
                self.add({"run_id": mark["run_id"], "sent": uri})
            if "through" in mark and tuple(mark["through"]) > tuple(have.get("through", START)):
                self.add({"sent": uri, "through": list(mark["through"])})


def destination(lines: list[dict[str, Any]], uri: str) -> dict[str, Any]:
    """What the journal's marks say of the server at `uri`: its MLflow run ("run_id") and how far its points went
    ("through": [step, n], every point line before it taken). A journal written before marks were kept names the
    run id alone, after the header line of the server it belongs to."""
    server, found = "", {}
    for entry in lines:
        if "server" in entry and "run_name" in entry:  # a header: the server the attempt tracked in
            server = entry["server"]
        if "run_id" in entry and entry.get("sent", server) == uri:
            found["run_id"] = entry["run_id"]
        if entry.get("sent") == uri and "through" in entry:
            found["through"] = max(tuple(found.get("through", START)), tuple(entry["through"]))
    return found


def carries(entry: dict[str, Any]) -> bool:
    """Whether a journal line has something for the server (not only a note of the run's own: a mark)."""
    return any(k in entry for k in ("step", "params", "tags", "files", "register", "status"))
