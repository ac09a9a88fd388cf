"""What a config means on a device, built once (job/recipe/build.py): the parts every command takes its setup from."""

import pytest
import torch
from conftest import write_image_folder

from job.config import load_config
from job.errors import ConfigError
from job.recipe import build as recipe

CPU = torch.device("cpu")


def test_iris_on_a_cpu_is_a_placed_model_its_optimizer_schedule_and_loaders():
    cfg = load_config("iris", ["optim.schedule=cosine", "data.batch_size=32", "train.epochs=3"])
    r = recipe.build(cfg, CPU, recipe.read_data(cfg))
    assert r.precision == "fp32" and not r.channels_last  # no convolutions: no layout to choose
    assert r.model.training and all(p.device == CPU for p in r.model.parameters())
    assert [p for g in r.optimizer.param_groups for p in g["params"]] == list(r.model.parameters())
    assert isinstance(r.scheduler, torch.optim.lr_scheduler.CosineAnnealingLR)
    assert r.scheduler.T_max == 3 * len(r.train) == 3 * 4  # 120 training rows in batches of 32
    assert (r.train.batch_size, r.test.batch_size, r.test.n) == (32, 30, 30)  # a batch is at most the split
    assert not r.scaler.is_enabled() and r.feed.where == "the host"


def test_images_on_a_cpu_go_channels_last_normalised_with_test_batches_of_their_own(tmp_path):
    root = write_image_folder(tmp_path / "imgs", n_classes=3, per_class=10, size=32)
    sets = ["data.kind=folder", f"data.path={root}", "data.normalize=true", "data.eval_batch_size=5"]
    cfg = load_config("cifar10", sets)
    data = recipe.read_data(cfg)
    r = recipe.build(cfg, CPU, data)
    assert r.channels_last and r.model[0].weight.is_contiguous(memory_format=torch.channels_last)
    x = next(r.train.batches()).x
    assert x.is_contiguous(memory_format=torch.channels_last) and x.dtype == torch.float32
    whole = next(r.feed.train(len(data.train)).batches()).x
    assert abs(float(whole.mean())) < 0.1 and abs(float(whole.std()) - 1) < 0.1  # by the split's own statistics
    assert r.test.batch_size == 5 and r.scheduler is None
    off = recipe.build(load_config("cifar10", [*sets, "train.channels_last=off"]), CPU, data)
    assert not off.channels_last and off.model[0].weight.is_contiguous()


def test_batches_that_cannot_be_made_are_one_line_config_errors():
    cfg = load_config("iris", ["data.batch_size=119"])  # 120 rows: a last batch of 1, which 2 processes cannot share
    with pytest.raises(ConfigError, match="cannot be split over 2 processes"):
        recipe.build(cfg, CPU, recipe.read_data(cfg), rank=0, world=2)
    assert recipe.build(cfg, CPU, recipe.read_data(cfg), loaders=False).train is None  # find-batch-size's own sizes


def test_fused_sgd_starts_from_zero_momentum_and_autocast_follows_the_precision():
    cfg = load_config("iris", ["optim.momentum=0.9"])
    model = torch.nn.Linear(4, 3)
    optimizer = recipe.make_optimizer(cfg, model, fused=True)
    recipe.prime_momentum(optimizer)
    assert all(torch.equal(optimizer.state[p]["momentum_buffer"], torch.zeros_like(p)) for p in model.parameters())
    assert recipe.autocast("fp32", CPU)().__class__.__name__ == "nullcontext"
    with recipe.autocast("bf16", CPU)():
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
    with pytest.raises(ConfigError, match="optim.nesterov"):
        recipe.make_optimizer(load_config("iris", ["optim.nesterov=true", "optim.momentum=0"]), model)
