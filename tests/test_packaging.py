"""What a normal, non-editable install ships: the presets and the bundled example, not test helpers."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    pytest.importorskip("setuptools")
    source = tmp_path_factory.mktemp("source")  # a copy, so the build leaves no build/ in the checkout
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in ("torchcal", "configs"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(source),
                    "-w", str(out)], check=True, capture_output=True)
    [built] = out.glob("torchcal-*.whl")
    return zipfile.ZipFile(built)


def test_every_preset_ships_in_the_package(wheel):
    names = set(wheel.namelist())
    presets = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
    assert presets and all(f"torchcal/configs/{p}" in names for p in presets)
    assert "torchcal/data/examples/cifar10_resnet110_kangsepp.npz" in names


def test_every_subpackage_ships(wheel):
    shipped = {Path(n).parent.as_posix() for n in wheel.namelist() if n.endswith("__init__.py")}
    in_tree = {p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "torchcal").rglob("__init__.py")}
    assert in_tree <= shipped


def test_import_is_cheap_and_every_subpackage_is_an_attribute():
    """``import torchcal`` imports no torch; afterwards every subpackage is reachable as an
    attribute (``torchcal.calibrators.matrix``, ``torchcal.fit.fold_indices``), as after an
    explicit import."""
    names = ("calibrators", "data", "fit", "functional", "heads", "label_shift", "lightning", "metrics", "plots", "report")
    code = (
        "import sys, torchcal; assert 'torch' not in sys.modules; "
        f"[getattr(torchcal, n) for n in {names!r}]; "
        "print(torchcal.calibrators.matrix.DEFAULT_REG_GRID[0], torchcal.fit.fold_indices.__name__, "
        "torchcal.heads.attach.__name__, set(" + repr(names) + ") <= set(torchcal.__all__))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert result.stdout.split() == ["0.0001", "fold_indices", "attach", "True"]
