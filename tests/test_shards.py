"""Shards: `job shard` packs an image folder into the WebDataset layout, shards written by a plain tarfile script
load, a stream's position restores exactly, streamed runs resume bit for bit after SIGTERM, read from gs:// through
a faulty store, split over torchrun's processes with every sample seen once, and hold memory flat in data size."""

import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    assert_same_run,
    encode,
    invoke,
    job_env,
    metrics,
    pattern_images,
    run_job,
    scalars,
    sets,
    start_job,
    tar_folder,
    write_image_folder,
)
from faultproxy import FaultProxy

from job.data.decode import auto_workers
from job.data.sample_stream import Part, SampleStream, saved
from job.data.shard_sets import open_shards
from job.data.stream import Decoder, StreamLoader, deal
from job.group.memory import peak_tree_rss

STREAM = ["--device", "cpu", "--config", "cifar10", *sets("data.kind=shards", "data.placement=stream")]


def shard_names(root: Path, split: str) -> list[Path]:
    return sorted((root / split).glob("*.tar"))


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    """60 train / 15 test 16x16 PNG images in 3 classes, packed 8 samples a shard."""
    root = tmp_path_factory.mktemp("packed")
    src = write_image_folder(root / "images", per_class=20, test_per_class=5)
    code, err = invoke(["shard", str(src), str(root / "shards"), "--samples-per-shard", "8", "--val-split", "0"])
    assert code == 0, err
    return root / "shards"


