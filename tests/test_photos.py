"""Photos as people hold them: real files (EXIF-turned JPEGs, HEIC written by pillow-heif, CMYK, 16-bit PNG, palette
and alpha), class folders with no split, nested folders, system files, bad files; the val split and what the run
chooses on it; manifests; class weights."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pillow_heif
import pytest
import torch
from conftest import assert_same_run, invoke, job_env, metrics, sets, weights, write_image_folder
from PIL import Image

from job.config import DataConfig
from job.data.decode import decode as stream_decode
from job.data.folder import load_folder
from job.data.image import open_rgb, pixels
from job.data.preprocess import Preprocess
from job.data.split import HoldOut, is_system_file, sort_files
from job.errors import DataError

pillow_heif.register_heif_opener()

ORIENT_TAG = 0x0112
# EXIF orientation -> the transpose that stores an upright picture that way (the inverse of what a viewer applies)
STORE = {3: Image.Transpose.ROTATE_180, 6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270}


def arrow(w: int = 40, h: int = 24) -> Image.Image:
    """A picture that is not the same turned: a bright left half, a dark right half, a red top row."""
    px = np.zeros((h, w, 3), np.uint8)
    px[:, : w // 2] = 220
    px[:2, :, 0] = 255
    return Image.fromarray(px, "RGB")


def turned_jpeg(img: Image.Image, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[ORIENT_TAG] = orientation
    buf = io.BytesIO()
    img.transpose(STORE[orientation]).save(buf, "JPEG", quality=95, exif=exif.tobytes())
    return buf.getvalue()


def saved(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def close(a: np.ndarray, b: np.ndarray, tol: float = 6) -> bool:
    return a.shape == b.shape and float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean()) < tol


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_orientation_is_applied_on_every_host_path(orientation):
    upright = np.asarray(arrow())
    data = turned_jpeg(arrow(), orientation)
    assert np.asarray(Image.open(io.BytesIO(data))).shape != upright.shape or orientation == 3  # stored turned
    assert close(pixels(data, "p.jpg"), upright)
    streamed = stream_decode([("p", "jpg", data)], None)[0].transpose(1, 2, 0)
    assert close(streamed, upright)
    assert np.array_equal(streamed, pixels(data, "p.jpg"))  # one decoding: the same array


def test_heic_written_by_pillow_heif_is_read():
    data = saved(arrow(), "HEIF", quality=95)
    assert data[4:8] == b"ftyp"
    assert close(pixels(data, "IMG_0001.HEIC"), np.asarray(arrow()), tol=10)


def test_modes_become_the_same_rgb():
    img = arrow()
    rgb = np.asarray(img)
    assert close(pixels(saved(img.convert("CMYK"), "JPEG", quality=95), "c.jpg"), rgb)
    rgba = img.convert("RGBA")
    rgba.putalpha(128)
    assert np.array_equal(pixels(saved(rgba, "PNG"), "a.png"), rgb)  # alpha dropped, the colour kept
    palette = img.convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
    palette.info["transparency"] = 0
    assert close(pixels(saved(palette, "PNG", transparency=0), "p.png"), rgb)
    grey = pixels(saved(img.convert("L"), "PNG"), "g.png")
    assert grey.shape == rgb.shape and np.array_equal(grey[..., 0], grey[..., 2])


def test_sixteen_bit_png_is_scaled_not_clipped_or_wrapped():
    levels = np.array([[0, 257 * 100, 65535, 300]], dtype=np.uint16)  # 300: wraps to 44 modulo 256, clips to 255
    data = saved(Image.fromarray(levels), "PNG")
    assert Image.open(io.BytesIO(data)).mode.startswith("I")
    want = [0, 100, 255, 1]
    assert pixels(data, "deep.png")[0, :, 0].tolist() == want
    assert stream_decode([("deep", "png", data)], None)[0, 0, 0].tolist() == want


def test_bad_files_are_named_in_words():
    good = saved(arrow(), "JPEG")
    for data, words in ((b"", "empty"), (good[:200], "truncated"), (b"not a picture", "not an image file")):
        with pytest.raises(DataError, match=words) as e:
            open_rgb(data, "IMG_1.jpg")
        assert "IMG_1.jpg" in str(e.value) and "BytesIO" not in str(e.value)


def test_split_is_stable_stratified_and_ignores_system_files():
    names = [f"{c}/{'DCIM/100APPLE/' if i % 7 == 0 else ''}IMG_{i:04d}.JPG" for c in ("cat", "dog") for i in range(400)]
    files = sort_files(names, HoldOut(val=0.2, test=0.1, seed=3))
    assert files.classes() == ["cat", "dog"] and not files.outside
    for c in ("cat", "dog"):
        val = sum(1 for _, k in files.roles["val"] if k == c)
        test = sum(1 for _, k in files.roles["test"] if k == c)
        assert 50 <= val <= 110 and 20 <= test <= 65, (c, val, test)
    assert sum(len(r) for r in files.roles.values()) == 800  # nested photos count for their class
    more = sort_files(names + [f"cat/new_{i}.jpg" for i in range(100)], HoldOut(val=0.2, test=0.1, seed=3))
    assert set(files.held_out["val"]) <= set(more.held_out["val"])
    assert set(files.held_out["test"]) <= set(more.held_out["test"])
    other = sort_files(names, HoldOut(val=0.2, test=0.1, seed=4))
    assert set(other.held_out["val"]) != set(files.held_out["val"])
    for name in (".DS_Store", "cat/._IMG_1.JPG", "cat/Thumbs.db", "desktop.ini", "cat/@eaDir/IMG_1.JPG/x.jpg"):
        assert is_system_file(name)
    assert not is_system_file("cat/IMG_1.JPG")


def test_split_folders_and_an_archive_of_one_top_folder():
    names = ["photos/train/a/1.jpg", "photos/train/b/2.jpg", "photos/valid/a/3.jpg", "photos/test/b/4.png"]
    files = sort_files(names, HoldOut(val=0.5))
    assert files.folders == ("train", "val", "test")
    assert files.roles["val"] == [("photos/valid/a/3.jpg", "a")] and not files.held_out["val"]  # val/ given: none held


def photo_folder(root: Path, per_class: int = 30) -> Path:
    """Three classes, half their JPEGs stored turned with an EXIF tag, nested folders, system files, two bad files."""
    rng = np.random.default_rng(0)
    for k, name in enumerate(("cats", "dogs", "owls")):
        for i in range(per_class):
            px = np.full((24, 24, 3), 40, np.uint8)
            px[:, :, k] = 200 + rng.integers(0, 40)
            px[: 6 + k * 6] = 255  # a bright band from the top, as wide as the class says
            img = Image.fromarray(px)
            nest = "2024/summer/" if i % 5 == 0 else ""
            path = root / name / f"{nest}IMG_{i:03d}.{'JPG' if i % 3 else 'jpeg'}"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(turned_jpeg(img, 6) if i % 2 else saved(img, "JPEG", quality=95))
        (root / name / ".DS_Store").write_bytes(b"\0\1")
        (root / name / f"._IMG_{k}.JPG").write_bytes(b"\0\5\26\7")
    (root / "cats" / "IMG_900.jpg").write_bytes(b"")
    (root / "dogs" / "IMG_901.jpg").write_bytes(b"<html>not found</html>")
    (root / "notes.txt").write_text("labels by hand\n")
    return root


def test_skipped_files_are_said_to_be_in_data_json_only_where_a_run_writes_one(tmp_path):
    """More bad files than are named on the console: a run that reads its data says data.json lists them, and writes
    it; a folder of bad images alone ends at reading with no data.json, and says none."""
    bad = tmp_path / "bad"
    for split in ("train", "test"):
        for k in ("cats", "dogs"):
            (bad / split / k).mkdir(parents=True)
            for i in range(3):
                (bad / split / k / f"IMG_{i}.jpg").write_bytes(b"\xff\xd8\xff\xe0 cut")
    code, err = invoke(["train", "--device", "cpu", "--config", "cifar10", "--output", str(tmp_path / "run"),
                        *sets("data.kind=folder", f"data.path={bad}", "data.image_size=16")])  # fmt: skip
    assert code == 3 and "no training image could be decoded" in err, err
    assert "skipped 12 files" in err and "data.json" not in err, err
    assert not (tmp_path / "run" / "data.json").exists()
    good = write_image_folder(tmp_path / "good", per_class=4, test_per_class=2)
    for i in range(4):
        (good / "train" / "class0" / f"broken{i}.png").write_bytes(b"")
    lines: list[str] = []
    load_folder(DataConfig(kind="folder", path=str(good)), None, lines.append)
    assert "data: data.json lists the 4 files skipped" in lines, lines


def test_class_folders_with_no_split_bad_files_skipped_and_named(tmp_path):
    root = photo_folder(tmp_path / "photos")
    lines: list[str] = []
    cfg = DataConfig(kind="folder", path=str(root), val_split=0.25, image_size=24)
    data = load_folder(cfg, None, lines.append)
    inv = data.inventory
    assert data.classes == ["cats", "dogs", "owls"]
    assert len(data.train) + len(data.val) == 90 and data.test is None
    assert sorted(s["path"] for s in inv.skipped) == ["cats/IMG_900.jpg", "dogs/IMG_901.jpg"]
    assert any("skipped cats/IMG_900.jpg: an empty file" in line for line in lines)
    assert any("1 file" in line and "notes.txt" in line for line in lines)
    assert len(inv.held_out["val"]) == len(data.val)
    # every turned photo reads upright: the band is at the top of every image
    x = torch.cat([data.train.x, data.val.x]).float()
    assert (x[:, :, :4].mean((1, 2, 3)) > x[:, :, -4:].mean((1, 2, 3)) + 50).all()
    with pytest.raises(DataError, match="IMG_90[01].jpg.*skip_bad_samples"):
        load_folder(cfg.model_copy(update={"skip_bad_samples": False}), None, lines.append)


def test_a_run_on_class_folders_chooses_on_val_and_writes_data_json(tmp_path):
    root = photo_folder(tmp_path / "photos")
    out = tmp_path / "run"
    base = ["train", "--device", "cpu", "--config", "cifar10", "--output", str(out)]
    over = sets(
        "data.kind=folder",
        f"data.path={root}",
        "data.image_size=32",
        "data.val_split=0.2",
        "data.test_split=0.2",
        "optim.name=adamw",
        "optim.lr=0.003",
        "train.epochs=3",
        "data.batch_size=16",
    )
    code, err = invoke([*base, *over])
    assert code == 0, err
    d = json.loads((out / "data.json").read_text())
    assert d["classes"] == ["cats", "dogs", "owls"]
    counted = sum(s["images"] for s in d["splits"].values())
    assert counted == 90 and len(d["skipped"]) == 2
    assert set(d["held_out"]) == {"val", "test"} and d["held_out"]["test"]
    rows = metrics(str(out))
    assert all("val_accuracy" in r and "test_accuracy" not in r for r in rows[:-1])
    last = rows[-1]  # the test split, once, on the model chosen on val
    assert last["chosen_epoch"] >= 1 and "test_accuracy" in last and "train_loss" not in last
    assert "test accuracy" in err and "best val accuracy" in err


def test_early_stopping_ends_the_run_with_the_best_weights_and_resumes_exactly(tmp_path):
    root = photo_folder(tmp_path / "photos")
    over = sets(
        "data.kind=folder",
        f"data.path={root}",
        "data.image_size=32",
        "data.val_split=0.3",
        "optim.lr=1e-9",
        "train.epochs=30",
        "train.early_stopping_patience=2",
        "train.early_stopping_min_delta=0.01",
        "train.log_every_steps=1",
        "data.batch_size=16",
    )
    run = ["train", "--device", "cpu", "--config", "cifar10"]
    out = tmp_path / "a"
    code, err = invoke([*run, "--output", str(out), *over])
    assert code == 0, err
    rows = metrics(str(out))
    assert len(rows) == 3 and "early stopping" in err  # the first evaluation, then two without a gain of 0.01
    best = max(range(3), key=lambda i: (rows[i]["val_accuracy"], -i))
    assert f"(epoch {best + 1})" in err
    # stopped after 2 epochs and continued: the same evaluations, the same stop, the same weights
    cut = tmp_path / "b"
    assert invoke([*run, "--output", str(cut), *over, *sets("train.epochs=2")])[0] == 0
    code, err = invoke([*run, "--output", str(cut), *over])
    assert code == 0, err
    assert_same_run(str(out), str(cut))
    code, err = invoke([*run, "--output", str(out), *over, *sets("train.epochs=40")])  # a finished run is left alone
    assert code == 0 and "complete: early stopping" in err and "another --output" in err


def photo_manifest(tmp_path: Path) -> Path:
    """labels.csv over photo_folder's images (columns file, kind, split): 9 rows marked test, a row naming a file that
    is not there, and one naming by absolute path a photo stored under a name with no suffix."""
    root = photo_folder(tmp_path / "photos")
    blob = tmp_path / "elsewhere" / "d41d8cd98f00b204"
    blob.parent.mkdir()
    blob.write_bytes((root / "owls" / "IMG_001.JPG").read_bytes())
    table = tmp_path / "labels.csv"
    with open(table, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["file", "kind", "split"])
        for k, name in enumerate(("cats", "dogs", "owls")):
            for p in sorted((root / name).rglob("IMG_0*")):
                w.writerow([p.relative_to(tmp_path).as_posix(), k, "test" if p.stem.endswith("7") else ""])
        w.writerow(["photos/cats/gone.jpg", 0, ""])
        w.writerow([str(blob), 2, "train"])
    return table


def test_a_manifest_of_paths_and_labels(tmp_path):
    table = photo_manifest(tmp_path)
    jsonl = tmp_path / "labels.jsonl"
    with open(table, newline="") as f:
        rows = list(csv.DictReader(f))
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for path in (table, jsonl):
        cfg = DataConfig(
            kind="manifest", path=str(path), path_column="file", label_column="kind", val_split=0.2, image_size=24
        )
        from job.data.manifest import load_manifest

        data = load_manifest(cfg, None, lambda _: None)
        assert data.classes == ["0", "1", "2"]
        assert len(data.test) == 9  # IMG_007, 017, 027 of each class
        assert len(data.train) + len(data.val) + len(data.test) == 91  # and the photo named by its path alone
        assert [s["path"] for s in data.inventory.skipped] == ["photos/cats/gone.jpg"]


def test_a_manifest_packed_into_shards_splits_and_decodes_as_it_reads(tmp_path):
    """`job shard labels.csv DST` packs a manifest's images, in the classes and splits its rows give (val held out by
    the same hash of each path): read back from the shards, each split holds the same pixels as the manifest read
    into memory; the missing file is skipped and named; a photo named with no suffix is stored under its format's."""
    import tarfile

    from job.data.manifest import load_manifest
    from job.data.stream import load_shards

    table = photo_manifest(tmp_path)
    dst = tmp_path / "shards"
    columns = ["--path-column", "file", "--label-column", "kind"]
    code, err = invoke(["shard", str(table), str(dst), *columns, "--val-split", "0.2", "--samples-per-shard", "16"])
    assert code == 0, err
    index = json.loads((dst / "index.json").read_text())
    assert index["classes"] == ["0", "1", "2"] and index["columns"]["path"] == "file"
    assert [s["path"] for s in index["inventory"]["skipped"]] == ["photos/cats/gone.jpg"]
    members = []
    for shard in dst.glob("train/*.tar"):
        with tarfile.open(shard) as tar:
            members += tar.getnames()
    assert sum(1 for m in members if not m.endswith(".cls")) == index["inventory"]["splits"]["train"]["images"]
    assert all(m.rsplit(".", 1)[1] in ("jpg", "jpeg", "cls") for m in members), members[:4]
    cfg = DataConfig(
        kind="manifest", path=str(table), path_column="file", label_column="kind", val_split=0.2, image_size=24
    )
    held = load_manifest(cfg, None, lambda _: None)
    packed = load_shards(cfg.model_copy(update={"kind": "shards", "path": str(dst), "placement": "host"}), None, print)
    assert packed.inventory.held_out == held.inventory.held_out and len(packed.test) == 9
    for split in ("train", "val", "test"):
        a, b = held.split(split), packed.split(split)
        assert sorted(zip(a.y.tolist(), map(bytes, a.x.numpy()))) == sorted(zip(b.y.tolist(), map(bytes, b.x.numpy())))
    code, err = invoke(
        ["shard", str(table), str(dst), "--path-column", "file", "--label-column", "split", "--val-split", "0.2"]
    )
    assert code == 2 and "--label-column kind" in err and "Traceback" not in err, err


