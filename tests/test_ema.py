"""train.ema: the average is torch's AveragedModel with timm's warmup, step by step; a run evaluates, saves and
keeps it in its checkpoints."""

import json

import pytest
import torch
from conftest import write_image_folder
from torch import nn
from torch.optim.swa_utils import AveragedModel

from job.config import load_config
from job.recipe.ema import ModelEma, ema_decay
from job.run import checkpoint
from job.run.train import run


def timm_warmup_decay(decay: float, n: int) -> float:
    """timm ModelEmaV3.get_decay(step) with use_warmup, warmup_gamma 1, warmup_power 2/3, for the update that
    follows n others (timm's step n + 1)."""
    step = max(0, n + 1 - 1)
    return 0.0 if step <= 0 else max(min(1 - (1 + step) ** (-2 / 3), decay), 0.0)


@pytest.mark.parametrize("warmup", [True, False])
def test_ema_weights_equal_a_reference_averaged_model_step_by_step(warmup):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    decay = 0.9

    def reference_lerp(averaged, current, n):  # n: updates so far, a tensor as AveragedModel passes it
        if not averaged[0].is_floating_point():  # batch norm's counter: taken as the model's
            return torch._foreach_copy_(averaged, current)
        d = timm_warmup_decay(decay, int(n)) if warmup else decay
        torch._foreach_lerp_(averaged, current, 1 - d)

    reference = AveragedModel(model, multi_avg_fn=reference_lerp, use_buffers=True)
    ema = ModelEma(model, decay, warmup)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step in range(30):
        x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 3, (8,))
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        ema.update()
        reference.update_parameters(model)
        ours, theirs = ema.module.state_dict(), reference.module.state_dict()
        for k, v in ours.items():
            if v.is_floating_point():
                assert torch.allclose(v, theirs[k], rtol=1e-6, atol=1e-7), (step, k)
            else:
                assert torch.equal(v, model.state_dict()[k]), k  # counters follow the model
    # The average is not the model: after 30 steps it lags behind.
    assert not torch.equal(ema.module[0].weight, model[0].weight)
    assert ema_decay(decay, 0, warmup) == 0.0  # the first update copies the model, as AveragedModel's does


def test_a_run_evaluates_saves_and_checkpoints_the_average(tmp_path, capsys):
    images = write_image_folder(tmp_path / "images", size=32)
    sets = [f"data.path={images}", "data.kind=folder", "model.name=cifar_cnn", "train.epochs=2"]
    cfg = load_config("iris", [*sets, "train.ema=0.9", "optim.lr=0.05", "data.batch_size=16"])
    run(cfg, str(tmp_path / "run"), "cpu", "never", True)
    saved = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    latest = sorted((tmp_path / "run" / "checkpoints").glob("e*.pt"))[-1]
    payload = checkpoint.load_payload(latest.read_bytes(), None, str(latest))  # weights-only
    assert payload["ema"]["updates"] == payload["progress"]["step"]
    for k, v in saved.items():
        assert torch.equal(v, payload["ema"]["module"][k]), k
    assert any(not torch.equal(v, payload["model"][k]) for k, v in saved.items())  # the average, not the model


def test_evaluate_and_predict_take_a_checkpoints_average(tmp_path):
    from job.use import bundle
    from job.use.evaluate import evaluate_checkpoint

    images = write_image_folder(tmp_path / "images", size=32)
    sets = [f"data.path={images}", "data.kind=folder", "model.name=cifar_cnn", "train.epochs=2", "data.batch_size=16"]
    run(load_config("iris", [*sets, "train.ema=0.9", "optim.lr=0.05"]), str(tmp_path / "run"), "cpu", "never", True)
    latest = str(sorted((tmp_path / "run" / "checkpoints").glob("e*.pt"))[-1])
    evaluated = evaluate_checkpoint(latest, None, [], "cpu")
    final = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert evaluated["test_accuracy"] == final[-1]["test_accuracy"]
    assert evaluated["test_loss"] == pytest.approx(final[-1]["test_loss"], rel=1e-5)
    predictor = bundle.load_predictor(latest, torch.device("cpu"))
    saved = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    for k, v in predictor.model.state_dict().items():
        assert torch.equal(v, saved[k]), k
