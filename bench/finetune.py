"""Fine-tuning on photos at 224 px: the `finetune` preset on CIFAR-10 JPEGs upscaled to photo size.

    python bench/finetune.py [--archive ../shared/datasets/cifar10-jpeg.tar.gz] [--per-class 100]
                             [--model mobilenet_v3_small] [--weights FILE|NAME] [--device cpu] [--epochs 2]

Builds an image folder of `per-class` training and `per-class/2` test images per class, each CIFAR-10 JPEG
upscaled to 400x350 (bicubic, JPEG quality 90: the size of a phone photo's thumbnail, so that decoding and the
resize to the weights' 232 or 256 px are real work), then runs the preset twice, with the backbone frozen and
with every layer trained, and prints each run's test accuracy, its images/s over the last epoch (training
images over the epoch's time, its test pass included, as the run's log says) and its wall time.

--weights: a torchvision weights name (DEFAULT, needs the internet or the weights in $JOB_CACHE_DIR) or the URL of
a state_dict. Without it the script saves a randomly initialised model's state_dict and loads that, so the
pipeline's speed is measured anywhere; the accuracy then is that of features nobody trained, not of fine-tuning.
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
from collections import defaultdict
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
PHOTO = (400, 350)  # width, height of the upscaled "photos"


def first_of_each_class(archive: Path, want: dict[str, int]):
    """(split, class, file name, bytes) of the archive's first want[split] images of each class of each split."""
    taken: dict[tuple[str, str], int] = defaultdict(int)
    with tarfile.open(archive) as tar:
        for member in tar:
            parts = Path(member.name).parts
            if not member.isfile() or len(parts) < 4 or parts[-3] not in want:
                continue
            split, cls = parts[-3], parts[-2]
            if taken[split, cls] >= want[split]:
                continue
            taken[split, cls] += 1
            yield split, cls, parts[-1], tar.extractfile(member).read()


def make_photos(archive: Path, dst: Path, per_class: int) -> int:
    """dst/train/<class>/*.jpg and dst/test/<class>/*.jpg, upscaled from the archive's first images of each class."""
    n = 0
    for split, cls, name, data in first_of_each_class(archive, {"train": per_class, "test": max(per_class // 2, 1)}):
        out = dst / split / cls / name
        out.parent.mkdir(parents=True, exist_ok=True)
        Image.open(io.BytesIO(data)).convert("RGB").resize(PHOTO, Image.BICUBIC).save(out, quality=90)
        n += 1
    return n


def finetune(photos: Path, out: Path, a: argparse.Namespace, *overrides: str) -> dict:
    sets = [
        f"data.path={photos}",
        f"model.name={a.model}",
        f"model.weights={a.weights}",
        f"train.epochs={a.epochs}",
        f"data.batch_size={a.batch_size}",
        *overrides,
    ]
    cmd = [sys.executable, "-m", "job", "train", "--config", "finetune", "--device", a.device, "--output", str(out)]
    start = time.perf_counter()
    done = subprocess.run([*cmd, *(x for s in sets for x in ("--set", s))], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(done.stderr[-2000:])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"wall_s": time.perf_counter() - start, "last": records[-1], "log": done.stderr}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--archive", type=Path, default=ROOT.parent / "shared/datasets/cifar10-jpeg.tar.gz")
    ap.add_argument("--per-class", type=int, default=100)
    ap.add_argument("--model", default="mobilenet_v3_small")
    ap.add_argument("--weights", default="")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        t = time.perf_counter()
        n = make_photos(a.archive, work / "photos", a.per_class)
        print(f"{n} photos of {PHOTO[0]}x{PHOTO[1]} made in {time.perf_counter() - t:.1f} s")
        if not a.weights:
            import torch
            import torchvision

            torch.manual_seed(0)
            a.weights = str(work / "random.pth")
            torch.save(torchvision.models.get_model(a.model).state_dict(), a.weights)
            print(f"weights: a randomly initialised {a.model} (no pretrained weights given): speed only")
        for label, extra in (("frozen backbone", ("model.freeze_backbone=true",)), ("every layer", ())):
            r = finetune(work / "photos", work / label.replace(" ", "-"), a, *extra)
            last = r["last"]
            step = next((line for line in r["log"].splitlines() if line.startswith("step:")), "")
            print(
                f"{a.model} {label}, {a.device}: test accuracy {last['test_accuracy']:.3f} after {last['epoch']} "
                f"epochs; {last['samples_per_s']:.1f} images/s (last epoch, test pass included); "
                f"{r['wall_s']:.0f} s in all; "
                f"{step}"
            )


if __name__ == "__main__":
    main()
