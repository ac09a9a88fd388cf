"""State that saves itself: every piece of run state a resume needs is a component registered with the run, and a
checkpoint is what its components say, gathered and handed back without the commit or the restore knowing them.

A component is anything with `state_dict()` and `load_state_dict(state)`: the shape of torch's
torch.distributed.checkpoint.stateful.Stateful (any of those fits; this Protocol is the same, declared here since
importing that module costs a run a second of start-up). A model, an optimizer, a scheduler are components as torch
built them; the run's own (the chooser, the loss sums, the decisions made at the start) are small classes or `Kept`.

    parts = Components()
    parts.add("chooser", chooser)                 # its state_dict() is saved under "chooser"
    parts.add("loss_sums", sums, per_rank=True)   # every process's saved, by rank
    payload = parts.gather()                      # {"components": [names], "chooser": {...}, ...}; a collective
                                                  # in a group (gather_ranks, then gather on rank 0, split it)
    missing = parts.restore(payload)              # each its part; the names the checkpoint does not hold

A component added to a run (a sink's sent-up-to mark, say) is saved and restored from then on with no change to the
loop or the checkpoint code: add it to the run's Components (set_up in job/run/train.py makes them; the loop holds
them as `loop.parts`). One added after the restore is handed its part as it is added, so each piece registers where
it is built (the accumulator with the step, a sink with the reporter); components are restored in the order they
were added. A checkpoint written before a component existed does not hold it: it is left as built, and named in
`missing`. A per-rank part is saved as {"by_rank": [rank 0's, rank 1's, ...]}, and its `load_state_dict` is given
that whole dict, since what a process takes depends on the group (`own` gives this process's entry when the group
has the size that saved it; loss sums take the rows' mean otherwise, a stream refuses, the RNGs of ranks but 0 are
seeded afresh).

Values are tensors and plain values only (dicts, lists, numbers, strings), so that the checkpoint still loads with
torch.load(weights_only=True).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from job.errors import CheckpointError, one_line
from job.group import distributed

LISTED = "components"  # the payload's key naming the components it holds
BY_RANK = "by_rank"  # a per-rank part's key for its list of every process's state


@runtime_checkable
class Stateful(Protocol):
    """What a component is: torch.distributed.checkpoint.stateful.Stateful's shape."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class Kept:
    """A component made of two functions: what to save, and what to do with it on restore (for state that lives in
    a plain value, a tensor, or the process: RNGs, a decision made at the start)."""

    def __init__(self, save: Callable[[], Any], load: Callable[[Any], None] | None = None) -> None:
        self.save, self.load = save, load

    def state_dict(self) -> Any:
        return self.save()

    def load_state_dict(self, state_dict: Any) -> None:
        if self.load is not None:
            self.load(state_dict)


class Components:
    """The run's components by name, in the order they were added (restored in that order)."""

    def __init__(self) -> None:
        self.parts: dict[str, Stateful] = {}
        self.per_rank: set[str] = set()
        self.restoring: dict[str, Any] | None = None  # the payload restored from, while the run sets up
        self.missing: list[str] = []  # the components it did not hold

    def add(self, name: str, component: Stateful, per_rank: bool = False) -> Stateful:
        """Register `component` under `name` (its key in the checkpoint); returns it. `per_rank`: each process of a
        group holds its own (a loader's position, RNGs, loss sums), and the checkpoint keeps them all, by rank."""
        if name == LISTED or name in self.parts:
            raise ValueError(f"a run component named {name!r} is registered already")
        if not isinstance(component, Stateful):
            raise TypeError(f"run component {name!r}: needs state_dict() and load_state_dict()")
        self.parts[name] = component
        if per_rank:
            self.per_rank.add(name)
        if self.restoring is not None:
            self.hand(name)
        return component

    def names(self) -> list[str]:
        return list(self.parts)

    def gather_ranks(self) -> dict[str, Any]:
        """The per-rank parts, every process's state by rank: a collective in a group (every process calls it; the
        result is rank 0's to save)."""
        # In the order they were added, the same in every process (a set's order is not: strings hash per process).
        ranked = [(name, part) for name, part in self.parts.items() if name in self.per_rank]
        return {name: {BY_RANK: distributed.gather_objects(part.state_dict())} for name, part in ranked}

    def gather(self, ranks: dict[str, Any] | None = None) -> dict[str, Any]:
        """Every component's state by name, and the list of names. `ranks`: the per-rank parts gathered already
        (gather_ranks); without it they are gathered here, a collective in a group."""
        ranks = self.gather_ranks() if ranks is None else ranks
        payload: dict[str, Any] = {LISTED: self.names()}
        for name, part in self.parts.items():
            payload[name] = ranks[name] if name in self.per_rank else part.state_dict()
        return payload

    def restore(self, payload: dict[str, Any]) -> list[str]:
        """Hand each component its part of `payload` (and each added from now on, as it is added); returns the names
        the payload does not hold, left as built. A part that does not fit its component is a CheckpointError
        naming it."""
        self.restoring, missing = payload, []
        for name in self.parts:
            if not self.hand(name):
                missing.append(name)
        return missing

    def settled(self) -> None:
        """The run is set up: the payload it restored from is let go (a component added later starts as built)."""
        self.restoring = None

    def hand(self, name: str) -> bool:
        """Give component `name` its part of the payload being restored; False (and named in `missing`) where the
        payload holds none."""
        state = self.restoring.get(name) if self.restoring is not None else None
        if state is None:
            self.missing.append(name)
            return False
        try:
            self.parts[name].load_state_dict(state)
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
            raise CheckpointError(f"checkpoint's {name} does not fit this run: {one_line(e)}") from None
        return True


def own(saved: dict[str, list]) -> Any:
    """This process's entry of a per-rank part ({"by_rank": [...]}), or None where a group of another size saved it."""
    rows = saved[BY_RANK]
    return rows[distributed.rank()] if len(rows) == distributed.world() else None