def test_shard_writes_the_webdataset_layout_with_an_index(packed):
    index = json.loads((packed / "index.json").read_text())
    assert (packed / "classes.txt").read_text().split() == ["class0", "class1", "class2"]
    for split, n in (("train", 60), ("test", 15)):
        tars = shard_names(packed, split)
        assert len(tars) == -(-n // 8) and [e["nsamples"] for e in index["splits"][split]][0] == 8
        seen, labels = 0, []
        for t in tars:
            with tarfile.open(t) as tar:
                names = tar.getnames()
                assert len(names) % 2 == 0 and all(n.endswith((".png", ".cls")) for n in names)
                labels += [int(tar.extractfile(m).read()) for m in tar if m.name.endswith(".cls")]
            seen += len(names) // 2
        assert seen == n == sum(e["nsamples"] for e in index["splits"][split])
        assert sorted(set(labels)) == [0, 1, 2]
    with tarfile.open(shard_names(packed, "train")[0]) as tar:
        first = [int(tar.extractfile(m).read()) for m in tar.getmembers() if m.name.endswith(".cls")]
    assert len(set(first)) > 1  # shuffled across shards: the folder's order would put one class first


def test_shard_again_is_a_no_op_and_another_source_is_refused(packed, tmp_path):
    before = {p: p.stat().st_mtime_ns for p in packed.rglob("*")}
    source = json.loads((packed / "index.json").read_text())["source"]
    code, err = invoke(["shard", source, str(packed), "--val-split", "0"])
    assert code == 0 and "already packed" in err
    assert {p: p.stat().st_mtime_ns for p in packed.rglob("*")} == before
    code, err = invoke(["shard", source, str(packed), "--val-split", "0.2"])  # another split: not this pack
    assert code == 2 and "--val-split 0.0" in err and "Traceback" not in err
    other = write_image_folder(tmp_path / "other")
    code, err = invoke(["shard", str(other), str(packed)])
    assert code == 2 and "packed from" in err and "Traceback" not in err


def test_shard_from_a_tar_gz_and_a_bad_image_named_and_skipped(tmp_path):
    src = write_image_folder(tmp_path / "images")
    archive = tar_folder(src, tmp_path / "images.tar.gz", "images")
    code, err = invoke(["shard", str(archive), str(tmp_path / "a")])
    assert code == 0, err
    assert len(shard_names(tmp_path / "a", "train")) == 1
    (src / "train" / "class1" / "0013.png").write_bytes(b"not an image")
    code, err = invoke(["shard", str(src), str(tmp_path / "b"), "--val-split", "0"])
    assert code == 0 and "skipped train/class1/0013.png: not an image file" in err and "Traceback" not in err
    index = json.loads((tmp_path / "b" / "index.json").read_text())
    assert [s["path"] for s in index["inventory"]["skipped"]] == ["train/class1/0013.png"]
    assert sum(e["nsamples"] for e in index["splits"]["train"]) == 35  # 36 images, one skipped
    code, err = invoke(["shard", str(tmp_path / "missing"), str(tmp_path / "c")])
    assert code == 3 and err.count("error:") == 1 and "Traceback" not in err
    assert not (tmp_path / "c").exists()  # a failed start leaves no folder behind


def plain_shards(root: Path, n_train: int = 40, n_test: int = 12, per_shard: int = 10) -> Path:
    """Shards as another tool writes them: tarfile's default (pax) format, keys with folders in them, JPEG and PNG
    mixed, no index.json and no classes.txt."""
    for split, n, seed in (("train", n_train, 0), ("test", n_test, 1)):
        images, labels = pattern_images(4, n // 4, 12, seed)
        (root / split).mkdir(parents=True)
        for s in range(0, n, per_shard):
            with tarfile.open(root / split / f"part-{s // per_shard:03d}.tar", "w") as tar:
                for i in range(s, min(n, s + per_shard)):
                    for name, data in (
                        (
                            f"photos/batch{i % 3}/img{i:05d}.{'jpg' if i % 2 else 'png'}",
                            encode(images[i], "jpg" if i % 2 else "png"),
                        ),
                        (f"photos/batch{i % 3}/img{i:05d}.cls", str(labels[i]).encode()),
                    ):
                        member = tarfile.TarInfo(name)
                        member.size = len(data)
                        tar.addfile(member, io.BytesIO(data))
    return root


def test_shards_written_by_tarfile_load_and_train(tmp_path):
    root = plain_shards(tmp_path / "plain")
    shards = open_shards(str(root), tmp_path / "cache", lambda line: None)
    assert [s.samples for s in shards.splits["train"]] == [10, 10, 10, 10] and shards.classes == ["0", "1", "2", "3"]
    args = [*STREAM, *sets(f"data.path={root}", "train.epochs=1", "data.batch_size=8", "model.name=mlp")]
    code, err = invoke(["train", *args, "--output", str(tmp_path / "run")])
    assert code == 0, err
    assert metrics(str(tmp_path / "run"))[-1]["test_accuracy"] >= 0


def test_a_stream_resumed_from_any_position_goes_on_exactly(packed):
    urls = [Part(s.url, s.samples) for s in open_shards(str(packed), None, lambda line: None).splits["train"]]
    whole = [(s.key, s.shard) for s in SampleStream(urls, 16, (7, 0))]
    assert sorted(k for k, _ in whole) == sorted({k for k, _ in whole}) and len(whole) == 60
    assert [k for k, _ in whole] != [s.key for s in SampleStream(urls, 0, (7, 0))]  # the buffer shuffles
    for cut in (1, 17, 33, 59):
        stream = SampleStream(urls, 16, (7, 0))
        it = iter(stream)
        head = [next(it).key for _ in range(cut)]
        place = json.loads(json.dumps(saved(stream.position())))  # as a checkpoint keeps it
        rest = [s.key for s in SampleStream(urls, 16, (7, 0), place)]
        assert head + rest == [k for k, _ in whole], cut


def test_shards_dealt_over_processes_cover_the_epoch_once_with_zero_weight_padding(packed):
    shards = open_shards(str(packed), None, lambda line: None).splits["train"]  # 8 shards: 7 of 8, one of 4
    hands = deal(shards, 3)
    assert sorted(p.url for h in hands for p in h) == [s.url for s in shards]
    decoder = Decoder(0, None)
    loaders = [StreamLoader(shards, 6, torch.device("cpu"), decoder, rank=r, world=3) for r in range(3)]
    assert len({len(x) for x in loaders}) == 1
    steps = len(loaders[0])
    seen = []
    for loader in loaders:
        batches = list(loader.batches())
        assert len(batches) == steps
        for b in batches:
            assert (b.weight > 0) == (b.own > 0)
            if b.own:
                seen += [bytes(img.numpy().tobytes()) for img in (b.x * 255).round().to(torch.uint8)]
    assert len(seen) == 60 and len(set(seen)) == 60
    for i in range(steps):  # the processes' weights average to one over each step (DDP divides by 3)
        assert sum(x.loss_weight(i) for x in loaders) == pytest.approx(3.0)


RECORDER = """
import os, signal
import torch
from torch import nn

class Net(nn.Module):
    '''A linear model over 3x16x16 images that writes the first pixels of every training sample it sees to
    $RECORD.<rank> and sends its process SIGTERM in training step $STOP_AT_STEP (from 1; unset: never).'''

    def __init__(self, num_classes):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, num_classes))
        self.steps, self.at = 0, int(os.environ.get("STOP_AT_STEP", "0"))

    def forward(self, x):
        if self.training:
            self.steps += 1
            if self.steps == self.at:
                os.kill(os.getpid(), signal.SIGTERM)
            if os.environ.get("RECORD"):
                ids = (x.flatten(1)[:, :24] * 255).round().to(torch.uint8)
                with open(f"{os.environ['RECORD']}.{os.environ.get('RANK', '0')}", "a") as f:
                    f.writelines(row.numpy().tobytes().hex() + "\\n" for row in ids)
        return self.net(x)
"""


@pytest.fixture
def recorder(tmp_path) -> dict:
    (tmp_path / "recorder.py").write_text(RECORDER)
    return {"PYTHONPATH": str(tmp_path)}


def image_ids(shards_root: Path) -> list[str]:
    """The same first pixels of every training image in the shards, decoded as the job decodes them."""
    from job.data.stream import read_all

    split = read_all(open_shards(str(shards_root), None, lambda line: None).splits["train"], Decoder(0, None))
    return [row.numpy().tobytes().hex() for row in split.x.flatten(1)[:, :24]]


RECORDED = [
    *STREAM,
    *sets("model.name=recorder:Net", "train.step_capture=off", "data.batch_size=4", "train.log_every_steps=5"),
]


def test_sigterm_mid_epoch_of_a_stream_commits_and_resumes_exactly(packed, recorder, tmp_path):
    """60 samples in batches of 4: 15 steps an epoch; the model stops its process in step 22 (epoch 2)."""
    args = [*RECORDED, *sets(f"data.path={packed}", "train.epochs=3", "data.random_hflip=true")]
    out = tmp_path / "cut"
    stopped = run_job("train", *args, "--output", str(out), env={**recorder, "STOP_AT_STEP": "22"})
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    assert "in epoch 2 at step 22" in stopped.stderr
    again = run_job("train", *args, "--output", str(out), env=recorder)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "7 steps into epoch 2" in again.stderr
    reference = run_job("train", *args, "--output", str(tmp_path / "ref"), env=recorder)
    assert reference.returncode == 0, reference.stderr[-2000:]
    assert_same_run(str(tmp_path / "ref"), str(out))


def test_torchrun_processes_see_disjoint_samples_covering_the_epoch(tmp_path, recorder):
    src = write_image_folder(tmp_path / "images", per_class=20, test_per_class=4)
    code, err = invoke(
        ["shard", str(src), str(tmp_path / "sh"), "--samples-per-shard", "10", "--val-split", "0"]
    )  # 6 shards
    assert code == 0, err
    record = tmp_path / "seen"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "job", "train"]
    args = [*RECORDED, *sets(f"data.path={tmp_path / 'sh'}", "train.epochs=1", "data.batch_size=8")]
    env = {**job_env(recorder["PYTHONPATH"]), "RECORD": str(record)}
    # A timeout: decoding processes left behind by the workers would hold stderr open, and the run would never end.
    run = [*cmd, *args, "--output", str(tmp_path / "run")]
    done = subprocess.run(run, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = [Path(f"{record}.{r}").read_text().split() for r in range(2)]
    assert len(seen[0]) == len(seen[1]) == 30  # 3 shards of 10 each, 4 a step: 8 steps, no padding
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == sorted(image_ids(tmp_path / "sh"))


def test_streaming_from_gcs_through_a_store_failing_mid_shard(tmp_path, bucket, gcs_server):
    """Shards on the GCS emulator read through a proxy that resets connections and answers 503: downloads in 4 KB
    requests, so each shard takes many and some fail mid-shard; the run ends as the one from local disk does."""
    src = write_image_folder(tmp_path / "images", per_class=20, test_per_class=4)
    code, err = invoke(["shard", str(src), bucket.url("sh"), "--samples-per-shard", "10", "--val-split", "0"])
    assert code == 0, err
    assert sorted(n.rsplit("/", 1)[-1] for n in bucket.names("sh/train")) == [f"train-{i:06d}.tar" for i in range(6)]
    code, err = invoke(["shard", str(src), str(tmp_path / "local"), "--samples-per-shard", "10", "--val-split", "0"])
    assert code == 0, err
    args = [
        *STREAM,
        *sets("data.batch_size=8", "model.name=mlp", "train.epochs=2", "data.cache=false", "train.log_every_steps=4"),
    ]
    small_reads = "import sys, job.data.sample_stream as s; s.CHUNK = 4096; from job.cli import main; main()"
    with FaultProxy(gcs_server, fail_rate=0.15, seed=3, kinds=("reset", "503")) as proxy:
        remote = subprocess.run(
            [
                sys.executable,
                "-c",
                small_reads,
                "train",
                *args,
                *sets(f"data.path={bucket.url('sh')}"),
                "--output",
                str(tmp_path / "g"),
            ],
            capture_output=True,
            text=True,
            env={**job_env(), "STORAGE_EMULATOR_HOST": proxy.url},
            timeout=300,
        )
        assert remote.returncode == 0, remote.stderr[-2000:]
        assert proxy.counts["reset"] + proxy.counts["503"] > 5 and proxy.counts["requests"] > 60
    local = run_job("train", *args, *sets(f"data.path={tmp_path / 'local'}"), "--output", str(tmp_path / "l"))
    assert local.returncode == 0, local.stderr[-2000:]
    assert_same_run(str(tmp_path / "l"), str(tmp_path / "g"))


@pytest.mark.parametrize("damage", ["header", "image"])
def test_a_corrupt_shard_is_named_in_one_line(packed, tmp_path, damage):
    bad = tmp_path / "bad"
    shutil.copytree(packed, bad)
    victim = shard_names(bad, "train")[3]
    data = bytearray(victim.read_bytes())
    size = int(data[124:136].rstrip(b"\0 "), 8)
    second = 512 + -(-size // 512) * 512  # the .cls member's header follows the first image
    if damage == "header":
        data[second + 148 : second + 156] = b"0000001\0"  # a checksum that cannot match
    else:
        data[512 + 40 : 512 + size - 20] = bytes(range(256)) * ((size - 60) // 256) + bytes((size - 60) % 256)
    victim.write_bytes(bytes(data))
    args = [*STREAM, *sets(f"data.path={bad}", "model.name=mlp", "train.epochs=1")]
    if damage == "image":  # a sample whose image cannot be decoded is skipped and named, or stops the run
        code, err = invoke(["train", *args, "--output", str(tmp_path / "s")])
        assert code == 0 and f"skipped a sample: cannot decode image {victim}" in err, err
        args += sets("data.skip_bad_samples=false")
    code, err = invoke(["train", *args, "--output", str(tmp_path / "r")])
    assert code == 3 and victim.name in err and "Traceback" not in err, err


def test_memory_of_a_stream_does_not_grow_with_the_data(tmp_path):
    """The same 64x64 shards listed once and ten times over (copies): 10x the data (9,000 images, 110 MB decoded),
    the same peak memory of the process and its decoders."""
    src = write_image_folder(tmp_path / "images", per_class=300, size=64, test_per_class=10)
    code, err = invoke(["shard", str(src), str(tmp_path / "x1"), "--samples-per-shard", "100", "--val-split", "0"])
    assert code == 0, err
    x10 = tmp_path / "x10"
    shutil.copytree(tmp_path / "x1" / "test", x10 / "test")
    for copy in range(10):
        for t in shard_names(tmp_path / "x1", "train"):
            (x10 / "train").mkdir(parents=True, exist_ok=True)
            shutil.copy(t, x10 / "train" / f"{copy}-{t.name}")
    peaks = {}
    for name in ("x1", "x10"):
        args = sets(f"data.path={tmp_path / name}", "model.name=mlp", "data.batch_size=100", "train.epochs=1")
        proc = start_job("train", *STREAM, *args, "--output", str(tmp_path / f"run-{name}"))
        peaks[name] = peak_tree_rss(proc)
        assert proc.wait() == 0, proc.stderr.read()[-2000:]
    assert peaks["x10"] < peaks["x1"] * 1.05 + 20e6, peaks  # in memory, x10 would hold 110 MB more


FOLDER_STREAM = [
    "--device",
    "cpu",
    "--config",
    "cifar10",
    *sets("data.kind=folder", "data.placement=stream", "model.name=recorder:Net", "train.step_capture=off"),
    *sets("data.batch_size=4", "train.log_every_steps=5"),
]


def test_an_image_folder_streams_from_shards_packed_once_and_resumes_elsewhere(tmp_path, recorder):
    """A folder with data.placement=stream is packed into the job's cache once; a run stopped mid-epoch and resumed
    on a machine without that cache (the cache wiped) packs the same shards again and ends as the run that never
    stopped, bit for bit."""
    src = write_image_folder(tmp_path / "images", per_class=20, test_per_class=5)  # 60 train, 15 test
    args = [*FOLDER_STREAM, *sets(f"data.path={src}", "train.epochs=2", "data.random_hflip=true")]
    cache = tmp_path / "cache"
    env = {**recorder, "JOB_CACHE_DIR": str(cache)}
    reference = run_job("train", *args, "--output", str(tmp_path / "ref"), env=env)
    assert reference.returncode == 0, reference.stderr[-2000:]
    assert "packing it into shards" in reference.stderr and "streamed" in reference.stderr
    packs = list((cache / "data" / "shards").glob("*-*"))
    assert len(packs) == 1 and len(list((packs[0] / "train").glob("*.tar"))) == 15  # 16 a split at least: 4 each
    out = tmp_path / "cut"
    stopped = run_job("train", *args, "--output", str(out), env={**env, "STOP_AT_STEP": "20"})
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    assert "from its shards" in stopped.stderr and "packing" not in stopped.stderr
    shutil.rmtree(cache)
    again = run_job("train", *args, "--output", str(out), env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "packing it into shards" in again.stderr and "5 steps into epoch 2" in again.stderr
    assert_same_run(str(tmp_path / "ref"), str(out))


def test_an_archive_streams_and_a_changed_one_is_packed_again(tmp_path):
    src = write_image_folder(tmp_path / "images", per_class=8, test_per_class=3, size=32)
    archive = tar_folder(src, tmp_path / "photos.tar.gz", "photos")
    cache = tmp_path / "cache"
    args = ["--device", "cpu", "--config", "cifar10", *sets("data.kind=folder", "data.placement=stream")]
    args += sets(f"data.path={archive}", "train.epochs=1", "data.batch_size=4")
    first = run_job("train", *args, "--output", str(tmp_path / "a"), env={"JOB_CACHE_DIR": str(cache)})
    assert first.returncode == 0, first.stderr[-2000:]
    assert "24 train / 9 test" in first.stderr and "streamed" in first.stderr
    (src / "train" / "class0" / "0000.png").unlink()
    tar_folder(src, archive, "photos")
    second = run_job("train", *args, "--output", str(tmp_path / "b"), env={"JOB_CACHE_DIR": str(cache)})
    assert second.returncode == 0, second.stderr[-2000:]
    assert "packing it into shards" in second.stderr and "23 train / 9 test" in second.stderr
    assert len(list((cache / "data" / "shards").glob("*-*"))) == 1  # the earlier version's pack removed


HOLD_A_PACK = """
import sys
from pathlib import Path
from job.data.files import source
from job.data.pack import packed_for_streaming
from job.data.split import HoldOut
packed = packed_for_streaming(source(sys.argv[1]), Path(sys.argv[2]), lambda line: None, HoldOut(0.1, 0.0, 42))
print(packed, flush=True)
sys.stdin.read()  # a run reading the pack until it ends
"""


def test_a_pack_another_run_reads_is_never_removed(tmp_path):
    """Runs over one folder with other split settings each keep their own pack; a pack made stale by a change to
    the folder is removed once no run reads it (a run still reading it keeps it), and a pack that fails (a column
    misspelt) removes nothing."""
    from conftest import job_env

    from job.data.files import source
    from job.data.manifest import Columns
    from job.data.pack import packed_for_streaming
    from job.data.split import HoldOut
    from job.errors import DataError

    src = write_image_folder(tmp_path / "images", per_class=6, test_per_class=2, size=8)
    cache = tmp_path / "cache"
    reader = subprocess.Popen(
        [sys.executable, "-c", HOLD_A_PACK, str(src), str(cache)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=job_env(),
    )  # fmt: skip
    try:
        read = Path(reader.stdout.readline().strip())
        assert (read / "index.json").is_file()
        other = packed_for_streaming(source(str(src)), cache, print, HoldOut(0.2, 0.0, 42))
        assert (read / "index.json").is_file() and (Path(other) / "index.json").is_file()
        (src / "train" / "class0" / "0000.png").unlink()
        changed = packed_for_streaming(source(str(src)), cache, print, HoldOut(0.1, 0.0, 42))
        assert Path(changed) != read and (read / "index.json").is_file()  # still read by the other run
    finally:
        reader.stdin.close()
        reader.wait(timeout=60)
    (src / "train" / "class0" / "0001.png").unlink()
    latest = packed_for_streaming(source(str(src)), cache, print, HoldOut(0.1, 0.0, 42))
    assert not read.exists() and (Path(changed) / "index.json").is_file()  # this process reads `changed` still
    assert (Path(other) / "index.json").is_file() and (Path(latest) / "index.json").is_file()
    table = tmp_path / "labels.csv"
    rows = [f"{p.relative_to(tmp_path).as_posix()},{c}\n" for c in (1, 2) for p in sorted(src.glob(f"*/class{c}/*"))]
    table.write_text("path,label\n" + "".join(rows))
    good = packed_for_streaming(source(str(table)), cache, print, HoldOut(0.5, 0.0, 42), Columns())
    with pytest.raises(DataError, match="no column 'kind'"):
        packed_for_streaming(source(str(table)), cache, print, HoldOut(0.5, 0.0, 42), Columns(label="kind"))
    assert (Path(good) / "index.json").is_file()


def members_of(pack: Path) -> dict[str, bytes]:
    """Every member of a pack's shards, by name."""
    out = {}
    for shard in sorted(pack.glob("*/*.tar")):
        with tarfile.open(shard) as tar:
            out |= {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    return out


def test_a_pack_to_stream_keeps_small_images_decoded_and_larger_ones_as_files(tmp_path):
    """A run's pack to stream keeps images of at most 64 x 64 pixels decoded (.npy members of the very pixels the
    files decode to; its index and the run's placement say so), so that a streamed epoch decodes nothing; larger
    images, and `job shard`'s shards, stay as their files. A run resumed from a checkpoint of a version whose packs
    kept every image as its file (a placement that records no `stored`) reads such a pack: its saved byte offsets
    point into it."""
    from PIL import Image

    from job.config import DataConfig
    from job.data.decode import decode_batch
    from job.data.pack import pack
    from job.data.placement import restored
    from job.data.preprocess import Preprocess
    from job.data.read import load_data

    small = write_image_folder(tmp_path / "small", per_class=4, test_per_class=2, size=16)
    files = sorted(small.glob("*/*/*.png"))
    expected = sorted(np.asarray(Image.open(f).convert("RGB")).tobytes() for f in files)
    cfg = DataConfig(kind="folder", path=str(small), placement="stream")
    data = load_data(cfg, tmp_path / "cache", print)
    stored = data.streaming.stored
    assert stored is not None and stored.decoded and "kept decoded" in stored.reason
    assert restored(data.streaming.saved()) == data.streaming  # what a checkpoint records of it
    got = members_of(Path(data.shards.url))
    arrays = [np.load(io.BytesIO(b)) for name, b in got.items() if name.endswith(".npy")]
    assert len(arrays) == len(files) and not any(n.endswith(".png") for n in got)
    assert sorted(a.tobytes() for a in arrays) == expected and {a.shape for a in arrays} == {(16, 16, 3)}
    one = next(b for name, b in got.items() if name.endswith(".npy"))
    held = decode_batch([("a", "npy", one), ("cut", "npy", one[:100])], Preprocess((32, 32), False), True)
    assert held.images.shape == (2, 3, 32, 32) and [i for i, _ in held.bad] == [1]  # resized; a cut one named

    legacy = restored({"streamed": True, "reason": "data.placement=stream"})  # a checkpoint of an earlier version
    old = load_data(cfg, tmp_path / "cache", print, legacy)
    assert old.streaming.stored is None and old.shards.url != data.shards.url
    assert sum(n.endswith(".png") for n in members_of(Path(old.shards.url))) == len(files)

    large = write_image_folder(tmp_path / "large", per_class=4, test_per_class=2, size=65)
    photos = load_data(cfg.model_copy(update={"path": str(large)}), tmp_path / "cache", print)
    assert not photos.streaming.stored.decoded
    assert not any(n.endswith(".npy") for n in members_of(Path(photos.shards.url)))
    index = pack(str(small), str(tmp_path / "shards"), print)  # job shard: the files, as ever
    assert "stored" not in index and not any(n.endswith(".npy") for n in members_of(tmp_path / "shards"))


def test_tables_and_cifar_batches_do_not_stream(tmp_path):
    code, err = invoke(["train", "--device", "cpu", "--set", "data.placement=stream", "--output", str(tmp_path / "r")])
    assert code == 2 and "data.placement=stream: streams the data kinds folder" in err and "csv data" in err
    assert not (tmp_path / "r").exists()


def test_a_folder_too_big_for_its_share_of_memory_streams_under_auto(tmp_path):
    """placement auto: 33 images of 32x32 take 101 KB decoded; with data.device_share at a billionth of the free
    memory (bytes, on any machine) the folder streams, and with the default share it is held in memory."""
    src = write_image_folder(tmp_path / "images", per_class=8, test_per_class=3, size=32)
    args = ["--device", "cpu", "--config", "cifar10", *sets("data.kind=folder", f"data.path={src}", "train.epochs=1")]
    env = {"JOB_CACHE_DIR": str(tmp_path / "cache")}
    small = run_job("train", *args, *sets("data.device_share=1e-9"), "--output", str(tmp_path / "s"), env=env)
    assert small.returncode == 0, small.stderr[-2000:]
    assert "would take 0.0 GB" in small.stderr and "streaming it" in small.stderr and "streamed" in small.stderr
    held = run_job("train", *args, "--output", str(tmp_path / "h"), env=env)
    assert held.returncode == 0, held.stderr[-2000:]
    assert "streaming" not in held.stderr and "held on the host" in held.stderr


def test_tensorboard_shows_when_the_input_is_the_bottleneck(tmp_path):
    """Noise PNGs of 256 x 256 (slow to decode) decoded and resized in the training process (data.workers=0) for a
    linear model over 8 x 8 inputs: most of the steps' time is the wait for their batches, and system/data_wait_s
    says so."""
    rng = np.random.default_rng(0)
    for split, n in (("train", 80), ("test", 4)):
        for i in range(n):
            folder = tmp_path / "images" / split / f"c{i % 2}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{i}.png").write_bytes(encode(rng.integers(0, 256, (3, 256, 256), dtype=np.uint8)))
    args = ["--device", "cpu", "--config", "cifar10", *sets("data.kind=folder", "data.placement=stream")]
    args += sets(f"data.path={tmp_path / 'images'}", "train.epochs=2", "data.workers=0", "data.batch_size=4")
    args += sets("data.image_size=8", "model.name=mlp", "model.hidden=[]", "train.log_every_steps=5")
    done = run_job("train", *args, "--output", str(tmp_path / "run"), env={"JOB_CACHE_DIR": str(tmp_path / "c")})
    assert done.returncode == 0, done.stderr[-2000:]
    step_time = dict(scalars(str(tmp_path / "run"), "system/step_time_s"))
    wait = dict(scalars(str(tmp_path / "run"), "system/data_wait_s"))
    assert list(wait) == list(step_time) == list(range(5, 41, 5))  # 80 samples: 20 steps an epoch
    assert all(0 < wait[s] <= step_time[s] for s in wait)
    assert all(wait[s] > 0.6 * step_time[s] for s in wait if s > 5), (wait, step_time)  # the first: warm-up


def test_decoding_processes_follow_the_cores_and_what_trains_on_them():
    """auto: a process per core but one (at most 8); none when a CPU of two cores trains, where a decoding process
    only adds copies and contention to the same cores' work (bench/stream.py measured it)."""
    assert auto_workers("auto", "cpu", cores=2) == 0
    assert auto_workers("auto", "cpu", cores=1) == 0
    assert auto_workers("auto", "cuda", cores=2) == 1  # a GPU trains: the host's cores are free to decode
    assert auto_workers("auto", "cpu", cores=4) == 3
    assert auto_workers("auto", "cuda", cores=64) == 8
    assert auto_workers("auto", None, cores=2) == 1  # decoding a data set into memory before training
    assert auto_workers(3, "cpu", cores=2) == 3


def test_the_test_split_is_kept_decoded_after_its_first_pass_when_small(packed, tmp_path):
    """A split read the same way at every pass (the test split) is replayed from memory once it has been read
    whole, when it fits the bytes allowed; shards gone after the first pass show it reads nothing again. Processes
    whose shards run out feed their last batch again, kept as such."""
    copy = tmp_path / "shards"
    shutil.copytree(packed, copy)
    shards = open_shards(str(copy), None, lambda line: None).splits["test"]  # 15 samples in 2 shards
    decoder = Decoder(0, None)
    for world in (1, 2):
        loaders = [
            StreamLoader(shards, 4, torch.device("cpu"), decoder, rank=r, world=world, keep_bytes=1 << 20)
            for r in range(world)
        ]
        first = [[(b.x.clone(), b.y.clone(), b.own) for b in loader.batches()] for loader in loaders]
        stored = {url: Path(url).read_bytes() for url in (s.url for s in shards)}
        for url in stored:
            Path(url).unlink()
        again = [[(b.x, b.y, b.own) for b in loader.batches(1)] for loader in loaders]
        for a, b in zip(first, again):
            assert len(a) == len(b) == len(loaders[0])
            assert all(
                torch.equal(xa, xb) and torch.equal(ya, yb) and oa == ob for (xa, ya, oa), (xb, yb, ob) in zip(a, b)
            )
        for url, data in stored.items():
            Path(url).write_bytes(data)
    small = StreamLoader(shards, 4, torch.device("cpu"), decoder, keep_bytes=100)  # a batch is 4x3x16x16 bytes
    list(small.batches())
    assert small.kept is None
    shuffled = StreamLoader(shards, 4, torch.device("cpu"), decoder, shuffle=True, keep_bytes=1 << 20)
    list(shuffled.batches())
    assert shuffled.kept is None  # another order each epoch: read again


def test_alternating_flips_in_a_stream_show_every_sample_both_ways_every_two_epochs(packed):
    """random_hflip: alternate, streamed: a sample's side is a function of the seed and its key, so it alternates by
    epoch whatever order the shuffle brings it in."""
    shards = open_shards(str(packed), None, lambda line: None).splits["train"]
    decoder = Decoder(0, None)
    loader = StreamLoader(shards, 60, torch.device("cpu"), decoder, seed=3, shuffle=True, buffer=30, hflip="alternate")
    plain = [img for b in StreamLoader(shards, 60, torch.device("cpu"), decoder).batches() for img in b.x]
    upright = {img.numpy().tobytes(): i for i, img in enumerate(plain)}
    mirrored = {img.flip(-1).numpy().tobytes(): i for i, img in enumerate(plain)}

    def sides(epoch: int) -> dict[int, bool]:
        (batch,) = loader.batches(epoch)
        x = batch.x
        found = {}
        for img in x:
            key = img.numpy().tobytes()
            found[upright[key] if key in upright else mirrored[key]] = key in mirrored
        return found

    e0, e1, e2 = sides(0), sides(1), sides(2)
    assert len(e0) == 60 and 0 < sum(e0.values()) < 60
    assert all(e1[i] != e0[i] for i in e0) and e2 == e0


def test_decoding_on_the_device_without_a_gpu_is_one_line_and_exit_2(packed, tmp_path):
    args = [*STREAM, *sets(f"data.path={packed}", "data.decode=device", "model.name=mlp")]
    code, err = invoke(["train", *args, "--output", str(tmp_path / "run")])
    assert code == 2 and "data.decode: decoding on the device needs a CUDA device; this runs on cpu" in err, err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_a_count_cache_being_written_by_another_process_is_counted_again(tmp_path):
    """The processes of a group open the same shards at once: one may find the counts cache another is still
    writing (empty, or cut short). The shards are counted again, never a JSON traceback; the cache is written
    whole (a temporary file renamed into place)."""
    wds = pytest.importorskip("webdataset", reason="the webdataset package writes the other tool's shards")
    from conftest import encode, pattern_images

    from job.data.shard_sets import open_shards

    root = tmp_path / "shards"
    images, labels = pattern_images(2, 3, 16, 0)
    for split in ("train", "test"):
        (root / split).mkdir(parents=True)
        with wds.TarWriter(str(root / split / "part-000.tar")) as sink:
            for i in range(6):
                sink.write({"__key__": f"s{i}", "png": encode(images[i]), "cls": str(labels[i])})
    cache = tmp_path / "cache"
    first = open_shards(str(root), cache, lambda _: None)
    kept = sorted((cache / "shard-counts").glob("*.json"))
    assert len(kept) == 2 and not [p for p in (cache / "shard-counts").iterdir() if p.suffix != ".json"]
    for cut in ("", kept[0].read_text()[:3]):
        for p in kept:
            p.write_text(cut)
        again = open_shards(str(root), cache, lambda _: None)
        assert again.samples("train") == first.samples("train") == 6 and again.samples("test") == 6
