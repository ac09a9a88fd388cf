"""job/run/state.py: components registered with a run are gathered into a payload that loads weights-only, and each
is handed its own part back."""

import io
import shutil
from pathlib import Path

import pytest
import torch
from conftest import invoke, metrics, sets

from job.errors import CheckpointError
from job.run.state import Components, Kept, Stateful, own


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
    assert held["value"] == {"by_rank": [[1.0, 2.0]]} and own(held["value"]) == [1.0, 2.0]  # every process's
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


# A run folder written by the code of before components (checkpoint format 1, its state in fixed keys), stopped by
# SIGTERM one batch into epoch 3 of the Iris preset (data.batch_size=4: 30 steps an epoch; train.ema=0.9 and
# train.accumulate_steps=2, so the EMA, the accumulator's sums, the loader's place and the loss sums are all in it).
OLD_RUN = Path(__file__).parent / "data" / "checkpoint-v1-iris"
OLD_SETTINGS = sets(
    "data.batch_size=4",
    "train.ema=0.9",
    "train.accumulate_steps=2",
    "train.eval_every_epochs=1",
    "train.checkpoint_every_epochs=1",
    "train.log_every_steps=5",
    "train.keep_last=1",
)


def test_a_checkpoint_written_before_components_still_resumes(tmp_path):
    out = tmp_path / "run"
    shutil.copytree(OLD_RUN, out)
    from job.run import checkpoint
    from job.storage.run_folder import RunDir

    payload, _ = checkpoint.load_latest(RunDir(str(out)))  # read in the components' shape
    assert payload["format"] == checkpoint.FORMAT and "loss_sums" not in payload["progress"]
    assert len(payload["loss_sums"]["by_rank"]) == 1 and len(payload["places"]["by_rank"]) == 1
    assert len(payload["rng"]["by_rank"]) == 1 and len(payload["accumulator"]["accumulated"]) == 4
    assert {"model", "optimizer", "ema", "chooser", "placement", "precision"} <= set(payload["components"])
    code, err = invoke(["train", "--device", "cpu", "--output", str(out), *OLD_SETTINGS, "--set", "train.epochs=4"])
    assert code == 0, err[-2000:]
    assert "resuming iris from epoch 2, step 61 (1 steps into epoch 3)" in err
    last = metrics(str(out))[-1]
    # What the code that wrote it made of resuming it (the same command, on the CPU): the state came back whole.
    assert (last["epoch"], last["step"]) == (4, 120)
    assert last["train_loss"] == pytest.approx(1.0975704193115234, rel=1e-5)
    assert last["test_loss"] == pytest.approx(1.0970450083414713, rel=1e-5)


class Commits:
    """A caller's own run state: how many checkpoints it has been saved in, across attempts."""

    def __init__(self) -> None:
        self.made = 0

    def state_dict(self) -> dict:
        self.made += 1
        return {"made": self.made, "marks": torch.arange(self.made)}

    def load_state_dict(self, state: dict) -> None:
        self.made = state["made"]


def test_a_component_added_to_a_run_is_saved_and_restored_without_the_loop_or_checkpoint_code_knowing_it(tmp_path):
    from job.config import load_config
    from job.run import checkpoint
    from job.run.train import run
    from job.storage.run_folder import RunDir

    out = str(tmp_path / "run")
    first = Commits()
    every = "train.checkpoint_every_epochs=1"
    run(load_config("iris", ["train.epochs=2", every]), out, "cpu", components={"commits": first})
    assert first.made == 2  # one checkpoint an epoch
    again = Commits()
    run(load_config("iris", ["train.epochs=3", every]), out, "cpu", components={"commits": again})
    assert again.made == 3  # took 2 from the checkpoint, then was saved once more
    payload, manifest = checkpoint.load_latest(RunDir(out))
    assert payload["commits"]["made"] == 3 and torch.equal(payload["commits"]["marks"], torch.arange(3))
    assert "commits" in payload["components"] and "commits" in manifest["components"]
    assert {"model", "optimizer", "progress", "rng", "chooser", "loss_sums"} <= set(manifest["components"])
