"""The cifar10-fast preset and the parts it is made of, each usable on its own: the whitening network and its
data-dependent start, parameters that train for the first epochs only, batch-norm rates, the triangular schedule,
lookahead, label smoothing, reflected crops, alternating flips and test-time augmentation. The preset itself runs as
a user runs it, in real processes: it trains on a CPU, and a run stopped by SIGTERM resumes bit for bit."""

from __future__ import annotations

import functools
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_run, invoke, metrics, pointer, run_job, scalars, sets, start_job, write_cifar_batches

from job.config import load_config
from job.data.augment import crop_flip
from job.data.augment import viewed_logits as logits
from job.data.dataset import Split
from job.data.loader import BatchLoader
from job.errors import ConfigError
from job.recipe import build as recipe
from job.recipe import schedule
from job.recipe.models import CifarFast
from job.recipe.step import EagerStep

CPU = torch.device("cpu")


def small_fast(tmp_path: Path, *overrides: str):
    root = write_cifar_batches(tmp_path / "c10")
    cfg = load_config("cifar10-fast", [f"data.path={root}", "data.batch_size=20", "train.epochs=4", *overrides])
    return cfg, recipe.read_data(cfg)


def test_whitening_layer_starts_from_the_data_patch_covariance():
    torch.manual_seed(0)
    mixing = torch.randn(3, 3)  # correlated channels, as in photos
    images = torch.einsum("ij,njhw->nihw", mixing, torch.randn(64, 3, 16, 16))
    model = CifarFast(widths=(8, 16, 16))
    model.init_from_data(images)
    out = F.conv2d(images, model.whiten.weight[:12])  # the 12 directions; the other 12 are their negatives
    flat = out.permute(0, 2, 3, 1).reshape(-1, 12)
    cov = flat.T @ flat / len(flat)
    assert torch.allclose(cov, torch.eye(12), atol=0.02)  # whitened: eigenvalues >> eps
    assert torch.equal(model.whiten.weight[12:], -model.whiten.weight[:12])
    assert not model.whiten.weight.requires_grad and model.whiten.bias.requires_grad


def test_the_preset_builds_its_parts(tmp_path):
    cfg, data = small_fast(tmp_path)
    r = recipe.build(cfg, CPU, data)
    groups = r.optimizer.param_groups
    assert [len(g["params"]) for g in groups] == [7, 1, 6]  # weights; the whitening bias; batch-norm biases
    assert groups[2]["lr"] == pytest.approx(64 * groups[0]["initial_lr"] * 0.2)  # at step 0 of the triangle
    assert groups[2]["weight_decay"] * 64 == pytest.approx(groups[0]["weight_decay"])
    assert groups[1]["params"][0] is r.model.whiten.bias and groups[1]["train_epochs"] == 3
    assert not any(
        p.requires_grad for m in r.model.modules() if isinstance(m, torch.nn.BatchNorm2d) for p in [m.weight]
    )
    assert r.lookahead is not None and r.lookahead.total == 4 * len(r.train) == 4 * 5
    assert r.loss.keywords == {"label_smoothing": 0.2}
    fresh = CifarFast()
    fresh.init_from_data(r.feed.sample_images(5000))  # a seeded sample of the training images, as seen
    assert torch.allclose(r.model.whiten.weight, fresh.whiten.weight)  # whitened from the data at build
    assert not torch.allclose(CifarFast().whiten.weight, fresh.whiten.weight)


