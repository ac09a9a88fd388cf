"""The loader contract on streamed shards: every sample of an epoch once across any group, padding that no caller
counts, a position that restores anywhere (the padded stretch included), evaluation on N processes equal to one,
and shards from other tools (the webdataset package's own writer: pax headers, non-ASCII keys) read exactly;
shards cut short, miscounted, gzipped or gone named in one line."""

import gzip
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import encode, invoke, pattern_images, sets, stopping_model, write_image_folder

from job.data.sample_stream import Part, SampleStream, saved
from job.data.shard_sets import open_shards
from job.data.shards import read_range
from job.data.split import HoldOut, Roles
from job.data.stream import Decoder, StreamLoader, sample_images
from job.errors import DataError
from job.use import evaluate

wds = pytest.importorskip("webdataset", reason="the webdataset package writes the other tool's shards")

CPU = torch.device("cpu")
STREAM = ["--device", "cpu", "--config", "cifar10", *sets("data.kind=shards", "data.placement=stream")]


def wds_shards(root: Path, train: list[int], test: list[int], size: int = 8) -> Path:
    """Shards of the sizes given written by webdataset's TarWriter, with keys that need pax headers."""
    for split, sizes, seed in (("train", train, 0), ("test", test, 1)):
        images, labels = pattern_images(4, -(-sum(sizes) // 4), size, seed)
        (root / split).mkdir(parents=True)
        at = 0
        for k, n in enumerate(sizes):
            with wds.TarWriter(str(root / split / f"café-{k:03d}.tar")) as sink:
                for i in range(at, at + n):
                    sink.write({"__key__": f"été/échantillon-{i:05d}", "png": encode(images[i]), "cls": str(labels[i])})
            at += n
    (root / "classes.txt").write_text("a\nb\nc\nd\n")
    return root


@pytest.fixture(scope="module")
def uneven(tmp_path_factory) -> Path:
    return wds_shards(tmp_path_factory.mktemp("wds"), [23, 5, 4, 3, 2], [9, 4])


def splits(root: Path, cache: Path | None = None, hold: HoldOut | None = None):
    return open_shards(str(root), cache, lambda line: None, hold).splits


CARVED = HoldOut(0.3, 0.0, 42)  # val held out of train/ by each sample's key: shards from other tools have no val/


def pixels(x: torch.Tensor) -> list[bytes]:
    return [img.numpy().tobytes() for img in (x * 255).round().to(torch.uint8)]


def test_webdataset_shards_resume_exactly_from_any_sample(uneven):
    parts = [Part(s.url, s.samples) for s in splits(uneven)["train"]]
    whole = [s.key for s in SampleStream(parts, 6, (3, 0))]
    assert len(whole) == 37 and len(set(whole)) == 37 and all(k.startswith("été/") for k in whole)
    for cut in (1, 6, 20, 36):
        it = iter(stream := SampleStream(parts, 6, (3, 0)))
        head = [next(it).key for _ in range(cut)]
        place = json.loads(json.dumps(saved(stream.position())))
        assert head + [s.key for s in SampleStream(parts, 6, (3, 0), place)] == whole, cut
    first = next(iter(SampleStream(parts[:1], 0, (0,))))
    again = read_range(parts[0].url, 0, first.start, first.end)
    assert again.key == first.key and again.members == first.members  # the pax header is part of the sample


@pytest.mark.parametrize("world", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_sample_once_across_any_group_with_padding_weighed_zero(uneven, world, drop_last):
    """5 train shards of 23, 5, 4, 3, 2 samples: whole shards dealt to up to 5 processes, shared beyond that."""
    shards = splits(uneven)["train"]
    loaders = [
        StreamLoader(
            shards, 2 * world, CPU, Decoder(0, None), rank=r, world=world, drop_last=drop_last, shuffle=True, buffer=4
        )
        for r in range(world)
    ]
    runs = [list(loader.batches(1)) for loader in loaders]
    assert len({len(run) for run in runs}) == 1 and len(runs[0]) == len(loaders[0])
    seen = [p for run in runs for b in run if b.own for p in pixels(b.x)]
    everything = pixels(torch.cat([b.x for b in StreamLoader(shards, 37, CPU, Decoder(0, None)).batches()]))
    assert len(seen) == len(set(seen))
    if drop_last:  # as many full batches as the process with the fewest samples has
        assert len(seen) == len(loaders[0]) * loaders[0].batch_size
    else:
        assert sorted(seen) == sorted(everything)
    for i in range(len(runs[0])):
        step = [run[i] for run in runs]
        assert sum(b.weight for b in step) == pytest.approx(world)
        assert all(b.samples == sum(s.own for s in step) for b in step)
        assert all((b.own == 0) == (b.weight == 0) for b in step)


@pytest.mark.parametrize("world", [3, 7])
@pytest.mark.parametrize("hold", [None, CARVED])
def test_a_stream_resumes_exactly_from_any_step_the_padded_stretch_included(uneven, world, hold):
    shards = splits(uneven, None, hold)["train"]

    def loader(rank: int) -> StreamLoader:
        return StreamLoader(
            shards,
            2 * world,
            CPU,
            Decoder(0, None),
            rank=rank,
            world=world,
            shuffle=True,
            buffer=5,
            crop_padding=1,
            hflip=True,
        )

    for rank in range(world):
        whole = loader(rank)
        run, places = [], []
        for b in whole.batches(2):
            run.append(b)
            places.append(json.loads(json.dumps(whole.position())))  # as a checkpoint keeps it
        padded = [i for i, b in enumerate(run) if not b.own]
        cuts = sorted({1, len(run) - 1, *padded[:2]} - {0, len(run)})
        for cut in cuts:
            resumed = loader(rank)
            resumed.resume_at(2, cut, [places[cut - 1]] * world)
            rest = list(resumed.batches(2, cut))
            assert len(rest) == len(run) - cut, (rank, cut)
            for a, b in zip(run[cut:], rest):
                assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y) and (a.weight, a.own) == (b.weight, b.own)


def keys(batches) -> list[str]:
    return [name.rpartition(".tar:")[2] for b in batches for name in b.names]


def test_shards_with_no_val_hold_val_out_of_train_by_key_streamed_held_and_on_any_group(uneven, tmp_path):
    """Shards from another tool hold train/ and test/ but no val/: data.val_split of train/'s samples is held out
    for val, each by a hash of its key and data.split_seed (as a folder's files are by their path), the same
    samples whether streamed on any number of processes or held in memory; counted once, the count cached."""
    from job.config import DataConfig
    from job.data.read import load_data

    every = [s.key for s in SampleStream([Part(s.url, s.samples) for s in splits(uneven)["train"]], 0, (0,))]
    roles = Roles(42, 0.3, 0.0)
    val = sorted(k for k in every if roles(k) == "val")
    train = sorted(k for k in every if roles(k) == "train")
    assert 4 <= len(val) <= 20 and len(val) + len(train) == 37
    said: list[str] = []
    carved = open_shards(str(uneven), tmp_path, said.append, CARVED)
    assert carved.samples("val") == len(val) and carved.samples("train") == len(train) and carved.samples("test") == 13
    assert any("held out for val" in line for line in said), said
    for split, expected in (("train", train), ("val", val)):
        for world in (1, 3, 7):  # 7 processes share the 5 shards sample by sample
            shards = carved.splits[split]
            batch = 2 * world
            loaders = [StreamLoader(shards, batch, CPU, Decoder(0, None), rank=r, world=world) for r in range(world)]
            seen = [k for loader in loaders for k in keys(loader.batches())]
            assert sorted(seen) == expected, (split, world)
    again: list[str] = []
    assert open_shards(str(uneven), tmp_path, again.append, CARVED).splits == carved.splits
    assert not any("counted" in line for line in again), again  # the cache's counts
    other = open_shards(str(uneven), tmp_path, print, HoldOut(0.3, 0.0, 7)).splits["val"]
    assert sorted(keys(StreamLoader(other, 64, CPU, Decoder(0, None)).batches())) != val
    cfg = DataConfig(kind="shards", path=str(uneven), placement="host", val_split=0.3)
    held = load_data(cfg, tmp_path, print)
    assert sorted(n.rpartition(".tar:")[2] for n in held.val.names) == val
    assert sorted(n.rpartition(".tar:")[2] for n in held.train.names) == train
    inventory = held.inventory
    assert sorted(n.rpartition(".tar:")[2] for n in inventory.held_out["val"]) == val
    assert sum(inventory.counts["val"].values()) == len(val) and sum(inventory.counts["train"].values()) == len(train)
    streamed = load_data(cfg.model_copy(update={"placement": "stream"}), tmp_path, print)
    assert streamed.inventory.digest() == inventory.digest()
    said.clear()
    untouched = load_data(cfg.model_copy(update={"val_split": 0.0}), tmp_path, said.append)
    assert untouched.val is None and untouched.inventory is None and len(untouched.train) == 37
    assert any("no val/" in line and "chosen on test" in line and "data.val_split" in line for line in said), said


def test_a_run_on_shards_with_no_val_chooses_on_the_val_it_held_out_and_resumes_exactly(uneven, tmp_path):
    """Streamed, stopped mid-epoch and resumed: the same run as one that never stopped, its evaluations on the val
    held out of train/, its data.json naming those samples."""
    from conftest import assert_same_run, metrics, run_job

    (tmp_path / "stopper.py").write_text(STOPPER)
    args = [
        "train",
        *STREAM,
        *sets(f"data.path={uneven}", "model.name=stopper:Net", "train.epochs=2", "data.batch_size=6"),
        *sets("data.val_split=0.3", "train.step_capture=off", "data.shuffle_buffer=5", "train.log_every_steps=2"),
    ]
    env = {"PYTHONPATH": str(tmp_path)}
    ref = run_job(*args, "--output", str(tmp_path / "ref"), env=env)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert "held out for val" in ref.stderr and "evaluations report test" not in ref.stderr, ref.stderr[-3000:]
    out = str(tmp_path / "cut")
    stopped = run_job(*args, "--output", out, env={**env, "STOP_AT_STEP": "6"})
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    again = run_job(*args, "--output", out, env=env)
    assert again.returncode == 0 and "steps into epoch 2" in again.stderr, again.stderr[-3000:]
    assert_same_run(str(tmp_path / "ref"), out)
    last = metrics(out)[-1]
    assert "val_accuracy" in last and "test_accuracy" in last, last
    data = json.loads((tmp_path / "cut" / "data.json").read_text())
    roles = Roles(42, 0.3, 0.0)
    held = sorted(n.rpartition(".tar:")[2] for n in data["held_out"]["val"])
    assert held and all(roles(k) == "val" for k in held) and data["splits"]["val"]["images"] == len(held)


def test_evaluation_on_several_processes_counts_each_sample_once(uneven):
    """2 test shards of 9 and 4 samples over 3 processes: the sums over the group equal one process's."""
    shards = splits(uneven)["test"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 4))

    def sums(world: int) -> torch.Tensor:
        loaders = [StreamLoader(shards, 2 * world, CPU, Decoder(0, None), rank=r, world=world) for r in range(world)]
        return sum(evaluate.test_sums(model, loader, torch.no_grad) for loader in loaders)

    one = sums(1)
    for world in (2, 3, 5):
        assert torch.allclose(sums(world), one, atol=1e-4), world


def test_a_shard_cut_short_miscounted_gzipped_or_gone_is_named(uneven, tmp_path):
    cut = tmp_path / "cut"
    shutil.copytree(uneven, cut)
    victim = sorted((cut / "train").glob("*.tar"))[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) * 6 // 10 // 512 * 512])  # cut at a block boundary: no end blocks
    with pytest.raises(DataError, match=f"{victim.name}: cut short"):
        splits(cut)  # counted without an index: read to the end once
    indexed = tmp_path / "indexed"
    src = write_image_folder(tmp_path / "images", per_class=12, test_per_class=4)
    assert invoke(["shard", str(src), str(indexed), "--samples-per-shard", "8"])[0] == 0
    first = sorted((indexed / "train").glob("*.tar"))[0]
    whole = first.read_bytes()
    first.write_bytes(whole[: len(whole) // 2 // 512 * 512])
    with pytest.raises(DataError, match=f"{first.name}: .* bytes where index.json records"):
        splits(indexed)
    first.unlink()
    with pytest.raises(DataError, match=f"{first.name}: listed in index.json but not there"):
        splits(indexed)
    first.write_bytes(gzip.compress(whole))
    with pytest.raises(DataError, match=f"{first.name}: a gzip file"):
        list(SampleStream([Part(str(first), 8)], 0, (0,)))
    first.write_bytes(whole)
    with pytest.raises(DataError, match=f"{first.name}: holds 8 samples where its count says 9"):
        list(SampleStream([Part(str(first), 9)], 0, (0,)))


def test_a_truncated_shard_stops_the_run_with_one_line(uneven, tmp_path):
    cut = tmp_path / "cut"
    src = write_image_folder(tmp_path / "images", per_class=12, test_per_class=4)
    assert invoke(["shard", str(src), str(cut), "--samples-per-shard", "8"])[0] == 0
    victim = sorted((cut / "train").glob("*.tar"))[1]
    victim.write_bytes(victim.read_bytes()[:2048])
    code, err = invoke(["train", *STREAM, *sets(f"data.path={cut}", "model.name=mlp", "train.epochs=1")])
    assert code == 3 and victim.name in err and "Traceback" not in err, err


def test_statistics_and_data_dependent_starts_see_a_seeded_sample_not_the_first_class(tmp_path):
    """A folder packed in class order (one shard a class): the sample holds every class."""
    src = write_image_folder(tmp_path / "images", n_classes=4, per_class=30, test_per_class=2)
    root = tmp_path / "classes"
    for split in ("train", "test"):
        (root / split).mkdir(parents=True)
    import tarfile

    for split in ("train", "test"):
        for k, folder in enumerate(sorted((src / split).iterdir())):
            with tarfile.open(root / split / f"{k:03d}.tar", "w") as tar:
                for f in sorted(folder.iterdir()):
                    tar.add(f, arcname=f"{f.stem}.png")
                    cls = tmp_path / "cls"
                    cls.write_text(str(k))
                    tar.add(cls, arcname=f"{f.stem}.cls")
    shards = splits(root)["train"]
    everything = StreamLoader(shards, 120, CPU, Decoder(0, None)).batches()
    batch = next(everything)
    by_pixels = dict(zip(pixels(batch.x), batch.y.tolist()))
    sample = sample_images(shards, Decoder(0, None), 20, seed=0)
    classes = {by_pixels[p] for p in pixels(sample.float() / 255)}
    assert len(sample) == 20 and len(classes) >= 3
    assert torch.equal(sample, sample_images(shards, Decoder(0, None), 20, seed=0))


STOPPER = stopping_model(
    "nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, num_classes))",
    "An MLP over 3x8x8 images of 50,000 parameters: gloo reduces a bucket that size in a ring.",
)


def test_three_processes_stopped_mid_stream_and_in_the_padded_stretch_resume_exactly(uneven, tmp_path):
    """Train shards of 23, 5, 4, 3, 2 samples over 3 processes in batches of 6: 12 steps an epoch, two processes
    padding from step 5 on. Stopped in step 2 of epoch 2 (every process mid-stream: their gradients are summed three
    ways) and again in the padded stretch, the run ends as one that never stopped; its test accuracy is what
    `evaluate` measures in one process."""
    from conftest import assert_same_run, metrics, run_job

    (tmp_path / "stopper.py").write_text(STOPPER)
    args = [
        "train",
        *STREAM,
        "--nproc-per-node",
        "3",
        *sets(f"data.path={uneven}", "model.name=stopper:Net", "train.epochs=3", "data.batch_size=6"),
        *sets("train.step_capture=off", "data.shuffle_buffer=5", "train.log_every_steps=5"),
    ]
    env = {"PYTHONPATH": str(tmp_path)}
    ref = run_job(*args, "--output", str(tmp_path / "ref"), env=env)
    assert ref.returncode == 0, ref.stderr[-3000:]
    out = str(tmp_path / "cut")
    resumed = []
    for stop in ("14", "7", None):  # a stop is learnt by the group one step later
        attempt = run_job(*args, "--output", out, env={**env, **({"STOP_AT_STEP": stop} if stop else {})})
        assert attempt.returncode == (75 if stop else 0), attempt.stderr[-3000:]
        resumed += [line for line in attempt.stderr.splitlines() if line.startswith("resuming")]
    assert "(3 steps into epoch 2)" in resumed[0] and "(11 steps into epoch 2)" in resumed[1], resumed
    assert_same_run(str(tmp_path / "ref"), out)
    group = metrics(out)[-1]
    one = run_job("evaluate", "--checkpoint", out, "--device", "cpu", "--json", env=env)
    assert one.returncode == 0, one.stderr[-2000:]
    measured = json.loads(one.stdout)
    assert measured["samples"] == 13 and measured["test_accuracy"] == pytest.approx(group["test_accuracy"], abs=1e-12)


def test_a_resumed_run_keeps_the_placement_it_started_with(uneven, tmp_path):
    """data.placement auto streams a data set too big for its share of memory; resumed where it would fit, the run
    keeps streaming (another placement reads in another order) and ends as one that never stopped. Setting the
    placement overrides it, and says what that gives up."""
    from conftest import assert_same_run, run_job

    (tmp_path / "stopper.py").write_text(STOPPER)
    common = [
        "train",
        "--device",
        "cpu",
        "--config",
        "cifar10",
        *sets("data.kind=shards", f"data.path={uneven}", "model.name=stopper:Net", "train.epochs=2"),
        *sets("data.batch_size=6", "train.step_capture=off", "train.log_every_steps=2"),
    ]
    tight, roomy = sets("data.device_share=0.000000001"), sets("data.device_share=0.9")
    env = {"PYTHONPATH": str(tmp_path)}
    ref = run_job(*common, *tight, "--output", str(tmp_path / "ref"), env=env)
    assert ref.returncode == 0 and "streaming it" in ref.stderr, ref.stderr[-2000:]
    out = str(tmp_path / "cut")
    stopped = run_job(*common, *tight, "--output", out, env={**env, "STOP_AT_STEP": "9"})
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    again = run_job(*common, *roomy, "--output", out, env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "streamed" in again.stderr and "as the run started" in again.stderr
    assert_same_run(str(tmp_path / "ref"), out)
    held = run_job(*common, *sets("data.placement=host", "train.epochs=3"), "--output", out, env=env)
    assert held.returncode == 0, held.stderr[-2000:]
    assert "where the run started streamed" in held.stderr and "no longer matches" in held.stderr


def test_find_batch_size_and_bench_on_streamed_shards(uneven):
    """Both read the data through the loader contract: find-batch-size searches on streamed batches; bench, whose
    naive loop holds its data in memory, says so in one line."""
    data = sets("data.kind=shards", "data.placement=stream", f"data.path={uneven}", "model.name=mlp")
    code, err = invoke(["find-batch-size", "--config", "cifar10", *data, "--device", "cpu"])
    assert code == 0 and "batch 37: fits" in err, err
    code, err = invoke(["bench", "--config", "cifar10", *data, "--devices", "cpu"])
    assert code == 2 and "streamed from shards" in err and "Traceback" not in err, err


def test_empty_shards_are_left_out_of_the_deal(uneven, tmp_path):
    """An index may list a shard of no samples: no process is dealt nothing but it (it would take no step while the
    others wait for it)."""
    from job.data.shards import Shard

    shards = [*splits(uneven)["train"][:1], Shard(str(tmp_path / "empty.tar"), 0, 0)]
    loaders = [StreamLoader(shards, 4, CPU, Decoder(0, None), rank=r, world=2) for r in range(2)]
    runs = [list(loader.batches()) for loader in loaders]
    assert [len(run) for run in runs] == [len(loaders[0])] * 2 and sum(b.own for run in runs for b in run) == 23


def test_malformed_pax_headers_are_one_line_not_a_hang(tmp_path):
    import io
    import tarfile

    from job.data.shards import ShardFile, pax_records, samples

    for bad in (b"0 path=x\n", b"-5 path=x\n", b"99 path=x\n"):
        with pytest.raises(ValueError):
            pax_records(bad)
    good = tmp_path / "good.tar"
    with tarfile.open(good, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("été.cls")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"1"))
    data = bytearray(good.read_bytes())
    at = data.index(b" path=")
    data[at - 2 : at] = b"00"  # the record's length: 0
    header = data[:512]
    header[148:156] = b" " * 8
    data[148:156] = f"{sum(header):06o}\0 ".encode()
    (tmp_path / "bad.tar").write_bytes(bytes(data))
    f = ShardFile(str(tmp_path / "bad.tar"))
    with pytest.raises(DataError, match="bad.tar: not a readable tar shard .*malformed pax"):
        list(samples(f, 0, str(tmp_path / "bad.tar")))


def test_a_place_from_other_shards_or_an_earlier_version(uneven, tmp_path):
    from job.data.placement import Streaming, decide_streaming
    from job.errors import CheckpointError

    shards = splits(uneven)["train"]
    whole = StreamLoader(shards, 6, CPU, Decoder(0, None), shuffle=True, buffer=4)
    run, places = [], []
    for b in whole.batches(1):
        run.append(b)
        places.append(whole.position())
    old = {k: places[2]["stream"][k] for k in ("shard", "offset", "draws", "buffer")}  # as earlier versions saved it
    resumed = StreamLoader(shards, 6, CPU, Decoder(0, None), shuffle=True, buffer=4)
    resumed.resume_at(1, 3, [old])
    rest = list(resumed.batches(1, 3))
    assert all(torch.equal(a.x, b.x) for a, b in zip(run[3:], rest)) and len(rest) == len(run) - 3
    fewer = StreamLoader(shards[:4], 6, CPU, Decoder(0, None), shuffle=True, buffer=4)
    with pytest.raises(CheckpointError, match="other shards"):
        fewer.resume_at(1, 3, [places[2]])
    once = decide_streaming("auto", lambda: 0, 0.5, Streaming(True, "data.placement=stream"))
    twice = decide_streaming("auto", lambda: 0, 0.5, once)
    assert twice == once and twice.reason == "as the run started (data.placement=stream)"
