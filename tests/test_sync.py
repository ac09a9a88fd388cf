"""The uploader on its own: a local folder mirrored to a store in the order asked, from one thread, with no RunDir."""

import time
from pathlib import Path

import fsspec
from fsspec.implementations.memory import MemoryFileSystem

from job.storage.sync import Uploader


class SlowMemory(MemoryFileSystem):
    """An in-memory store whose uploads of payloads take a while, and which records what arrives, in order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.arrived: list[tuple[str, bytes]] = []

    def pipe_file(self, path, value, **kwargs):
        if path.endswith(".pt"):
            time.sleep(0.02)  # payloads upload slower than commits come: the queue grows
        self.arrived.append((path.rsplit("/", 1)[-1], value))
        return super().pipe_file(path, value, **kwargs)


def uploader(local: Path, fs, root: str, timeout_s: float = 30.0) -> Uploader:
    return Uploader(local, lambda rel: (fs, f"{root}/{rel}"), timeout_s, tree_every_s=30.0)


def write(local: Path, rel: str, data: bytes) -> None:
    (local / rel).parent.mkdir(parents=True, exist_ok=True)
    (local / rel).write_bytes(data)


def test_pointer_arrives_as_queued_after_its_checkpoint_and_no_file_is_skipped(tmp_path):
    fs = SlowMemory(skip_instance_cache=True)
    up = uploader(tmp_path, fs, "/order")
    for i in range(1, 7):
        for rel, data in ((f"ck/{i}.pt", b"p" * i), (f"ck/{i}.json", b"m"), ("ck/latest.json", str(i).encode())):
            write(tmp_path, rel, data)
            up.put(rel)
        if i > 1:  # keep_last=1: prune the previous one
            up.delete(f"ck/{i - 1}.json")
            up.delete(f"ck/{i - 1}.pt")
    assert up.wait(30)
    up.stop()
    names = [name for name, _ in fs.arrived]
    assert [data for name, data in fs.arrived if name == "latest.json"] == [str(i).encode() for i in range(1, 7)]
    pointer_at = [k for k, name in enumerate(names) if name == "latest.json"]
    for i, at in enumerate(pointer_at, start=1):  # payload, then manifest, then the pointer naming them
        assert names.index(f"{i}.pt") < names.index(f"{i}.json") < at
    assert sorted(fs.ls("/order/ck", detail=False)) == ["/order/ck/6.json", "/order/ck/6.pt", "/order/ck/latest.json"]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["6.json", "6.pt", "latest.json"]


def test_a_delete_removes_the_stores_copy_then_the_local_one_and_counts_until_done(tmp_path):
    fs = SlowMemory(skip_instance_cache=True)
    up = uploader(tmp_path, fs, "/del")
    write(tmp_path, "a.pt", b"payload")
    up.put("a.pt")
    up.delete("a.pt")
    assert up.deleting("a.pt") and not up.deleting("b.pt")  # gone as far as readers are concerned, at once
    assert up.wait(30)
    assert not up.deleting("a.pt")
    assert [name for name, _ in fs.arrived] == ["a.pt"]  # sent first, as queued, then deleted
    assert not fs.exists("/del/a.pt") and not (tmp_path / "a.pt").exists()
    up.stop()


def test_growing_files_are_sent_by_their_new_bytes(bucket, tmp_path):
    up = uploader(tmp_path, bucket.fs, f"{bucket.name}/run")
    events = tmp_path / "tensorboard/events.out.tfevents.1"
    events.parent.mkdir(parents=True)
    sent = b""
    for i in range(5):
        chunk = bytes([65 + i]) * (1000 + i)
        with open(events, "ab") as f:
            f.write(chunk)
        sent += chunk
        up.tree("tensorboard")
        assert up.wait(30)
        assert bucket.fs.cat_file(f"{bucket.name}/run/tensorboard/events.out.tfevents.1") == sent
    assert up.sent["tensorboard/events.out.tfevents.1"] == (len(sent), 4)  # 1 whole upload, 4 composes
    up.stop()
    assert bucket.names("run") == ["tensorboard/events.out.tfevents.1"]  # no compose parts left behind


def test_a_local_store_gets_growing_files_by_appends(tmp_path):
    local, target = tmp_path / "staging", tmp_path / "drive"
    up = uploader(local, fsspec.filesystem("file"), str(target))
    events = local / "tb/events.1"
    events.parent.mkdir(parents=True)
    for chunk in (b"one ", b"two ", b"three"):
        with open(events, "ab") as f:
            f.write(chunk)
        up.tree("tb")
        assert up.wait(10)
    assert (target / "tb/events.1").read_bytes() == b"one two three"
    assert up.sent["tb/events.1"] == (13, 0)  # appended, not rewritten
    up.stop()


def test_a_store_that_refuses_uploads_is_given_up_with_the_queue_kept_in_order(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")  # the store's folder is a file: every upload fails
    up = uploader(tmp_path / "staging", fsspec.filesystem("file"), str(blocker), timeout_s=1.0)
    for rel in ("ck/1.pt", "ck/1.json", "ck/latest.json"):
        write(tmp_path / "staging", rel, b"x")
        up.put(rel)
    t0 = time.monotonic()
    assert not up.wait(30)  # gave up: False, long before the wait's own limit
    assert time.monotonic() - t0 < 15
    assert up.error.startswith("put ck/1.pt: ")
    assert [op.rel for op in up.pending()] == ["ck/1.pt", "ck/1.json", "ck/latest.json"]
    up.stop()


def test_an_atomic_write_makes_the_file_and_its_folder_entry_durable(tmp_path, monkeypatch):
    """fsync of the file, then of its folder after the rename: a crash right after a commit finds the new name."""
    import os

    from job.storage import sync

    synced = []
    real = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(sync.os, "fsync", spy)
    sync.write_atomic(tmp_path / "ck" / "latest.json", b"{}")
    assert (tmp_path / "ck/latest.json").read_bytes() == b"{}"
    assert synced[-1] == str(tmp_path / "ck") and len(synced) == 2  # the temporary file's data, then the folder


def stalled_store(gcs_server, delay_s: float):
    """A gcsfs client of the emulator behind a proxy that holds every request for `delay_s` before passing it on:
    a store that has stopped answering, without failing."""
    import gcsfs
    from faultproxy import FaultProxy

    proxy = FaultProxy(gcs_server, fail_rate=1.0, kinds=("delay",), delay_s=delay_s).start()
    fs = gcsfs.GCSFileSystem(endpoint_url=proxy.url, token="anon", skip_instance_cache=True, use_listings_cache=False)
    return proxy, fs


def test_the_upload_timeout_bounds_a_store_that_stops_answering(bucket, gcs_server, tmp_path):
    """output.upload_timeout_seconds is a bound on the whole wait, the store client's own retries and a request that
    never returns included: a file gets the timeout (plus a second per MiB) from its first try, then the uploader
    gives up with the queue kept."""
    proxy, fs = stalled_store(gcs_server, delay_s=60)
    try:
        up = uploader(tmp_path, fs, f"{bucket.name}/run", timeout_s=2.0)
        write(tmp_path, "ck/latest.json", b"{}")
        up.put("ck/latest.json")
        t0 = time.monotonic()
        assert not up.wait(40)
        assert time.monotonic() - t0 < 8
        assert up.error.startswith("put ck/latest.json: ") and [op.rel for op in up.pending()] == ["ck/latest.json"]
        up.stop()
    finally:
        proxy.stop()


def test_stop_ends_the_upload_under_way_and_the_thread_with_it(bucket, gcs_server, tmp_path):
    """stop() (a failed run abandoning its uploads) cancels the request in flight and returns once the uploader's
    thread has ended: nothing it does can land after a next attempt's uploader has started."""
    proxy, fs = stalled_store(gcs_server, delay_s=60)
    try:
        up = uploader(tmp_path, fs, f"{bucket.name}/run", timeout_s=120.0)
        write(tmp_path, "ck/latest.json", b"{}")
        up.put("ck/latest.json")
        time.sleep(1.0)  # the request is under way, held by the store
        t0 = time.monotonic()
        up.stop()
        assert time.monotonic() - t0 < 3 and not up._thread.is_alive()
        assert [op.rel for op in up.pending()] == ["ck/latest.json"]  # still to send, by the next attempt
    finally:
        proxy.stop()


def test_a_file_put_only_where_none_is_also_where_the_filesystem_refuses_a_hard_link(tmp_path):
    """Drive's and Cloud Storage's FUSE mounts have no hard links: the kernel refuses os.link there as it refuses a
    link across filesystems (here, a file in /dev/shm linked into tmp_path), and the create-if-absent still holds."""
    import os

    import pytest

    from job.storage.sync import link_or_create

    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the test's folder")
    made = shm / f"job-test-{os.getpid()}"
    for target, data in ((tmp_path / "lease.json", b"first"), (tmp_path / "lease.json", b"second")):
        made.write_bytes(data)
        try:
            link_or_create(made, target, data)
        except FileExistsError:
            assert data == b"second"  # refused: something is there
        finally:
            made.unlink(missing_ok=True)
    assert (tmp_path / "lease.json").read_bytes() == b"first"
