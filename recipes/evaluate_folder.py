"""Evaluate every scores file in a folder and summarise: how good is each model's output, how much of
its cross-entropy is miscalibration, and which calibration stage removes it.

Each file (``.npz``, ``.pt``/``.pth``, ``.csv``, or ``.npy`` with its labels file next to it, see
``torchcal.data``) goes through ``torchcal evaluate`` with the options given here, which writes its
report to ``OUT/<file stem>/`` (``OUT/<file name>/`` for files whose stems are the same: ``x.npz``
and ``x.csv``); the summary table is printed and written to ``OUT/summary.csv``.
Files that cannot be read are reported (one line each, by ``torchcal evaluate``) and skipped.

    python recipes/evaluate_folder.py my_logits/ --out reports/
    python recipes/evaluate_folder.py my_logits/ --config kull-2019-dirichlet --no-figures
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from torchcal.cli import main as torchcal_main

SUFFIXES = {".npz", ".npy", ".pt", ".pth", ".csv"}


def score_files(folder: Path) -> list[Path]:
    """The scores files in ``folder``; the ``.npy`` labels files that ``torchcal.data`` finds beside
    a scores file (``x_logits.npy`` -> ``x_labels.npy`` or ``x_targets.npy``) are partners, not
    scores. (Any name with "labels" in it was: ``noisy_labels_logits.npy`` had no report.)"""
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in SUFFIXES)
    partners = {p.with_name(p.stem.replace(word, labels) + ".npy") for p in files if p.suffix == ".npy"
                for word in ("logits", "scores", "probs") if word in p.stem for labels in ("labels", "targets")}
    return [p for p in files if p not in partners]


def report_folder(path: Path, paths: Sequence[Path]) -> str:
    """Where ``path``'s report goes: its stem, or its name where another file has that stem (two
    reports in one folder: the second overwrote the first)."""
    return path.stem if sum(p.stem == path.stem for p in paths) == 1 else path.name


def summary_row(path: Path, report: dict) -> dict[str, str]:
    """One line of the summary from a ``report.json``."""
    best = next(m for m in report["methods"] if m["method"] == report["best"])
    return {"file": path.name, "samples": str(report["num_samples"]), "classes": str(report["num_classes"]),
            "nce_raw": f"{report['raw']['nce']['value']:.3f}", "error_rate": f"{report['raw']['error_rate']['value']:.3f}",
            "best": best["method"], "nce_best": f"{best['quality']['nce']['value']:.3f}",
            "rcl_percent": f"{best['relative_calibration_loss']:.1f}"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--out", type=Path, default=Path("torchcal-report-folder"))
    parser.add_argument("--config", help="a YAML configuration (file or name in configs/)")
    parser.add_argument("--method", help="comma-separated methods (default: temperature,affine)")
    parser.add_argument("--bootstrap", help="bootstrap replicates (default 1000)")
    parser.add_argument("--no-figures", action="store_true")
    args = parser.parse_args(argv)
    options = [f"--{name}={value}" for name, value in (("config", args.config), ("method", args.method),
                                                        ("bootstrap", args.bootstrap)) if value is not None]
    options += ["--quiet"] + (["--no-figures"] if args.no_figures else [])

    rows = []
    paths = score_files(args.folder)
    for path in paths:
        out = args.out / report_folder(path, paths)
        if torchcal_main(["evaluate", str(path), "--out", str(out), *options]) == 0:
            rows.append(summary_row(path, json.loads((out / "report.json").read_text())))
        print()
    if not rows:
        print(f"no readable scores files in {args.folder}")
        return 1
    widths = {k: max(len(k), *(len(r[k]) for r in rows)) for k in rows[0]}
    for row in [{k: k for k in rows[0]}, *rows]:
        print("  ".join(row[k].ljust(widths[k]) for k in row))
    with (args.out / "summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nreports in {args.out}/<file stem>/, summary in {args.out / 'summary.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
