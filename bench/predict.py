"""`job predict` against a tight loop that decodes and runs the same model on the same files in the same process.

    python bench/predict.py [--photos 2000] [--repeat 3]

Trains a small model (the cifar10 CNN, 32 px) on a folder of synthetic photos, then prints
  - images/s of `job predict` (its predict() in this process: listing, reading, decoding ahead, batches, CSV rows)
    and of a tight loop over the same files (read, the same decode, the same preprocessing, the model), fastest of
    `--repeat` each, alternating, and their ratio (goal: at least 0.9);
  - the peak memory of `python -m job predict` over the folder given once and given ten times (ten times the
    inputs), and their ratio (goal: within a few percent).
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from job.data.augment import to_float  # noqa: E402
from job.data.image import pixels  # noqa: E402
from job.group.memory import peak_tree_rss  # noqa: E402
from job.use.bundle import load_predictor  # noqa: E402
from job.use.predict import predict  # noqa: E402


def photos(root: Path, n: int) -> None:
    rng = np.random.default_rng(0)
    for i in range(n):
        k = i % 4
        px = rng.integers(0, 60, (48, 64, 3), dtype=np.uint8)
        px[:, :, k % 3] += 150
        buf = io.BytesIO()
        Image.fromarray(px).save(buf, "JPEG", quality=90)
        path = root / f"class{k}" / f"IMG_{i:05d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(buf.getvalue())


def tight(run: Path, files: list[Path], batch: int) -> float:
    """images/s of the plainest loop: the model loaded, then read, decode, preprocess, forward, argmax (as job
    predict's time counts its loading too)."""
    t0 = time.perf_counter()
    p = load_predictor(str(run), torch.device("cpu"))
    with torch.no_grad():
        for i in range(0, len(files), batch):
            chunk = files[i : i + batch]
            held = np.stack([pixels(f.read_bytes(), f.name, p.pre).transpose(2, 0, 1) for f in chunk])
            x = to_float(torch.from_numpy(held), torch.contiguous_format, p.mean, p.std, p.view)
            p.model(x).argmax(1).tolist()
    return len(files) / (time.perf_counter() - t0)


def job(run: Path, folder: Path, out: Path, batch: int) -> float:
    t0 = time.perf_counter()
    done = predict(str(run), [str(folder)], str(out), 1, batch, torch.device("cpu"), log=lambda _: None)
    return done["labelled"] / (time.perf_counter() - t0)


def peak(run: Path, inputs: list[str], out: Path) -> int:
    proc = subprocess.Popen(
        [sys.executable, "-m", "job", "predict", "-m", str(run), *inputs, "--device", "cpu", "-o", str(out)],
        cwd=ROOT,
        stderr=subprocess.DEVNULL,
    )
    top = peak_tree_rss(proc)
    if proc.wait() != 0:
        sys.exit("job predict failed")
    return top


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--photos", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        photos(work / "photos", a.photos)
        run = work / "run"
        train = [sys.executable, "-m", "job", "train", "--device", "cpu", "--config", "cifar10", "--output", str(run)]
        for item in ("data.kind=folder", f"data.path={work / 'photos'}", "data.image_size=32", "data.val_split=0.2"):
            train += ["--set", item]
        subprocess.run([*train, "--set", "train.epochs=1"], cwd=ROOT, check=True, stderr=subprocess.DEVNULL)
        files = sorted((work / "photos").rglob("*.jpg"))
        speeds: dict[str, list[float]] = {"tight": [], "job": []}
        for i in range(a.repeat):
            speeds["tight"].append(tight(run, files, a.batch))
            speeds["job"].append(job(run, work / "photos", work / f"p{i}.csv", a.batch))
        t, j = max(speeds["tight"]), max(speeds["job"])
        print(f"{len(files)} photos: tight loop {t:.0f} images/s, job predict {j:.0f} images/s, ratio {j / t:.2f}")
        one = peak(run, [str(work / "photos")], work / "m1.csv")
        ten = peak(run, [str(work / "photos")] * 10, work / "m10.csv")
        print(f"peak memory: {one / 2**20:.0f} MiB for {len(files)} inputs, {ten / 2**20:.0f} MiB for ten times them, "
              f"ratio {ten / one:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
