import io
import json

import fsspec
import pytest
import torch
from torch import nn

from job.errors import CheckpointError
from job.group.env import rng_state, set_rng_state
from job.run import checkpoint
from job.run.state import Components, Kept
from job.storage.run_folder import RunDir


def payload(seed: int) -> dict:
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    parts = Components()
    parts.add("model", model)
    parts.add("optimizer", opt)
    parts.add("progress", Kept(lambda: {"epoch": seed, "step": seed * 10}))
    return {"format": checkpoint.FORMAT} | parts.gather()


def commit_three(tmp_path, keep_last=5) -> RunDir:
    run = RunDir(str(tmp_path / "run"))
    for epoch in (1, 2, 3):
        checkpoint.commit(run, payload(epoch), epoch, epoch * 10, {"test_accuracy": epoch / 10}, keep_last)
    return run


def test_commit_writes_payload_manifest_pointer_and_loads_weights_only(tmp_path):
    run = commit_three(tmp_path)
    names = run.list("checkpoints")
    assert "latest.json" in names and "e00003-s0000000030.pt" in names and "e00003-s0000000030.json" in names
    pointer = json.loads(run.read("checkpoints/latest.json"))
    assert pointer["epoch"] == 3 and pointer["step"] == 30 and pointer["metrics"] == {"test_accuracy": 0.3}
    raw = run.read(f"checkpoints/{pointer['file']}")
    assert len(raw) == pointer["size"]
    plain = torch.load(io.BytesIO(raw), weights_only=True)  # what any user can do with it
    assert plain["progress"]["epoch"] == 3
    loaded, manifest = checkpoint.load_latest(run)
    assert manifest["step"] == 30 and torch.equal(loaded["model"]["weight"], plain["model"]["weight"])


def test_retention_keeps_the_newest(tmp_path):
    run = commit_three(tmp_path, keep_last=2)
    stems = sorted({n.rsplit(".", 1)[0] for n in run.list("checkpoints")} - {"latest"})
    assert stems == ["e00002-s0000000020", "e00003-s0000000030"]


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete", "pointer"])
def test_damaged_newest_falls_back_to_previous(tmp_path, damage, capsys):
    run = commit_three(tmp_path)
    newest = run.path("checkpoints/e00003-s0000000030.pt")
    if damage == "corrupt":
        data = bytearray(newest.read_bytes())
        data[len(data) // 2] ^= 0xFF
        newest.write_bytes(bytes(data))
    elif damage == "truncate":
        newest.write_bytes(newest.read_bytes()[:100])
    elif damage == "delete":
        newest.unlink()
    else:
        run.path("checkpoints/latest.json").write_text("{not json")
    loaded, manifest = checkpoint.load_latest(run)
    expected_step = 30 if damage == "pointer" else 20
    assert manifest["step"] == expected_step and loaded["progress"]["step"] == expected_step
    if damage != "pointer":
        err = capsys.readouterr().err
        assert "warning:" in err and "using an older checkpoint" in err


def test_no_good_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    run = commit_three(tmp_path)
    for name in run.list("checkpoints"):
        if name.endswith(".pt"):
            run.path(f"checkpoints/{name}").write_bytes(b"junk")
    with pytest.raises(CheckpointError, match="no checkpoint verifies"):
        checkpoint.load_latest(run)
    assert checkpoint.load_latest(RunDir(str(tmp_path / "empty"))) is None


def test_a_payload_never_committed_is_not_a_checkpoint(tmp_path, capsys):
    """A kill between a commit's payload and its manifest leaves a .pt that no manifest or pointer names: the commit
    never happened, so a first commit cut short starts the run afresh, and a later one leaves the last commit."""
    run = RunDir(str(tmp_path / "run"))
    orphan = run.path("checkpoints/e00001-s0000000010.pt")
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"cut short")
    assert checkpoint.load_latest(run) is None
    assert "e00001-s0000000010.pt" in capsys.readouterr().err  # named, as not committed
    checkpoint.commit(run, payload(1), 1, 10, {}, 5)
    run.path("checkpoints/e00002-s0000000020.pt").write_bytes(b"cut short")
    _, manifest = checkpoint.load_latest(run)
    assert manifest["step"] == 10


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_refuses_checkpoints_that_need_unpickling_code(tmp_path):
    evil = tmp_path / "evil.pt"
    torch.save({"format": 1, "model": {}, "x": Evil()}, evil)
    with pytest.raises(CheckpointError, match="refusing to load it"):
        checkpoint.load_url(str(evil))
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        checkpoint.load_url(str(tmp_path / "missing.pt"))
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.ones(2)}, other)
    with pytest.raises(CheckpointError, match="not a checkpoint of this job"):
        checkpoint.load_url(str(other))


