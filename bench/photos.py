"""Photo folders as people hold them: what sorting their files costs, and what bad files cost a run's start.

    python bench/photos.py [--names 1000000] [--photos 20000] [--repeat 2]

Prints
  - the seconds to take 1,000,000 file names (nested class folders, system files among them) through what the
    folder reader does with a listing: system files and other files set aside, the layout found, each file's
    class and split (val and test held out by a hash of its path). Goal: under 2 s on this CPU.
  - the seconds from nothing to the data in memory (every photo read and decoded: what precedes a run's first
    step) for a folder of N photos, and for the same folder with 1% bad files added (empty, cut short, not
    images), and their ratio. The two alternate `--repeat` times and the fastest of each counts. Goal: at most 1.1.
"""

from __future__ import annotations

import argparse
import io
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from job.data.folder import Listing  # noqa: E402
from job.data.split import HoldOut, sort_files  # noqa: E402


def names(n: int) -> list[str]:
    """n names as a phone's export holds them: 100 class folders, some nested by date, a system file per 1,000."""
    out = []
    for i in range(n):
        nest = "DCIM/100APPLE/" if i % 7 == 0 else ""
        out.append(f"class{i % 100:03d}/{nest}IMG_{i:07d}.{'JPG' if i % 2 else 'jpeg'}")
        if i % 1000 == 0:
            out.append(f"class{i % 100:03d}/._IMG_{i:07d}.JPG")
    return out


def sorting(n: int) -> float:
    listed = names(n)
    t0 = time.perf_counter()
    listing = Listing()
    kept = [name for name in listed if listing.keep(name)]
    files = sort_files(sorted(kept), HoldOut(val=0.1, test=0.1, seed=42))
    seconds = time.perf_counter() - t0
    assert sum(len(r) for r in files.roles.values()) == n
    return seconds


def jpeg(rng: np.random.Generator) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(buf, "JPEG", quality=85)
    return buf.getvalue()


def photo_folder(root: Path, n: int, bad: int) -> None:
    rng = np.random.default_rng(0)
    for i in range(n):
        path = root / f"class{i % 10}" / f"IMG_{i:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(jpeg(rng))
    good = jpeg(rng)
    for i in range(bad):
        data = (b"", good[: len(good) // 3], b"<html>404</html>")[i % 3]
        (root / f"class{i % 10}" / f"IMG_9{i:05d}.jpg").write_bytes(data)


def reading(folder: Path) -> float:
    from job.config import DataConfig
    from job.data.folder import load_folder

    cfg = DataConfig(kind="folder", path=str(folder), image_size=32)
    t0 = time.perf_counter()
    load_folder(cfg, None, lambda _: None)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--names", type=int, default=1_000_000)
    ap.add_argument("--photos", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    seconds = min(sorting(a.names) for _ in range(a.repeat))
    print(f"sorting {a.names:,} file names into classes and splits: {seconds:.2f} s (goal: under 2 s)")
    with tempfile.TemporaryDirectory() as tmp:
        clean, dirty = Path(tmp) / "clean", Path(tmp) / "dirty"
        photo_folder(clean, a.photos, 0)
        shutil.copytree(clean, dirty)
        photo_folder(dirty, 0, a.photos // 100)  # the same photos, and 1% bad files beside them
        times: dict[str, list[float]] = {"clean": [], "dirty": []}
        for _ in range(a.repeat):
            times["clean"].append(reading(clean))
            times["dirty"].append(reading(dirty))
    c, d = min(times["clean"]), min(times["dirty"])
    print(
        f"{a.photos:,} photos read and decoded: {c:.1f} s; with {a.photos // 100} bad files among them: {d:.1f} s; "
        f"ratio {d / c:.3f} (goal: at most 1.1)"
    )


if __name__ == "__main__":
    main()
