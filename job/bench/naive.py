"""The tutorials' training loop, written for comparison: a per-item Dataset, a DataLoader, `loss.item()` every
log window and a test pass that reads every batch's loss, the same recipe as the job's loop.

This is the baseline `python -m job bench` measures against, slow on purpose in the tutorials' ways: each
item is made in Python (an image goes through PIL and torchvision's transforms), each batch is collated on
the host and copied to the device, and the host waits for the device at every `.item()`.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset
from torchvision.transforms import v2

from job.config import Config, parse_warmup
from job.data.augment import channel_stats
from job.data.dataset import Dataset, Split
from job.errors import ConfigError
from job.group.env import seed_everything
from job.recipe.build import make_optimizer, precision_for
from job.recipe.models import build_model
from job.recipe.schedule import make_scheduler


class ItemDataset(TorchDataset):
    """One sample at a time, as torchvision's CIFAR10 serves it: an image becomes a PIL image, then the
    transforms make a float tensor; a table row is its float tensor. Labels are Python ints."""

    def __init__(self, split: Split, transform=None) -> None:
        self.is_image = split.x.dtype == torch.uint8
        # Images as H x W x C numpy arrays, the layout PIL reads (H x W for one channel).
        self.x = split.x.permute(0, 2, 3, 1).squeeze(3).numpy() if self.is_image else split.x
        self.y = split.y.tolist()
        self.transform = transform

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not self.is_image:
            return self.x[i], self.y[i]
        return self.transform(Image.fromarray(np.ascontiguousarray(self.x[i]))), self.y[i]


def image_transform(size: tuple[int, int], padding: int, hflip: bool, mean, std) -> v2.Compose:
    """The tutorials' per-image pipeline: RandomCrop(padding) and RandomHorizontalFlip on the PIL image,
    then to a float tensor in [0, 1], then Normalize."""
    steps = [v2.RandomCrop(size, padding=padding)] if padding else []
    steps += [v2.RandomHorizontalFlip()] if hflip else []
    steps += [v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]
    steps += [v2.Normalize(mean.tolist(), std.tolist())] if mean is not None else []
    return v2.Compose(steps)


def make_data_loaders(cfg: Config, data: Dataset) -> tuple[DataLoader, DataLoader]:
    """Training and test DataLoaders over per-item datasets, with the recipe's batch, order and augmentation."""
    d = cfg.data
    train_tf = test_tf = None
    if data.is_image:
        mean, std = channel_stats(data.train.x) if d.normalize is True else (None, None)
        size = tuple(data.input_shape[1:])
        train_tf = image_transform(size, d.random_crop_padding, d.random_hflip, mean, std)
        test_tf = image_transform(size, 0, False, mean, std)
    batch = len(data.train) if d.batch_size == "full" else d.batch_size
    order = torch.Generator().manual_seed(cfg.seed)
    train = DataLoader(
        ItemDataset(data.train, train_tf), batch_size=batch, shuffle=d.shuffle, drop_last=d.drop_last, generator=order
    )
    if len(train) == 0:
        raise ConfigError(f"data.drop_last: the training split ({len(data.train)}) is smaller than one batch")
    held_out = data.test if data.test is not None else data.val
    test = DataLoader(ItemDataset(held_out, test_tf), batch_size=d.eval_batch_size or batch)
    return train, test


def check_tutorial_recipe(cfg: Config, data) -> None:
    """ConfigError for a recipe with settings the tutorials' loop has no counterpart for: compared with it, the job
    would be timed against another recipe."""
    if data.streamed:
        raise ConfigError(
            f"bench: the tutorials' loop holds its data in memory, and {cfg.data.path} is streamed from shards; bench "
            "with data.placement=host, or time this run with `python -m job train` (summary: train_seconds)"
        )
    if data.multilabel:
        raise ConfigError(
            "bench: the tutorials' loop learns one class an image, and this data is multi-label (lists of labels); "
            "time this run with `python -m job train` (summary: train_seconds)"
        )
    model = build_model(cfg.model, data.input_shape, len(data.classes))
    if beyond := beyond_the_tutorials(cfg, model):
        raise ConfigError(
            f"bench: the tutorials' loop it compares against has nothing for {', '.join(beyond)}; bench a recipe "
            "without them, or time this one with `python -m job train` (summary: train_seconds)"
        )


