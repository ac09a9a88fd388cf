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
LOWEST, HIGHEST = 0.05, 20.0  # the temperatures a fit may reach: beyond them a val split says nothing more
# The rule for fitting at all. The temperature is one parameter of a model of whether each prediction is right, and
# what moves it is the wrong and the right ones: the rule of ten events per parameter of a logistic model (Peduzzi et
# al. 1996) asks for MIN_EACH of the rarer outcome (with none wrong, the likelihood's best is as sharp as allowed), and
# MIN_SAMPLES gives the calibration error that checks the fit (BINS bins) about 7 samples a bin. At these counts a
# perfectly calibrated model's fitted temperature falls within about 25% of 1 nine times in ten; below them: 1.
MIN_SAMPLES = 100
MIN_EACH = 10


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
    if math.isfinite(t):
        return min(max(t, LOWEST), HIGHEST)
    # A val split the model separates perfectly has no finite best (sharper is always likelier): the bound it ran to.
    return min((LOWEST, 1.0, HIGHEST), key=lambda c: float(F.cross_entropy(logits / c, labels)))


def too_small(samples: int, wrong: int) -> bool:
    """Whether a val split of `samples` with `wrong` mispredicted ones is too small to fit a temperature on (the rule
    beside MIN_SAMPLES)."""
    return samples < MIN_SAMPLES or min(wrong, samples - wrong) < MIN_EACH


def rule() -> str:
    return f"at least {MIN_SAMPLES} samples, {MIN_EACH} of them wrong and {MIN_EACH} right"


def calibrating_temperature(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """The temperature a run keeps: 1 on a val split too small to fit one on (too_small), else fit_temperature's
    where it lowers the split's expected calibration error, else 1 (the likelihood's best of a barely trained model
    can sharpen probabilities past what the split supports: they are left as they are then)."""
    p = logits.detach().double().cpu()
    y = labels.detach().long().cpu()
    if len(y) == 0 or too_small(len(y), int((p.argmax(1) != y).sum())):
        return 1.0
    t = fit_temperature(p, y)
    after = expected_calibration_error(torch.softmax(p / t, 1), y)
    return t if after < expected_calibration_error(torch.softmax(p, 1), y) else 1.0


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
    """Accuracy against confidence per bin, before and after the temperature, each panel titled with its ECE. Drawn
    with Pillow: a few milliseconds, where a matplotlib figure costs a quarter of a second at the end of every run."""
    from PIL import Image, ImageDraw

    side, margin, top = 240, 36, 30
    img = Image.new("RGB", (2 * (side + 2 * margin), side + top + margin + 10), "white")
    draw = ImageDraw.Draw(img)
    for panel, (t, name) in enumerate(((1.0, "before"), (temperature, "after"))):
        x0, y0 = panel * (side + 2 * margin) + margin, top
        p = torch.softmax(logits.double() / t, 1)
        ece = expected_calibration_error(p, labels)
        draw.text((x0, 6), f"{split}, {name} (T = {t:.3g}): ECE {ece:.4f}", fill="black")
        for b, (n, _, acc) in enumerate(confidence_bins(p, labels)):
            if n:
                left, right = x0 + b * side / BINS, x0 + (b + 1) * side / BINS
                draw.rectangle((left, y0 + side * (1 - acc), right, y0 + side), fill=(66, 133, 244), outline="black")
        draw.line((x0, y0 + side, x0 + side, y0), fill=(128, 128, 128), width=1)  # perfectly calibrated
        draw.rectangle((x0, y0, x0 + side, y0 + side), outline="black")
        draw.text((x0, y0 + side + 4), "0", fill="black")
        draw.text((x0 + side - 6, y0 + side + 4), "1", fill="black")
        draw.text((x0 + side / 2 - 40, y0 + side + 4), "confidence", fill="black")
        draw.text((x0 - margin + 2, y0), "acc.", fill="black")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def describe(temperature: float | None, metrics: dict) -> str:
    """The run's last word on its calibration (empty without a val split to fit on)."""
    if temperature is None or "val_ece" not in metrics:
        return ""
    split = "test" if "test_ece" in metrics else "val"
    before, after = metrics[f"{split}_ece"], metrics[f"{split}_ece_calibrated"]
    samples, wrong = int(metrics.get("val_calibration_samples", 0)), int(metrics.get("val_calibration_wrong", 0))
    if temperature == 1.0 and "val_calibration_samples" in metrics and too_small(samples, wrong):
        return (
            f"calibration: val split too small to fit a temperature on ({samples} samples, {wrong} wrong; the rule: "
            f"{rule()}), the probabilities are left as they are (temperature 1 in model.json); {split} expected "
            f"calibration error {before:.4f}"
        )
    if temperature == 1.0:
        return (
            f"calibration: no temperature fitted on val lowered its expected calibration error, the probabilities are "
            f"left as they are (temperature 1 in model.json); {split} expected calibration error {before:.4f}"
        )
    return (
        f"calibrated on val: temperature {temperature:.3g} (model.json); {split} expected calibration error "
        f"{before:.4f} -> {after:.4f} (report/{split}/reliability.png)"
    )
