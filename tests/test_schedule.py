"""optim.warmup before the schedule, optim.layer_decay's per-block rates and train.finetune_stages: the class layer
alone first, then the whole model."""

import pytest
import torch
from conftest import write_image_folder

from job.config import load_config
from job.errors import ConfigError
from job.recipe import build as recipe
from job.recipe.models import build_model
from job.recipe.schedule import make_scheduler
from job.run.train import run


def rates(overrides: list[str], total: int = 100, epochs: int = 10) -> list[list[float]]:
    """Each optimizer step's rate of every parameter group, over a run of `total` steps in `epochs` epochs."""
    cfg = load_config("iris", [f"train.epochs={epochs}", "optim.lr=0.1", *overrides])
    model = build_model(cfg.model, (4,), 3)
    optimizer = recipe.make_optimizer(cfg, model)
    scheduler = make_scheduler(cfg, optimizer, total)
    out = []
    for _ in range(total):
        out.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("warmup", ["2", "'20 steps'", "'2 epochs'"])
def test_warmup_rises_linearly_then_the_schedule_runs_over_the_steps_left(warmup):
    lrs = [r[0] for r in rates(["optim.schedule=cosine", f"optim.warmup={warmup}"])]
    assert lrs[:20] == pytest.approx([0.1 * (t + 1) / 20 for t in range(20)])
    assert lrs[20] == pytest.approx(0.1)  # the cosine from its top, over the 80 steps left
    assert lrs[60] == pytest.approx(0.05)
    assert lrs[-1] < 0.001
    flat = [r[0] for r in rates(["optim.warmup=0.5"])]  # no schedule: warm-up, then the rate itself
    assert flat[:5] == pytest.approx([0.02, 0.04, 0.06, 0.08, 0.1]) and flat[5:] == pytest.approx([0.1] * 95)


@pytest.mark.parametrize(
    "bad",
    ["optim.warmup=fast", "optim.warmup=-1", "optim.warmup='2.5 steps'", "optim.warmup=true", "optim.warmup='2 days'"],
)
def test_a_bad_warmup_is_one_line_naming_the_key(bad):
    with pytest.raises(ConfigError, match=r"^optim\.warmup: expected epochs"):
        load_config("iris", [bad])


def test_a_warmup_as_long_as_the_run_or_with_onecycle_is_refused():
    with pytest.raises(ConfigError, match="optim.warmup: 100 steps, the whole run"):
        rates(["optim.warmup=10"])
    with pytest.raises(ConfigError, match="onecycle warms up itself"):
        rates(["optim.warmup=1", "optim.schedule=onecycle"])
    with pytest.raises(ConfigError, match="train.finetune_stages: expected fewer epochs"):
        load_config("iris", ["train.epochs=3", "train.finetune_stages=3"])


def test_layer_decay_and_finetune_stages_rates():
    # The mlp's blocks: layers.0 (the hidden layer), then the class layer.
    by_step = rates(["model.hidden=[8, 8]", "optim.layer_decay=0.5", "train.finetune_stages=3"])
    head, *below = zip(*by_step)
    assert all(r == pytest.approx(0.1) for r in head)
    below.sort(key=lambda group: -group[-1])  # in the model's order: the deepest block first
    for depth, group in enumerate(below, 1):
        assert group[:30] == (0.0,) * 30  # the first 3 epochs of 10 steps: the class layer alone
        assert group[30:] == pytest.approx((0.1 * 0.5**depth,) * 70)
    assert len(below) == 2


def test_in_the_first_stage_only_the_class_layer_moves(tmp_path):
    images = write_image_folder(tmp_path / "images", size=32)
    base = [f"data.path={images}", "data.kind=folder", "model.name=cifar_cnn", "train.epochs=2"]
    base += ["train.finetune_stages=1", "optim.momentum=0.9", "data.batch_size=12", "train.keep_last=2"]
    base += ["train.checkpoint_every_epochs=1"]
    states = []
    for lr in (0.05, 0.01):
        run(load_config("iris", [*base, f"optim.lr={lr}"]), str(tmp_path / f"run{lr}"), "cpu", "never", True)
        first = sorted((tmp_path / f"run{lr}" / "checkpoints").glob("e00001*.pt"))[0]
        states.append(torch.load(first, weights_only=True)["model"])
    model = build_model(load_config("iris", base).model, (3, 32, 32), 3)
    params = [name for name, _ in model.named_parameters()]
    head = params[-1].rpartition(".")[0]
    for name in params:  # the backbone where it started in both, whatever the rate; the class layer learnt
        assert torch.equal(states[0][name], states[1][name]) != name.startswith(f"{head}."), name
