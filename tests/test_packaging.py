"""What `pip install .` installs is what `pip install -r requirements.txt` installs: pyproject.toml's dependencies and
requirements.txt name the same packages at the same versions, so every command (`job sweep` needs optuna, tracking
mlflow-skinny) works from either."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib", reason="Python 3.11's TOML reader")

ROOT = Path(__file__).resolve().parent.parent


def normalised(lines: list[str]) -> dict[str, str]:
    """{package name: its requirement, spelled one way} of requirement lines (comments and blanks left out)."""
    out = {}
    for line in lines:
        text = line.split("#", 1)[0].strip()
        if text:
            r = Requirement(text)
            out[r.name.lower().replace("_", "-")] = f"{sorted(r.extras)}{r.specifier}{r.marker or ''}"
    return out


def test_pyproject_declares_what_requirements_txt_lists():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = normalised(project["dependencies"])
    listed = normalised((ROOT / "requirements.txt").read_text().splitlines())
    assert {"optuna", "mlflow-skinny", "torch"} <= set(listed)  # the file was read, the packages of every command
    missing = {k: v for k, v in listed.items() if declared.get(k) != v}
    extra = {k: v for k, v in declared.items() if k not in listed}
    assert not missing and not extra, f"requirements.txt only: {missing}; pyproject.toml only: {extra}"
