"""The Colab notebook: valid, committed without outputs, and executed top to bottom as Colab would run it (only
`google.colab` replaced by a stub whose drive.mount makes the folder), writing the run to the "Drive" folder;
executed again it resumes."""

import json
import os
import textwrap
from pathlib import Path

import nbformat
import pytest
import torch
from conftest import ROOT, write_image_folder
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOK = ROOT / "colab" / "train.ipynb"
PARAMETERS = (
    "CONFIG",
    "DATA_PATH",
    "OUTPUT_DIR",
    "OVERRIDES",
    "MOUNT_DRIVE",
    "INSTALL_SPEC",
    "PREDICT_INPUTS",
    "EXPORT_FORMAT",
)


def test_notebook_is_valid_and_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)
    first = code[0]
    assert "parameters" in first.metadata.get("tags", [])
    assert all(f"{name} = " in first.source for name in PARAMETERS)
    assert "import google.colab" not in "".join(c.source for c in code)  # Colab is detected by its environment


def colab_stub(folder: Path) -> Path:
    """A stand-in for google.colab alone (the real google package stays importable): drive.mount makes MyDrive."""
    package = folder / "google" / "colab"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "drive.py").write_text(
        textwrap.dedent(
            """
            import os

            mounted, flushed = [], []

            def mount(mountpoint, force_remount=False, **kwargs):
                os.makedirs(os.path.join(mountpoint, "MyDrive"), exist_ok=True)
                mounted.append(mountpoint)

            def flush_and_unmount(**kwargs):
                flushed.append(True)
                print("stub: Drive flushed and unmounted")
            """
        )
    )
    return folder


def execute(tmp_path: Path, **params) -> str:
    """Run the notebook with parameters injected after the cell tagged `parameters`; returns its text output."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    source = "\n".join(f"{k} = {v!r}" for k, v in params.items())
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]}))
    env = {
        "COLAB_RELEASE_TAG": "stub",
        "PYTHONPATH": os.pathsep.join([str(colab_stub(tmp_path / f"stub-{len(list(tmp_path.iterdir()))}")), str(ROOT)]),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel, and the job it starts, inherit these
    try:
        client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
        client.execute()
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    texts, images = [], 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            texts.append(out.get("text", ""))
            images += "image/png" in out.get("data", {})
    return "".join(texts) + f"\n[{images} images]"


def test_notebook_trains_to_drive_then_resumes(tmp_path):
    drive_run = tmp_path / "content" / "drive" / "MyDrive" / "runs" / "iris"
    params = {
        "CONFIG": "iris",
        "DATA_PATH": "",
        "OUTPUT_DIR": str(drive_run),
        "OVERRIDES": ["train.epochs=2000"],
        "MOUNT_DRIVE": True,
        "INSTALL_SPEC": "",
        "PREDICT_INPUTS": [str(ROOT / "job" / "presets" / "iris.csv")],
    }
    first = execute(tmp_path, **params)
    assert "running on Colab" in first and "[1 images]" in first
    assert "final (epoch 2000, step 2000)" in first and "stub: Drive flushed" in first
    assert "predict: 150 rows labelled" in first and "a table's model is not exported" in first
    rows = (drive_run / "labels.csv").read_text().splitlines()
    assert rows[0].startswith("path,label,probability,") and len(rows) == 151
    for name in ("config.yaml", "metrics.jsonl", "model.pt", "curves.png", "checkpoints/latest.json"):
        assert (drive_run / name).is_file(), name
    assert list((drive_run / "tensorboard").glob("events.out.tfevents.*"))
    weights = torch.load(drive_run / "model.pt", weights_only=True)
    assert weights and all(isinstance(v, torch.Tensor) for v in weights.values())
    assert not list(drive_run.rglob(".*"))  # no temporary files left on Drive

    second = execute(tmp_path, **{**params, "OVERRIDES": ["train.epochs=2400"]})
    assert "resuming iris from epoch 2000, step 2000" in second
    assert "final (epoch 2400, step 2400)" in second
    records = [json.loads(line) for line in (drive_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1000, 2000, 2400]


def test_the_default_install_source_is_a_copy_of_the_repository_on_drive(tmp_path):
    """No placeholder repository anywhere: the notebook installs from a copy of the repository on Drive by default,
    and says what to do when there is none there."""
    for path in (NOTEBOOK, ROOT / "README.md"):
        assert "OWNER/" not in path.read_text(), path
    first = next(c for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code")
    assert 'INSTALL_SPEC = "/content/drive/MyDrive/job"' in first.source
    missing = str(tmp_path / "content" / "drive" / "MyDrive" / "job")
    params = {"OUTPUT_DIR": str(tmp_path / "content" / "drive" / "MyDrive" / "runs" / "x"), "INSTALL_SPEC": missing}
    with pytest.raises(CellExecutionError, match=f"INSTALL_SPEC: no copy of the job's repository at {missing}"):
        execute(tmp_path, **params)
    assert not (tmp_path / "content" / "drive" / "MyDrive" / "runs").exists()  # stopped before training


def test_notebook_labels_new_photos_and_exports_the_model(tmp_path):
    """A photo run in the notebook goes on to its predict and export cells: labels.csv and a checked model.onnx on
    "Drive"."""
    photos = write_image_folder(tmp_path / "photos", n_classes=2, per_class=8, size=32, test_per_class=3)
    drive_run = tmp_path / "content" / "drive" / "MyDrive" / "runs" / "photos"
    params = {
        "CONFIG": "cifar10",
        "DATA_PATH": str(photos),
        "OUTPUT_DIR": str(drive_run),
        "OVERRIDES": ["data.kind=folder", "data.image_size=32", "train.epochs=1"],
        "MOUNT_DRIVE": True,
        "INSTALL_SPEC": "",
        "PREDICT_INPUTS": [str(photos / "test")],
        "EXPORT_FORMAT": "onnx",
    }
    out = execute(tmp_path, **params)
    assert "predict: 6 images labelled" in out and "checked on 6 images with onnxruntime" in out, out[-2000:]
    rows = (drive_run / "labels.csv").read_text().splitlines()
    assert rows[0].startswith("path,label,probability,label_2,probability_2,") and len(rows) == 7
    check = json.loads((drive_run / "model.onnx.check.json").read_text())
    assert check["labels_agree"] and check["images"] == 6
    assert (drive_run / "model.onnx").stat().st_size > 0
