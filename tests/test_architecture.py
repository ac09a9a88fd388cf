"""The package's map stays true: docs/architecture.md and job/__init__.py name every part, and the contracts the
page cites by id are the ones pyproject.toml holds (lint-imports, in CI's lint step, checks the imports)."""

import re

import pytest
from conftest import ROOT

import job

tomllib = pytest.importorskip("tomllib", reason="Python 3.11's TOML reader")
PAGE = (ROOT / "docs" / "architecture.md").read_text()
CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def parts() -> list[str]:
    return sorted(p.parent.name for p in (ROOT / "job").glob("*/__init__.py"))


def test_the_page_and_the_package_map_name_every_part():
    assert len(parts()) >= 6
    for part in parts():
        assert f"[{part}/]" in PAGE, part
        assert re.search(rf"^    {part}/ ", job.__doc__, flags=re.M), part


def test_the_page_cites_the_contracts_pyproject_holds():
    ids = {c["id"] for c in CONTRACTS}
    cited = set(re.findall(r"\(`([a-z-]+)`\)", PAGE))
    assert cited and cited <= ids, cited - ids
    layers = next(c for c in CONTRACTS if c["type"] == "layers")
    named = {name.strip("() ") for layer in layers["layers"] for name in re.split(r"[|:]", layer)}
    assert set(parts()) <= named  # every folder is placed in the layers (exhaustive: the top modules too)
