import fsspec
import pytest

from job.errors import StorageError
from job.storage.run_folder import RunDir


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


def test_remote_run_stages_locally_and_mirrors_in_order():
    run = RunDir("memory://bucket/runs/r1")
    assert run.remote and run.local != "memory://bucket/runs/r1"
    run.prepare()
    run.start_sync()
    for i in range(20):  # payloads, manifests and pointers in the order written
        run.write(f"checkpoints/{i}.pt", b"p" * i)
        run.write("checkpoints/latest.json", str(i).encode())
    run.path("tensorboard").mkdir()
    run.path("tensorboard/events.1").write_bytes(b"e")
    run.upload_tree("tensorboard")
    assert run.list("checkpoints")[:2] == ["0.pt", "1.pt"]  # the run's own view needs no round trip
    run.delete("checkpoints/0.pt")
    run.finish()
    fs = fsspec.filesystem("memory")
    assert fs.cat_file("/bucket/runs/r1/checkpoints/latest.json") == b"19"
    assert fs.cat_file("/bucket/runs/r1/checkpoints/19.pt") == b"p" * 19
    assert fs.cat_file("/bucket/runs/r1/tensorboard/events.1") == b"e"
    assert not fs.exists("/bucket/runs/r1/checkpoints/0.pt") and not fs.exists("/bucket/runs/r1/.probe")
    assert run.staged_files() == []  # everything is in the store: the staging copy is gone
    assert RunDir("memory://bucket/runs/r1").has_run()


def test_routes_send_files_to_other_folders(bucket):
    run = RunDir(bucket.url("ckpt"), routes={"tensorboard": bucket.url("logs"), "model.pt": bucket.url("m/model.pt")})
    run.prepare()
    run.start_sync()
    run.write("model.pt", b"w")
    run.write("config.yaml", b"c")
    run.path("tensorboard").mkdir(parents=True)
    run.path("tensorboard/events.x").write_bytes(b"e")
    run.upload_tree("tensorboard")
    run.finish()
    assert bucket.names() == ["ckpt/config.yaml", "logs/events.x", "m/model.pt"]


def test_staged_local_output_is_copied_in_the_background(tmp_path):
    target = tmp_path / "drive" / "MyDrive" / "run"
    run = RunDir(str(target), staged=True)
    assert run.remote and run.local != target
    run.prepare()
    run.start_sync()
    run.write("checkpoints/a.pt", b"payload")
    events = run.path("tensorboard/events.out.tfevents.1")
    events.parent.mkdir(parents=True)
    for chunk in (b"one ", b"two ", b"three"):
        with open(events, "ab") as f:
            f.write(chunk)
        run.upload_tree("tensorboard")
        assert run.uploader.wait(10)
    assert (target / "tensorboard/events.out.tfevents.1").read_bytes() == b"one two three"
    assert run.uploader.sent["tensorboard/events.out.tfevents.1"] == (13, 0)  # appended, not rewritten
    run.finish()
    assert (target / "checkpoints/a.pt").read_bytes() == b"payload"
    assert run.staged_files() == [] and not list(target.rglob(".*"))


def test_unwritable_output_is_a_storage_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StorageError, match="cannot write the output folder"):
        RunDir(str(blocker / "run")).prepare()
    with pytest.raises(StorageError, match="not a usable URL"):
        RunDir("nosuchproto://x/y")


def test_network_filesystem_reads_the_mount_of_the_path():
    from job.storage.run_folder import network_filesystem

    assert network_filesystem("/proc/self") == ""  # proc: no network filesystem
