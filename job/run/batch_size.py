"""`find-batch-size`: the largest training batch that fits on the device, and the one line an out-of-memory
during training ends with.

The search trains for real on batches of the run's own data and model: doubling from 1 until a batch does
not fit (or the training split is used whole), then bisecting between the last that fitted and the first
that did not. Each trial runs two optimizer steps, so the optimizer's state is held as it will be in
training. Out-of-memory is caught and the memory handed back before the next trial. The answer is within 3%
of the exact limit: closer is noise, since fragmentation moves the limit between runs.
"""

from __future__ import annotations

import gc
import time

import torch

from job.config import Config
from job.group.env import GIB
from job.group.memory import is_out_of_memory, memory_guard, memory_limit, out_of_memory_error


def find_batch_size(cfg: Config, device_name: str = "auto", memory_gib: float | None = None) -> dict:
    """The largest batch size that trains on the device; a dict with the search's trials."""
    from job.console import say
    from job.group.env import describe_device, pick_device, seed_everything
    from job.recipe import build as recipe
    from job.recipe.cuda_graph import CudaGraphStep
    from job.recipe.models import own_class
    from job.recipe.plan import build_step, plan_step, step_facts

    device = pick_device(device_name)
    seed_everything(cfg.seed, cfg.train.deterministic)
    data = recipe.read_data(cfg)
    n = data.samples("train")
    # On a GPU the run's own step: a CUDA graph holds its own memory besides the eager steps before it.
    capture = cfg.train.step_capture if device.type == "cuda" and not cfg.train.compile else "off"
    trials: list[dict] = []

    def fits(batch: int) -> bool:
        """Two training steps (after a captured step's warm-up and capture) and one evaluation batch: training
        and evaluation share the device, and a captured step keeps its memory while evaluation runs."""
        t0 = time.perf_counter()
        loader = step = None
        try:
            loader = r.feed.train(batch)
            # no schedule: built without loaders
            step = build_step(r, sums, plan_step(step_facts(r, capture, own_model=own_class(cfg.model.name))))
            count = 2 + (step.warmup if isinstance(step, CudaGraphStep) else 0)
            for _ in range(count):
                first = next(loader.batches())
                step(first.x, first.y)
            r.model.eval()
            with torch.no_grad(), r.amp():
                held_out = "val" if r.feed.has("val") else "test"  # built without loaders: ask the data
                r.model(next(r.feed.test(batch, split=held_out).batches()).x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            ok = True
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            ok = False
        finally:
            r.model.train()
            del loader, step
            r.optimizer.zero_grad(set_to_none=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        trials.append({"batch_size": batch, "fits": ok, "seconds": round(time.perf_counter() - t0, 3)})
        say(f"  batch {batch}: {'fits' if ok else 'out of memory'}")
        return ok

    with memory_limit(device, memory_gib) as cap:
        # The model, optimizer and both splits where training keeps them, placed once inside the limit.
        limit = memory_gib * GIB if memory_gib is not None else None
        with memory_guard("holding the model and the data set", device):
            r = recipe.build(cfg, device, data, loaders=False, memory_limit=limit)
        sums = torch.zeros(2, device=device)
        what = f"model {cfg.model.name}, {r.precision}; training split {n} samples"
        say(f"device {describe_device(device)}, {cap}; {what}")
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