def test_a_manifest_naming_images_in_a_bucket_packs_them_as_it_reads_them(tmp_path, bucket):
    """Rows naming images by gs:// URL (fetched many at once), one of them not there: packed and held alike, the
    missing one skipped and named."""
    from job.data.manifest import load_manifest
    from job.data.stream import load_shards

    root = photo_folder(tmp_path / "photos")
    bucket.put_tree(root / "owls", "owls")
    table = tmp_path / "labels.csv"
    with open(table, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "label"])
        for name in ("cats", "dogs"):
            w.writerows([p.relative_to(tmp_path).as_posix(), name] for p in sorted((root / name).rglob("IMG_0*")))
        w.writerows([bucket.url(f"owls/{p.relative_to(root / 'owls').as_posix()}"), "owls"]
                    for p in sorted((root / "owls").rglob("IMG_0*")))  # fmt: skip
        w.writerow([bucket.url("owls/IMG_999.jpg"), "owls"])
    dst = tmp_path / "shards"
    code, err = invoke(["shard", str(table), str(dst), "--val-split", "0.2"])
    assert code == 0, err
    cfg = DataConfig(kind="manifest", path=str(table), val_split=0.2, image_size=24)
    held = load_manifest(cfg, None, print)
    packed = load_shards(cfg.model_copy(update={"kind": "shards", "path": str(dst)}), None, print)
    assert [s["path"] for s in held.inventory.skipped] == [bucket.url("owls/IMG_999.jpg")]
    assert [s["path"] for s in packed.inventory.skipped] == [bucket.url("owls/IMG_999.jpg")]
    assert held.inventory.counts == packed.inventory.counts
    # every one of the 30 owls read from the bucket (which split each takes hangs on its URL: the bucket's random name)
    assert sum(split["owls"] for split in held.inventory.counts.values()) == 30


