"""Shards: `job shard` packs an image folder into the WebDataset layout, shards written by a plain tarfile script
load, a stream's position restores exactly, streamed runs resume bit for bit after SIGTERM, read from gs:// through
a faulty store, split over torchrun's processes with every sample seen once, and hold memory flat in data size."""

import io
import json
import tarfile
from pathlib import Path

import pytest
import torch
from conftest import (
    encode,
    invoke,
    metrics,
    pattern_images,
    sets,
    tar_folder,
    write_image_folder,
)

from job.data.shards import open_shards
from job.data.stream import Decoder, SampleStream, StreamLoader, deal

STREAM = ["--device", "cpu", "--config", "cifar10", *sets("data.kind=shards", "data.placement=stream")]


def shard_names(root: Path, split: str) -> list[Path]:
    return sorted((root / split).glob("*.tar"))


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    """60 train / 15 test 16x16 PNG images in 3 classes, packed 8 samples a shard."""
    root = tmp_path_factory.mktemp("packed")
    src = write_image_folder(root / "images", per_class=20, test_per_class=5)
    code, err = invoke(["shard", str(src), str(root / "shards"), "--samples-per-shard", "8"])
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
    code, err = invoke(["shard", json.loads((packed / "index.json").read_text())["source"], str(packed)])
    assert code == 0 and "already packed" in err
    assert {p: p.stat().st_mtime_ns for p in packed.rglob("*")} == before
    other = write_image_folder(tmp_path / "other")
    code, err = invoke(["shard", str(other), str(packed)])
    assert code == 2 and "packed from" in err and "Traceback" not in err


def test_shard_from_a_tar_gz_and_a_bad_image_named(tmp_path):
    src = write_image_folder(tmp_path / "images")
    archive = tar_folder(src, tmp_path / "images.tar.gz", "images")
    code, err = invoke(["shard", str(archive), str(tmp_path / "a")])
    assert code == 0, err
    assert len(shard_names(tmp_path / "a", "train")) == 1
    (src / "train" / "class1" / "0013.png").write_bytes(b"not an image")
    code, err = invoke(["shard", str(src), str(tmp_path / "b")])
    assert code == 3 and "0013.png" in err and "not an image" in err and err.count("error:") == 1
    assert "Traceback" not in err
    assert not (tmp_path / "b").exists()  # a failed start leaves no folder behind


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
    urls = [str(p) for p in shard_names(packed, "train")]
    whole = [(s.key, s.shard) for s in SampleStream(urls, 16, (7, 0))]
    assert sorted(k for k, _ in whole) == sorted({k for k, _ in whole}) and len(whole) == 60
    assert [k for k, _ in whole] != [s.key for s in SampleStream(urls, 0, (7, 0))]  # the buffer shuffles
    for cut in (1, 17, 33, 59):
        stream = SampleStream(urls, 16, (7, 0))
        it = iter(stream)
        head = [next(it).key for _ in range(cut)]
        place = json.loads(json.dumps(stream.position()))  # as a checkpoint keeps it
        rest = [s.key for s in SampleStream(urls, 16, (7, 0), place)]
        assert head + rest == [k for k, _ in whole], cut


def test_shards_dealt_over_processes_cover_the_epoch_once_with_zero_weight_padding(packed):
    shards = open_shards(str(packed), None, lambda line: None).splits["train"]  # 8 shards: 7 of 8, one of 4
    hands = deal(shards, 3)
    assert sorted(i for h in hands for i in h) == list(range(len(shards)))
    decoder = Decoder(0, None)
    loaders = [StreamLoader(shards, 6, torch.device("cpu"), decoder, rank=r, world=3) for r in range(3)]
    assert len({len(x) for x in loaders}) == 1
    steps = len(loaders[0])
    seen = []
    for loader in loaders:
        batches = list(loader.batches())
        assert len(batches) == steps
        for i, (x, _) in enumerate(batches):
            if loader.loss_weight(i) > 0:
                seen += [bytes(img.numpy().tobytes()) for img in (x * 255).round().to(torch.uint8)]
    assert len(seen) == 60 and len(set(seen)) == 60
    for i in range(steps):  # the processes' weights average to one over each step (DDP divides by 3)
        assert sum(x.loss_weight(i) for x in loaders) == pytest.approx(3.0)
