"""What each of the recipes' tricks is worth on small data: 2,000 CIFAR-10 training images, equal epochs.

    python bench/recipes.py [--archive ../shared/datasets/cifar10-jpeg.tar.gz] [--per-class 200] [--test-per-class 100]
                            [--model cifar_fast] [--epochs 60] [--seeds 3] [--device cuda] [--only plain,ema,...]
                            [--recipe ema,trivial_augment,...] [--set optim.lr=0.02 ...] [--jobs 2] [--work DIR]

Builds an image folder of the archive's first `per-class` training and `test-per-class` test images of each class
(32 px, as stored), then trains the plain recipe (SGD with Nesterov momentum, cosine schedule, 4-pixel crops and
flips: the job's usual CIFAR recipe), each trick added to it alone, all of them together (`all`) and the recipe
(`recipe`: the tricks `--recipe` names; by default EMA, the warm-up, MixUp, random erasing and label smoothing, the
recipe measured), for `seeds` seeds each (0, 1, ...), and prints the mean test accuracy after the last epoch of each
and its gain over the plain recipe in points. Every run is an ordinary `python -m job train` that evaluates once,
after its last epoch (`--set`: a setting for every run, plain included: a trick's strength such as
train.mix_probability or data.erasing_probability, or train.cpu_threads); each line also lists its seeds'
accuracies. The goal: the recipe gains at least 3 points, mean of 3 seeds (measured at 60 epochs: +3.5).

--model: `cifar_fast` (the default: the cifar10-fast preset's network, batch norm and GELU, made narrow, widths 32,
64, 64, so that it overfits the 2,000 images and an epoch takes seconds on a CPU; lr 0.2), `cifar_cnn` (the
tutorials' CNN, which has no activation and underfits them: lr 0.01, as it diverges above 0.02) or any other
model name (lr 0.01). The rate is the same for the plain recipe and every trick.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from finetune import first_of_each_class  # noqa: E402  (the same subset, as stored rather than upscaled)

PLAIN = (
    "data.kind=folder",
    "data.val_split=0",
    "data.batch_size=64",
    "data.random_crop_padding=4",
    "data.random_hflip=true",
    "optim.momentum=0.9",
    "optim.nesterov=true",
    "optim.weight_decay=0.0005",
    "optim.schedule=cosine",
    "train.log_every_steps=1000",
)
MODELS = {
    # narrow, so that an epoch of 2,000 images takes seconds on a CPU; with batch norm it trains at a high rate
    "cifar_fast": ("model.kwargs.widths=[32, 64, 64]", "data.normalize=true", "optim.lr=0.2"),
    # SGD with momentum, batches of 64: 0.05 and 0.03 diverge (10%, no batch norm); 0.02 gains 5 points but is at the
    # edge (with a warm-up, one seed of three diverged): docs/benchmarks.md
    "cifar_cnn": ("optim.lr=0.01",),
}
TRICKS = {
    # the EMA warm-up keeps the decay under 1 - 1921^(-2/3) = 0.9935 in 60 epochs (1,920 steps): the last ~150 averaged
    "ema": ("train.ema=0.995",),
    "warmup": ("optim.warmup=2",),  # epochs
    "trivial_augment": ("data.augment=[trivial_augment]",),
    "rand_augment": ("data.augment=[rand_augment]",),
    "random_erasing": ("data.augment=[random_erasing]",),
    "mixup": ("train.mixup=0.2",),
    "cutmix": ("train.cutmix=1.0",),
    "label_smoothing": ("train.label_smoothing=0.1",),
}
AUGMENTS = ("trivial_augment", "rand_augment", "random_erasing")  # one data.augment list between them
ALL = [n for n in TRICKS if n != "rand_augment"]  # RandAugment is the other choice to TrivialAugment, not a second
# The recipe measured to gain 3.5 points over the plain one at 60 epochs, mean of 3 seeds (docs/benchmarks.md)
RECIPE = ("ema", "warmup", "mixup", "random_erasing", "label_smoothing")


def make_subset(archive: Path, dst: Path, per_class: int, test_per_class: int) -> int:
    """dst/train/<class>/*.jpg and dst/test/<class>/*.jpg: the archive's first images of each class, as stored."""
    n = 0
    for split, cls, name, data in first_of_each_class(archive, {"train": per_class, "test": test_per_class}):
        out = dst / split / cls / name
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)
        n += 1
    return n


def combined(names: list[str]) -> tuple[str, ...]:
    """The settings of several tricks together: their data.augment entries in one list."""
    augments = [n for n in names if n in AUGMENTS]
    sets = tuple(x for n in names if n not in AUGMENTS for x in TRICKS[n])
    return sets + ((f"data.augment=[{', '.join(augments)}]",) if augments else ())


def train(work: Path, data: Path, name: str, a: argparse.Namespace, seed: int, extra: tuple[str, ...]) -> float:
    """One run's final test accuracy; a run that `work` already holds, with the same settings, is read back."""
    sets = [f"data.path={data}", f"model.name={a.model}", f"train.epochs={a.epochs}", f"seed={seed}", *PLAIN]
    sets += [*MODELS.get(a.model, ("optim.lr=0.01",)), f"train.eval_every_epochs={a.epochs}", *a.set, *extra]
    # a run is a function of its settings (a rerun gives the same accuracy to the digit): named by them, it is reused
    out = work / f"{name}-{seed}-{hashlib.sha256(repr(sets).encode()).hexdigest()[:12]}"
    if not (out / "metrics.jsonl").exists():
        cmd = [sys.executable, "-m", "job", "train", "--config", "cifar10", "--device", a.device, "--output", str(out)]
        args = [*cmd, *(x for s in sets for x in ("--set", s))]
        done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(done.stderr[-2000:])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return records[-1]["test_accuracy"]


def pool_train(
    work: Path, data: Path, run: tuple[str, int], a: argparse.Namespace, recipes: dict
) -> tuple[float, float]:
    """One run's accuracy and seconds (0 for a run read back)."""
    t = time.perf_counter()
    name, seed = run
    return train(work, data, name, a, seed, recipes[name]), time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--archive", type=Path, default=ROOT.parent / "shared/datasets/cifar10-jpeg.tar.gz")
    ap.add_argument("--per-class", type=int, default=200)
    ap.add_argument("--test-per-class", type=int, default=100)
    ap.add_argument("--model", default="cifar_fast")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--only", default="", help="comma-separated: plain, all, recipe or trick names (default: all)")
    ap.add_argument("--recipe", default=",".join(RECIPE), help="comma-separated trick names: the recipe's tricks")
    ap.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at a time (each one process; with train.cpu_threads=1 on a CPU, one per core)",
    )
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE for every recipe's runs (repeatable)")
    ap.add_argument("--work", type=Path, help="keep the data and runs here, and reuse the runs it holds")
    a = ap.parse_args()
    chosen = a.recipe.split(",")
    if unknown := [n for n in chosen if n not in TRICKS]:
        ap.error(f"--recipe: no trick {', '.join(unknown)} (the tricks: {', '.join(TRICKS)})")
    recipes = {"plain": (), **TRICKS, "all": combined(ALL), "recipe": combined(chosen)}
    if a.only:
        recipes = {k: v for k, v in recipes.items() if k in a.only.split(",") or k == "plain"}
    with tempfile.TemporaryDirectory() as tmp:
        work = a.work or Path(tmp)
        data = work / f"data-{a.per_class}-{a.test_per_class}"
        if not data.exists():
            shutil.rmtree(work / "part", ignore_errors=True)  # an earlier, interrupted one
            make_subset(a.archive, work / "part", a.per_class, a.test_per_class)
            (work / "part").rename(data)
        n = sum(1 for f in data.rglob("*") if f.is_file())
        print(f"{n} CIFAR-10 images; {a.model}, {a.epochs} epochs, seeds 0..{a.seeds - 1}, device {a.device}", *a.set)
        if "recipe" in recipes:
            print("recipe:", *recipes["recipe"])
        # --jobs runs at a time, each a process of its own; each recipe printed once its seeds are done, in order
        runs = [(name, s) for name in recipes for s in range(a.seeds)]
        with ThreadPoolExecutor(a.jobs) as pool:
            results = pool.map(lambda r: pool_train(work, data, r, a, recipes), runs)  # in the order of runs
            means = {}
            for name in recipes:
                got = [next(results) for _ in range(a.seeds)]
                accs, seconds = [acc for acc, _ in got], sum(t for _, t in got)
                means[name] = statistics.mean(accs)
                gain = "" if name == "plain" else f"  {100 * (means[name] - means['plain']):+.1f} points"
                spread = f" ± {100 * statistics.stdev(accs):.1f}" if len(accs) > 1 else ""
                print(
                    f"{name:16s} test accuracy {100 * means[name]:5.1f}%{spread}{gain}  ({seconds:.0f} s)"
                    f"  seeds: {', '.join(f'{100 * x:.1f}' for x in accs)}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