def test_a_manifest_naming_an_image_twice_packs_it_twice(tmp_path):
    """Rows may repeat an image (oversampling): packed, each row is a sample of its own key, so copies that the
    shuffle puts side by side are not read back as one sample; streamed as many as held."""
    from job.data.manifest import load_manifest
    from job.data.stream import load_shards

    table = photo_manifest(tmp_path)
    with open(table, "a", newline="") as f:
        csv.writer(f).writerows([["photos/owls/IMG_002.JPG", 2, "train"]] * 6)
    dst = tmp_path / "shards"
    columns = ["--path-column", "file", "--label-column", "kind", "--val-split", "0.2"]
    code, err = invoke(["shard", str(table), str(dst), *columns, "--samples-per-shard", "200"])  # one train shard
    assert code == 0, err
    cfg = DataConfig(
        kind="manifest", path=str(table), path_column="file", label_column="kind", val_split=0.2, image_size=24
    )
    held = load_manifest(cfg, None, print)
    streamed = load_shards(
        cfg.model_copy(update={"kind": "shards", "path": str(dst), "placement": "host"}), None, print
    )
    assert len(streamed.train) == len(held.train) >= 68 + 6


def test_a_manifest_with_bad_or_missing_images_or_a_misspelt_split_column_under_strict_settings(tmp_path):
    """data.skip_bad_samples=false stops at a missing or undecodable image however the manifest is read (held, or
    packed to stream); a split column named in the config that the manifest lacks is named, not passed over."""
    from job.data.manifest import load_manifest

    table = photo_manifest(tmp_path)  # it names photos/cats/gone.jpg, which is not there
    over = sets(
        "data.kind=manifest", f"data.path={table}", "data.path_column=file", "data.label_column=kind",
        "data.val_split=0.2", "data.image_size=32", "train.epochs=1", "data.skip_bad_samples=false",
    )  # fmt: skip
    for placement in ("host", "stream"):
        out = tmp_path / placement
        code, err = invoke(["train", "--device", "cpu", "--config", "cifar10", "--output", str(out), *over,
                            *sets(f"data.placement={placement}")])  # fmt: skip
        assert code == 3 and "gone.jpg" in err and "skip_bad_samples" in err and "Traceback" not in err, err
        assert not out.exists() or not any(out.iterdir())
    cfg = DataConfig(kind="manifest", path=str(table), path_column="file", label_column="kind", split_column="part")
    with pytest.raises(DataError, match="no column 'part'"):
        load_manifest(cfg, None, print)


