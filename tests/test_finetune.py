"""Fine-tuning: torchvision models and their weights by name, weights files from a web server and gs:// on loopback
(downloaded once into the cache), a frozen backbone left exactly as loaded, gradient accumulation equal to one
large batch and resumed bit for bit from the middle of a group, and the photo views' shapes and ranges."""

from __future__ import annotations

import functools
import http.server
import threading
from pathlib import Path

import pytest
import torch
import torchvision
from conftest import (
    assert_same_run,
    invoke,
    pattern_images,
    pointer,
    run_job,
    scalars,
    sets,
    stopping_model,
    weights,
    write_cifar_batches,
    write_image_folder,
)

from job.config import load_config
from job.data.augment import View
from job.data.dataset import Split
from job.data.loader import BatchLoader
from job.errors import StorageError
from job.recipe import build as recipe
from job.recipe.weights import Weights, cache_path, download, resolve


def test_a_torchvision_weights_name_resolves_to_its_url_and_preprocessing():
    w = resolve("resnet50", "DEFAULT")
    assert w.name == "ResNet50_Weights.IMAGENET1K_V2"
    assert w.url == "https://download.pytorch.org/models/resnet50-11ad3fa6.pth" and w.hash_prefix == "11ad3fa6"
    assert (w.crop_size, w.resize_size) == (224, 232)
    assert w.mean == (0.485, 0.456, 0.406) and w.std == (0.229, 0.224, 0.225)
    assert resolve("resnet50", "ResNet50_Weights.IMAGENET1K_V1").resize_size == 256
    assert resolve("mobilenet_v3_small", "IMAGENET1K_V1").url.endswith("mobilenet_v3_small-047dcff4.pth")
    # The preprocessing becomes the data's defaults: what config.yaml records, and the normalisation.
    cfg = load_config("cifar10", ["data.kind=folder", "model.name=resnet50", "model.weights=DEFAULT"])
    d = recipe.resolved(cfg).data
    assert (d.image_size, d.resize_size, d.normalize) == (224, 232, "auto")
    from job.recipe.feed import normalization

    mean, std = normalization(recipe.resolved(cfg), data=_images(8))
    assert mean.tolist() == pytest.approx([0.485, 0.456, 0.406]) and std.tolist() == pytest.approx(
        [0.229, 0.224, 0.225]
    )
    # A size the user gives wins; the resize keeps the weights' ratio to it.
    d = recipe.resolved(load_config("cifar10", ["model.name=resnet50", "model.weights=DEFAULT", "data.image_size=160"]))
    assert (d.data.image_size, d.data.resize_size) == (160, 166)


def _images(n: int):
    from job.data.dataset import Dataset

    x, y = pattern_images(2, n // 2, 8)
    split = Split(torch.from_numpy(x), torch.tensor(y))
    return Dataset(split, split, ["a", "b"], "pattern")


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def web(tmp_path):
    """An HTTP server on 127.0.0.1 serving tmp_path/www; yields (folder, base URL, server) and stops it after."""
    root = tmp_path / "www"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}", server
    server.shutdown()
    server.server_close()


def mobilenet_file(path: Path) -> dict[str, torch.Tensor]:
    """A 1000-class mobilenet_v3_small's state_dict in a file, with batch-norm statistics that are not the fresh
    model's (so that keeping them is seen)."""
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v3_small()
    state = model.state_dict()
    for k, v in state.items():
        if k.endswith("running_mean"):
            v.uniform_(-0.1, 0.1)
        elif k.endswith("running_var"):
            v.uniform_(0.5, 1.5)
    torch.save(state, path)
    return state


def cifar_args(tmp_path: Path, *overrides: str) -> list[str]:
    data = write_cifar_batches(tmp_path / "cifar-10-batches-py", n_train=64, n_test=32)
    return [
        "train",
        "--config",
        "cifar10",
        "--device",
        "cpu",
        *sets(f"data.path={data}", "train.epochs=1", "data.batch_size=16", "model.name=mobilenet_v3_small", *overrides),
    ]


def assert_backbone_kept(state: dict[str, torch.Tensor], out: dict[str, torch.Tensor], head: str) -> None:
    """Every tensor of the file outside the head, parameters and batch-norm statistics alike, unchanged."""
    for k, v in state.items():
        if k.startswith(f"{head}."):
            assert out[k].shape[0] == 10, k
        else:
            assert torch.equal(out[k], v), k


