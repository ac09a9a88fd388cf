"""Calibrated probabilities: one temperature fitted on val after training (Guo et al. 2017, "On Calibration of Modern
Neural Networks"), the expected calibration error before and after, and the reliability diagram.

Dividing the logits by one positive number changes no prediction (the arg max stays), only how sure the
probabilities are; a network trained with cross-entropy is usually over-sure, and a temperature above 1 mends it.
"""

from __future__ import annotations

import io
import math

import torch
import torch.nn.functional as F

BINS = 15  # the usual count for the expected calibration error (Guo et al., torchmetrics' default)
FIT_STEPS = 50


def fit_temperature(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """The temperature T > 0 that minimises the negative log-likelihood of `labels` under softmax(logits / T), by
    LBFGS on log T (positive by construction). 1.0 where there is nothing to fit (no samples, a single class)."""
    logits, labels = logits.detach().double().cpu(), labels.detach().long().cpu()
    if len(labels) == 0 or logits.shape[1] < 2:
        return 1.0
    log_t = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([log_t], lr=0.5, max_iter=FIT_STEPS, line_search_fn="strong_wolfe")

    def nll() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(logits / log_t.exp(), labels)
        loss.backward()
        return loss

    opt.step(nll)
    t = float(log_t.detach().exp())
    return t if math.isfinite(t) and t > 0 else 1.0


def confidence_bins(
    probabilities: torch.Tensor, labels: torch.Tensor, bins: int = BINS
) -> list[tuple[int, float, float]]:
    """Per equal-width bin of the top probability: (samples, mean confidence, accuracy); (0, 0, 0) where empty."""
    confidence, predicted = probabilities.double().max(1)
    right = (predicted == labels).double()
    at = (confidence * bins).ceil().long().clamp(1, bins) - 1  # (0, 1/bins] is the first bin, as torchmetrics bins
    out = []
    for b in range(bins):
        mask = at == b
        n = int(mask.sum())
        out.append((n, float(confidence[mask].mean()) if n else 0.0, float(right[mask].mean()) if n else 0.0))
    return out


def expected_calibration_error(probabilities: torch.Tensor, labels: torch.Tensor, bins: int = BINS) -> float:
    """The mean gap between confidence and accuracy over `bins` equal-width bins of the top probability, each
    weighted by its share of the samples."""
    total = len(labels)
    if total == 0:
        return 0.0
    return sum(n / total * abs(conf - acc) for n, conf, acc in confidence_bins(probabilities, labels, bins))


def reliability_png(logits: torch.Tensor, labels: torch.Tensor, temperature: float, split: str) -> bytes:
    """Accuracy against confidence per bin, before and after the temperature, with each one's ECE in its title."""
    from matplotlib.figure import Figure  # without pyplot: no global backend switched

    fig = Figure(figsize=(9, 4.2))
    width = 1 / BINS
    for ax, t, name in zip(fig.subplots(1, 2), (1.0, temperature), ("before", "after")):
        p = torch.softmax(logits.double() / t, 1)
        binned = confidence_bins(p, labels)
        centres = [(b + 0.5) * width for b in range(BINS)]
        ax.bar(centres, [acc for _, _, acc in binned], width=width, edgecolor="black", label="accuracy")
        ax.plot([0, 1], [0, 1], "--", color="grey", label="perfectly calibrated")
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence (top probability)", ylabel="accuracy")
        ece = expected_calibration_error(p, labels)
        ax.set_title(f"{split}, {name} (T = {t:.3g}): ECE {ece:.4f}", fontsize=9)
        ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()
