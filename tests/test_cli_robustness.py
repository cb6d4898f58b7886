"""The command line on corrupted or truncated files, wrong keys and huge files: every case ends
with exit code 2 and one line ``torchcal: error: ...`` that names the file and the problem; never
a traceback, never an attempt to load more than the memory holds.

(tests/test_cli.py covers the basic bad options and a few bad files; these are the broken ones.)
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from torchcal.cli import main

N, K = 60, 3


def good_arrays():
    rs = np.random.RandomState(0)
    labels = rs.randint(K, size=N)
    logits = rs.standard_normal((N, K)).astype(np.float32)
    logits[np.arange(N), labels] += 2
    return logits, labels


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(capsys, argv, *fragments):
    code, out, err = run(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("torchcal: error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def npz_bytes(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def npy_bytes(array) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def pt_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def huge_npy_header(shape, descr="<f4") -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": descr, "fortran_order": False, "shape": shape})
    return buffer.getvalue()


LOGITS, LABELS = good_arrays()
GOOD_NPZ = npz_bytes(logits=LOGITS, labels=LABELS)
GOOD_PT = pt_bytes({"logits": torch.from_numpy(LOGITS), "labels": torch.from_numpy(LABELS)})
GOOD_CSV = "c0,c1,c2,label\n" + "\n".join(",".join(f"{v:.6f}" for v in row) + f",{y}" for row, y in zip(LOGITS, LABELS)) + "\n"


class Evil:
    """Unpickling this runs code: a weights_only load must refuse it."""

    def __reduce__(self):
        return (print, ("pwned",))


# (file name, content, fragments the one-line message must contain)
CORRUPT_SCORES = [
    ("truncated.npz", GOOD_NPZ[: len(GOOD_NPZ) // 2], ["truncated.npz", "not a readable .npz file"]),
    ("garbage.npz", b"\x00\x01garbage" * 50, ["garbage.npz", "not a readable .npz file (it is no NumPy file, or it holds pickled"]),
    ("empty.npz", b"", ["empty.npz", "not a readable .npz file"]),
    ("truncated.npy", npy_bytes(LOGITS)[:-40], ["truncated.npy", "not a readable .npy file"]),
    ("garbage.npy", b"not numpy at all", ["garbage.npy", "not a readable .npy file (it is no NumPy file, or it holds pickled"]),
    ("object.npy", npy_bytes(np.array([{"a": 1}, None], dtype=object)), ["object.npy", "not a readable .npy file (it is no NumPy file, or it holds pickled"]),
    ("truncated.pt", GOOD_PT[: len(GOOD_PT) // 2], ["truncated.pt", "not a readable torch file"]),
    ("garbage.pt", b"\x80\x04garbage", ["garbage.pt", "not a readable torch file"]),
    ("pickled-code.pt", pickle.dumps(Evil()), ["pickled-code.pt", "not a readable torch file"]),
    ("truncated.csv", GOOD_CSV[: GOOD_CSV.index(",", len(GOOD_CSV) // 2)].encode(), ["truncated.csv", "every CSV row must have 4 cells"]),
    ("cut-mid-cell.csv", GOOD_CSV[: GOOD_CSV.index(",", len(GOOD_CSV) // 2) + 1].encode(), ["cut-mid-cell.csv", "every CSV cell after the header must be a number"]),
    ("binary.csv", b"c0,c1,label\n\xff\xfe\x00\x81,1,0\n", ["binary.csv"]),
    ("header-only.csv", b"c0,c1,c2,label\n", ["header-only.csv", "has a header but no rows of scores"]),
    ("text-cells.csv", b"c0,c1,label\n0.1,abc,1\n", ["text-cells.csv", "must be a number"]),
    ("unsupported.h5", b"\x89HDF\r\n\x1a\n", ["unsupported file type '.h5'"]),
]


@pytest.mark.parametrize("name, content, fragments", CORRUPT_SCORES, ids=[c[0] for c in CORRUPT_SCORES])
@pytest.mark.parametrize("command", ["evaluate", "calibrate", "apply"])
def test_corrupted_or_truncated_scores_file(name, content, fragments, command, tmp_path, capsys):
    path = tmp_path / name
    path.write_bytes(content)
    if command == "evaluate":
        argv = ["evaluate", path, "--out", tmp_path / "report", "--quiet"]
    elif command == "calibrate":
        argv = ["calibrate", path, "--method", "temperature", "--save", tmp_path / "head.pt", "--quiet"]
    else:
        good = tmp_path / "good.npz"
        good.write_bytes(GOOD_NPZ)
        assert run(capsys, "calibrate", good, "--method", "temperature", "--save", tmp_path / "head.pt", "--quiet")[0] == 0
        argv = ["apply", tmp_path / "head.pt", path, "--out", tmp_path / "out.npz", "--quiet"]
    assert_one_line_error(capsys, argv, *fragments)
    assert not (tmp_path / "out.npz").exists() and not (tmp_path / "report").exists()


# --------------------------------------------------------------------------- wrong keys and contents
WRONG_CONTENT = [
    ("typo-key.npz", npz_bytes(logit=LOGITS, labels=LABELS), ["no scores found: expected a key 'logits'", "found keys ['labels', 'logit']"]),
    ("label-key.npz", npz_bytes(logits=LOGITS, label=LABELS), ["no labels found: expected a key 'labels'", "'label'"]),
    ("val-scores-only.npz", npz_bytes(logits=LOGITS, labels=LABELS, logits_val=LOGITS),
     ["has 'logits_val' but no 'labels_val' or 'targets_val'"]),
    ("val-labels-only.npz", npz_bytes(logits=LOGITS, labels=LABELS, labels_val=LABELS), ["has 'labels_val' but no 'logits_val' or"]),
    ("wrong-keys.pt", pt_bytes({"scores": torch.from_numpy(LOGITS), "y": torch.from_numpy(LABELS)}), ["no scores found"]),
    ("list.pt", pt_bytes([1, 2, 3]), ["expected a dict, a (scores, labels) pair or a tensor, got list"]),
    ("strings.npz", npz_bytes(logits=np.array([["a", "b"], ["c", "d"]]), labels=np.array([0, 1])), ["scores must be a non-empty (N, K) or (N,) array of numbers"]),
    ("three-d.npz", npz_bytes(logits=np.zeros((4, 2, 2)), labels=np.arange(4) % 2), ["shape (4, 2, 2)"]),
    ("empty-logits.npz", npz_bytes(logits=np.zeros((0, 3)), labels=np.zeros(0, dtype=int)), ["non-empty"]),
    ("inf.npz", npz_bytes(logits=np.where(np.arange(N * K).reshape(N, K) == 5, np.inf, LOGITS), labels=LABELS), ["1 NaN or infinite values"]),
    ("float-labels.npz", npz_bytes(logits=LOGITS, labels=LABELS + 0.5), ["labels must be whole numbers"]),
    ("nan-labels.npz", npz_bytes(logits=LOGITS, labels=np.where(np.arange(N) == 3, np.nan, LABELS)), ["labels contain NaN"]),
    ("onehot-labels.npz", npz_bytes(logits=LOGITS, labels=np.eye(K)[LABELS]), [r"labels must have shape (N,)"]),
    ("short-labels.npz", npz_bytes(logits=LOGITS, labels=LABELS[:-1]), ["labels has 59 entries but the scores have N = 60"]),
    ("bad-probs.npz", npz_bytes(probs=np.full((N, K), 0.5), labels=LABELS), ["rows of probabilities must sum to one; row 0 sums to 1.5"]),
    ("negative-probs.npz", npz_bytes(probs=np.tile([1.5, -0.5, 0.0], (N, 1)), labels=LABELS), ["must lie in [0, 1]"]),
    ("string-labels.npz", npz_bytes(logits=LOGITS, labels=LABELS.astype(str)), ["labels must be class indices 0..K-1, got values of dtype <U21 such as '0'"]),
    ("string-labels.pt", pt_bytes({"logits": torch.from_numpy(LOGITS), "labels": [str(y) for y in LABELS]}), ["labels must be class indices"]),
    ("empty.npy", b"", ["empty.npy", "not a readable .npy file"]),
    ("ragged-tensors.pt", pt_bytes({"logits": [torch.zeros(3), torch.zeros(2)], "labels": torch.zeros(2)}),
     ["the scores cannot be read as an array of numbers", "save them as one array or dense tensor of numbers"]),
    ("complex.pt", pt_bytes({"logits": torch.from_numpy(LOGITS).to(torch.complex64), "labels": torch.from_numpy(LABELS)}),
     ["array of numbers, got shape (60, 3) and dtype complex64"]),
]


@pytest.mark.parametrize("name, content, fragments", WRONG_CONTENT, ids=[c[0] for c in WRONG_CONTENT])
def test_wrong_keys_and_contents(name, content, fragments, tmp_path, capsys):
    path = tmp_path / name
    path.write_bytes(content)
    assert_one_line_error(capsys, ["evaluate", path, "--out", tmp_path / "report", "--quiet"], name, *fragments)


def test_broken_labels_file(tmp_path, capsys):
    scores = tmp_path / "scores.npy"
    np.save(scores, LOGITS)
    truncated = tmp_path / "labels.npy"
    truncated.write_bytes(npy_bytes(LABELS)[:-17])
    assert_one_line_error(capsys, ["evaluate", scores, "--out", tmp_path / "o", "--quiet"], "scores.npy (labels: labels.npy, found beside it): labels file", "labels.npy: not a readable .npy file")
    garbage = tmp_path / "labels.pt"
    garbage.write_bytes(b"garbage")
    assert_one_line_error(capsys, ["evaluate", scores, "--labels", garbage, "--out", tmp_path / "o"], "labels file", "labels.pt: not a readable torch file")
    text = tmp_path / "y.txt"
    text.write_text("0\n1\nfoo\n")
    assert_one_line_error(capsys, ["evaluate", scores, "--labels", text, "--out", tmp_path / "o"], "y.txt", "labels must be one number per line")
    assert_one_line_error(capsys, ["evaluate", scores, "--labels", tmp_path / "none.npy", "--out", tmp_path / "o"], "no such labels file")


def test_broken_calibrator_file(tmp_path, capsys):
    good = tmp_path / "scores.npz"
    good.write_bytes(GOOD_NPZ)
    head = tmp_path / "head.pt"
    assert run(capsys, "calibrate", good, "--method", "affine", "--save", head, "--quiet")[0] == 0
    content = head.read_bytes()
    cases = [
        (content[: len(content) // 2], ["truncated.pt", "not a readable torch file"]),
        (pt_bytes({"weight": torch.ones(3)}), ["not a calibrator saved by torchcal"]),
        (pt_bytes(torch.ones(3)), ["not a calibrator saved by torchcal"]),
        (pickle.dumps(Evil()), ["not a readable torch file"]),
    ]
    for content_, fragments in cases:
        broken = tmp_path / "truncated.pt"
        broken.write_bytes(content_)
        assert_one_line_error(capsys, ["apply", broken, good, "--out", tmp_path / "out.npz"], *fragments)
    wider = tmp_path / "wider.npz"
    wider.write_bytes(npz_bytes(logits=np.zeros((5, K + 1)), labels=np.arange(5) % (K + 1)))
    assert_one_line_error(capsys, ["apply", head, wider, "--out", tmp_path / "out.npz"], "4 classes, but the calibrator was fitted on 3")
    assert not (tmp_path / "out.npz").exists()


def test_broken_config_and_cost_files(tmp_path, capsys):
    good = tmp_path / "scores.npz"
    good.write_bytes(GOOD_NPZ)
    config = tmp_path / "bad.yaml"
    config.write_text("methods: [temperature\n  cv: 3")
    assert_one_line_error(capsys, ["evaluate", good, "--config", config, "--out", tmp_path / "o"], "bad.yaml", "not valid YAML")
    # merge keys (<<: *anchor) are YAML, not a key given twice (the diff review: the first version
    # of the duplicate test refused them)
    config.write_text("methods: [dirichlet-l2, dirichlet-odir]\noptions:\n  dirichlet-l2: &grid\n    reg_grid: [0.001, 0.01]\n"
                      "  dirichlet-odir:\n    <<: *grid\n    reg_mu: 0.1\n")
    from torchcal.cli import load_config
    assert load_config(str(config))["options"] == {"dirichlet-l2": {"reg_grid": [0.001, 0.01]},
                                                  "dirichlet-odir": {"reg_grid": [0.001, 0.01], "reg_mu": 0.1}}
    # a key given twice: PyYAML keeps the last (a second options: block dropped the first's, silently)
    for text, key, line in [("options:\n  histogram: {n_bins: 5}\noptions:\n  platt: {}\n", "options", 3),
                            ("options:\n  histogram: {n_bins: 5}\n  histogram: {n_bins: 9}\n", "histogram", 3)]:
        config.write_text(text)
        assert_one_line_error(capsys, ["evaluate", good, "--config", config, "--out", tmp_path / "o"], "bad.yaml",
                              f"not valid YAML (the key '{key}' is given twice (line {line}); keep one)")
    config.write_text(yaml.safe_dump({"methods": ["temperature"], "folds": 3}))
    assert_one_line_error(capsys, ["evaluate", good, "--config", config, "--out", tmp_path / "o"], "unknown config keys ['folds']")
    for settings, fragment in [
        ({"methods": 3}, "methods must be a list of method names"),
        ({"methods": [["temperature"]]}, "methods must be a list of method names"),
        ({"methods": []}, "methods is empty; name one or more of temperature, affine,"),  # as --method "" is refused
        ({"options": ["temperature"]}, "options must map method names to their options"),
        ({"options": {"temperature": 5}}, "options must map method names to their options"),
        ({"options": {"dirichlet_odir": {"reg_lambda": 1000.0}}},
         "options for unknown method 'dirichlet_odir' (did you mean 'dirichlet-odir'?); the methods are temperature, affine,"),
        ({"options": {"7": {}}}, "options for unknown method '7'; the methods are"),
    ]:
        config.write_text(yaml.safe_dump(settings))
        assert_one_line_error(capsys, ["evaluate", good, "--config", config, "--out", tmp_path / "o"], "bad.yaml", fragment)
    assert_one_line_error(capsys, ["calibrate", good, "--method", "dirichlet-odir", "--config", config, "--save",
                                   tmp_path / "h.pt"], "bad.yaml", "options for unknown method '7'")
    # a config's costs and priors are named with the file (the messages said --costs / --priors,
    # and a ragged matrix gave torch's bare "expected sequence of length 2 at dim 1 (got 1)")
    for settings, fragment in [
        ({"costs": [[0, 1, 1], [1, 0]]}, "costs must be a K x M matrix of numbers, one list of M costs per class"),
        ({"costs": [[0, "a", 1], [1, 0, 1], [1, 1, 0]]}, "costs must be a K x M matrix of numbers"),
        ({"costs": "abstain:x"}, "costs abstain:ALPHA needs a number"),
        ({"priors": [0.5, 0.5]}, "priors needs 3 numbers"),
    ]:
        config.write_text(yaml.safe_dump(settings))
        assert_one_line_error(capsys, ["evaluate", good, "--config", config, "--out", tmp_path / "o"], f"{config}: {fragment}")
    assert_one_line_error(capsys, ["calibrate", good, "--method", "affine", "--config", config, "--save", tmp_path / "h.pt"],
                          f"{config}: priors needs 3 numbers")
    costs = tmp_path / "costs.csv"
    for content, fragment in [
        ("0,1\n1,0\n", "costs must have shape (K, M) = (3, M)"),
        ("0,1,1\n1,0,-1\n1,1,0\n", "costs must be non-negative"),
        ("0,1,x\n1,0,1\n1,1,0\n", "not a readable cost matrix"),
    ]:
        costs.write_text(content)
        assert_one_line_error(capsys, ["evaluate", good, "--costs", costs, "--bootstrap", "0", "--out", tmp_path / "o", "--quiet"], fragment)


def test_output_paths_that_cannot_be_written_are_refused_before_fitting(tmp_path, capsys, monkeypatch):
    good = tmp_path / "scores.npz"
    good.write_bytes(GOOD_NPZ)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    a_folder = tmp_path / "out.npz"
    a_folder.mkdir()
    monkeypatch.setattr("torchcal.report.fit_calibrator", lambda *a, **k: pytest.fail("fitted before the output was checked"))
    assert_one_line_error(capsys, ["evaluate", good, "--out", a_file, "--quiet"], "--out", "a file is already there; name a folder")
    assert_one_line_error(capsys, ["evaluate", good, "--out", a_file / "report", "--quiet"], "a_file is a file, not a folder")
    assert_one_line_error(capsys, ["calibrate", good, "--method", "affine", "--save", a_file / "h.pt"], "--save", "a_file is a file, not a folder")
    assert_one_line_error(capsys, ["calibrate", good, "--method", "affine", "--save", a_folder], "a folder is already there; name a file")
    monkeypatch.undo()
    head = tmp_path / "head.pt"
    assert run(capsys, "calibrate", good, "--method", "affine", "--save", head, "--quiet")[0] == 0
    assert_one_line_error(capsys, ["apply", head, good, "--out", a_folder], "--out", "a folder is already there; name a file")
    # an input of the command (`apply head.pt s.npz --out head.pt` wrote over the calibrator; a fuzz review)
    before = head.read_bytes()
    assert_one_line_error(capsys, ["apply", head, good, "--out", head], "--out", "is also an input of this command", "name another file")
    assert_one_line_error(capsys, ["apply", head, good, "--out", good], "is also an input of this command")
    assert head.read_bytes() == before
    torch_scores = tmp_path / "scores.pt"
    assert run(capsys, "apply", head, good, "--out", torch_scores, "--quiet")[0] == 0
    assert_one_line_error(capsys, ["calibrate", torch_scores, "--method", "affine", "--save", torch_scores], "--save", "is also an input")
    np.save(tmp_path / "scores_only.npy", np.load(good)["logits"])
    labels_file = tmp_path / "labels.pt"
    torch.save(torch.from_numpy(np.load(good)["labels"]), labels_file)
    for argv in (["calibrate", tmp_path / "scores_only.npy", "--labels", labels_file, "--method", "affine", "--save", labels_file],
                 ["apply", head, tmp_path / "scores_only.npy", "--labels", labels_file, "--out", labels_file]):
        assert_one_line_error(capsys, argv, "is also an input of this command")  # (the labels file, a diff review)


def _refuse_to_fit(monkeypatch):
    def fit(*args, **kwargs):
        pytest.fail("fitted before the output was checked")

    for name in ("torchcal.report.fit_calibrator", "torchcal.report.evaluate"):
        monkeypatch.setattr(name, fit)


def _outputs_refused_before_fitting(tmp_path, capsys, monkeypatch, folder, *fragments):
    """evaluate --out, calibrate --save and apply --out in ``folder``: one line, before any fit."""
    good = tmp_path / "scores.npz"
    good.write_bytes(GOOD_NPZ)
    head = tmp_path / "head.pt"
    assert run(capsys, "calibrate", good, "--method", "affine", "--save", head, "--quiet")[0] == 0
    _refuse_to_fit(monkeypatch)
    for argv in (["evaluate", good, "--out", folder / "report", "--quiet"],
                 ["calibrate", good, "--method", "affine", "--save", folder / "sub" / "h.pt", "--quiet"],
                 ["apply", head, good, "--out", folder / "out.npz", "--quiet"]):
        assert_one_line_error(capsys, argv, *fragments)


def test_output_locations_that_cannot_be_created_are_refused_before_fitting(tmp_path, capsys, monkeypatch):
    """They were refused only when the report was written, after every fit and the bootstrap."""
    if not Path("/proc/self").is_dir():
        pytest.skip("needs /proc, where no file can be created even by root")
    _outputs_refused_before_fitting(tmp_path, capsys, monkeypatch, Path("/proc/torchcal-test"),
                                    "cannot create files in /proc", "name a location you can write to")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes through permission bits")
def test_output_folders_without_write_permission_are_refused_before_fitting(tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    _outputs_refused_before_fitting(tmp_path, capsys, monkeypatch, locked, f"cannot create files in {locked} (Permission denied)")
    assert list(locked.iterdir()) == []
    read_only = tmp_path / "old.npz"
    read_only.write_bytes(b"")
    read_only.chmod(0o444)
    assert_one_line_error(capsys, ["apply", tmp_path / "head.pt", tmp_path / "scores.npz", "--out", read_only],
                          "the file is there and cannot be overwritten")


def test_the_labels_of_calibration_scores_are_asked_for_by_their_option(tmp_path, capsys):
    """Calibration scores without labels: the message said --labels, which labels SCORES; and
    --calibration-labels without --calibration was ignored (cross-validation ran instead)."""
    good = tmp_path / "scores.npz"
    good.write_bytes(GOOD_NPZ)
    np.save(tmp_path / "val_scores.npy", LOGITS)
    np.save(tmp_path / "y.npy", LABELS)  # a name not found next to val_scores.npy
    common = ["--out", tmp_path / "o", "--quiet"]
    assert_one_line_error(capsys, ["evaluate", good, "--calibration", tmp_path / "val_scores.npy", *common],
                          "val_scores.npy: no labels file found next to it", "or --calibration-labels on the command line")
    assert_one_line_error(capsys, ["evaluate", good, "--calibration", good, "--calibration-labels", tmp_path / "y.npy", *common],
                          "a labels file was given too (labels_path, --calibration-labels)")
    assert_one_line_error(capsys, ["evaluate", good, "--calibration-labels", tmp_path / "y.npy", *common],
                          "--calibration-labels labels the --calibration scores, and none were given")
    assert not (tmp_path / "o").exists()


def test_a_labels_file_given_for_scores_that_have_labels_is_an_error(tmp_path, capsys):
    """It was silently ignored for .npz, .pt and .csv files (and used for .npy)."""
    other = tmp_path / "other.npy"
    np.save(other, LABELS[::-1].copy())
    for name, content, fragment in [
        ("s.npz", GOOD_NPZ, "own labels ('labels')"),
        ("s.pt", pt_bytes((torch.from_numpy(LOGITS), torch.from_numpy(LABELS))), "own labels (a (scores, labels) pair)"),
        ("s.csv", GOOD_CSV.encode(), "own labels (its 'label' column)"),
    ]:
        path = tmp_path / name
        path.write_bytes(content)
        assert_one_line_error(capsys, ["evaluate", path, "--labels", other, "--out", tmp_path / "o", "--quiet"], name, fragment, "drop one of them")


def test_integer_settings_are_checked_where_they_were_given(tmp_path, capsys):
    good = tmp_path / "scores.npz"
    good.write_bytes(GOOD_NPZ)
    base = ["evaluate", good, "--method", "temperature", "--out", tmp_path / "o", "--quiet", "--no-figures"]
    assert_one_line_error(capsys, [*base, "--cv", "0"], "--cv must be an integer >= 2 (the number of folds), got 0")
    assert_one_line_error(capsys, [*base, "--bootstrap", "1"], "--bootstrap must be 0 (no intervals) or an integer >= 2")
    config = tmp_path / "c.yaml"
    for content, fragment in [
        ({"bootstrap": 2.7}, "c.yaml: bootstrap must be 0 (no intervals) or an integer >= 2 (replicates), got 2.7"),
        ({"cv": "abc"}, "c.yaml: cv must be an integer >= 2 (the number of folds), got 'abc'"),
        ({"seed": -1}, "c.yaml: seed must be an integer in [0, 2**64), got -1"),
    ]:
        config.write_text(yaml.safe_dump(content))
        assert_one_line_error(capsys, [*base, "--config", config], fragment)
    # review findings: a seed beyond torch's generators was named as 'seed' after the bootstrap had
    # begun; a negative first prior read as an option got argparse's bare "expected one argument"
    assert_one_line_error(capsys, [*base, "--seed", str(2**64)], f"--seed must be an integer in [0, 2**64), got {2**64}")
    assert_one_line_error(capsys, [*base, "--priors", "-0.1,1.1"], "expected one argument", "goes after '=', as in --priors=-0.1,1.1")
    assert "goes after '='" not in assert_one_line_error(capsys, [*base, "--seed"], "expected one argument")


def test_labels_of_one_class_only(tmp_path, capsys):
    logits, _ = good_arrays()
    one = tmp_path / "one.npz"
    one.write_bytes(npz_bytes(logits=logits, labels=np.full(N, 2)))
    assert_one_line_error(capsys, ["evaluate", one, "--out", tmp_path / "o", "--quiet"], "one.npz: every label is class 2", "two classes present")
    for quiet in ([], ["--quiet"]):
        assert_one_line_error(capsys, ["calibrate", one, "--method", "temperature", "--save", tmp_path / "h.pt", *quiet],
                              "one.npz: every label is class 2")
        assert not (tmp_path / "h.pt").exists()


# --------------------------------------------------------------------------- huge files
@pytest.mark.parametrize("suffix", [".npy", ".npz"])
def test_huge_file_is_refused_before_it_is_read(suffix, tmp_path, capsys):
    """A scores array larger than the memory (here 10^12 x 10 float32, 37 TiB by its header) is
    refused with one line saying how large it is, instead of a MemoryError traceback (or, for
    arrays that just fit, a run that the out-of-memory killer ends without a word)."""
    header = huge_npy_header((10**12, 10))
    path = tmp_path / f"huge{suffix}"
    if suffix == ".npy":
        path.write_bytes(header)
    else:
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("logits.npy", header)
            z.writestr("labels.npy", npy_bytes(np.zeros(3, dtype=np.int64)))
    labels = tmp_path / "labels.npy"
    np.save(labels, np.zeros(3, dtype=np.int64))
    line = assert_one_line_error(capsys, ["evaluate", path, "--labels", labels, "--out", tmp_path / "o", "--quiet"], f"huge{suffix}")
    assert "too large" in line and "TiB" in line


def test_file_larger_than_the_available_memory_is_refused_without_reading_it(tmp_path, capsys, monkeypatch):
    """A complete file (sparse on disk) whose array and working copies exceed the memory available."""
    import torchcal.data.loading as loading

    path = tmp_path / "scores.npy"
    with path.open("wb") as f:
        f.write(huge_npy_header((2 * 10**6, 10)))  # 76.3 MiB of float32
        f.truncate(f.tell() + 8 * 10**7)
    np.save(tmp_path / "labels.npy", np.zeros(2 * 10**6, dtype=np.int64))
    monkeypatch.setattr(loading, "_available_memory", lambda: 256 * 2**20)  # as if 256 MiB were free
    line = assert_one_line_error(capsys, ["evaluate", path, "--out", tmp_path / "o", "--quiet"], "scores.npy", "too large")
    assert "76.3 MiB of float32" in line and "256 MiB is available" in line


def test_csv_file_larger_than_the_available_memory_is_refused_before_it_is_parsed(tmp_path, capsys, monkeypatch):
    """Parsing a CSV file takes a few times the text (CSV_EXPANSION): refused where that is more than is available."""
    import torchcal.data.loading as loading

    path = tmp_path / "scores.csv"
    path.write_text(GOOD_CSV)
    monkeypatch.setattr(loading, "_available_memory", lambda: (loading.CSV_EXPANSION - 1) * len(GOOD_CSV))
    line = assert_one_line_error(capsys, ["evaluate", path, "--out", tmp_path / "o", "--quiet"], "scores.csv", "too large")
    assert "numpy.save" in line


def test_running_out_of_memory_is_one_line(tmp_path, capsys, monkeypatch):
    """torch's CPU allocator raises a RuntimeError: at K = 20,000 the run ended in a traceback
    (exit 1) from the cost matrix (a review). Other RuntimeErrors are bugs and stay tracebacks."""
    import torchcal.report

    path = tmp_path / "scores.npz"
    path.write_bytes(GOOD_NPZ)

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 3200000000 bytes.")

    monkeypatch.setattr(torchcal.report, "evaluate", out_of_memory)
    line = assert_one_line_error(capsys, ["evaluate", path, "--out", tmp_path / "o", "--quiet"], "out of memory (DefaultCPUAllocator")
    assert "--method temperature" in line
    for bug in ("a bug", "unsupported memory format"):  # (a message about memory is not out of memory)
        monkeypatch.setattr(torchcal.report, "evaluate", lambda *a, bug=bug, **k: (_ for _ in ()).throw(RuntimeError(bug)))
        with pytest.raises(RuntimeError, match=bug):
            run(capsys, "evaluate", path, "--out", tmp_path / "o", "--quiet")


def test_a_file_that_fits_still_loads(tmp_path, capsys):
    path = tmp_path / "scores.npz"
    path.write_bytes(GOOD_NPZ)
    code, out, err = run(capsys, "evaluate", path, "--bootstrap", "0", "--no-figures", "--out", tmp_path / "o", "--quiet")
    assert code == 0, err
