"""Calibrated probabilities end to end: a run fits a temperature on val and writes it to model.json with each split's
expected calibration error before and after it; predict serves the run's test-time views over that temperature, so
its labels on the test split give the run's test accuracy; the exports hold the temperature; at 1 nothing changes."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import invoke, metrics, run_job, sets
from PIL import Image

from job.use.bundle import Served, load_predictor, recipe_input


def noisy_folder(root: Path, per_class: int = 160, test_per_class: int = 12) -> Path:
    """train/ and test/ folders of 3 classes told apart by a faint tint in noise: learnable, never certain, so the
    val split (a quarter of train: about 120, above calibrate.MIN_SAMPLES) has a best temperature."""
    rng = np.random.default_rng(0)
    for split, count in (("train", per_class), ("test", test_per_class)):
        for k in range(3):
            (root / split / f"class{k}").mkdir(parents=True)
            for i in range(count):
                img = rng.integers(0, 200, (32, 32, 3))
                img[..., k] += 8  # faint: about 15 of the val split wrong, enough to fit on
                Image.fromarray(img.astype(np.uint8)).save(root / split / f"class{k}" / f"{i:03d}.png")
    return root


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, Path, str]:
    """(run folder, image folder with train/ and test/, the training command's output)."""
    root = tmp_path_factory.mktemp("calibration")
    images = noisy_folder(root / "images")
    over = sets(
        f"data.path={images}",
        "data.kind=folder",
        "data.val_split=0.25",
        "train.epochs=3",
        "train.test_time_augmentation=flip",
        "optim.name=adamw",
        "optim.lr=0.003",
        "data.batch_size=16",
    )
    code, out = invoke(["train", "--device", "cpu", "--config", "cifar10", "--output", str(root / "run"), *over])
    assert code == 0, out
    return root / "run", images, out


def test_the_run_fits_a_temperature_on_val_and_reports_calibration_before_and_after(run):
    folder, _, out = run
    card = json.loads((folder / "model.json").read_text())
    t = card["temperature"]
    assert isinstance(t, float) and t > 0 and t != 1.0
    for split in ("val", "test"):
        assert (folder / "report" / split / "reliability.png").stat().st_size > 1000
        assert 0 <= card["metrics"][f"{split}_ece"] <= 1 and 0 <= card["metrics"][f"{split}_ece_calibrated"] <= 1
    assert f"temperature {t:.3g} (model.json)" in out
    # Fitted on val: val's calibration error is no worse after it than before.
    assert card["metrics"]["val_ece_calibrated"] <= card["metrics"]["val_ece"] + 1e-9


def test_predict_on_the_test_split_gives_the_runs_test_accuracy_with_its_test_time_views(run, tmp_path):
    folder, images, _ = run
    files = sorted((images / "test").rglob("*.png"))
    code, out = invoke(
        ["predict", "-m", str(folder), *map(str, files), "--device", "cpu", "-o", str(tmp_path / "p.jsonl")]
    )
    assert code == 0, out
    assert "test-time views (flip)" in out and "temperature" in out
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    right = sum(r["top_k"][0][0] == Path(r["path"]).parent.name for r in rows)
    tested = [m for m in metrics(str(folder)) if "test_accuracy" in m and "chosen_epoch" in m][-1]
    assert right / len(rows) == pytest.approx(tested["test_accuracy"], abs=1e-9)


def test_temperature_one_changes_nothing(run, tmp_path):
    folder, images, _ = run
    model = torch.nn.Linear(4, 3)
    x = torch.randn(5, 4)
    assert torch.equal(Served(model)(x), model(x))
    plain = tmp_path / "plain"
    shutil.copytree(folder, plain)
    card = json.loads((plain / "model.json").read_text())
    card["temperature"] = 1.0
    (plain / "model.json").write_text(json.dumps(card))
    fitted, one = load_predictor(str(folder), torch.device("cpu")), load_predictor(str(plain), torch.device("cpu"))
    batch = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8)
    with torch.no_grad():
        views = (one.model(one_x := _as_input(one, batch)) + one.model(one_x.flip(-1))) / 2
    assert torch.allclose(one.probabilities(batch), torch.softmax(views, 1), atol=1e-6)
    assert torch.allclose(fitted.probabilities(batch), torch.softmax(views / fitted.temperature, 1), atol=1e-6)


def _as_input(p, batch: torch.Tensor) -> torch.Tensor:
    from job.data.augment import to_float

    return to_float(batch, torch.contiguous_format, p.mean, p.std, p.view)


def test_the_onnx_export_holds_the_temperature(run, tmp_path):
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime checks the export (requirements-test.txt)")
    folder, images, _ = run
    out = tmp_path / "m.onnx"
    code, said = invoke(["export", "--model", str(folder), "--format", "onnx", "--output", str(out)])
    assert code == 0, said
    session = ort.InferenceSession(str(out))
    meta = session.get_modelmeta().custom_metadata_map
    card = json.loads((folder / "model.json").read_text())
    assert json.loads(meta["temperature"]) == pytest.approx(card["temperature"])
    files = sorted((images / "test").rglob("*.png"))[:6]
    x = np.stack([recipe_input(card["preprocessing"], f.read_bytes()) for f in files])
    got = session.run(None, {session.get_inputs()[0].name: x})[0]
    p = load_predictor(str(folder), torch.device("cpu"))
    with torch.no_grad():  # the run's test-time views (flip) averaged, over the temperature: what predict serves
        x_ = torch.from_numpy(x)
        want = (p.model(x_) + p.model(x_.flip(-1))) / 2 / card["temperature"]
    assert np.allclose(got, want.numpy(), atol=1e-4)


def test_evaluate_of_a_checkpoint_reports_with_the_runs_test_time_views_as_its_metrics(run, tmp_path):
    folder, _, _ = run
    args = ["evaluate", "--checkpoint", str(folder), "--report", str(tmp_path / "rep"), "--device", "cpu", "--json"]
    done = run_job(*args)
    assert done.returncode == 0, done.stderr[-2000:]
    said = json.loads(done.stdout)
    with open(tmp_path / "rep" / "test" / "classes.csv") as f:
        rows = list(csv.DictReader(f))
    right = sum(round(float(r["recall"]) * int(r["support"])) for r in rows)
    assert right / sum(int(r["support"]) for r in rows) == pytest.approx(said["test_accuracy"], abs=1e-9)


def test_a_val_split_too_small_to_fit_on_leaves_the_temperature_at_one_and_says_so(tmp_path):
    """Iris with 3 val rows: no temperature is fitted on them (job/recipe/calibrate.py's rule); model.json holds 1, the
    probabilities served are the model's own, and the run's last lines say why."""
    over = sets("data.val_split=0.02", "train.epochs=300")
    code, out = invoke(["train", "--device", "cpu", "--config", "iris", "--output", str(tmp_path / "run"), *over])
    assert code == 0, out
    card = json.loads((tmp_path / "run" / "model.json").read_text())
    assert card["metrics"]["val_calibration_samples"] == 3
    assert card["temperature"] == 1.0
    assert "val split too small to fit a temperature on (3 samples" in out, out[-1500:]
