"""State that saves itself: every piece of run state a resume needs is a component registered with the run, and a
checkpoint is what its components say, gathered and handed back without the commit or the restore knowing them.

A component is anything with `state_dict()` and `load_state_dict(state)`: the shape of torch's
torch.distributed.checkpoint.stateful.Stateful (any of those fits; this Protocol is the same, declared here since
importing that module costs a run a second of start-up). A model, an optimizer, a scheduler are components as torch
built them; the run's own (the chooser, the loss sums, the decisions made at the start) are small classes or `Kept`.

    parts = Components()
    parts.add("chooser", chooser)                 # its state_dict() is saved under "chooser"
    parts.add("loss_sums", sums, per_rank=True)   # every process's saved, by rank; each restores its own
    payload = parts.gather()                      # every process calls it (a group gathers the per-rank parts);
                                                  # {"components": [names], "chooser": {...}, ...} on rank 0
    missing = parts.restore(payload)              # each its part; names the checkpoint does not hold

A component added to a run (a sink's sent-up-to mark, say) is saved and restored from then on with no change to the
loop or the checkpoint code: add it to the run's Components (the loop holds them as `loop.parts`) before the restore.
A checkpoint written before it existed does not hold it: the restore leaves it as built and names it among the
missing. A per-rank part is saved as {"by_rank": [rank 0's, rank 1's, ...]}; each process restores its own entry
when the group has the size that saved it, and otherwise `load_state_dict` is given that whole dict to make what it
can of it (loss sums take the rows' mean; the RNGs of ranks but 0 are seeded afresh).

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
        return component

    def names(self) -> list[str]:
        return list(self.parts)

    def gather(self) -> dict[str, Any]:
        """Every component's state by name, and the list of names. A collective in a group: every process calls it,
        and the per-rank parts hold every process's state, by rank (the others' result is theirs alone)."""
        payload: dict[str, Any] = {LISTED: self.names()}
        for name, part in self.parts.items():
            state = part.state_dict()
            payload[name] = {BY_RANK: distributed.gather_objects(state)} if name in self.per_rank else state
        return payload

    def restore(self, payload: dict[str, Any], names: list[str] | None = None) -> list[str]:
        """Hand each component (or those of `names`) its part of `payload`; returns the names the payload does not
        hold, left as built. A part that does not fit its component is a CheckpointError naming it."""
        missing = []
        for name, part in self.parts.items():
            if names is not None and name not in names:
                continue
            if payload.get(name) is None:
                missing.append(name)
                continue
            state = payload[name]
            if name in self.per_rank and len(state[BY_RANK]) == distributed.world():
                state = state[BY_RANK][distributed.rank()]
            try:
                part.load_state_dict(state)
            except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
                raise CheckpointError(f"checkpoint's {name} does not fit this run: {one_line(e)}") from None
        return missing
