"""job/run/state.py: components registered with a run are gathered into a payload that loads weights-only, and each
is handed its own part back."""

import io

import pytest
import torch

from job.errors import CheckpointError
from job.run.state import Components, Kept, Stateful


class Mark:
    """A sink's sent-up-to mark, as a component."""

    def __init__(self) -> None:
        self.sent = -1

    def state_dict(self) -> dict:
        return {"sent": self.sent}

    def load_state_dict(self, state: dict) -> None:
        self.sent = state["sent"]


def weights_only_roundtrip(payload: dict) -> dict:
    buf = io.BytesIO()
    torch.save(payload, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def test_components_gathered_and_restored_through_a_weights_only_file():
    model, mark, held = torch.nn.Linear(3, 2), Mark(), {"value": 0}
    parts = Components()
    parts.add("model", model)
    parts.add("mark", mark)
    parts.add("sums", Kept(lambda: [1.0, 2.0], lambda s: held.update(value=s)), per_rank=True)
    mark.sent = 41
    payload = weights_only_roundtrip(parts.gather())
    assert payload["components"] == ["model", "mark", "sums"]
    assert payload["sums"] == {"by_rank": [[1.0, 2.0]]}

    fresh_model, fresh_mark = torch.nn.Linear(3, 2), Mark()
    again = Components()
    again.add("model", fresh_model)
    again.add("mark", fresh_mark)
    again.add("sums", Kept(lambda: [], lambda s: held.update(value=s)), per_rank=True)
    again.add("added_later", Mark())
    assert again.restore(payload) == ["added_later"]  # a checkpoint from before it existed: left as built, named
    assert fresh_mark.sent == 41
    assert held["value"] == [1.0, 2.0]  # this process's own entry
    assert torch.equal(fresh_model.weight, model.weight)


def test_a_part_that_does_not_fit_names_itself():
    parts = Components()
    parts.add("model", torch.nn.Linear(3, 2))
    with pytest.raises(CheckpointError, match="checkpoint's model does not fit"):
        parts.restore({"model": torch.nn.Linear(4, 2).state_dict()})


def test_a_component_is_stateful_and_named_once():
    parts = Components()
    assert isinstance(Mark(), Stateful)
    parts.add("mark", Mark())
    with pytest.raises(ValueError, match="registered already"):
        parts.add("mark", Mark())
    with pytest.raises(TypeError, match="state_dict"):
        parts.add("other", object())