def beyond_the_tutorials(cfg: Config, model: torch.nn.Module) -> list[str]:
    """The settings of a recipe that the tutorials' loop has no counterpart for."""
    d, o, t = cfg.data, cfg.optim, cfg.train
    found = {
        "data.random_hflip=alternate": d.random_hflip == "alternate",
        "data.random_crop_padding_mode=reflect": d.random_crop_padding and d.random_crop_padding_mode == "reflect",
        "optim.lookahead_every": o.lookahead_every > 0,
        "optim.warmup": parse_warmup(o.warmup)[0] > 0,
        "optim.layer_decay": o.layer_decay != 1,
        "data.augment": bool(d.augment),
        "train.ema": t.ema > 0,
        "train.mixup, train.cutmix": bool(t.mixup or t.cutmix),
        "train.finetune_stages": t.finetune_stages > 0,
        "train.label_smoothing": t.label_smoothing > 0,
        "train.test_time_augmentation": t.test_time_augmentation != "none",
        f"model {cfg.model.name}'s init_from_data": hasattr(model, "init_from_data"),
    }
    return [name for name, used in found.items() if used]


def train_naive(cfg: Config, data: Dataset, device: torch.device) -> dict:
    """Train the recipe with the tutorials' loop on `device`; returns seconds spent in training epochs (the
    device waited for at each epoch's end; test passes excluded), the epochs and the final test accuracy."""
    seed_everything(cfg.seed, cfg.train.deterministic)
    model = build_model(cfg.model, data.input_shape, len(data.classes))
    train_loader, test_loader = make_data_loaders(cfg, data)
    precision = precision_for(cfg, device, model, data.input_shape, data)[0].name  # as the job's run decides it
    model = model.to(device)
    optimizer = make_optimizer(cfg, model)
    scheduler = make_scheduler(cfg, optimizer, cfg.train.epochs * len(train_loader))
    half = torch.bfloat16 if precision == "bf16" else torch.float16
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    step, train_seconds, logged, result = 0, 0.0, [], {}
    for epoch in range(cfg.train.epochs):
        model.train()
        t0 = time.perf_counter()
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            with torch.autocast(device.type, dtype=half, enabled=precision != "fp32"):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if scheduler is not None:
                scheduler.step()
            step += 1
            if step % cfg.train.log_every_steps == 0:
                logged.append((step, loss.item()))  # the tutorials' habit: the host waits for the device here
        wait_for(device)
        train_seconds += time.perf_counter() - t0
        if (epoch + 1) % cfg.train.eval_every_epochs == 0 or epoch + 1 == cfg.train.epochs:
            result = test_pass(model, test_loader, device, precision, half)
    epochs, accuracy = cfg.train.epochs, result["test_accuracy"]
    return {"train_seconds": train_seconds, "epochs_run": epochs, "final_accuracy": accuracy, "precision": precision}


def wait_for(device: torch.device) -> None:
    """Let the device finish its queued work, so an epoch's time is the device's time too."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@torch.no_grad()
def test_pass(model, loader: DataLoader, device: torch.device, precision: str, half: torch.dtype) -> dict:
    """Test loss and accuracy, reading each batch's loss and hits on the host as the tutorials do."""
    model.eval()
    loss_sum, correct, n = 0.0, 0, 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        with torch.autocast(device.type, dtype=half, enabled=precision != "fp32"):
            out = model(x)
        loss_sum += F.cross_entropy(out.float(), y, reduction="sum").item()
        correct += (out.argmax(1) == y).sum().item()
        n += len(y)
    model.train()
    return {"test_loss": loss_sum / n, "test_accuracy": correct / n}
