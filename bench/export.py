"""Exports checked against their models: ONNX (onnxruntime) and pt2 (torch.export.load), for the cifar10 CNN,
resnet18 and mobilenet_v3_small, each trained briefly on CIFAR-10 photos and checked on the run's test images.

    python bench/export.py SHARED_CIFAR_JPEG_FOLDER [--per-class 100] [--epochs 1]

Prints, per model and format, the images checked, the largest logit difference and whether every top-1 label
agreed (goal: 100% agreement and at most 1e-4, fp32 on the CPU), from `job export`'s own <file>.check.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("cifar_cnn", "resnet18", "mobilenet_v3_small")


def subset(src: Path, dst: Path, per_class: int) -> None:
    """train/ and test/ of the first per_class (train) and per_class // 4 (test) photos of each class."""
    for split, n in (("train", per_class), ("test", max(per_class // 4, 1))):
        for folder in sorted((src / split).iterdir()):
            out = dst / split / folder.name
            out.mkdir(parents=True)
            for f in sorted(folder.iterdir())[:n]:
                shutil.copy(f, out / f.name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cifar", type=Path, help="a CIFAR-10 JPEG folder (train/<class>/*.jpg, test/<class>/*.jpg)")
    ap.add_argument("--per-class", type=int, default=100)
    ap.add_argument("--epochs", type=int, default=1)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        subset(a.cifar, work / "data", a.per_class)
        for name in MODELS:
            run = work / name
            train = [
                sys.executable,
                "-m",
                "job",
                "train",
                "--device",
                "cpu",
                "--config",
                "cifar10",
                "--output",
                str(run),
            ]
            for item in (
                "data.kind=folder",
                f"data.path={work / 'data'}",
                f"model.name={name}",
                f"train.epochs={a.epochs}",
            ):
                train += ["--set", item]
            subprocess.run(train, cwd=ROOT, check=True, stderr=subprocess.DEVNULL)
            for fmt in ("onnx", "pt2"):
                out = work / f"{name}.{fmt}"
                done = subprocess.run(
                    [sys.executable, "-m", "job", "export", "-m", str(run), "-f", fmt, "-o", str(out)],
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                )
                if done.returncode != 0:
                    print(f"{name} {fmt}: export failed: {done.stderr.strip().splitlines()[-1]}")
                    continue
                check = json.loads(Path(f"{out}.check.json").read_text())
                print(
                    f"{name:20s} {fmt:4s} {check['images']} test images: largest logit difference "
                    f"{check['max_abs_logit_diff']:.1e}, top-1 agree {check['labels_agree']}"
                )


if __name__ == "__main__":
    main()