def test_triangle_schedule_and_parameters_held_after_their_epochs():
    cfg = load_config("iris", ["optim.schedule=triangle", "train.epochs=10", "optim.lr=1.0"])
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 3))
    model.param_epochs = {"0.bias": 2}
    cfg = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"norm_lr_scale": 4.0, "weight_decay": 0.1})})
    optimizer = recipe.make_optimizer(cfg, model)
    sched = schedule.make_scheduler(cfg, optimizer, 100)  # 10 steps an epoch
    lrs = []
    for _ in range(100):
        lrs.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        sched.step()
    plain, limited, norm = zip(*lrs)
    assert plain[0] == pytest.approx(0.2) and plain[23] == pytest.approx(1.0) and max(plain) == pytest.approx(1.0)
    assert plain[-1] == pytest.approx(1 + (0.07 - 1) * 76 / 77)  # the last step's rate: on the way to 0.07
    assert all(n == pytest.approx(4 * p) for n, p in zip(norm, plain))
    assert limited[:20] == plain[:20] and set(limited[20:]) == {0.0}  # two epochs, then held
    replanned = schedule.replan(cfg, optimizer, 200, 100)  # trained longer: the same curve over 200 steps
    assert schedule.planned_steps(replanned) == 200
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1 + (0.07 - 1) * (100 - 46) / (200 - 46))
    assert optimizer.param_groups[1]["lr"] == 0.0
    onecycle = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"schedule": "onecycle"})})
    with pytest.raises(ConfigError, match="onecycle cannot hold"):
        schedule.make_scheduler(onecycle, optimizer, 100)
    model.param_epochs = {"nope": 1}
    with pytest.raises(ConfigError, match="param_epochs names no parameter of it: nope"):
        recipe.make_optimizer(cfg, model)


def test_a_held_parameter_does_not_move_under_momentum_and_weight_decay(tmp_path):
    cfg, data = small_fast(tmp_path, "train.epochs=2", "model.kwargs={whiten_bias_epochs: 1, widths: [8, 8, 8]}")
    r = recipe.build(cfg, CPU, data)
    step = EagerStep(r.model, r.optimizer, r.scheduler, r.scaler, r.amp, torch.zeros(3), loss=r.loss)
    bias = r.model.whiten.bias
    seen = []
    for epoch in range(2):
        for b in r.train.batches(epoch):
            seen.append(bias.detach().clone())
            step(b.x, b.y)
    assert not torch.equal(seen[0], seen[5])  # it trained in the first epoch (5 steps)
    assert all(torch.equal(seen[5], b) for b in seen[5:]) and torch.equal(seen[5], bias.detach())


def test_lookahead_pulls_toward_the_slow_copy_and_ends_on_it():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    look = schedule.Lookahead(model, every=2, total_steps=4)
    start = [t.clone() for t in look.slow]
    weight = model[0].weight
    for step in range(1, 5):
        with torch.no_grad():
            weight.add_(1.0)
        look.step()
        if step == 2:  # decay 0.95^2 * (2/4)^3: the slow copy moves most of the way, and the weight takes it
            decay = 0.95**2 / 8
            expected = start[0] + 2 * (1 - decay)
            assert torch.allclose(look.slow[0], expected) and torch.equal(weight.detach(), look.slow[0])
    assert torch.equal(weight.detach(), look.slow[0]) and look.steps == 4
    saved = look.state_dict()
    other = schedule.Lookahead(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)), 2, 4)
    other.load_state_dict(saved)
    assert other.steps == 4 and all(torch.equal(a, b) for a, b in zip(other.slow, look.slow))


def test_label_smoothing_is_the_training_loss():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    cfg = load_config("iris", ["train.label_smoothing=0.2"])
    sums = torch.zeros(3)
    loss = functools.partial(F.cross_entropy, label_smoothing=cfg.train.label_smoothing)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    EagerStep(model, optimizer, None, torch.amp.GradScaler("cpu", enabled=False), recipe.autocast("fp32", CPU), sums,
              loss=loss)(x, y)  # fmt: skip
    with torch.no_grad():
        assert sums[0] == pytest.approx(float(F.cross_entropy(model(x), y, label_smoothing=0.2)))
        assert sums[0] != pytest.approx(float(F.cross_entropy(model(x), y)))


def test_reflected_crops_match_padding_by_reflection():
    torch.manual_seed(1)
    x = torch.randint(0, 255, (6, 3, 8, 8), dtype=torch.uint8)
    crops = torch.randint(0, 5, (6, 2))
    flips = torch.rand(6) < 0.5
    got = crop_flip(x, 2, crops, flips, reflect=True)
    padded = F.pad(x.float(), (2, 2, 2, 2), mode="reflect")
    for i in range(6):
        r, c = crops[i].tolist()
        want = padded[i, :, r : r + 8, c : c + 8]
        want = want.flip(-1) if flips[i] else want
        assert torch.equal(got[i].float(), want)