def test_a_manifest_streams_with_data_placement_stream(tmp_path):
    """data.placement=stream on a manifest packs its images into the job's cache once and trains from the shards,
    choosing on the val its rows hold out; a second run reads the same pack."""
    table = photo_manifest(tmp_path)
    over = sets(
        "data.kind=manifest", f"data.path={table}", "data.path_column=file", "data.label_column=kind",
        "data.val_split=0.2", "data.image_size=32", "data.placement=stream", "train.epochs=2", "data.batch_size=16",
    )  # fmt: skip
    code, err = invoke(["train", "--device", "cpu", "--config", "cifar10", "--output", str(tmp_path / "a"), *over])
    assert code == 0, err
    assert "packing it into shards" in err and "streamed" in err and "skipped photos/cats/gone.jpg" in err, err
    last = metrics(str(tmp_path / "a"))[-1]
    assert "val_accuracy" in last and "test_accuracy" in last, last
    data = json.loads((tmp_path / "a" / "data.json").read_text())
    assert data["splits"]["test"]["images"] == 9 and [s["path"] for s in data["skipped"]] == ["photos/cats/gone.jpg"]
    code, err = invoke(["train", "--device", "cpu", "--config", "cifar10", "--output", str(tmp_path / "b"), *over])
    assert code == 0 and "from its shards in" in err, err


