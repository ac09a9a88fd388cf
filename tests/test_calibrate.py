"""The temperature fitted on val, the expected calibration error and the reliability diagram (job/recipe/calibrate.py),
against references computed another way: a grid search of the likelihood, scikit-learn's calibration curve."""

from __future__ import annotations

import io

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from sklearn.calibration import calibration_curve

from job.recipe.calibrate import (
    BINS,
    LOWEST,
    MIN_EACH,
    MIN_SAMPLES,
    calibrating_temperature,
    describe,
    expected_calibration_error,
    fit_temperature,
    reliability_png,
    too_small,
)


def drawn(n: int, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and labels drawn from the logits' own softmax: a perfectly calibrated model, whose temperature is 1."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, classes, generator=g, dtype=torch.float64) * 2
    labels = torch.multinomial(torch.softmax(logits, 1), 1, generator=g).squeeze(1)
    return logits, labels


def grid_best(logits: torch.Tensor, labels: torch.Tensor) -> float:
    ts = torch.logspace(0, 0.7, 701, dtype=torch.float64)  # 1 to 5, steps of 0.23%
    nll = torch.stack([F.cross_entropy(logits / t, labels) for t in ts])
    return float(ts[nll.argmin()])


def test_the_fitted_temperature_is_the_likelihoods_minimum_and_mends_an_over_sure_model():
    logits, labels = drawn(8_000, 10, seed=0)
    assert abs(fit_temperature(logits, labels) - 1.0) < 0.05  # calibrated already: nothing to mend
    sure = logits * 3  # three times too sure of itself
    t = fit_temperature(sure, labels)
    assert abs(t - grid_best(sure, labels)) < 0.01 * t
    assert 2.7 < t < 3.3
    before = expected_calibration_error(torch.softmax(sure, 1), labels)
    after = expected_calibration_error(torch.softmax(sure / t, 1), labels)
    assert after < before / 3
    assert torch.equal((sure / t).argmax(1), sure.argmax(1))  # no prediction changes


def test_a_perfectly_separated_val_split_gives_a_bounded_temperature_no_worse_than_none():
    logits = torch.tensor([[8.0, 0.0, 0.0], [0.0, 9.0, 0.0], [0.0, 0.0, 7.0]]).repeat(20, 1)
    labels = torch.tensor([0, 1, 2]).repeat(20)
    t = fit_temperature(logits, labels)  # no finite best: sharper is always likelier
    assert LOWEST <= t <= 1.0
    assert F.cross_entropy(logits / t, labels) <= F.cross_entropy(logits, labels)


def test_nothing_to_fit_is_temperature_one():
    assert fit_temperature(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long)) == 1.0
    assert fit_temperature(torch.randn(8, 1), torch.zeros(8, dtype=torch.long)) == 1.0


def test_expected_calibration_error_matches_scikit_learns_calibration_curve():
    logits, labels = drawn(5_000, 4, seed=1)
    p = torch.softmax(logits * 2, 1)
    confidence, predicted = p.max(1)
    right = (predicted == labels).numpy().astype(int)
    acc, conf = calibration_curve(right, confidence.numpy(), n_bins=BINS, strategy="uniform")
    bins = np.linspace(0, 1, BINS + 1)
    counts = np.bincount(np.searchsorted(bins[1:-1], confidence.numpy()), minlength=BINS)
    reference = float(np.sum(counts[counts > 0] / len(right) * np.abs(acc - conf)))
    assert abs(expected_calibration_error(p, labels) - reference) < 1e-9


def test_the_reliability_diagram_is_a_picture_of_both():
    logits, labels = drawn(500, 3, seed=2)
    png = reliability_png(logits * 3, labels, fit_temperature(logits * 3, labels), "val")
    img = Image.open(io.BytesIO(png))
    assert img.format == "PNG" and img.width > 2 * img.height * 0.9


def test_a_temperature_that_would_worsen_vals_calibration_is_not_kept():
    """On a small val split of a barely trained model the likelihood's best temperature can sharpen the probabilities
    past what the split supports: its expected calibration error rises (here 0.133 to 0.142, on a split big enough to
    fit on). The run keeps 1 then; an over-sure model's temperature, which lowers it, is kept."""
    g = torch.Generator().manual_seed(9)
    n = 120
    logits = torch.randn(n, 3, generator=g) * 0.3
    labels = torch.randint(0, 3, (n,), generator=g)
    right = torch.rand(n, generator=g) < 0.6
    logits[right, labels[right]] += 0.5
    fitted = fit_temperature(logits, labels)
    ece = lambda t: expected_calibration_error(torch.softmax(logits.double() / t, 1), labels)  # noqa: E731
    assert not too_small(n, int((logits.argmax(1) != labels).sum()))  # big enough to fit on
    assert ece(fitted) > ece(1.0)  # the case: the fit would worsen it
    assert calibrating_temperature(logits, labels) == 1.0
    sure, drawn_labels = drawn(2_000, 10, seed=1)
    assert calibrating_temperature(sure * 3, drawn_labels) == fit_temperature(sure * 3, drawn_labels) > 2


def test_a_temperature_is_fitted_only_on_a_val_split_big_enough_to_fit_it():
    """Three images, all right and a little sure: the likelihood's best is the sharpest temperature allowed (20x
    sharper) and it lowers those same three images' calibration error, yet says nothing of any other image. Below
    the rule (MIN_SAMPLES samples, MIN_EACH of them wrong and MIN_EACH right) the temperature stays 1."""
    three = torch.tensor([[2.0, 0.5, 0.0], [0.3, 1.5, 0.0], [0.0, 0.4, 1.2]]), torch.tensor([0, 1, 2])
    assert fit_temperature(*three) == LOWEST  # the case: a fit would make every prediction 20x sharper
    assert calibrating_temperature(*three) == 1.0
    sure, labels = drawn(2_000, 10, seed=3)
    assert calibrating_temperature(sure * 3, labels) > 2  # a split big enough: fitted
    few = slice(0, MIN_SAMPLES - 1)
    assert calibrating_temperature(sure[few] * 3, labels[few]) == 1.0  # the same model, one sample short of the rule
    right = sure.argmax(1) == labels
    almost_all_right = torch.cat([right.nonzero()[:, 0][:500], (~right).nonzero()[:, 0][: MIN_EACH - 1]])
    assert calibrating_temperature(sure[almost_all_right] * 3, labels[almost_all_right]) == 1.0  # too few wrong


def test_the_runs_last_word_says_a_val_split_too_small_to_fit_a_temperature_on():
    said = describe(1.0, {"val_ece": 0.2, "val_ece_calibrated": 0.2, "val_calibration_samples": 3})
    assert "val split too small to fit a temperature on (3 samples" in said and "temperature 1" in said
    counts = {"val_calibration_samples": 5_000, "val_calibration_wrong": 900}
    kept = describe(1.0, {"val_ece": 0.2, "val_ece_calibrated": 0.2, **counts})
    assert "too small" not in kept and "lowered" in kept
