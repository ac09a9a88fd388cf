"""The GPU path: the same job on CUDA, with no host sync inside an epoch. Skipped where there is no CUDA device."""

import csv
import json

import numpy as np
import pytest
import torch
from conftest import encode, pattern_images, run_job, write_cifar_batches, write_image_folder

from job.config import load_config
from job.console import say
from job.data.loader import BatchLoader
from job.data.read import load_data
from job.group.stop import StopRequest
from job.recipe import build as recipe
from job.recipe.cuda_graph import CudaGraphStep, host_waits
from job.recipe.plan import build_step, plan_step, step_facts
from job.run.attempts import Attempt
from job.run.choose import Chooser
from job.run.meters import LossLog, TrainClock
from job.run.progress import Progress
from job.run.train import Loop, train_epoch
from job.sinks.report import Report
from job.storage.run_folder import RunDir

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("capture", ["auto", "off"])
@pytest.mark.parametrize("placement", ["device", "host"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_an_epoch_never_waits_for_the_gpu(tmp_path, placement, precision, capture):
    root = write_image_folder(tmp_path / "imgs", n_classes=4, per_class=40, size=32)
    cfg = load_config(
        "cifar10",
        [
            "data.kind=folder",
            f"data.path={root}",
            "data.batch_size=16",
            "train.log_every_steps=3",
            "data.random_crop_padding=4",
            "data.random_hflip=true",
            "data.normalize=true",
            f"data.placement={placement}",
            f"train.precision={precision}",
            "optim.momentum=0.9",
            "optim.schedule=onecycle",
        ],
    )
    data = load_data(cfg.data, tmp_path / "cache", say)
    r = recipe.build(cfg, CUDA, data)  # fp16: fused optimizer kernels, so the loss scaler never syncs
    assert r.feed.where == ("the device" if placement == "device" else "the host")
    state, log = Progress(), LossLog(CUDA, cfg.train.log_every_steps)
    step = build_step(r, log.sums, plan_step(step_facts(r, capture, 1e9)))
    assert isinstance(step, CudaGraphStep) == (capture == "auto")
    run_dir = RunDir(str(tmp_path / "run"))
    report = Report(run_dir, {}, 2, len(r.train), 0)
    with StopRequest(20) as stop:
        clock, chooser = TrainClock(CUDA), Chooser(cfg.train, r.evaluated_on)
        loop = Loop(cfg, run_dir, r, step, state, log, report, stop, clock, 0.0, 0.0, Attempt(None), chooser)
        for _ in range(2):  # warm-up: cuDNN picks its kernels, then each batch shape is captured
            train_epoch(loop, 0)
        torch.cuda.synchronize()
        if capture == "auto":
            assert len(step.graphs) == 1  # 160 images in batches of 16: one shape, captured after 3 eager steps
        torch.cuda.set_sync_debug_mode("error")
        try:
            train_epoch(loop, 1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    train = r.train
    assert state.step == 3 * len(train)
    assert torch.isfinite(log.sums).all()


def test_device_and_host_placement_give_the_same_batches(tmp_path):
    root = write_image_folder(tmp_path / "imgs", n_classes=3, per_class=10, size=16)
    cfg = load_config("cifar10", ["data.kind=folder", f"data.path={root}"])
    data = load_data(cfg.data, tmp_path / "cache", say)
    kw = dict(seed=4, shuffle=True, crop_padding=2, hflip=True)
    on_device = list(BatchLoader(data.train, 8, CUDA, CUDA, **kw).batches(epoch=3))
    on_host = list(BatchLoader(data.train, 8, CUDA, torch.device("cpu"), **kw).batches(epoch=3))
    on_cpu = list(BatchLoader(data.train, 8, torch.device("cpu"), torch.device("cpu"), **kw).batches(epoch=3))
    for (a, ya), (b, yb), (c, yc) in (
        ((p.x, p.y), (q.x, q.y), (r.x, r.y)) for p, q, r in zip(on_device, on_host, on_cpu)
    ):
        assert torch.equal(a, b) and torch.equal(ya, yb) and torch.equal(ya.cpu(), yc)
        assert torch.allclose(a.cpu(), c, rtol=0, atol=1e-6)  # the same pixels; x / 255 may round differently


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_train_on_cuda_end_to_end(tmp_path, precision):
    out = tmp_path / precision
    result = run_job(
        "train",
        "--device",
        "cuda",
        "--set",
        "train.epochs=3000",
        "--set",
        f"train.precision={precision}",
        "--output",
        str(out),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "device cuda:0" in result.stderr
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["test_accuracy"] >= 0.9
    weights = torch.load(out / "model.pt", weights_only=True)
    assert all(t.device.type == "cpu" for t in weights.values())


SCHEDULED = ["optim.momentum=0.9", "optim.schedule=cosine", "train.precision=fp32"]


@pytest.mark.parametrize("overrides", [["train.precision=fp32"], SCHEDULED, ["train.precision=fp16"]])
def test_cuda_graph_steps_train_as_eager_steps(tmp_path, overrides):
    """The same run replayed as CUDA graphs and run eagerly ends with the same weights (up to cuDNN's choices)."""
    root = write_image_folder(tmp_path / "imgs", n_classes=4, per_class=30, size=32)
    common = ["--device", "cuda", *sum((["--set", o] for o in overrides), [])]
    common += ["--set", "data.kind=folder", "--set", f"data.path={root}", "--set", "data.batch_size=16"]
    common += ["--set", "train.epochs=3", "--set", "train.deterministic=true"]
    results = {}
    for capture in ("auto", "off"):
        out = tmp_path / capture
        args = [*common, "--set", f"train.step_capture={capture}", "--output", str(out)]
        r = run_job("train", "--config", "cifar10", *args)
        assert r.returncode == 0, r.stderr[-2000:]
        assert ("CUDA graph" in r.stderr) == (capture == "auto")
        results[capture] = torch.load(out / "model.pt", weights_only=True)
    for k, v in results["off"].items():
        assert torch.allclose(v, results["auto"][k], rtol=1e-4, atol=1e-5), k


def test_iris_preset_on_the_gpu_is_captured_whole(tmp_path):
    r = run_job("train", "--device", "cuda", "--set", "train.epochs=2000", "--output", str(tmp_path / "iris"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "one CUDA graph per batch shape (forward, backward and SGD step)" in r.stderr


def test_a_step_that_reads_a_value_on_the_host_runs_eagerly_and_says_why(tmp_path):
    """`.item()` inside forward cannot be replayed: the run finds it before capturing and trains on, eagerly."""
    (tmp_path / "hostread.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self, num_classes):\n"
        "        super().__init__()\n"
        "        self.a, self.b = nn.Linear(4, 16), nn.Linear(16, num_classes)\n"
        "    def forward(self, x):\n"
        "        h = torch.relu(self.a(x))\n"
        "        return self.b(h * 2 if h.mean().item() > 1e9 else h)\n"
    )
    r = run_job(
        "train",
        "--device",
        "cuda",
        "--set",
        "model.name=hostread:Net",
        "--set",
        "train.epochs=2000",
        "--set",
        "train.step_capture=on",  # a model of one's own is captured when asked (auto: eager, and says why)
        "--output",
        str(tmp_path / "run"),
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "could not be captured as a CUDA graph: the step waits for the GPU on the host" in r.stderr
    last = json.loads((tmp_path / "run/metrics.jsonl").read_text().splitlines()[-1])
    assert last["test_accuracy"] >= 0.9


def test_a_model_that_replaces_a_buffer_in_its_forward_runs_eagerly_and_counts_every_step(tmp_path):
    """A forward that puts a new tensor in a buffer's place (self.seen = self.seen + 1) would replay into the tensor it
    replaced, its count frozen: the last warm-up step finds it, and the run goes on eagerly, counting as it does with
    capture off."""
    (tmp_path / "counting.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self, num_classes):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(4, num_classes)\n"
        "        self.register_buffer('seen', torch.zeros(()))\n"
        "    def forward(self, x):\n"
        "        self.seen = self.seen + 1\n"
        "        return self.fc(x)\n"
    )
    seen = {}
    for capture in ("on", "off"):
        out = tmp_path / capture
        sets = [
            "model.name=counting:Net",
            "train.epochs=40",
            "train.eval_every_epochs=20",
            f"train.step_capture={capture}",
        ]
        args = ["--device", "cuda", *sum((["--set", s] for s in sets), []), "--output", str(out)]
        r = run_job("train", *args, env={"PYTHONPATH": str(tmp_path)})
        assert r.returncode == 0, r.stderr[-2000:]
        seen[capture] = float(torch.load(out / "model.pt", weights_only=True)["seen"])
        if capture == "on":
            assert "could not be captured as a CUDA graph: the model's forward replaces its buffer seen" in r.stderr
    assert seen["on"] == seen["off"] > 40, seen


def model_failing_at_capture(folder, name: str, act: str) -> str:
    """model.name of an Iris model whose forward does `act` at its fourth training call alone (three eager warm-up
    steps, then the capture): what the host-wait probe before the capture cannot see."""
    (folder / f"{name}.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self, num_classes):\n"
        "        super().__init__()\n"
        "        self.a, self.b, self.calls = nn.Linear(4, 16), nn.Linear(16, num_classes), 0\n"
        "    def forward(self, x):\n"
        "        self.calls += self.training\n"
        "        if self.calls == 4:\n"
        f"            {act}\n"
        "        return self.b(torch.relu(self.a(x)))\n"
    )
    return f"{name}:Net"


HOST_COPY = "x = x + x.cpu().to(x.device) * 0"  # a copy to the host inside a capture: CUDA ends the capture


@pytest.mark.parametrize("act", [HOST_COPY, "raise ValueError('not in a graph')"])
def test_a_capture_that_fails_where_the_probe_cannot_see_it_falls_back_to_eager_and_trains_on(tmp_path, act):
    """A step that does, only while it is captured, what a graph cannot hold (a copy to the host: CUDA ends the
    capture; a Python error): the run says why, the device is brought back, and it trains on eagerly to the end."""
    name = model_failing_at_capture(tmp_path, "oncecaptured", act)
    out = tmp_path / "run"
    args = ["--device", "cuda", "--set", f"model.name={name}", "--set", "train.epochs=2000"]
    args += ["--set", "train.step_capture=on"]  # a model of one's own is captured when asked
    r = run_job("train", *args, "--output", str(out), env={"PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "could not be captured as a CUDA graph" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["epoch"] == 2000 and last["test_accuracy"] >= 0.9


def test_after_a_failed_capture_the_allocator_is_whole_and_memory_stays_flat(tmp_path, monkeypatch):
    """A capture CUDA ends (a copy to the host inside it) leaves no capture the memory allocator still thinks under
    way: empty_cache works (find-batch-size and out-of-memory retries call it) and eager steps do not leak."""
    name = model_failing_at_capture(tmp_path, "failscapture", HOST_COPY)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config("iris", [f"model.name={name}"])
    r = recipe.build(cfg, CUDA, load_data(cfg.data, tmp_path / "cache", say))
    log = LossLog(CUDA, 10)
    step = build_step(r, log.sums, plan_step(step_facts(r, "on", 1e9, own_model=True)))
    assert isinstance(step, CudaGraphStep)
    batch = next(iter(r.train.batches(0)))
    for _ in range(5):  # three warm-up steps, the capture that fails, an eager step
        step(batch.x, batch.y)
    assert "could not be captured" in step.description and not step.graphs
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    for _ in range(50):
        step(batch.x, batch.y)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before + 2**20 and torch.isfinite(log.sums).all()


def test_the_fast_preset_on_cuda_never_waits_in_an_epoch_and_captures_as_it_runs_eagerly(tmp_path):
    """cifar10-fast's parts (the schedule with a parameter held after its epochs, lookahead, alternating flips,
    reflected crops) add no host sync to an epoch, and the run captured as CUDA graphs ends where the eager one does."""
    root = write_cifar_batches(tmp_path / "c10", n_train=400, n_test=100)
    sets = [f"data.path={root}", "data.batch_size=50", "train.epochs=2", "train.log_every_steps=4"]
    cfg = load_config("cifar10-fast", sets)
    data = load_data(cfg.data, tmp_path / "cache", say)
    r = recipe.build(cfg, CUDA, data)
    state, log = Progress(), LossLog(CUDA, cfg.train.log_every_steps)
    step = build_step(r, log.sums, plan_step(step_facts(r, "auto")))
    assert isinstance(step, CudaGraphStep) and r.lookahead is not None
    run_dir = RunDir(str(tmp_path / "run"))
    with StopRequest(20) as stop:
        report = Report(run_dir, {}, 2, len(r.train), 0)
        clock, chooser = TrainClock(CUDA), Chooser(cfg.train, r.evaluated_on)
        loop = Loop(cfg, run_dir, r, step, state, log, report, stop, clock, 0.0, 0.0, Attempt(None), chooser)
        train_epoch(loop, 0)  # warm-up and capture
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            train_epoch(loop, 1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert not step.failed and len(step.graphs) == 1 and torch.isfinite(log.sums).all()
    results = {}
    for capture in ("auto", "off"):
        out = tmp_path / capture
        args = ["--device", "cuda", "--output", str(out), "--set", f"train.step_capture={capture}"]
        done = run_job("train", "--config", "cifar10-fast", *args, *sum((["--set", s] for s in sets), []),
                       "--set", "train.deterministic=true", "--set", "train.precision=fp32")  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        results[capture] = torch.load(out / "model.pt", weights_only=True)
    for k, v in results["off"].items():
        assert torch.allclose(v.float(), results["auto"][k].float(), rtol=1e-3, atol=1e-4), k


def test_jpeg_batches_decoded_on_the_device_match_the_host_decoder(tmp_path):
    """nvJPEG and libjpeg-turbo may round a little differently; the images, resized alike, must be the same, each
    of them: 100 images are four groups of nvJPEG's 32, decoded while the last group's resizes are still queued."""
    from job.data.decode import DEVICE_GROUP, Decoder, DeviceDecoder, decoded
    from job.data.preprocess import Preprocess

    images, _ = pattern_images(4, 25, 64, 0)
    assert len(images) > 3 * DEVICE_GROUP
    items = [(f"img{i}", "jpg", encode(img, "jpg")) for i, img in enumerate(images)]
    items.append(("odd.png", "png", encode(images[0], "png")))  # another format in the batch: decoded on the host
    for pre in (Preprocess(), Preprocess((48, 48), False), Preprocess((40, 40), True)):
        host = decoded(Decoder(0, pre).submit(items), ("a", "b"))
        device = decoded(DeviceDecoder(CUDA, pre).submit(items), ("a", "b"))
        assert device.is_cuda and device.shape == host.shape and device.dtype == torch.uint8
        diff = (device.cpu().int() - host.int()).abs().float()
        per_image = diff.mean((1, 2, 3))
        assert per_image.max() < 1.5 and diff.max() <= 48, (pre, per_image.max(), per_image.argmax(), diff.max())


def test_phone_sized_photos_not_square_decoded_on_the_device_match_the_host_decoder():
    """A phone's photos are 4:3 (landscape and portrait) and large: host (Pillow, drafting the JPEG) and device
    (nvJPEG, then resizing on the GPU) must cut the same box out of them and scale it alike, for every way a run
    holds its images: square by the short side with a centre crop, stretched to a square, a box of another aspect
    (predict's for a model of non-square input), and as the files are."""
    from job.data.decode import Decoder, DeviceDecoder, decoded
    from job.data.preprocess import Preprocess

    h, w = 1512, 2016
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    # Smooth ramps and a marker off centre, so a box cut elsewhere or turned shows as a large difference.
    land = np.stack([xx / w * 255, yy / h * 255, ((xx // 96 + yy // 96) % 2) * 200 + 20])
    land[:, 200:420, 300:600] = 255
    items = [
        ("land.jpg", "jpg", encode(land.astype(np.uint8), "jpg")),
        ("port.jpg", "jpg", encode(land.transpose(0, 2, 1).copy().astype(np.uint8), "jpg")),
    ]
    for pre in (
        Preprocess((256, 256), True, (224, 224)),
        Preprocess((224, 224), False),
        Preprocess((96, 128), True),
        Preprocess(),
    ):
        for item in items:
            host = decoded(Decoder(0, pre).submit([item]), ("a", "b"))
            device = decoded(DeviceDecoder(CUDA, pre).submit([item]), ("a", "b"))
            assert device.shape == host.shape, (pre, item[0], device.shape, host.shape)
            diff = (device.cpu().int() - host.int()).abs().float()
            assert diff.mean() < 2.0 and diff.quantile(0.999) <= 40, (pre, item[0], diff.mean(), diff.max())


def test_the_device_decoder_out_of_memory_stops_the_batch_and_is_not_taken_for_a_refusal():
    """A group nvJPEG refuses (a CMYK JPEG) is decoded on the host; running out of device memory is not a refusal:
    it stops the batch as out of memory (the run names the batch size), and does not quietly decode every photo of
    the run on the host instead (where each is resized before it is sent: 8 big photos would have fit)."""
    from job.data.decode import DeviceDecoder, decoded
    from job.data.preprocess import Preprocess

    ramp = np.linspace(0, 255, 3000, dtype=np.float32)
    photo = np.stack([np.add.outer(ramp, ramp) / 2, np.add.outer(ramp, -ramp) % 256, np.tile(ramp, (3000, 1))])
    items = [(f"big{i}", "jpg", encode(photo.astype(np.uint8), "jpg")) for i in range(8)]  # 8 x 27 MB decoded
    decoder = DeviceDecoder(CUDA, Preprocess((32, 32), False))
    decoded(decoder.submit(items[:1]), ("a", "b"))  # nvJPEG's own state made before the cap
    torch.cuda.synchronize()
    total = torch.cuda.get_device_properties(CUDA).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 64 * 2**20) / total)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            decoded(decoder.submit(items), ("a", "b"))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def test_exif_turned_jpegs_decoded_on_the_device_are_upright_as_on_the_host():
    """nvJPEG ignores EXIF orientation: the device decoder turns each image by its tag, as the host's Pillow does."""
    import io

    from PIL import Image

    from job.data.decode import Decoder, DeviceDecoder, decoded

    images, _ = pattern_images(2, 4, 48, 0)
    items = []
    for i, img in enumerate(images):
        pil = Image.fromarray(img.transpose(1, 2, 0)[:, :32])  # 48 x 32: not square, so a turn shows
        exif = Image.Exif()
        exif[0x0112] = (3, 6, 8, 2)[i % 4]
        buf = io.BytesIO()
        pil.save(buf, "JPEG", quality=95, exif=exif.tobytes())
        items.append((f"img{i}", "jpg", buf.getvalue()))
    for item in items:  # shapes differ by the turn: one at a time
        host = decoded(Decoder(0, None).submit([item]), ("a", "b"))
        device = decoded(DeviceDecoder(CUDA, None).submit([item]), ("a", "b"))
        assert device.shape == host.shape, item[0]
        assert (device.cpu().int() - host.int()).abs().float().mean() < 1.5, item[0]


def test_a_stream_decoded_on_the_device_trains_end_to_end(tmp_path):
    root = write_image_folder(tmp_path / "imgs", n_classes=3, per_class=20, size=48, fmt="jpg")
    code = run_job("shard", str(root), str(tmp_path / "shards"), "--samples-per-shard", "16")
    assert code.returncode == 0, code.stderr[-2000:]
    sets = ["data.kind=shards", "data.placement=stream", "data.decode=device", f"data.path={tmp_path / 'shards'}"]
    sets += ["data.image_size=32", "data.batch_size=8", "train.epochs=2", "data.normalize=true"]
    done = run_job("train", "--config", "cifar10", "--device", "cuda", "--output", str(tmp_path / "run"),
                   *sum((["--set", s] for s in sets), []))  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "JPEG images decoded on cuda:0 (nvJPEG)" in done.stderr
    last = json.loads((tmp_path / "run/metrics.jsonl").read_text().splitlines()[-1])
    assert last["epoch"] == 2 and last["test_accuracy"] >= 0


def shard_folder(tmp_path, **how):
    """JPEG class folders packed as shards of 16 samples: what a streamed run reads."""
    root = write_image_folder(tmp_path / "imgs", fmt="jpg", **how)
    done = run_job("shard", str(root), str(tmp_path / "shards"), "--samples-per-shard", "16")
    assert done.returncode == 0, done.stderr[-2000:]
    return tmp_path / "shards"


def test_streamed_batches_decoded_on_the_device_match_the_host_while_the_step_keeps_the_gpu_busy(tmp_path):
    """The device decoder's images are handed to the step's stream, and their memory goes back to the decoder's pool
    when the loader drops them: unless the pool waits for the step's queued kernels to read them, the decoder writes
    the next groups into them (and nvJPEG's hardware engine does not wait for the stream it is given). Batches of
    128 (four groups of 32) while the training stream is kept busy, each image compared with the host decoder's."""
    shards = shard_folder(tmp_path, n_classes=3, per_class=8, size=48, test_per_class=100)
    seen = {}
    for decode in ("host", "device"):
        sets = ["data.kind=shards", "data.placement=stream", f"data.decode={decode}", f"data.path={shards}"]
        sets += ["data.image_size=32", "data.normalize=false"]
        cfg = load_config("cifar10", sets)
        r = recipe.build(cfg, CUDA, load_data(cfg.data, tmp_path / f"cache-{decode}", say))
        loader = r.feed.streamed("test", 128, 0, 1)  # decoded every pass (an evaluation keeps a small split)
        busy, xs, names = torch.randn(4096, 4096, device=CUDA), [], []
        for _ in range(3):  # a pass and its repeats: the decoder and the step overlap differently each time
            for b in loader.batches(0):
                for _ in range(4):  # the step's kernels, queued ahead of the next batch's
                    busy = (busy @ busy).tanh_()
                xs.append(b.x.clone())
                names += list(b.names)
        torch.cuda.synchronize()
        seen[decode] = torch.cat(xs).cpu(), names
    (host, host_names), (device, device_names) = seen["host"], seen["device"]
    assert device_names == host_names and host.shape == device.shape and host.shape[0] == 900
    diff = (device - host).abs().mean((1, 2, 3)) * 255  # per image, in the 0-255 scale
    assert diff.max() < 1.5, [(host_names[i], float(diff[i])) for i in diff.argsort(descending=True)[:5]]


@pytest.mark.parametrize("crops", ["random_resized", "centre"])
@pytest.mark.parametrize("decode", ["host", "device"])
def test_a_streamed_epoch_with_a_view_never_waits_for_the_gpu(tmp_path, decode, crops):
    """A streamed epoch's flips and random resized crops (drawn on the host), or the centre crop of the view
    (photos held larger than the model sees): copied and made without the host waiting for the GPU, decoded on the
    host or on the device; and the host-wait probe before each capture not fooled by the decoder's own waits."""
    shards = shard_folder(tmp_path, n_classes=4, per_class=40, size=48, test_per_class=8)
    sets = ["data.kind=shards", "data.placement=stream", f"data.decode={decode}", f"data.path={shards}"]
    sets += ["data.image_size=32", "data.resize_size=40", "data.random_hflip=true", "data.normalize=true"]
    sets += [f"data.random_resized_crop={crops == 'random_resized'}", "data.batch_size=16", "train.precision=bf16"]
    cfg = load_config("cifar10", [*sets, "train.log_every_steps=3"])
    r = recipe.build(cfg, CUDA, load_data(cfg.data, tmp_path / "cache", say))
    assert r.input_shape[-1] == 32
    state, log = Progress(), LossLog(CUDA, cfg.train.log_every_steps)
    step = build_step(r, log.sums, plan_step(step_facts(r, "auto", 1e9)))
    run_dir = RunDir(str(tmp_path / "run"))
    report = Report(run_dir, {}, 2, len(r.train), 0)
    with StopRequest(20) as stop:
        clock, chooser = TrainClock(CUDA), Chooser(cfg.train, r.evaluated_on)
        loop = Loop(cfg, run_dir, r, step, state, log, report, stop, clock, 0.0, 0.0, Attempt(None), chooser)
        for epoch in range(2):  # warm-up: cuDNN picks its kernels, each batch shape is captured
            train_epoch(loop, epoch)
        torch.cuda.synchronize()
        assert step.graphs and not step.failed, step.failed
        with host_waits() as waits:  # this thread's: the device decoder's thread waits for its own stream, rightly
            train_epoch(loop, 2)
    assert not waits, waits
    assert state.step == 3 * len(r.train) and torch.isfinite(log.sums).all()


def test_predict_decoding_on_the_device_labels_as_the_host_decoder_does(tmp_path):
    """predict --decode device: JPEG photos (EXIF-turned ones among them) decoded by nvJPEG give the labels and
    probabilities the host's decoding gives, and a broken file still gets its own error row."""
    from test_photos import photo_folder, turned_jpeg

    photos = photo_folder(tmp_path / "photos")
    sets = ["data.kind=folder", f"data.path={photos}", "data.image_size=32", "data.val_split=0.3", "train.epochs=3"]
    done = run_job("train", "--config", "cifar10", "--device", "cuda", "--output", str(tmp_path / "run"),
                   *sum((["--set", s] for s in sets), []))  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    new = tmp_path / "new"
    new.mkdir()
    from PIL import Image, ImageOps

    for i, p in enumerate(sorted(photos.rglob("IMG_0*"))[:40]):  # .JPG and .jpeg, as phones name them
        turned = ImageOps.exif_transpose(Image.open(p)).convert("RGB") if i % 2 else None
        (new / f"{i:03d}.jpg").write_bytes(turned_jpeg(turned, 6) if turned is not None else p.read_bytes())
    (new / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 cut")
    rows = {}
    for decode in ("host", "device"):
        out = tmp_path / f"{decode}.csv"
        args = ["-m", str(tmp_path / "run"), str(new), "--device", "cuda", "--decode", decode, "-o", str(out)]
        done = run_job("predict", *args, "--batch-size", "16")
        assert done.returncode == 0 and "40 images labelled, 1 could not be read" in done.stderr, done.stderr[-2000:]
        rows[decode] = {r["path"]: r for r in csv.DictReader(out.open(newline=""))}
    assert rows["host"].keys() == rows["device"].keys()
    for path, host in rows["host"].items():
        device = rows["device"][path]
        assert bool(host["error"]) == bool(device["error"]) == path.endswith("broken.jpg"), (path, host, device)
        if not host["error"]:  # nvJPEG rounds a little differently: a near tie may go the other way
            near_tie = float(host["probability"]) < 0.6
            assert device["label"] == host["label"] or near_tie, (path, host, device)
            if device["label"] == host["label"]:
                assert abs(float(device["probability"]) - float(host["probability"])) < 0.05, (path, host, device)


def test_find_batch_size_with_capture_answers_a_batch_that_trains_under_the_same_cap(tmp_path):
    """find-batch-size measures the run's own captured step (a graph holds memory of its own besides the eager
    warm-up's): its answer trains a whole epoch, evaluation included, under the memory cap it was found under."""
    from job.group.memory import memory_limit
    from job.run.batch_size import find_batch_size
    from job.run.train import run

    root = write_image_folder(tmp_path / "imgs", n_classes=4, per_class=300, size=32, test_per_class=50)
    sets = [f"data.path={root}", "data.kind=folder", "train.step_capture=on", "train.epochs=1", "data.val_split=0"]
    cap = 0.25  # GiB: the model's batch limit well below the 1,200 training images
    found = find_batch_size(load_config("cifar10", sets), "cuda", cap)
    assert found["limited_by"] == "memory", found
    cfg = load_config("cifar10", [*sets, f"data.batch_size={found['batch_size']}"])
    with memory_limit(CUDA, cap):
        summary = run(cfg, str(tmp_path / "run"), "cuda", "never", True)
    assert summary["epochs_run"] == 1 and summary["steps"] >= 1200 // found["batch_size"], summary


@pytest.mark.parametrize("augmentation", ["none", "flip_shift"])
def test_an_evaluation_pass_never_waits_for_the_gpu_and_counts_as_the_cpu_does(tmp_path, augmentation):
    """An evaluation's sums (loss, accuracy, top-5, the confusion matrix) are counted on the device: no host wait
    a batch (a bincount and a masked index each waited), the counts a bincount gives, through a view (photos held
    larger than the model's input: torchvision's roi_align operator, also in deterministic mode)."""
    from job.use.evaluate import test_sums
    from job.use.scores import confusion_add

    at, counted = torch.randint(0, 36, (5000,)), torch.rand(5000) < 0.8
    cells = torch.zeros(36, device=CUDA)
    confusion_add(cells, at.to(CUDA), counted.to(CUDA))
    assert torch.equal(cells.cpu(), torch.bincount(at[counted], minlength=36).float())

    root = write_image_folder(tmp_path / "imgs", n_classes=6, per_class=10, size=40, test_per_class=30)
    sets = ["data.kind=folder", f"data.path={root}", "data.image_size=32", "data.resize_size=40"]
    cfg = load_config("cifar10", [*sets, "data.eval_batch_size=32", "train.precision=fp32"])
    data = load_data(cfg.data, tmp_path / "cache", say)
    on = {d: recipe.build(cfg, torch.device(d), data) for d in ("cuda", "cpu")}
    on["cuda"].model.load_state_dict(on["cpu"].model.state_dict())
    r = on["cuda"]
    test_sums(r.model, r.held_out["test"], r.amp, augmentation, classes=6)  # cuDNN picks its kernels
    torch.cuda.synchronize()
    with host_waits() as waits:
        sums = test_sums(r.model, r.held_out["test"], r.amp, augmentation, classes=6)
    assert not waits, waits
    cpu = test_sums(on["cpu"].model, on["cpu"].held_out["test"], on["cpu"].amp, augmentation, classes=6)
    sums = sums.cpu()
    assert sums[2] == cpu[2] == 180 and sums[4:].sum() == 180, (sums, cpu)  # every sample counted, once
    assert abs(float(sums[1] - cpu[1])) <= 3  # TF32 convolutions on the GPU: a near tie may go the other way
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        again = test_sums(r.model, r.held_out["test"], r.amp, augmentation, classes=6).cpu()
    finally:
        torch.use_deterministic_algorithms(False)
    assert again[2] == 180 and again[4:].sum() == 180 and abs(float(again[1] - sums[1])) <= 3


@pytest.mark.parametrize("placement", ["device", "host"])
def test_the_recipes_tricks_never_wait_for_the_gpu(tmp_path, placement):
    """EMA updates, TrivialAugment and random erasing, MixUp and CutMix and a warm-up: an epoch with every one of
    them runs without the host waiting for the device."""
    root = write_image_folder(tmp_path / "imgs", n_classes=4, per_class=40, size=32)
    tricks = ["train.ema=0.99", "data.augment=[trivial_augment, random_erasing]", "train.mixup=0.2"]
    tricks += ["train.cutmix=1.0", "train.mix_switch=0.5", "optim.warmup='5 steps'", "optim.schedule=cosine"]
    cfg = load_config(
        "cifar10",
        ["data.kind=folder", f"data.path={root}", "data.batch_size=16", "data.random_hflip=true"]
        + ["data.normalize=true", f"data.placement={placement}", "optim.momentum=0.9", *tricks],
    )
    data = load_data(cfg.data, tmp_path / "cache", say)
    r = recipe.build(cfg, CUDA, data)
    state, log = Progress(), LossLog(CUDA, cfg.train.log_every_steps)
    step = build_step(r, log.sums, plan_step(step_facts(r, "auto", 1e9)))
    run_dir = RunDir(str(tmp_path / "run"))
    report = Report(run_dir, {}, 2, len(r.train), 0)
    with StopRequest(20) as stop:
        clock, chooser = TrainClock(CUDA), Chooser(cfg.train, r.evaluated_on)
        loop = Loop(cfg, run_dir, r, step, state, log, report, stop, clock, 0.0, 0.0, Attempt(None), chooser)
        for _ in range(2):
            train_epoch(loop, 0)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            train_epoch(loop, 1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert r.ema.updates == state.step and torch.isfinite(log.sums).all()
