"""The statistics recipe runs and reproduces SOURCES.md's numbers for ResNet-110 before/after TS."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "calibration_statistics_resnet110.py"


def test_statistics_recipe(capsys):
    spec = importlib.util.spec_from_file_location("calibration_statistics_resnet110", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    assert recipe.main(["--fast"]) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines()[3:]:
        name, raw, calibrated = (cell.strip() for cell in line.strip("|").split("|"))
        rows[name] = (float(raw), float(calibrated))
    # SOURCES.md: test NLL 0.3583 -> 0.2093, Brier 0.1102 -> 0.0979, ECE15 4.75 % -> 1.13 % (T = 2.395)
    assert rows["NLL (nats)"] == pytest.approx((0.3583, 0.2093), abs=5e-5)
    assert rows["Brier"] == pytest.approx((0.1102, 0.0979), abs=5e-5)
    assert rows["ECE top-label 15 bins (%)"] == pytest.approx((4.75, 1.13), abs=5e-3)
    assert rows["smooth ECE top-label (%)"][1] < rows["smooth ECE top-label (%)"][0]
    assert rows["CORP Brier UNC"][0] == rows["CORP Brier UNC"][1]  # TS keeps the argmax
