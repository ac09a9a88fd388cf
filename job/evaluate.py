"""`evaluate`: the test loss and accuracy of a saved checkpoint, with the data and model its config names."""

from __future__ import annotations

from job import checkpoint
from job.config import apply_override, load_config, validate
from job.data import load_data
from job.env import pick_device
from job.errors import CheckpointError
from job.models import build_model
from job.train import autocast, evaluate, make_loaders


def evaluate_checkpoint(url: str, config: str | None, overrides: list[str], device_name: str) -> dict:
    payload, manifest = checkpoint.load_url(url)
    if config:
        cfg = load_config(config, overrides)
    else:
        raw = payload.get("config")
        if not isinstance(raw, dict):
            raise CheckpointError(f"{url}: holds no config; pass --config")
        for item in overrides:
            apply_override(raw, item)
        cfg = validate(raw)
    device = pick_device(device_name)
    data = load_data(cfg.data, cfg.seed)
    model = build_model(cfg.model, data.input_shape, len(data.classes))
    try:
        model.load_state_dict(payload["model"])
    except RuntimeError as e:
        raise CheckpointError(f"{url}: weights do not fit model {cfg.model.name}: {str(e).splitlines()[0]}") from None
    model.to(device)
    _, test, _ = make_loaders(cfg, data, device)
    loss_sum, correct = evaluate(model, test, autocast(cfg, device)).tolist()
    progress = payload.get("progress", {})
    return {
        "checkpoint": url,
        "epoch": progress.get("epoch"),
        "step": progress.get("step"),
        "test_loss": loss_sum / test.n,
        "test_accuracy": correct / test.n,
        "samples": test.n,
        "device": str(device),
    }
