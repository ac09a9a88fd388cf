"""`job predict` on a GPU against the model's forward pass on pre-decoded tensors already on the device.

    python bench/predict_gpu.py CIFAR10_JPEG_TAR_GZ [--photos 2000] [--train 500] [--repeat 2]

Makes photos as bench/stream_gpu.py does (CIFAR-10 images upscaled to 400x350, JPEG at quality 90), trains
ResNet-50 at 224 px on --train of them for one epoch (a whole `python -m job train` run), then labels --photos
others and prints the images/s of
  - the model's forward pass over them pre-decoded and preprocessed on the device, batch by batch (the bound);
  - `job predict` (its predict() in this process: listing, reading, decoding ahead, batches, rows written), with
    images decoded on the host (--decode host) and by the GPU's nvJPEG (--decode device), fastest of --repeat;
and each over the bound (goal: at least 0.90).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from stream_gpu import PHOTO, make_photos  # noqa: E402

from job.data.augment import to_float  # noqa: E402
from job.data.decode import Decoder, decoded  # noqa: E402
from job.use.bundle import load_predictor  # noqa: E402
from job.use.predict import predict  # noqa: E402


def train(photos: Path, out: Path, device: str) -> None:
    sets = ["data.kind=folder", f"data.path={photos}", "model.name=resnet50", "data.image_size=224"]
    sets += ["data.normalize=true", "data.batch_size=64", "train.epochs=1"]
    cmd = [sys.executable, "-m", "job", "train", "--config", "cifar10", "--device", device, "--output", str(out)]
    done = subprocess.run([*cmd, *sum((["--set", s] for s in sets), [])], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"training failed:\n{done.stderr[-3000:]}")


def bound(run: Path, files: list[Path], batch: int, device: torch.device) -> float:
    """images/s of the model alone: every photo decoded beforehand (held as predict holds them) and on the device;
    timed from the first batch's preprocessing to the last batch's labels."""
    p = load_predictor(str(run), device)
    decoder = Decoder(8, p.pre, skip=False)
    held = [decoded(decoder.submit([(f.name, "jpg", f.read_bytes()) for f in files[i : i + batch]]), ("", ""))
            for i in range(0, len(files), batch)]  # fmt: skip
    held = [h.to(device) for h in held]
    with torch.no_grad():
        for x in held[:2]:  # warm-up: cuDNN picks its kernels
            p.model(to_float(x, torch.contiguous_format, p.mean, p.std, p.view)).argmax(1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        labels = [p.model(to_float(x, torch.contiguous_format, p.mean, p.std, p.view)).argmax(1) for x in held]
        torch.cat(labels).cpu()
    return len(files) / (time.perf_counter() - t0)


def job(run: Path, folder: Path, out: Path, batch: int, device: torch.device, decode: str) -> float:
    t0 = time.perf_counter()
    done = predict(str(run), [str(folder)], str(out), 1, batch, device, log=lambda _: None, decode=decode)
    return done["labelled"] / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("archive", type=Path)
    ap.add_argument("--photos", type=int, default=2000)
    ap.add_argument("--train", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--device", default="cuda", help="cpu: a check of the script itself (no GPU decoding run)")
    a = ap.parse_args()
    device = torch.device(a.device)
    work = Path(tempfile.mkdtemp(prefix="predict-gpu-"))
    t0 = time.perf_counter()
    make_photos(a.archive, work / "photos", a.train, a.photos)  # train/ to learn from, test/ to label
    train(work / "photos", work / "run", a.device)
    made = f"{a.train + a.photos} photos of {PHOTO[0]}x{PHOTO[1]} made"
    print(f"{made}, ResNet-50 trained on {a.train} of them: {time.perf_counter() - t0:.0f} s", flush=True)
    files = sorted((work / "photos" / "test").rglob("*.jpg"))
    rates = {"forward on pre-decoded device tensors": bound(work / "run", files, a.batch, device)}
    decodes = ("host", "device") if device.type == "cuda" else ("host",)
    for decode in decodes:
        runs = [job(work / "run", work / "photos" / "test", work / f"{decode}{i}.csv", a.batch, device, decode)
                for i in range(a.repeat)]  # fmt: skip
        rates[f"job predict, decoded on the {'GPU' if decode == 'device' else 'host'}"] = max(runs)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{where}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, {len(files)} photos, batch {a.batch}")
    base = rates.pop("forward on pre-decoded device tensors")
    print(f"{'forward on pre-decoded device tensors':40s} {base:8.0f} images/s")
    for what, rate in rates.items():
        print(f"{what:40s} {rate:8.0f} images/s   / forward: {rate / base:.2f} (goal >= 0.90)")


if __name__ == "__main__":
    main()
