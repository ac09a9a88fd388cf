"""`python -m job bench` and the naive loop it measures against: both loops reach the same accuracy on the same
recipe, the naive loop's per-item pipeline makes what the job's batched one makes, and the command prints its
table and refuses devices that are not there."""

import json

import pytest
import torch
from conftest import run_job, write_cifar_batches, write_image_folder

from job.bench.compare import bench, format_table
from job.bench.naive import make_data_loaders
from job.config import load_config
from job.console import say
from job.data.augment import channel_stats, crop_flip
from job.data.loader import BatchLoader
from job.data.read import load_data

CPU = torch.device("cpu")


def by_loop(result: dict) -> dict[str, dict]:
    return {r["loop"]: r for r in result["rows"]}


def test_iris_both_loops_reach_the_same_accuracy():
    """The bundled (real) Iris table, 2,000 of the preset's 20,000 epochs: part-way up the learning curve, where
    a loop that learned differently would show. 30 test rows: one row is 0.033; chance is 1/3."""
    result = bench(load_config("iris", ["train.epochs=2000"]), [CPU])
    rows = by_loop(result)
    naive, job = rows["naive"], rows["job"]
    assert naive["test_accuracy"] >= 0.8 and job["test_accuracy"] >= 0.8, rows
    assert abs(naive["test_accuracy"] - job["test_accuracy"]) <= 2 / 30 + 1e-9, rows
    for r in rows.values():
        assert r["device"] == "cpu" and r["epochs"] == 2000
        assert r["samples_per_s"] * r["seconds_per_epoch"] == pytest.approx(120)  # the full batch, each epoch
    assert naive["speedup_vs_naive"] == naive["speedup_vs_naive_cpu"] == 1.0
    assert job["speedup_vs_naive"] == pytest.approx(naive["seconds_per_epoch"] / job["seconds_per_epoch"])
    assert result["recipe"]["batch_size"] == 120 and result["machine"]["cpu_cores"] >= 1
    table = format_table(json.loads(json.dumps(result)))  # what --json prints carries everything the table shows
    assert [line.split()[:2] for line in table.splitlines() if line.startswith("cpu")] == [
        ["cpu", "naive"],
        ["cpu", "job"],
    ]


def test_images_with_augmentation_both_loops_reach_the_same_accuracy(tmp_path):
    """Encoded JPEG image folders through the CIFAR-10 recipe with normalisation, random crops and flips: the
    naive loop augments each PIL image, the job each batch as tensors. 40 test images, chance 0.25."""
    folder = write_image_folder(tmp_path / "img", n_classes=4, per_class=30, size=32, fmt="jpg", test_per_class=10)
    cfg = load_config(
        "cifar10",
        [
            "data.kind=folder",
            f"data.path={folder}",
            "data.batch_size=16",
            "data.normalize=true",
            "data.random_crop_padding=2",
            "data.random_hflip=true",
            "optim.lr=0.05",
            "train.epochs=3",
        ],
    )
    rows = by_loop(bench(cfg, [CPU]))
    naive, job = rows["naive"]["test_accuracy"], rows["job"]["test_accuracy"]
    assert naive >= 0.7 and job >= 0.7, rows
    assert abs(naive - job) <= 0.15, rows


def test_real_cifar_images_both_loops_reach_the_same_accuracy(real_cifar_subset):
    """Real CIFAR-10 JPEGs (400 train / 100 test), the CIFAR-10 recipe with augmentation for 8 epochs. So few
    images leave the accuracy near 0.3 and noisy: over seeds 0-6 the two loops differed by 0.01-0.05."""
    sets = ["data.kind=folder", f"data.path={real_cifar_subset}", "data.batch_size=32", "data.normalize=true"]
    sets += ["data.random_crop_padding=4", "data.random_hflip=true", "optim.lr=0.02", "optim.momentum=0.9"]
    rows = by_loop(bench(load_config("cifar10", [*sets, "train.epochs=8"]), [CPU]))
    naive, job = rows["naive"]["test_accuracy"], rows["job"]["test_accuracy"]
    assert naive >= 0.18 and job >= 0.18, rows  # chance: 0.1
    assert abs(naive - job) <= 0.12, rows


def test_naive_items_are_what_the_job_batches_hold(tmp_path):
    """The same recipe, item by item: a test image from the naive loop (PIL, ToDtype, Normalize) equals the
    job's test batch row, and each augmented training image is one of the crops and flips the job can draw."""
    folder = write_image_folder(tmp_path / "img", n_classes=2, per_class=3, size=12, test_per_class=2)
    sets = ["data.kind=folder", f"data.path={folder}", "data.normalize=true", "data.random_crop_padding=2"]
    cfg = load_config("cifar10", [*sets, "data.random_hflip=true", "data.batch_size=4"])
    data = load_data(cfg.data, tmp_path / "cache", say)
    train, test = make_data_loaders(cfg, data)
    mean, std = channel_stats(data.train.x)
    job_test = next(BatchLoader(data.test, len(data.test), CPU, CPU, mean=mean, std=std).batches()).x
    naive_test = torch.stack([test.dataset[i][0] for i in range(len(data.test))])
    assert torch.allclose(naive_test, job_test, atol=1e-5)

    offsets = torch.cartesian_prod(torch.arange(5), torch.arange(5))  # padding 2: offsets 0..4 each way
    crops, flips = offsets.repeat(2, 1), torch.arange(50) >= 25
    candidates = crop_flip(data.train.x[:1].expand(50, -1, -1, -1), 2, crops, flips).float() / 255
    candidates = (candidates - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)
    torch.manual_seed(0)
    drawn = set()
    for _ in range(30):
        item, label = train.dataset[0]
        assert label == data.train.y[0].item()
        distance = (candidates - item).abs().flatten(1).amax(1)
        assert distance.min() < 1e-5
        drawn.add(int(distance.argmin()))
    assert len(drawn) > 5  # the crops and flips vary from draw to draw