def test_balanced_class_weights(tmp_path):
    from job.data.dataset import Dataset, Split
    from job.recipe.build import CountedLoss, balanced_weights

    y = torch.tensor([0] * 90 + [1] * 10)
    data = Dataset(Split(torch.zeros(100, 4), y), None, ["a", "b"], "t")
    w = balanced_weights(data)
    assert torch.allclose(w, torch.tensor([100 / (2 * 90), 100 / (2 * 10)]))
    logits = torch.randn(6, 2)
    labels = torch.tensor([0, 1, 1, 0, 0, 1])
    per = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    assert torch.allclose(CountedLoss(w)(logits, labels), (per * w[labels]).mean())


def test_weights_of_the_chosen_epoch_are_in_model_pt(tmp_path):
    root = photo_folder(tmp_path / "photos")
    out = tmp_path / "run"
    over = sets(
        "data.kind=folder",
        f"data.path={root}",
        "data.image_size=32",
        "data.val_split=0.3",
        "optim.name=adamw",
        "optim.lr=0.05",  # large enough that val accuracy moves between epochs
        "train.epochs=4",
        "train.keep_last=10",
        "data.batch_size=16",
    )
    code, err = invoke(["train", "--device", "cpu", "--config", "cifar10", "--output", str(out), *over])
    assert code == 0, err
    rows = [r for r in metrics(str(out)) if "train_loss" in r]
    # The best accuracy; a tie goes to the lower loss (job/run/choose.py), and then to the first
    best = rows.index(min(rows, key=lambda r: (-r["val_accuracy"], r["val_loss"])))
    ckpt = next((out / "checkpoints").glob(f"e{best + 1:05d}-*.pt"))
    saved_best = torch.load(ckpt, weights_only=True)["model"]
    final = weights(str(out))
    assert all(torch.equal(final[k], saved_best[k]) for k in final)


def test_resnet18_takes_its_stem_from_the_image_size():
    from job.config import ModelConfig
    from job.recipe.models import build_model, describe

    cfg = ModelConfig(name="resnet18")
    small, photo = build_model(cfg, (3, 32, 32), 4), build_model(cfg, (3, 96, 96), 4)
    assert small.conv1.kernel_size == (3, 3) and isinstance(small.maxpool, torch.nn.Identity)
    assert photo.conv1.kernel_size == (7, 7) and isinstance(photo.maxpool, torch.nn.MaxPool2d)
    assert "small stem" in describe(cfg, (3, 32, 32)) and "7x7" in describe(cfg, (3, 96, 96))
    forced = ModelConfig(name="resnet18", small_stem=True)
    assert build_model(forced, (3, 96, 96), 4).conv1.kernel_size == (3, 3)


def test_weights_that_cannot_be_downloaded_name_the_ways_on(tmp_path):
    import socket

    from job.errors import StorageError
    from job.recipe.weights import Weights, cache_path, download

    with socket.socket() as s:  # a port nothing listens on: what an offline machine or a firewall gives
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    w = Weights("DEFAULT", f"http://127.0.0.1:{port}/resnet18-f37072fd.pth", "ResNet18_Weights.IMAGENET1K_V1")
    with pytest.raises(StorageError) as e:
        download(w, tmp_path)
    text = str(e.value)
    assert str(cache_path(w, tmp_path)) in text and 'model.weights=""' in text and "gs://" in text


def test_streamed_shards_from_another_tool_skip_a_bad_sample(tmp_path):
    """A corrupt image in shards written by the webdataset package: its label is ignored (the batch keeps its
    shape, the epoch its order), it is named once, evaluations do not count it; skip_bad_samples=false stops."""
    wds = pytest.importorskip("webdataset", reason="the webdataset package writes the other tool's shards")
    from conftest import encode, pattern_images

    from job.data.batches import IGNORED
    from job.data.shard_sets import open_shards
    from job.data.stream import Decoder, StreamLoader
    from job.use import evaluate

    root = tmp_path / "shards"
    for split, n in (("train", 24), ("test", 12)):
        images, labels = pattern_images(3, n // 3, 32, 0)
        (root / split).mkdir(parents=True)
        with wds.TarWriter(str(root / split / "part-000.tar")) as sink:
            for i in range(n):
                data = encode(images[i]) if i != 5 else encode(images[i])[:60]  # cut short: not decodable
                sink.write({"__key__": f"s{i:04d}", "png": data, "cls": str(labels[i])})
    shards = open_shards(str(root), None, lambda _: None)
    said: list[str] = []
    loader = StreamLoader(shards.splits["test"], 4, torch.device("cpu"), Decoder(0, None), log=said.append)
    ys = torch.cat([b.y for b in loader.batches()])
    assert ys.tolist().count(IGNORED) == 1 and ys[5] == IGNORED and len(ys) == 12
    assert len(said) == 1 and "s0005" in said[0]
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 3))
    loss, correct, counted = evaluate.test_sums(model, loader, torch.no_grad).tolist()
    assert counted == 11
    over = sets(
        "data.kind=shards",
        f"data.path={root}",
        "data.placement=stream",
        "train.epochs=2",
        "data.batch_size=8",
    )
    code, err = invoke(["train", "--device", "cpu", "--config", "cifar10", "--output", str(tmp_path / "run"), *over])
    assert code == 0, err
    assert "skipped a sample" in err and "s0005" in err
    code, err = invoke(
        ["train", "--device", "cpu", "--config", "cifar10", "--output", str(tmp_path / "strict"), *over]
        + sets("data.skip_bad_samples=false")
    )
    assert code == 3 and "s0005" in err and "Traceback" not in err


