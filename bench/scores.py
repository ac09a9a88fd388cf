"""What the per-class scores cost an evaluation: the cifar10 recipe's test pass with the confusion matrix and top-5
counted on the device, then on the host the averages, the per-class table and the confusion picture TensorBoard gets,
against the same pass counting loss and accuracy alone, side by side in one process.

    python bench/scores.py CIFAR_PYTHON_FOLDER [--repeat 5]

CIFAR_PYTHON_FOLDER: CIFAR-10's python-version batches (acceptance/lib/cifar_fixture.py makes them from the shared
JPEG copy). Prints the fastest of `--repeat` passes of each, alternating, and their ratio (goal: at most 1.05).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from job.config import load_config  # noqa: E402
from job.recipe import build as recipe  # noqa: E402
from job.use import diagnostics, scores  # noqa: E402
from job.use.evaluate import test_sums  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cifar", type=Path)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    cfg = recipe.resolved(load_config("cifar10", [f"data.path={a.cifar}"]))
    device = torch.device("cpu")
    r = recipe.build(cfg, device, recipe.read_data(cfg), rank=0, world=1)
    loader, k = r.held_out["test"], len(r.classes)
    times: dict[str, list[float]] = {"loss and accuracy": [], "with the scores": []}
    for _ in range(a.repeat):
        for name, classes in (("loss and accuracy", 0), ("with the scores", k)):
            t0 = time.perf_counter()
            sums = test_sums(r.model, loader, r.amp, classes=classes).cpu()  # the evaluation's one host sync
            if classes:
                confusion = sums[4:].round().long().view(k, k)
                scores.averages(confusion), scores.table(confusion, r.classes)
                diagnostics.confusion_picture(confusion, r.classes, "test")
            times[name].append(time.perf_counter() - t0)
    plain, scored = min(times["loss and accuracy"]), min(times["with the scores"])
    print(
        f"cifar10 recipe, test pass over {loader.n} images (fastest of {a.repeat}): loss and accuracy {plain:.3f} s, "
        f"with the confusion matrix, top-5, the scores and the picture {scored:.3f} s, ratio {scored / plain:.3f} "
        "(goal: at most 1.05)"
    )


if __name__ == "__main__":
    main()
