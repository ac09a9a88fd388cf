"""train.mixup and train.cutmix: batches mixed with themselves reversed, drawn from the seed, epoch and step; the
loss takes the mixed targets with label smoothing and class weights as it takes labels."""

import pytest
import torch

from job.config import load_config
from job.data.batches import IGNORED
from job.errors import ConfigError
from job.recipe.build import CountedLoss
from job.recipe.mix import Mix


def batch(n: int = 8, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, size, size, generator=g), torch.arange(n) % 4


def test_mixup_blends_images_and_targets_by_one_share():
    x, y = batch()
    mix = Mix(4, seed=1, mixup=0.4)
    mixed, targets = mix(x, y, epoch=2, step=5)
    assert torch.allclose(targets.sum(1), torch.ones(8))
    lam = float(targets[0, y[0]]) if y[0] != y[-1] else None
    assert lam is not None and 0 < lam < 1
    assert torch.allclose(mixed, x * lam + x.flip(0) * (1 - lam), atol=1e-6)
    again, _ = mix(x, y, epoch=2, step=5)
    other, _ = mix(x, y, epoch=2, step=6)
    assert torch.equal(mixed, again) and not torch.equal(mixed, other)  # a function of (seed, epoch, step)


def test_cutmix_pastes_a_box_and_weighs_the_targets_by_its_area():
    x, y = batch()
    mixed, targets = Mix(4, seed=0, cutmix=1.0)(x, y, epoch=0, step=3)
    pasted = (mixed != x).any(1)  # where the reversed batch shows
    assert pasted.any() and torch.equal(pasted[0], pasted[1])  # one box for the batch
    share = pasted[0].float().mean()
    assert torch.equal(mixed[0][:, pasted[0]], x.flip(0)[0][:, pasted[0]])
    assert targets[0, y[0]] == pytest.approx(1 - float(share), abs=1e-6)


def test_probability_and_switch():
    x, y = batch()
    never = Mix(4, seed=0, mixup=1.0, probability=0.0)
    for step in range(5):
        out, targets = never(x, y, 0, step)
        assert torch.equal(out, x) and torch.equal(targets.argmax(1), y)
    both = Mix(4, seed=0, mixup=1.0, cutmix=1.0, switch=0.5)
    kinds = set()
    for step in range(30):
        out, _ = both(x, y, 0, step)
        changed = (out != x).any(1)[0]
        kinds.add("cut" if 0 < changed.float().mean() < 1 else "blend")
    assert kinds == {"cut", "blend"}


def test_the_loss_takes_mixed_targets_with_smoothing_and_class_weights():
    torch.manual_seed(0)
    logits, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 3, 1, IGNORED])
    one_hot = torch.nn.functional.one_hot(y.clamp(min=0), 4).float() * (y >= 0)[:, None]
    for weight in (None, torch.tensor([1.0, 2.0, 0.5, 3.0])):
        loss = CountedLoss(weight, smoothing=0.1)
        assert loss(logits, one_hot) == pytest.approx(float(loss(logits, y)), rel=1e-6)
    half = 0.5 * one_hot + 0.5 * one_hot.flip(0)  # a mixed target weighs by its classes' weights mixed alike
    weight = torch.tensor([1.0, 2.0, 0.5, 3.0])
    manual = -(half * logits.log_softmax(1)).sum(1) * (half @ weight)
    assert CountedLoss(weight)(logits, half) == pytest.approx(float(manual.sum() / 6), rel=1e-6)


def test_mixing_a_table_is_refused():
    from job.recipe import build as recipe

    cfg = load_config("iris", ["train.mixup=0.2"])
    with pytest.raises(ConfigError, match="train.mixup, train.cutmix: mix images"):
        recipe.build(cfg, torch.device("cpu"), recipe.read_data(cfg))


def test_multi_label_targets_mix_by_the_same_share_and_an_undecoded_partner_counts_for_nothing():
    x, _ = batch()
    y = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]] * 2, dtype=torch.float32)
    y[3] = -1  # a streamed sample that could not be decoded
    mixed, targets = Mix(4, seed=1, mixup=0.4)(x, y, epoch=2, step=5)
    _, single = Mix(4, seed=1, mixup=0.4)(x, torch.arange(8) % 4, epoch=2, step=5)
    lam = float(single[0, 0])  # the same draw as a single-label batch's
    assert torch.allclose(mixed, x * lam + x.flip(0) * (1 - lam), atol=1e-6)
    assert torch.allclose(targets[0], y[0] * lam + y[7] * (1 - lam))
    assert (targets[3] < 0).all() and (targets[4] < 0).all()  # 3 and its partner 7 - 3 = 4
    assert (targets[[0, 1, 2, 5, 6, 7]] >= 0).all()
    _, unmixed = Mix(4, seed=1, mixup=0.4, probability=0.0)(x, y, epoch=2, step=5)
    assert torch.equal(unmixed, y)  # not mixed: the targets as they were, the undecoded one alone below 0


def test_a_mix_with_an_undecoded_sample_counts_for_nothing_in_the_loss():
    x, y = batch()
    y[3] = IGNORED  # a streamed sample that could not be decoded: its image is zeros
    _, targets = Mix(4, seed=1, mixup=0.4)(x, y, epoch=2, step=5)
    assert (targets[3] == 0).all() and (targets[4] == 0).all()  # 3 and its partner 7 - 3 = 4: counted by neither
    assert torch.allclose(targets[[0, 1, 2, 5, 6, 7]].sum(1), torch.ones(6))