def test_a_resumed_run_refuses_a_changed_split(tmp_path):
    root = photo_folder(tmp_path / "photos")
    over = sets("data.kind=folder", f"data.path={root}", "data.image_size=32", "data.val_split=0.3", "train.epochs=1")
    run = ["train", "--device", "cpu", "--config", "cifar10", "--output", str(tmp_path / "run")]
    assert invoke([*run, *over])[0] == 0
    (root / "cats" / "IMG_new.jpg").write_bytes(saved(arrow(24, 24), "JPEG"))
    code, err = invoke([*run, *over, *sets("train.epochs=2")])
    assert code == 3 and "differ from those the run started with" in err, err


def test_imbalanced_classes_are_named_at_the_start():
    from job.data.split import Inventory

    lines = Inventory(["a", "b"], {"train": {"a": 200, "b": 12}}, {"val": [], "test": []}, []).lines()
    assert any("imbalanced" in line and "class_weights=balanced" in line for line in lines)
    even = Inventory(["a", "b"], {"train": {"a": 50, "b": 12}}, {}, [])
    assert not any("imbalanced" in line for line in even.lines())


def test_job_shard_packs_class_folders_with_the_same_split_as_a_run_in_memory(tmp_path):
    from job.data.pack import pack
    from job.data.split import HoldOut

    root = photo_folder(tmp_path / "photos")
    index = pack(str(root), str(tmp_path / "shards"), lambda _: None, hold=HoldOut(val=0.3, seed=7))
    cfg = DataConfig(kind="folder", path=str(root), val_split=0.3, split_seed=7, image_size=24)
    held = load_folder(cfg, None, lambda _: None)
    packed = index["inventory"]
    assert packed["held_out"] == held.inventory.to_json()["held_out"]
    assert packed["splits"] == held.inventory.to_json()["splits"]
    assert sorted(s["path"] for s in packed["skipped"]) == ["cats/IMG_900.jpg", "dogs/IMG_901.jpg"]
    assert sum(e["nsamples"] for e in index["splits"]["val"]) == len(held.val)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_the_device_decoders_turn_matches_pillows(orientation):
    """nvJPEG does not apply EXIF orientation; the device decoder reads the tag from the header and turns the image
    itself (job/data/decode.py orient). Checked here on the CPU against Pillow's exif_transpose, with torchvision's
    own JPEG decoder standing in for nvJPEG's (the GPU test compares nvJPEG with the host pixel for pixel)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    from job.data.decode import orient
    from job.data.image import exif_orientation

    inverse = {
        2: Image.Transpose.FLIP_LEFT_RIGHT,
        3: Image.Transpose.ROTATE_180,
        4: Image.Transpose.FLIP_TOP_BOTTOM,
        5: Image.Transpose.TRANSPOSE,
        6: Image.Transpose.ROTATE_90,
        7: Image.Transpose.TRANSVERSE,
        8: Image.Transpose.ROTATE_270,
    }
    img = arrow(40, 24)
    exif = Image.Exif()
    exif[ORIENT_TAG] = orientation
    stored = img.transpose(inverse[orientation]) if orientation > 1 else img
    data = saved(stored, "JPEG", quality=95, exif=exif.tobytes())
    assert exif_orientation(data) == orientation
    raw = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    turned = orient(raw, exif_orientation(data)).permute(1, 2, 0).numpy()
    assert close(turned, pixels(data, "p.jpg")) and close(turned, np.asarray(img))
    assert exif_orientation(saved(img, "PNG")) == 1 and exif_orientation(b"") == 1


def test_an_archive_splits_as_its_folder_and_names_starting_with_dot_slash_are_read(tmp_path):
    import pickle
    import tarfile

    from job.data.image import UnreadableImage
    from job.data.split import kind_of

    root = photo_folder(tmp_path / "photos")
    cfg = DataConfig(kind="folder", path=str(root), val_split=0.3, image_size=24)
    folder = load_folder(cfg, None, lambda _: None)
    for arcname, archive in (("photos", tmp_path / "a.tar.gz"), (".", tmp_path / "b.tar")):  # tar -C photos .
        with tarfile.open(archive, "w:gz" if archive.suffix == ".gz" else "w") as tar:
            tar.add(root, arcname=arcname)
        data = load_folder(cfg.model_copy(update={"path": str(archive)}), None, lambda _: None)
        assert len(data.val) == len(folder.val) and torch.equal(data.val.y, folder.val.y), arcname
        assert torch.equal(data.train.x, folder.train.x)
    assert kind_of("./cats/IMG_1.JPG") == "image" and kind_of("./cats/.DS_Store") == "system"
    e = pickle.loads(pickle.dumps(UnreadableImage("cats/x.jpg", "an empty file")))  # sent back by a decoding process
    assert e.name == "cats/x.jpg" and "cats/x.jpg" in str(e)


def test_a_jsonl_manifest_with_integer_labels(tmp_path):
    from job.data.manifest import load_manifest

    root = photo_folder(tmp_path / "photos", per_class=6)
    rows = [
        {"path": p.relative_to(tmp_path).as_posix(), "label": k, "split": "val" if p.stem.endswith("5") else None}
        for k, name in enumerate(("cats", "dogs", "owls"))
        for p in sorted((root / name).rglob("IMG_0*"))
    ]
    table = tmp_path / "labels.jsonl"
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_manifest(DataConfig(kind="manifest", path=str(table), val_split=0, image_size=24), None, print)
    assert data.classes == ["0", "1", "2"] and len(data.val) == 3 and len(data.train) == 15


def reproduce(data: bytes, pre: dict) -> np.ndarray:
    """The model's input for an image file from model.json's preprocessing, with Pillow and numpy alone, as a
    person serving the model would write it."""
    from PIL import ImageOps

    img = Image.open(io.BytesIO(data))
    img = ImageOps.exif_transpose(img) if pre["exif_orientation"] else img
    img = img.convert(pre["mode"])
    if pre["resize"] and "short_side" in pre["resize"]:
        s, (w, h) = pre["resize"]["short_side"], img.size
        img = img.resize((s, round(h * s / w)) if w <= h else (round(w * s / h), s), Image.Resampling.BILINEAR)
    elif pre["resize"]:
        h, w = pre["resize"]["size"]
        img = img.resize((w, h), Image.Resampling.BILINEAR)
    if pre["crop"]:
        (ch, cw), (w, h) = pre["crop"]["center"], img.size
        left, top = round((w - cw) / 2), round((h - ch) / 2)
        img = img.crop((left, top, left + cw, top + ch))
    x = np.asarray(img, np.float32) * pre["scale"]
    if pre["mean"] is not None:
        x = (x - np.asarray(pre["mean"], np.float32)) / np.asarray(pre["std"], np.float32)
    return x.transpose(2, 0, 1)


@pytest.mark.parametrize("sizes", [("data.image_size=24", "data.resize_size=28"), ("data.image_size=20",)])
def test_model_json_describes_the_model_and_reproduces_its_input(tmp_path, sizes):
    from job.config import load_config
    from job.data.augment import to_float
    from job.recipe import build as recipe

    root = photo_folder(tmp_path / "photos", per_class=8)
    out = tmp_path / "run"
    over = ["data.kind=folder", f"data.path={root}", *sizes, "data.normalize=true", "model.name=mlp", "train.epochs=1"]
    over += ["data.val_split=0.3"]
    code, err = invoke(["train", "--device", "cpu", "--config", "cifar10", "--output", str(out), *sets(*over)])
    assert code == 0, err
    card = json.loads((out / "model.json").read_text())
    assert card["classes"] == ["cats", "dogs", "owls"] and card["model"]["num_classes"] == 3
    assert card["model"]["name"] == "mlp" and "best_accuracy" in card["metrics"]
    chosen = next(r for r in metrics(str(out)) if r.get("epoch") == 1 and "val_loss" in r)
    assert card["metrics"]["best_val_loss"] == chosen["val_loss"]  # the chosen model's, which model.pt holds
    pre = card["preprocessing"]
    ckpt = torch.load(next((out / "checkpoints").glob("*.pt")), weights_only=True)
    assert ckpt["model_json"]["preprocessing"] == pre  # any checkpoint describes its model the same way
    cfg = recipe.resolved(load_config("cifar10", over))
    data = recipe.read_data(cfg)
    r = recipe.build(cfg, torch.device("cpu"), data, pretrained=False, started=ckpt)
    files = sorted(root.rglob("IMG_00*"))[:6]
    held = torch.stack(
        [torch.from_numpy(pixels(p.read_bytes(), p.name, Preprocess.of(cfg.data)).transpose(2, 0, 1).copy())
         for p in files]
    )  # fmt: skip
    mean, std = r.feed.stats()
    job_input = to_float(held, torch.contiguous_format, mean, std, r.feed.view).numpy()
    theirs = np.stack([reproduce(p.read_bytes(), pre) for p in files])
    assert theirs.shape == job_input.shape
    assert np.abs(theirs - job_input).mean() < 0.05 * float(np.abs(job_input).mean() + 1)


def test_every_process_names_the_streamed_samples_it_skips(tmp_path):
    """A sample that cannot be decoded in the shard rank 1 reads is named on the console by rank 1 (rank 0 alone
    spoke before, so it was skipped without a word)."""
    wds = pytest.importorskip("webdataset", reason="the webdataset package writes the other tool's shards")
    from conftest import encode, pattern_images
    from test_distributed import torchrun

    root = tmp_path / "shards"
    for split, n in (("train", 24), ("test", 12)):
        images, labels = pattern_images(3, n // 3, 32, 0)
        (root / split).mkdir(parents=True)
        for part in range(2):  # equal shards: rank 0 reads part-000, rank 1 part-001
            with wds.TarWriter(str(root / split / f"part-{part:03d}.tar")) as sink:
                for i in range(part * n // 2, (part + 1) * n // 2):
                    bad = split == "train" and i == n - 2
                    data = encode(images[i])[:60] if bad else encode(images[i])  # cut short: not decodable
                    sink.write({"__key__": f"s{i:04d}", "png": data, "cls": str(labels[i])})
    over = sets(
        "data.kind=shards", f"data.path={root}", "data.placement=stream", "train.epochs=1", "data.batch_size=8",
        "model.name=mlp",
    )  # fmt: skip
    done = torchrun("train", "--device", "cpu", "--config", "cifar10", "--output", str(tmp_path / "run"), *over)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "s0022" in done.stderr and "rank 1" in done.stderr, done.stderr[-3000:]


def test_keep_best_keeps_the_checkpoint_of_the_chosen_model(tmp_path):
    """With early_stopping_min_delta, a later val accuracy higher by less than the delta is not chosen: keep_best
    keeps the checkpoint of the chosen epoch, the weights model.pt holds, not the highest accuracy's."""
    root = write_image_folder(tmp_path / "imgs", n_classes=3, per_class=12, size=16, test_per_class=2)
    out = tmp_path / "run"
    over = sets(
        "data.kind=folder", f"data.path={root}", "model.name=mlp", "train.epochs=5", "data.batch_size=8",
        "data.val_split=0.3", "train.keep_best=true", "train.keep_last=1",
        "train.early_stopping_patience=10", "train.early_stopping_min_delta=1.0",
    )  # fmt: skip
    code, err = invoke(["train", "--device", "cpu", "--config", "cifar10", "--output", str(out), *over])
    assert code == 0, err
    accuracies = [r["val_accuracy"] for r in metrics(str(out)) if "val_accuracy" in r and "train_loss" in r]
    assert max(accuracies) > accuracies[0], accuracies  # a later epoch scored higher, by less than the delta
    kept = sorted(p.name for p in (out / "checkpoints").glob("e*.json"))
    assert kept[0].startswith("e00001-"), kept
    chosen = torch.load(out / "checkpoints" / kept[0].replace(".json", ".pt"), weights_only=True)["model"]
    final = torch.load(out / "model.pt", weights_only=True)
    assert all(torch.equal(chosen[k], final[k]) for k in final)


