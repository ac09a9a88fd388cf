"""`find-batch-size`: the largest training batch that fits on the device, and the one line an out-of-memory
during training ends with.

The search trains for real on batches of the run's own data and model: doubling from 1 until a batch does
not fit (or the training split is used whole), then bisecting between the last that fitted and the first
that did not. Each trial runs two optimizer steps, so the optimizer's state is held as it will be in
training. Out-of-memory is caught and the memory handed back before the next trial. The answer is within 3%
of the exact limit: closer is noise, since fragmentation moves the limit between runs.
"""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import time
from collections.abc import Iterator

import torch

from job.config import Config
from job.errors import ConfigError

GIB = 1024**3


def is_out_of_memory(e: BaseException) -> bool:
    """An allocation failure on any device (CPU allocations fail as a RuntimeError with errno 12)."""
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


def out_of_memory_error(setting: str, device: torch.device) -> ConfigError:
    """The one line for an out-of-memory: `setting` names the batch size in use (key=value), or where it happened."""
    if "=" not in setting:
        return ConfigError(f"out of memory on {device} {setting}: the data set or the model does not fit here")
    return ConfigError(
        f"out of memory on {device} at {setting}: use a smaller batch; `python -m job "
        "find-batch-size` with the same --config and --set finds the largest training batch that fits"
    )


@contextlib.contextmanager
def memory_guard(setting: str, device: torch.device) -> Iterator[None]:
    """Turn an out-of-memory inside the block into the one line naming the batch size in use."""
    try:
        yield
    except Exception as e:
        if is_out_of_memory(e):
            raise out_of_memory_error(setting, device) from None
        raise


@contextlib.contextmanager
def memory_limit(device: torch.device, gib: float | None) -> Iterator[str]:
    """Cap what this process may allocate on the device while the block runs: `gib`, or (CPU, by default) 80% of
    what the host has free, so that a batch that does not fit fails as an allocation error rather than waking
    the kernel's out-of-memory killer. Yields a description of the cap; the previous limit is put back after."""
    if device.type == "cuda":
        if gib is None:
            yield "the whole GPU"
            return
        total = torch.cuda.get_device_properties(device).total_memory
        # (an older torch has no getter: 1.0, the default, is put back there)
        before = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(device)
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * GIB / total), device)
        try:
            yield f"{gib:g} GiB of the GPU"
        finally:
            torch.cuda.set_per_process_memory_fraction(before, device)
        return
    if device.type != "cpu":
        yield f"all of {device}"
        return
    budget = gib * GIB if gib is not None else 0.8 * available_host_memory()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = int(virtual_size() + budget)
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        yield f"{budget / GIB:.2f} GiB of host memory" + (" (80% of what is free)" if gib is None else "")
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def available_host_memory() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def virtual_size() -> int:
    """This process's address space now: the cap is set this far above it."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmSize in /proc/self/status")


def find_batch_size(cfg: Config, device_name: str = "auto", memory_gib: float | None = None) -> dict:
    """The largest batch size that trains on the device; a dict with the search's trials."""
    from job.data import Split, load_data
    from job.data.loader import BatchLoader, channel_stats, choose_storage
    from job.env import describe_device, pick_device, resolve_precision, seed_everything
    from job.models import build_model
    from job.report import say
    from job.step import CudaGraphStep, build_step
    from job.train import autocast, fuse_optimizer, make_optimizer, prime_momentum, use_channels_last

    device = pick_device(device_name)
    seed_everything(cfg.seed, cfg.train.deterministic)
    data = load_data(cfg.data, cfg.seed)
    model = build_model(cfg.model, data.input_shape, len(data.classes))
    precision = resolve_precision(cfg.train.precision, device)
    channels_last = use_channels_last(cfg.train.channels_last, model, device, precision)
    model.to(device, memory_format=torch.channels_last if channels_last else torch.preserve_format).train()
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = not cfg.train.deterministic
    optimizer = make_optimizer(cfg, model, fuse_optimizer(device, precision))
    prime_momentum(optimizer)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    sums, amp = torch.zeros(2, device=device), autocast(cfg, device)
    # On a GPU the run's own step: a CUDA graph holds its own memory besides the eager steps before it.
    capture = cfg.train.step_capture if device.type == "cuda" and not cfg.train.compile else "off"
    mean = std = None
    if data.is_image and cfg.data.normalize:
        mean, std = channel_stats(data.train.x)
    n = len(data.train)
    held: dict[str, Split] = {}

    def fits(batch: int) -> bool:
        """Two training steps (after a captured step's warm-up and capture) and one evaluation batch: training
        and evaluation share the device, and a captured step keeps its memory while evaluation runs."""
        t0 = time.perf_counter()
        loader = step = None
        try:
            loader = BatchLoader(
                held["train"],
                batch,
                device,
                held["train"].x.device,
                seed=cfg.seed,
                mean=mean,
                std=std,
                channels_last=channels_last,
            )
            step = build_step(model, optimizer, None, scaler, amp, sums, device, capture, float("inf"))
            count = 2 + (step.warmup if isinstance(step, CudaGraphStep) else 0)
            for _ in range(count):
                x, y = next(loader.batches())
                step(x, y)
            test = BatchLoader(
                held["test"],
                cfg.data.eval_batch_size or batch,
                device,
                held["test"].x.device,
                mean=mean,
                std=std,
                channels_last=channels_last,
            )
            model.eval()
            with torch.no_grad(), amp():
                model(next(test.batches())[0])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            ok = True
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            ok = False
        finally:
            model.train()
            del loader, step
            optimizer.zero_grad(set_to_none=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        trials.append({"batch_size": batch, "fits": ok, "seconds": round(time.perf_counter() - t0, 3)})
        say(f"  batch {batch}: {'fits' if ok else 'out of memory'}")
        return ok

    with memory_limit(device, memory_gib) as cap:
        say(f"device {describe_device(device)}, {cap}; model {cfg.model.name}, {precision}; training split {n} samples")
        # Both splits where training keeps them, placed once inside the limit.
        nbytes = data.train.x.nbytes + data.test.x.nbytes
        limit = memory_gib * GIB if memory_gib is not None else None
        storage = choose_storage(nbytes, device, cfg.data.placement, cfg.data.device_share, limit)
        with memory_guard("holding the data set", device):
            held.update(
                {k: Split(s.x.to(storage), s.y.to(storage)) for k, s in (("train", data.train), ("test", data.test))}
            )
        trials: list[dict] = []
        good, bad = 0, None
        batch = 1
        while True:  # doubling
            if not fits(batch):
                bad = batch
                break
            good = batch
            if batch >= n:
                break
            batch = min(2 * batch, n)
        while bad is not None and bad - good > max(1, good // 32):  # bisection, to within 3%
            mid = (good + bad) // 2
            if fits(mid):
                good = mid
            else:
                bad = mid
    if good == 0:
        raise out_of_memory_error("data.batch_size=1", device)
    return {
        "batch_size": good,
        "limited_by": "memory" if bad is not None else "the training split",
        "device": str(device),
        "memory": cap,
        "training_samples": n,
        "trials": trials,
    }