def test_bench_command_prints_the_table(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    result = run_job("bench", "--config", "iris", "--devices", "cpu", "--epochs", "200", env={"TMPDIR": str(scratch)})
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("machine: ") and "torch" in lines[0] and "cores" in lines[0]
    assert lines[1].startswith("recipe: iris") and "200 epochs" in lines[1]
    header = next(line for line in lines if line.startswith("device"))
    assert all(name in header for name in ("precision", "s/epoch", "samples/s", "test acc", "vs naive", "vs naive cpu"))
    rows = [line.split() for line in lines if line.startswith("cpu")]
    assert [r[:2] for r in rows] == [["cpu", "naive"], ["cpu", "job"]]
    assert rows[0][-2:] == ["1.00x", "1.00x"] and all(r[2] == "fp32" and r[5].endswith("%") for r in rows)
    assert float(rows[1][-1].rstrip("x")) == pytest.approx(float(rows[0][3]) / float(rows[1][3]), rel=0.01)
    assert "bench: the naive loop on cpu" in result.stderr and "bench: the job on cpu" in result.stderr
    assert not list(scratch.glob("job-bench-*"))  # the job's run went to a scratch folder, removed afterwards
    assert "note: 200 steps are few" in result.stdout and "at least 500 steps" in result.stdout


def test_bench_refuses_an_unknown_device_before_any_training():
    result = run_job("bench", "--devices", "cpu,tpu", timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("error: --devices tpu: ") and result.stdout == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_bench_on_cuda_without_a_gpu_is_one_line_and_exit_2():
    result = run_job("bench", "--config", "iris", "--devices", "cuda", timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: --devices cuda: CUDA is not available here (no GPU, or no driver); see `python -m job info`"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")
def test_bench_on_cpu_and_cuda():
    result = bench(load_config("iris", ["train.epochs=500"]), [CPU, torch.device("cuda")])
    rows = {(r["device"].split(":")[0], r["loop"]): r for r in result["rows"]}
    assert set(rows) == {("cpu", "naive"), ("cpu", "job"), ("cuda", "naive"), ("cuda", "job")}
    assert result["machine"]["gpus"]
    cuda_naive = rows["cuda", "naive"]
    assert cuda_naive["speedup_vs_naive_cpu"] == pytest.approx(
        rows["cpu", "naive"]["seconds_per_epoch"] / cuda_naive["seconds_per_epoch"]
    )
    assert abs(rows["cuda", "job"]["test_accuracy"] - rows["cpu", "job"]["test_accuracy"]) <= 2 / 30 + 1e-9


def test_bench_refuses_a_recipe_the_tutorials_loop_cannot_run(tmp_path):
    """cifar10-fast's parts have no counterpart in the tutorials' loop: comparing against it would time another
    recipe. One line, exit 2, naming them."""
    root = write_cifar_batches(tmp_path / "c10")
    result = run_job("bench", "--config", "cifar10-fast", "--set", f"data.path={root}", "--epochs", "1", timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    line = result.stderr.strip()
    assert "\n" not in line and line.startswith("error: bench: the tutorials' loop it compares against has nothing")
    for name in ("alternate", "reflect", "lookahead_every", "label_smoothing", "test_time_augmentation", "init_from"):
        assert name in line


def test_the_recipes_tricks_are_beyond_the_tutorials_loop():
    from torch import nn

    from job.bench.naive import beyond_the_tutorials
    from job.config import load_config

    tricks = ["optim.warmup='5 steps'", "optim.layer_decay=0.7", "data.augment=[trivial_augment]", "train.ema=0.99"]
    tricks += ["train.mixup=0.2", "train.finetune_stages=1"]
    found = beyond_the_tutorials(load_config("iris", tricks), nn.Linear(4, 3))
    names = ["optim.warmup", "optim.layer_decay", "data.augment", "train.ema", "train.mixup, train.cutmix"]
    assert found == [*names, "train.finetune_stages"]
    assert beyond_the_tutorials(load_config("iris", ["optim.warmup='0 steps'"]), nn.Linear(4, 3)) == []


def test_bench_refuses_multi_label_data_in_one_line(tmp_path):
    from test_multilabel import manifests, mosaic_images

    data = tmp_path / "mosaics"
    paths = manifests(data, mosaic_images(data, 24))
    over = ["--set", "data.kind=manifest", "--set", f"data.path={paths['jsonl']}", "--set", "data.label_column=labels"]
    over += ["--set", "data.image_size=32", "--set", "data.val_split=0.25"]
    result = run_job("bench", "--config", "cifar10", *over, "--epochs", "1", timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: bench: the tutorials' loop learns one class an image"), result.stderr[-2000:]
    assert "Traceback" not in result.stderr