def test_weights_that_cannot_be_downloaded_are_found_before_the_data_is_read(tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = photo_folder(tmp_path / "photos")
    over = sets(
        "data.kind=folder",
        f"data.path={root}",
        "model.name=resnet18",
        f"model.weights=http://127.0.0.1:{port}/resnet18-f37072fd.pth",
        "data.val_split=0.2",
    )
    code, err = invoke(["train", "--device", "cpu", "--config", "finetune", "--output", str(tmp_path / "run"), *over])
    assert code == 4 and "cannot download" in err, err
    assert "data:" not in err and "skipped" not in err, err  # not a photo decoded first


PHONE = (3024, 4032)  # a phone's 12 MP photo as it is shown (w, h): portrait, stored landscape with EXIF tag 6


def phone_photo() -> bytes:
    w, h = PHONE
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    px = np.stack([x / w * 255, y / h * 255, 127 + 100 * np.sin(x / 12) * np.cos(y / 15)], -1)  # fine detail
    px[((x // 150 + y // 150) % 2) == 0, 0] *= 0.5  # squares whose edges show a box that is off by a pixel
    return turned_jpeg(Image.fromarray(px.astype(np.uint8)), 6)


@pytest.mark.parametrize("held, size, reduced", [(256, 224, True), (1600, 1400, False)])
def test_a_phone_photo_is_the_same_input_on_the_host_the_device_and_by_model_json(held, size, reduced):
    """A non-square 12 MP JPEG turned by EXIF: the host (Pillow), the device decoder's code (torchvision: its CPU
    decoder stands in for nvJPEG) and a Pillow user following model.json's recipe cut the same box of the photo and
    make the same input: the recipe exactly the host's (model.json says when the host decodes a JPEG at a reduced DCT
    scale, so the user does too), the device's within a mean of 1 grey level of it where both decode at full size,
    3 where the host decodes at the reduced scale and the device at full size."""
    from torchvision.io import ImageReadMode, decode_jpeg

    from job.config import load_config
    from job.data.augment import to_float
    from job.data.decode import upright_held
    from job.recipe import build as recipe
    from job.use import bundle

    data = phone_photo()
    cfg = load_config("cifar10", [f"data.resize_size={held}", f"data.image_size={size}", "data.kind=folder"])
    pre = Preprocess.of(cfg.data)
    assert pre.box(*PHONE) == (0, 504, 3024, 3528)  # the centre square of the short side, in the photo's pixels
    card = bundle.preprocessing(cfg.data, (3, size, size), None, None)
    with Image.open(io.BytesIO(data)) as img:
        img.draft("RGB", tuple(card["draft"]))
        assert (img.size != (PHONE[1], PHONE[0])) == reduced  # the host decodes at the scale model.json names
    _, view = recipe.model_input(cfg, (3, held, held), True)

    def model_input(held_image: torch.Tensor) -> np.ndarray:
        return to_float(held_image[None], torch.contiguous_format, None, None, view)[0].numpy() * 255

    host = model_input(torch.from_numpy(pixels(data, "p.jpg", pre).transpose(2, 0, 1).copy()))
    full = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    device = model_input(upright_held(full, data, pre))
    theirs = bundle.recipe_input(card, data) * 255
    assert host.shape == device.shape == theirs.shape == (3, size, size)
    assert np.abs(theirs - host).max() < 1e-3  # model.json's recipe is the host's, pixel for pixel
    assert np.abs(device - host).mean() < (3 if reduced else 1), np.abs(device - host).mean()


def test_heic_is_read_in_a_process_that_registered_nothing(tmp_path):
    """pillow-heif's opener is registered when the job first opens an image, not when its modules are imported: a
    fresh process reads a HEIC photo's pixels, a folder's first HEIC's size, and model.json's recipe input."""
    data = saved(arrow(), "HEIF", quality=95)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "IMG_0001.HEIC").write_bytes(data)
    code = (
        "import sys; from pathlib import Path; from job.data.image import pixels; "
        "from job.data.files import source; from job.data.placement import decoded_size; "
        "data = Path(sys.argv[1], 'a', 'IMG_0001.HEIC').read_bytes(); "
        "assert 'pillow_heif' not in sys.modules; "
        "print(pixels(data, 'IMG_0001.HEIC').shape, decoded_size(source(sys.argv[1]), None))"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=job_env())
    h, w = np.asarray(arrow()).shape[:2]
    assert done.returncode == 0 and done.stdout.split("\n")[0] == f"({h}, {w}, 3) {3 * h * w}", done.stderr[-2000:]
