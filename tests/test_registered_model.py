"""The model a run registers in MLflow is a model the job can use: `models:/NAME/1` downloaded with MLflow's own API
(model.pt and model.json, nothing else) is what `job predict --model` and `job export --model` take, against a real
MLflow server (SQLite backend, artifacts served by it) on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import invoke, sets, write_image_folder

mlflow = pytest.importorskip("mlflow", reason="the MLflow server and client (requirements-test.txt)")


@pytest.fixture(scope="module")
def registered(mlflow_server, tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the run folder, the registered model's version 1 as MLflow downloads it, the run's image folder)."""
    root = tmp_path_factory.mktemp("registered")
    images = write_image_folder(root / "images", per_class=16, size=32)
    over = sets(
        "data.kind=folder",
        f"data.path={images}",
        "data.val_split=0.25",
        "train.epochs=2",
        "data.batch_size=16",
        f"track.mlflow={mlflow_server}",
        "track.experiment=registered",
        "track.register=registered-model",
    )
    code, err = invoke(["train", "--device", "cpu", "--config", "cifar10", "--output", str(root / "run"), *over])
    assert code == 0, err
    with pytest.MonkeyPatch.context() as env:  # as `mlflow artifacts download -u models:/registered-model/1` does
        env.setenv("MLFLOW_TRACKING_URI", mlflow_server)
        got = mlflow.artifacts.download_artifacts(artifact_uri="models:/registered-model/1", dst_path=str(root / "dl"))
    return root / "run", Path(got), images


def rows(path: Path) -> dict[str, dict]:
    return {Path(r["path"]).name: r for r in map(json.loads, path.read_text().splitlines())}


def test_predict_takes_the_registered_model_as_mlflow_downloads_it(registered, tmp_path):
    run, model, images = registered
    assert sorted(p.name for p in model.iterdir()) == ["model.json", "model.pt"]  # the registry's copy, as it comes
    tests = sorted(str(p) for p in (images / "test").rglob("*.png"))
    for name, url in (("run", run), ("registry", model)):
        code, err = invoke(
            ["predict", "--model", str(url), *tests, "--device", "cpu", "--output", str(tmp_path / f"{name}.jsonl")]
        )
        assert code == 0, err
    ours, theirs = rows(tmp_path / "run.jsonl"), rows(tmp_path / "registry.jsonl")
    assert len(theirs) == len(tests) and not any(r.get("error") for r in theirs.values())
    assert {k: r["top_k"] for k, r in theirs.items()} == {k: r["top_k"] for k, r in ours.items()}


def test_export_takes_the_registered_model_as_mlflow_downloads_it(registered, tmp_path):
    _, model, images = registered
    out = tmp_path / "m.pt2"
    code, err = invoke(["export", "--model", str(model), "--format", "pt2", "--output", str(out)])
    assert code == 0, err
    check = json.loads((tmp_path / "m.pt2.check.json").read_text())
    assert out.stat().st_size > 0 and check["labels_agree"] and check["images"] > 0


def test_a_folder_without_model_json_names_model_json_alone(registered, tmp_path):
    _, model, _ = registered
    (tmp_path / "model.pt").write_bytes((model / "model.pt").read_bytes())
    code, err = invoke(["predict", "--model", str(tmp_path), str(tmp_path / "model.pt"), "--device", "cpu"])
    assert code == 5, err
    assert "model.json" in err and "config.yaml" not in err, err
