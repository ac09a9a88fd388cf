import time

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


def test_growing_files_are_sent_by_their_new_bytes(bucket):
    run = RunDir(bucket.url("run"))
    run.prepare()
    run.start_sync()
    events = run.path("tensorboard/events.out.tfevents.1")
    events.parent.mkdir(parents=True)
    sent = b""
    for i in range(5):
        chunk = bytes([65 + i]) * (1000 + i)
        with open(events, "ab") as f:
            f.write(chunk)
        sent += chunk
        run.upload_tree("tensorboard")
        assert run.uploader.wait(30)
        assert bucket.fs.cat_file(f"{bucket.name}/run/tensorboard/events.out.tfevents.1") == sent
    assert run.uploader.sent["tensorboard/events.out.tfevents.1"] == (len(sent), 4)  # 1 whole upload, 4 composes
    run.finish()
    assert bucket.names("run") == ["tensorboard/events.out.tfevents.1"]  # no compose parts left behind


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


def test_pointer_arrives_as_queued_after_its_checkpoint_and_no_file_is_skipped():
    sent = []

    class SlowStore(RunDir):
        def send(self, rel, data):
            if rel.endswith(".pt"):
                time.sleep(0.02)  # payloads upload slower than commits come: the queue grows
            sent.append((rel, data))
            super().send(rel, data)

    run = SlowStore("memory://bucket/runs/order")
    run.prepare()
    run.start_sync()
    for i in range(1, 7):
        run.write(f"checkpoints/{i}.pt", b"p" * i)
        run.write(f"checkpoints/{i}.json", b"m")
        run.write("checkpoints/latest.json", str(i).encode())
        if i > 1:  # keep_last=1: prune the previous one
            run.delete(f"checkpoints/{i - 1}.json")
            run.delete(f"checkpoints/{i - 1}.pt")
    assert run.list("checkpoints") == ["6.json", "6.pt", "latest.json"]  # the run's own view, deletions included
    run.finish()
    names = [rel for rel, _ in sent]
    pointers = [data for rel, data in sent if rel.endswith("latest.json")]
    assert pointers == [b"1", b"2", b"3", b"4", b"5", b"6"]  # each as it was when its commit queued it
    pointer_at = [k for k, rel in enumerate(names) if rel.endswith("latest.json")]
    for i, at in enumerate(pointer_at, start=1):  # payload, then manifest, then the pointer naming them
        assert names.index(f"checkpoints/{i}.pt") < names.index(f"checkpoints/{i}.json") < at
    fs = fsspec.filesystem("memory")
    assert sorted(fs.ls("/bucket/runs/order/checkpoints", detail=False)) == [
        "/bucket/runs/order/checkpoints/6.json",
        "/bucket/runs/order/checkpoints/6.pt",
        "/bucket/runs/order/checkpoints/latest.json",
    ]