def test_weights_downloaded_once_into_the_cache_then_read_without_the_server(tmp_path, web, job_cache):
    root, base, server = web
    state = mobilenet_file(root / "mnv3.pth")
    args = cifar_args(tmp_path, f"model.weights={base}/mnv3.pth", "model.freeze_backbone=true")
    first = run_job(*args, "--output", str(tmp_path / "first"))
    assert first.returncode == 0, first.stderr[-2000:]
    assert f"downloading {base}/mnv3.pth" in first.stderr
    assert "classifier.3 replaced to fit 10 classes" in first.stderr
    assert "training classifier.3 only (10,250 parameters)" in first.stderr
    cached = list((job_cache / "weights").glob("*-mnv3.pth"))
    assert len(cached) == 1 and cached[0].read_bytes() == (root / "mnv3.pth").read_bytes()
    assert_backbone_kept(state, weights(str(tmp_path / "first")), "classifier.3")

    server.shutdown()  # the second run has no server to ask
    server.server_close()
    second = run_job(*args, "--output", str(tmp_path / "second"))
    assert second.returncode == 0, second.stderr[-2000:]
    assert "from the cache" in second.stderr and "downloading" not in second.stderr
    assert_backbone_kept(state, weights(str(tmp_path / "second")), "classifier.3")


def test_a_download_that_fails_its_hash_check_is_refused_and_leaves_nothing(tmp_path, web):
    root, base, _ = web
    (root / "model-0123abcd.pth").write_bytes(b"not the file the name promises")
    w = Weights(source="X", url=f"{base}/model-0123abcd.pth", hash_prefix="0123abcd")
    with pytest.raises(StorageError, match="invalid hash value"):
        download(w, tmp_path / "cache")
    assert not any((tmp_path / "cache").iterdir())


