"""Streaming full-size photos to a GPU against the same training step fed from tensors already on the device.

    python bench/stream_gpu.py CIFAR10_JPEG_TAR_GZ [--images 20000] [--epochs 3]

Makes the photos (--images CIFAR-10 training images and 200 test images, as many of each class, upscaled to
400x350 and saved as JPEG at quality 90), packs them with `python -m job shard`, then trains ResNet-50 at 224 px
in bf16 on them three ways, each a whole `python -m job train` run on cuda: streamed from the shards and decoded
by host processes (data.decode host), streamed and decoded on the GPU (data.decode device), and decoded once into
GPU memory before the first step (data.placement device: the step fed with pre-decoded tensors on the device).
Every run holds the photos at 256 px and trains on random resized 224 px crops with flips. Prints the images/s of
each run's last epoch (its test pass of 200 images included) and streamed/pre-decoded (goal: at least 0.90).
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHOTO = (400, 350)


def photo(item: tuple[str, bytes]) -> tuple[str, bytes]:
    from PIL import Image

    name, data = item
    img = Image.open(io.BytesIO(data)).convert("RGB").resize(PHOTO, Image.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90)
    return name, buf.getvalue()


def make_photos(archive: Path, folder: Path, train: int, test: int = 200, classes: int = 10) -> None:
    """train and test images in all, the same number from each class (the archive lists them class by class)."""
    quota = {"train": train // classes, "test": test // classes}
    taken: dict[tuple[str, str], int] = {}
    items = []
    with tarfile.open(archive) as tar:
        for member in tar:
            parts = member.name.split("/")
            if not member.isfile() or len(parts) < 4 or parts[-3] not in quota:
                continue
            key = (parts[-3], parts[-2])
            if taken.get(key, 0) < quota[parts[-3]]:
                taken[key] = taken.get(key, 0) + 1
                items.append(("/".join(parts[-3:]), tar.extractfile(member).read()))
    with ProcessPoolExecutor() as pool:
        for name, data in pool.map(photo, items, chunksize=64):
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(data)


def images_per_s(shards: Path, out: Path, epochs: int, device: str, *overrides: str) -> tuple[float, str]:
    sets = [
        "data.kind=shards",
        f"data.path={shards}",
        "model.name=resnet50",
        "data.image_size=224",
        "data.resize_size=256",
        "data.random_resized_crop=true",
        "data.random_hflip=true",
        "data.normalize=true",
        "data.batch_size=256",
        "train.precision=bf16",
        "optim.momentum=0.9",
        f"train.epochs={epochs}",
        "train.log_every_steps=20",
        *overrides,
    ]
    cmd = [sys.executable, "-m", "job", "train", "--config", "cifar10", "--device", device, "--output", str(out)]
    r = subprocess.run([*cmd, *sum((["--set", s] for s in sets), [])], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(overrides)}\n{r.stderr[-3000:]}")
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    held = next((line for line in r.stderr.splitlines() if line.startswith("device ")), "")
    return last["samples_per_s"], held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("archive", type=Path)
    ap.add_argument("--images", type=int, default=20000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cpu: a check of the script itself (no GPU decoding run)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stream-gpu-"))
    t0 = time.perf_counter()
    make_photos(args.archive, work / "photos", args.images)
    packed = subprocess.run([sys.executable, "-m", "job", "shard", str(work / "photos"), str(work / "shards")])
    if packed.returncode != 0:
        sys.exit("job shard failed")
    print(f"{args.images} photos of {PHOTO[0]}x{PHOTO[1]} made and packed in {time.perf_counter() - t0:.0f} s")
    runs = {
        "streamed, decoded on the host": ("data.placement=stream", "data.decode=host"),
        "streamed, decoded on the GPU": ("data.placement=stream", "data.decode=device"),
        "pre-decoded, on the GPU": ("data.placement=device",),
    }
    if args.device == "cpu":
        runs = {k: v for k, v in runs.items() if "GPU" not in k} | {"pre-decoded, on the GPU": ("data.placement=host",)}
    rates = {}
    for i, (what, overrides) in enumerate(runs.items()):
        rates[what], held = images_per_s(work / "shards", work / f"run{i}", args.epochs, args.device, *overrides)
        print(f"{what:32s} {rates[what]:8.0f} images/s   ({held})", flush=True)

    import torch

    base = rates["pre-decoded, on the GPU"]
    where = torch.cuda.get_device_name() if args.device != "cpu" else "CPU"
    print(f"{where}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    for what in list(runs)[:-1]:
        print(f"{what:32s} / pre-decoded: {rates[what] / base:.2f} (goal >= 0.90)")


if __name__ == "__main__":
    main()
