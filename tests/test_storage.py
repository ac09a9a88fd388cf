import fsspec
import pytest

from job.errors import StorageError
from job.storage import RunDir


def test_local_run_writes_in_place_atomically(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    assert not run.remote and run.local == tmp_path / "run"
    run.prepare()
    run.write("a/b.txt", b"one")
    run.write("a/b.txt", b"two")
    assert (tmp_path / "run/a/b.txt").read_bytes() == b"two"
    assert [p.name for p in (tmp_path / "run/a").iterdir()] == ["b.txt"]  # no temporary files left
    assert run.read("a/b.txt") == b"two" and run.read("a/none") is None
    assert run.list("a") == ["b.txt"] and run.list("nothing") == []
    run.delete("a/b.txt")
    assert run.list("a") == []


def test_remote_run_stages_locally_and_mirrors():
    run = RunDir("memory://bucket/runs/r1")
    assert run.remote and run.local.is_dir()
    run.prepare()
    run.write("checkpoints/x.json", b"{}")
    (run.path("tensorboard")).mkdir()
    run.path("tensorboard/events.1").write_bytes(b"e")
    run.upload_tree("tensorboard")
    fs = fsspec.filesystem("memory")
    assert fs.cat_file("/bucket/runs/r1/checkpoints/x.json") == b"{}"
    assert fs.cat_file("/bucket/runs/r1/tensorboard/events.1") == b"e"
    assert not fs.exists("/bucket/runs/r1/.probe")
    assert run.has_run() is True
    run.delete("checkpoints/x.json")
    assert not fs.exists("/bucket/runs/r1/checkpoints/x.json")
    local = run.local
    run.close()
    assert not local.exists()


def test_unwritable_output_is_a_storage_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StorageError, match="cannot write the output folder"):
        RunDir(str(blocker / "run")).prepare()
    with pytest.raises(StorageError, match="not a usable output URL"):
        RunDir("nosuchproto://x/y")