def test_rng_state_round_trip():
    import random

    import numpy as np

    state = rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    buf = io.BytesIO()
    torch.save(state, buf)
    set_rng_state(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_keep_best_keeps_the_most_accurate_beside_the_newest(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    for epoch, accuracy in ((1, 0.5), (2, 0.9), (3, 0.6), (4, 0.7)):
        checkpoint.commit(run, payload(epoch), epoch, epoch * 10, {"test_accuracy": accuracy}, 1, keep_best=True)
    stems = sorted({n.rsplit(".", 1)[0] for n in run.list("checkpoints")} - {"latest"})
    assert stems == ["e00002-s0000000020", "e00004-s0000000040"]
    _, manifest = checkpoint.load_latest(run)
    assert manifest["epoch"] == 4


def test_recover_sends_what_an_earlier_attempt_left_unless_the_store_holds_another_run(capsys):
    def leftover(url: str, name: str, run_id: str) -> RunDir:
        """A staging folder as an attempt leaves it when the store went away after a local commit."""
        run = RunDir(url)
        run.prepare()
        pointer = json.dumps({"file": f"{name}.pt", "run": run_id}).encode()
        for rel, data in ((f"checkpoints/{name}.pt", b"payload"), ("checkpoints/latest.json", pointer)):
            run.path(rel).parent.mkdir(parents=True, exist_ok=True)
            run.path(rel).write_bytes(data)
        return run

    fs = fsspec.filesystem("memory")
    stored = {"file": "e00001-s0000000001.pt", "run": "a"}
    fs.pipe_file("/rec/same/checkpoints/latest.json", json.dumps(stored).encode())
    same = leftover("memory://rec/same", "e00002-s0000000002", "a")
    assert checkpoint.recover(same) == "e00002-s0000000002"
    assert fs.cat_file("/rec/same/checkpoints/e00002-s0000000002.pt") == b"payload"
    assert json.loads(fs.cat_file("/rec/same/checkpoints/latest.json"))["file"] == "e00002-s0000000002.pt"
    assert same.staged_files() == []

    fs.pipe_file("/rec/other/checkpoints/latest.json", json.dumps({**stored, "run": "b"}).encode())
    other = leftover("memory://rec/other", "e00009-s0000000009", "a")
    assert checkpoint.recover(other) is None
    assert "now holds another run" in capsys.readouterr().err
    assert not fs.exists("/rec/other/checkpoints/e00009-s0000000009.pt") and other.staged_files() == []


@pytest.mark.parametrize(
    "make, saved_how, resumed_how",
    [
        (lambda ps, **kw: torch.optim.SGD(ps, lr=0.1, momentum=0.9, **kw), {"foreach": True}, {"foreach": False}),
        (lambda ps, **kw: torch.optim.AdamW(ps, lr=0.1, **kw), {"fused": True}, {"foreach": False}),
        (lambda ps, **kw: torch.optim.AdamW(ps, lr=0.1, **kw), {"foreach": False}, {"fused": True}),
    ],
)
def test_restore_keeps_how_this_device_runs_the_optimizer(make, saved_how, resumed_how):
    """A checkpoint from one device's kernels (a GPU's fused ones) resumes with this device's, state intact, and
    the next step is the step the saving optimizer would have taken."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = make(model.parameters(), **saved_how)
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    other = nn.Linear(3, 2)
    other.load_state_dict(model.state_dict())
    fresh = make(other.parameters(), **resumed_how)
    checkpoint.load_optimizer(fresh, loaded)
    group = fresh.param_groups[0]
    assert all(group[k] == v for k, v in resumed_how.items()) and group["lr"] == 0.1
    for m, o in ((model, opt), (other, fresh)):
        o.zero_grad()
        m(torch.ones(1, 3)).sum().backward()
        o.step()
    assert torch.allclose(model.weight, other.weight, atol=1e-6) and torch.allclose(model.bias, other.bias, atol=1e-6)


def test_checkpoints_are_ordered_by_epoch_and_step_as_numbers_past_99999_epochs(tmp_path):
    """Names are zero-padded to 5 epoch digits: from epoch 100,000 on they no longer sort as text. The newest is the
    one with the highest (epoch, step), for retention, loading and the fallback search alike."""
    run = RunDir(str(tmp_path / "run"))
    for epoch in (99_998, 99_999, 100_000, 100_001):
        checkpoint.commit(run, payload(1), epoch, epoch * 2, {}, keep_last=2)
        assert json.loads(run.read("checkpoints/latest.json"))["epoch"] == epoch
    kept = sorted(n for n in run.list("checkpoints") if checkpoint.is_manifest(n))
    assert kept == ["e100000-s0000200000.json", "e100001-s0000200002.json"]  # the newest two, never the older
    assert checkpoint.load_latest(run)[1]["epoch"] == 100_001
    run.delete("checkpoints/latest.json")  # the fallback search by manifests orders them the same way
    assert checkpoint.load_latest(run)[1]["epoch"] == 100_001
    assert sorted(["e100000-s0000200000", "e99999-s0000199998", "e00002-s9"], key=checkpoint.order) == [
        "e00002-s9",
        "e99999-s0000199998",
        "e100000-s0000200000",
    ]


def test_the_newest_checkpoint_follows_the_pointer_and_never_another_runs(tmp_path):
    """A folder holding another run's checkpoints beside this run's (left by an older version, or copied in): the
    pointer names the run, and the fallback search stays within that run."""
    run = RunDir(str(tmp_path / "run"))
    checkpoint.commit(run, payload(1), 1, 10, {}, keep_last=5, run_id="a")
    other = checkpoint.commit(run, payload(5), 5, 50, {}, keep_last=5, run_id="b")
    pointer_a = checkpoint.commit(run, payload(2), 2, 20, {}, keep_last=5, run_id="a")
    assert other > "" and checkpoint.read_pointer(run.read("checkpoints/latest.json"))["run"] == "a"
    assert checkpoint.load_latest(run)[1]["file"] == f"{pointer_a}.pt"  # not b's newer epoch 5
    run.write(f"checkpoints/{pointer_a}.pt", b"damaged")
    assert checkpoint.load_latest(run)[1]["file"] == "e00001-s0000000010.pt"  # a's older one, never b's
