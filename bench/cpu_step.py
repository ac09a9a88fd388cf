"""One small training step on a CPU, three ways: eager (forward, backward, torch's SGD), the step's recorded graph
(recipe/record.py) run as its own Python code, and the same graph run by TorchScript's interpreter, as the job's traced
CPU step runs it where TorchScript's tracer takes it. Microseconds a step, one thread, the best of `--repeats`.

    python bench/cpu_step.py [--steps 3000] [--repeats 3]

Models: the Iris MLP (4-10-3, batch 120), an MLP with batch norm and dropout (batch 40), a small CNN (two 3x3
convolutions on 12x12 images, batch 16). The last two have a backward TorchScript's tracer does not take.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from job.recipe.record import record  # noqa: E402
from job.recipe.step import interpreted  # noqa: E402


def models() -> dict[str, tuple[nn.Module, torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(4, 10), nn.ReLU(), nn.Linear(10, 3))
    norm = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    cnn = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )  # fmt: skip
    return {
        "Iris MLP, batch 120": (mlp, torch.randn(120, 4), torch.randint(0, 3, (120,))),
        "MLP with batch norm and dropout, batch 40": (norm, torch.randn(40, 4), torch.randint(0, 3, (40,))),
        "small CNN, 12x12, batch 16": (cnn, torch.randn(16, 1, 12, 12), torch.randint(0, 10, (16,))),
    }


def ways(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    weights, buffers = [n for n, _ in model.named_parameters()], [n for n, _ in model.named_buffers()]

    def eager() -> None:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def joint(*tensors):
        k = len(weights)
        leaves = [t.detach().requires_grad_() for t in tensors[:k]]
        state = dict(zip(weights, leaves)) | dict(zip(buffers, tensors[k:-2]))
        loss = F.cross_entropy(torch.func.functional_call(model, state, (tensors[-2],)), tensors[-1])
        grads = torch.autograd.grad(loss, leaves)
        with torch.no_grad():
            for p, g in zip(tensors[:k], grads):
                p.add_(g, alpha=-0.01)
        return (loss.detach(),)

    args = [p.detach() for p in model.parameters()] + list(model.buffers())
    graph = record(joint, *[a.clone() for a in args], x, y)
    found = {"eager": eager, "graph as Python": lambda: graph(*args, x, y)}
    run = interpreted(graph, (*[a.clone() for a in args], x, y))  # as the job's step takes it: TorchScript, or not
    if run is not graph:
        found["TorchScript"] = lambda: run(*args, x, y)
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'model':<44}{'eager us':>10}{'graph us':>10}{'TorchScript us':>16}")
    for name, (model, x, y) in models().items():
        times = {}
        for way, step in ways(model, x, y).items():
            with torch.enable_grad() if way == "eager" else torch.no_grad():
                for _ in range(100):
                    step()
                best = float("inf")
                for _ in range(a.repeats):
                    t = time.perf_counter()
                    for _ in range(a.steps):
                        step()
                    best = min(best, time.perf_counter() - t)
            times[way] = best / a.steps * 1e6
        script = f"{times['TorchScript']:.0f}" if "TorchScript" in times else "cannot trace"
        print(f"{name:<44}{times['eager']:>10.0f}{times['graph as Python']:>10.0f}{script:>16}")


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore", FutureWarning)  # TorchScript's deprecation notice
    main()