def test_weights_from_gcs(tmp_path, bucket):
    state = mobilenet_file(tmp_path / "mnv3.pth")
    bucket.fs.put(str(tmp_path / "mnv3.pth"), f"{bucket.name}/weights/mnv3.pth")
    args = cifar_args(tmp_path, f"model.weights={bucket.url('weights/mnv3.pth')}", "model.freeze_backbone=true")
    done = run_job(*args, "--output", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert_backbone_kept(state, weights(str(tmp_path / "run")), "classifier.3")


def test_without_a_frozen_backbone_every_layer_trains_from_the_weights(tmp_path):
    state = mobilenet_file(tmp_path / "mnv3.pth")
    code, err = invoke(
        [*cifar_args(tmp_path, f"model.weights={tmp_path / 'mnv3.pth'}"), "--output", str(tmp_path / "r")]
    )
    assert code == 0, err
    out = weights(str(tmp_path / "r"))
    changed = [k for k, v in state.items() if not k.startswith("classifier.3.") and not torch.equal(out[k], v)]
    assert "features.0.0.weight" in changed and "features.0.1.running_mean" in changed


def iris(*overrides: str) -> list[str]:
    return [
        "train",
        "--device",
        "cpu",
        *sets("train.eval_every_epochs=50", "train.checkpoint_every_epochs=50", *overrides),
    ]


@pytest.mark.parametrize("capture", ["auto", "off"])
def test_uneven_accumulated_batches_weigh_by_their_samples(tmp_path, capture):
    """120 samples in batches of 50, 50 and 20, accumulated 3 at a time, train as full batches of 120 do: each
    batch's gradient weighs its share of the samples (equal weights would give the 20 as much say as the 50s).
    With momentum, so that any difference grows."""
    common = ("train.epochs=50", "optim.momentum=0.9", f"train.step_capture={capture}")
    code, err = invoke(
        [*iris(*common, "data.batch_size=50", "train.accumulate_steps=3"), "--output", str(tmp_path / "a")]
    )
    assert code == 0, err
    assert "the optimizer steps every 3 batches" in err
    code, err = invoke([*iris(*common, "data.batch_size=full"), "--output", str(tmp_path / "b")])
    assert code == 0, err
    a, b = weights(str(tmp_path / "a")), weights(str(tmp_path / "b"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


STOPPER = stopping_model(
    "nn.Sequential(nn.Linear(4, 10), nn.ReLU(), nn.Linear(10, num_classes))",
    "The Iris MLP, which sends its own process SIGTERM in training step $STOP_AT_STEP.",
)


def test_resume_in_the_middle_of_an_accumulated_group_is_bit_identical(tmp_path):
    """15 batches an epoch, 4 to a group (4, 4, 4, 3): stopped after batch 6, half way through the second group of
    epoch 1, the run commits the group's gradients so far and goes on with them; the cosine schedule spans the
    run's 12 optimizer steps."""
    (tmp_path / "stopper.py").write_text(STOPPER)
    env = {"PYTHONPATH": str(tmp_path)}
    args = iris(
        "model.name=stopper:Net",
        "train.step_capture=off",
        "data.batch_size=8",
        "train.accumulate_steps=4",
        "train.epochs=3",
        "train.eval_every_epochs=1",
        "train.log_every_steps=5",
        "optim.momentum=0.9",
        "optim.schedule=cosine",
    )
    out = tmp_path / "cut"
    stopped = run_job(*args, "--output", str(out), env={**env, "STOP_AT_STEP": "6"})
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    payload = torch.load(out / "checkpoints" / pointer(str(out))["file"], weights_only=True)
    assert payload["progress"]["epoch_step"] == 6 and len(payload["accumulator"]["accumulated"]) == 4
    assert payload["scheduler"]["T_max"] == 12 and payload["scheduler"]["last_epoch"] == 1
    again = run_job(*args, "--output", str(out), env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "6 steps into epoch 1" in again.stderr
    reference = run_job(*args, "--output", str(tmp_path / "ref"), env=env)
    assert reference.returncode == 0, reference.stderr[-2000:]
    assert_same_run(str(tmp_path / "ref"), str(out))


def test_photo_views_shapes_ranges_and_centre_crop():
    torch.manual_seed(0)
    x = torch.randint(0, 256, (64, 3, 40, 40), dtype=torch.uint8)
    split = Split(x, torch.arange(64) % 2)
    view = View(32, centre=32 / 40, scale=(0.25, 1.0))
    train = BatchLoader(split, 16, torch.device("cpu"), torch.device("cpu"), view=view, resized_crops=True, hflip=True)
    batches = [(b.x, b.y) for b in train.batches(0)]
    assert [tuple(b.shape) for b, _ in batches] == [(16, 3, 32, 32)] * 4
    assert all(b.dtype == torch.float32 and b.min() >= 0 and b.max() <= 1 for b, _ in batches)
    _, _, _, boxes, _ = train.draws(0)
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    assert (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= 40).all() and (boxes[:, 3] <= 40).all()
    assert ((w * h / 1600) >= 0.24).all() and ((w * h / 1600) <= 1.0).all() and ((w / h - 1).abs() < 0.5).all()
    assert len({tuple(b.tolist()) for b in boxes}) > 60  # a crop of its own for (nearly) every image
    assert not torch.equal(batches[0][0], next(iter(train.batches(1))).x)  # another epoch, other crops
    # Evaluation: the centre 32 x 32 of each 40 x 40 image, exactly.
    test = BatchLoader(split, 16, torch.device("cpu"), torch.device("cpu"), view=view)
    first = next(iter(test.batches())).x
    assert torch.allclose(first, x[:16, :, 4:36, 4:36].float() / 255, atol=1e-6)


def test_photos_train_end_to_end_from_a_folder_and_from_shards(tmp_path):
    """Photos held larger than the model's input, trained on random resized crops and evaluated on the centre crop,
    from a folder and from streamed shards."""
    root = write_image_folder(tmp_path / "photos", size=36)
    args = [
        "--device",
        "cpu",
        "--config",
        "cifar10",
        *sets(
            "data.image_size=24",
            "data.random_resized_crop=true",
            "data.random_hflip=true",
            "train.epochs=2",
            "data.batch_size=8",
            "model.name=resnet18",
        ),
    ]
    code, err = invoke(
        ["train", *args, "--set", "data.kind=folder", "--set", f"data.path={root}", "--output", str(tmp_path / "f")]
    )
    assert code == 0, err
    assert "inputs 3x27x27" in err  # held at 24 x 8/7
    saved = (tmp_path / "f" / "config.yaml").read_text()
    assert "resize_size: 27" in saved and "image_size: 24" in saved
    code, err = invoke(["shard", str(root), str(tmp_path / "shards")])
    assert code == 0, err
    code, err = invoke(
        [
            "train",
            *args,
            *sets("data.kind=shards", f"data.path={tmp_path / 'shards'}", "data.placement=stream"),
            "--output",
            str(tmp_path / "s"),
        ]
    )
    assert code == 0, err
    assert "streamed" in err


def test_photos_are_held_square_by_their_short_side_and_centre():
    from conftest import encode

    from job.data.image import pixels
    from job.data.preprocess import Preprocess
    from job.data.stream import decode as decode_stream

    img = torch.zeros(3, 24, 48, dtype=torch.uint8)
    img[:, :, 12:36] = 200  # a bright centre square in a wide photo
    data = encode(img.numpy())
    for held in (
        torch.from_numpy(pixels(data, "w.png", Preprocess((12, 12), True)).transpose(2, 0, 1).copy()),
        torch.from_numpy(decode_stream([("w", "png", data)], Preprocess((12, 12), True))[0]),
    ):
        assert tuple(held.shape) == (3, 12, 12)
        assert held.float().mean() > 190  # only the centre: the dark sides are cut, not squeezed in
    squeezed = pixels(data, "w.png", Preprocess((12, 12), False))
    assert squeezed.astype(float).mean() < 150


def test_the_finetune_preset_trains_a_photo_folder_from_the_cached_weights(tmp_path, job_cache):
    """The preset as the README runs it, with its torchvision weights already in the cache (this machine has no
    internet): the weights' preprocessing is the data's, the classifier is replaced, and the run trains on
    random resized crops of photos held at the weights' resize size."""
    cfg = load_config("finetune")
    assert (cfg.model.name, cfg.model.weights, cfg.optim.name, cfg.optim.schedule) == (
        "resnet50",
        "DEFAULT",
        "adamw",
        "cosine",
    )
    assert cfg.train.precision == "auto" and cfg.train.accumulate_steps == 1 and cfg.data.random_resized_crop
    d = recipe.resolved(cfg).data
    assert (d.image_size, d.resize_size) == (224, 232)
    # Weights of the user's own file know no preprocessing: the preset's 224 px crops, held at 8/7 of that.
    d = recipe.resolved(load_config("finetune", ["model.weights=gs://bucket/backbone.pth"])).data
    assert (d.image_size, d.resize_size) == (224, 256)
    # A smaller torchvision model keeps the run short on a CPU; its DEFAULT weights are seeded into the cache
    # where the download would put them.
    w = resolve("mobilenet_v3_small", "DEFAULT")
    state = mobilenet_file(tmp_path / "mnv3.pth")
    cached = cache_path(w, job_cache / "weights")
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_bytes((tmp_path / "mnv3.pth").read_bytes())
    photos = write_image_folder(tmp_path / "photos", n_classes=2, per_class=4, size=48, fmt="jpg", test_per_class=2)
    done = run_job(
        "train",
        "--config",
        "finetune",
        "--device",
        "cpu",
        *sets(f"data.path={photos}", "model.name=mobilenet_v3_small", "train.epochs=1", "data.batch_size=4"),
        "--output",
        str(tmp_path / "run"),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "from the cache" in done.stderr and "classifier.3 replaced to fit 2 classes" in done.stderr
    assert "inputs 3x256x256" in done.stderr  # held at mobilenet_v3_small weights' resize size
    out = weights(str(tmp_path / "run"))
    assert out["classifier.3.weight"].shape == (2, 1024)
    assert not torch.equal(out["features.0.0.weight"], state["features.0.0.weight"])  # the whole model trains


def test_the_photos_preset_is_the_finetune_recipe_with_a_warm_up_and_trains_a_photo_folder(tmp_path, job_cache):
    """photos: the finetune preset plus the tricks bench/recipes.py measured a gain for (the warm-up alone); a
    one-epoch trial run trains, its rate rising over the first steps."""
    photos_cfg, finetune_cfg = load_config("photos").model_dump(), load_config("finetune").model_dump()
    assert photos_cfg["optim"].pop("warmup") == 0.5 and finetune_cfg["optim"].pop("warmup") == 0
    assert {**photos_cfg, "name": "finetune"} == finetune_cfg
    w = resolve("mobilenet_v3_small", "DEFAULT")
    mobilenet_file(tmp_path / "mnv3.pth")
    cached = cache_path(w, job_cache / "weights")
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_bytes((tmp_path / "mnv3.pth").read_bytes())
    photos = write_image_folder(tmp_path / "photos", n_classes=2, per_class=16, size=48, fmt="jpg", test_per_class=2)
    over = ("model.name=mobilenet_v3_small", "train.epochs=1", "data.batch_size=4", "train.log_every_steps=1")
    done = run_job(
        "train",
        "--config",
        "photos",
        "--device",
        "cpu",
        *sets(f"data.path={photos}", *over),
        "--output",
        str(tmp_path / "run"),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "from the cache" in done.stderr
    lrs = [lr for _, lr in scalars(str(tmp_path / "run"), "train/lr")]
    assert len(lrs) >= 4 and lrs[1] > lrs[0]  # warming up (the cosine alone only falls)
    assert max(lrs) == pytest.approx(3e-4) and lrs[-1] < max(lrs)