def test_alternating_flips_show_every_image_both_ways_every_two_epochs():
    n = 64
    x = torch.zeros(n, 3, 2, 2, dtype=torch.uint8)
    x[..., 0] = 7  # the flip is visible: the left column holds a value, the right column zeros
    loader = BatchLoader(Split(x, torch.arange(n)), n // 4, CPU, CPU, seed=3, shuffle=True, hflip="alternate")

    def flipped(epoch: int) -> dict[int, bool]:  # an image's side, whatever batch the shuffle puts it in
        batches = list(loader.batches(epoch))
        return {int(label): bool((img[..., 0] == 0).all()) for b in batches for img, label in zip(b.x, b.y)}

    e0, e1, e2 = flipped(0), flipped(1), flipped(2)
    assert 0 < sum(e0.values()) < n  # at random in the first epoch
    assert all(e1[i] != e0[i] for i in range(n)) and e2 == e0


def test_test_time_augmentation_averages_flipped_and_shifted_views():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 5))
    x = torch.randn(2, 3, 8, 8)
    mirror = (model(x) + model(x.flip(-1))) / 2
    assert torch.allclose(logits(model, x, "flip"), mirror)
    padded = F.pad(x, (1, 1, 1, 1), mode="reflect")
    shifts = [padded[..., :8, :8], padded[..., 2:, 2:]]
    both = sum((model(s) + model(s.flip(-1))) / 2 for s in shifts) / 2
    assert torch.allclose(logits(model, x, "flip_shift"), (mirror + both) / 2, atol=1e-6)
    assert torch.equal(logits(model, x, "none"), model(x))


def test_image_settings_on_a_table_and_oversized_reflection_are_config_errors(tmp_path):
    cfg = load_config("iris", ["train.test_time_augmentation=flip"])
    with pytest.raises(ConfigError, match="train.test_time_augmentation"):
        recipe.build(cfg, CPU, recipe.read_data(cfg))
    cfg, data = small_fast(tmp_path, "data.random_crop_padding=32")
    with pytest.raises(ConfigError, match="reflect pads by less than the image's side"):
        recipe.build(cfg, CPU, data)


def test_the_preset_trains_on_a_cpu_and_resumes_bit_for_bit_after_sigterm(tmp_path):
    root = write_cifar_batches(tmp_path / "c10")
    args = ["train", "--config", "cifar10-fast", "--device", "cpu"]
    args += sets(f"data.path={root}", "data.batch_size=25", "train.epochs=8", "train.log_every_steps=2")
    proc = start_job(*args, "--output", str(tmp_path / "stopped"))
    deadline = time.time() + 300
    while not (tmp_path / "stopped/checkpoints/latest.json").exists() and proc.poll() is None:
        assert time.time() < deadline, "no first commit within 300 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-2000:]
    stopped = pointer(str(tmp_path / "stopped"))
    assert stopped["epoch"] < 8
    again = run_job(*args, "--output", str(tmp_path / "stopped"))
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"from epoch {stopped['epoch']}, step {stopped['step']}" in again.stderr
    code, err = invoke([*args, "--output", str(tmp_path / "reference")])
    assert code == 0, err
    assert "model cifar_fast" in err and "test_accuracy" in err
    assert_same_run(str(tmp_path / "reference"), str(tmp_path / "stopped"))
    records = metrics(str(tmp_path / "reference"))
    assert len(records) == 8 and records[-1]["test_accuracy"] > 0.3  # 10 classes of patterns: well above chance
    lrs = dict(scalars(str(tmp_path / "reference"), "train/lr"))
    assert max(lrs.values()) > lrs[min(lrs)] and lrs[max(lrs)] < max(lrs.values())  # up, then down


def test_the_clock_times_training_and_test_passes_apart():
    from job.run.meters import TrainClock

    clock = TrainClock(CPU)
    clock.start()
    time.sleep(0.05)
    with clock.testing():  # ends training's stretch
        time.sleep(0.1)
    clock.start()
    time.sleep(0.05)
    timed = clock.summary()
    assert 0.09 < timed["train_seconds"] < 1.0 and 0.09 < timed["test_seconds"] < 1.0  # neither counts the other
    assert len(timed["epoch_seconds"]) == 2 and all(0.045 < s < 0.5 for s in timed["epoch_seconds"])
    assert sum(timed["epoch_seconds"]) == pytest.approx(timed["train_seconds"], abs=1e-3)
