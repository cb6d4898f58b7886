"""The torchcal command line: the must-show numbers, every bad-input path, and the production path."""

from __future__ import annotations

import json
import logging
import math
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import torchcal
from torchcal.cli import main
from torchcal.report import load_calibrator


@pytest.fixture
def scores_file(tmp_path, synthetic):
    logits, labels = synthetic(3, 600, seed=0)
    path = tmp_path / "scores.npz"
    np.savez(path, logits=logits.astype(np.float32), labels=labels)
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_must_show_ferrer_ramos_table2(real, capsys, tmp_path):
    """`torchcal evaluate cifar10_resnet20_ferrer.npz --cv 5 --method affine`: NCE 0.122 -> 0.101, RCL 17.2 %
    (17.3 with our folds)."""
    real("cifar10_resnet20_ferrer")  # skips when the shared data are absent
    from conftest import REAL_DATA

    code, out, _ = run(capsys, "evaluate", REAL_DATA / "cifar10_resnet20_ferrer.npz", "--cv", "5", "--method", "affine",
                       "--out", tmp_path, "--no-figures", "--quiet")
    assert code == 0
    assert re.search(r"NCE 0\.122 -> 0\.101: RCL 17\.[23] %", out)
    assert "5-fold stratified cross-validation" in out
    saved = json.loads((tmp_path / "report.json").read_text())
    [affine] = saved["methods"]
    # 17.2 in Table 2, from the authors' folds; ours give 17.23-17.39 over fold seeds 0-9
    assert affine["relative_calibration_loss"] == pytest.approx(17.2, abs=0.2)
    assert saved["raw"]["nce"]["value"] == pytest.approx(0.2815 / math.log(10), abs=5e-5)  # SOURCES.md NLL / ln K
    assert round(saved["raw"]["ece"], 1) == 3.9  # Table 2, raw ECE
    assert affine["quality"]["ece"] == pytest.approx(0.8, abs=0.3)  # 0.8 in Table 2; our folds differ


def test_evaluate_writes_the_report_folder(scores_file, capsys, tmp_path):
    out_dir = tmp_path / "rep"
    code, out, err = run(capsys, "evaluate", scores_file, "--method", "temperature,affine", "--cv", "3",
                         "--bootstrap", "50", "--out", out_dir)
    assert code == 0 and "1. Raw posteriors (95 % bootstrap intervals, 50 replicates)" in out
    assert f"to {out_dir}/" in out
    assert {p.name for p in out_dir.iterdir()} >= {"report.txt", "report.json", "report.csv", "calibrator.pt",
                                                   "reliability_top_label.png", "bayes_risk.png"}
    assert (out_dir / "report.txt").read_text() in out + "\n"


def test_an_out_folder_used_again_loses_the_earlier_reports_files_only(tmp_path, synthetic, capsys):
    """The second report writes no figures: those of the first go, and nothing torchcal did not name."""
    from torchcal.report import REPORT_FILES

    logits, labels = synthetic(2, 300, seed=2)
    np.savez(tmp_path / "binary.npz", logits=logits, labels=labels)
    out_dir = tmp_path / "rep"
    common = ["--method", "temperature", "--cv", "2", "--bootstrap", "0", "--out", out_dir]
    assert run(capsys, "evaluate", tmp_path / "binary.npz", *common, "--quiet")[0] == 0
    figures = [name for name in REPORT_FILES if (out_dir / name).suffix == ".png"]
    assert {p.name for p in out_dir.iterdir()} == set(REPORT_FILES)  # K = 2: every name, det.png too
    (out_dir / "notes.txt").write_text("mine")
    (out_dir / "mine.png").write_bytes(b"")
    code, out, _ = run(capsys, "evaluate", tmp_path / "binary.npz", *common, "--no-figures")
    assert code == 0 and f"removed 5 files of an earlier report: {', '.join(figures)}" in out
    assert sorted(p.name for p in out_dir.iterdir()) == ["calibrator.pt", "mine.png", "notes.txt", "report.csv",
                                                         "report.json", "report.txt"]


def test_calibration_data_come_from_the_option_or_the_files_own_split(tmp_path, synthetic, capsys):
    logits, labels = synthetic(3, 900, seed=1)
    np.savez(tmp_path / "test.npz", logits=logits[:600], labels=labels[:600])
    np.savez(tmp_path / "cal.npz", logits=logits[600:], labels=labels[600:])
    np.savez(tmp_path / "both.npz", logits=logits[:600], labels=labels[:600],
             logits_val=logits[600:], labels_val=labels[600:])
    common = ["--method", "temperature", "--bootstrap", "0", "--no-figures", "--quiet", "--out", tmp_path / "o"]
    _, out, _ = run(capsys, "evaluate", tmp_path / "test.npz", "--calibration", tmp_path / "cal.npz", *common)
    assert f"fitted on separate calibration data ({tmp_path / 'cal.npz'}, N = 300, read as logits)" in out
    # a calibration file with a validation split gives that split, as to `calibrate`, not its test rows
    _, out, _ = run(capsys, "evaluate", tmp_path / "test.npz", "--calibration", tmp_path / "both.npz", *common)
    assert f"fitted on separate calibration data ({tmp_path / 'both.npz'} (val split), N = 300, read as logits)" in out
    _, out, _ = run(capsys, "evaluate", tmp_path / "both.npz", *common)
    assert "(val split), N = 300, read as logits)" in out
    _, out, _ = run(capsys, "evaluate", tmp_path / "both.npz", "--cv", "4", *common)
    assert "4-fold stratified cross-validation" in out
    # the evaluated file as its own calibration data: refused (exit 2), a copy of it too
    for calibration in (tmp_path / "test.npz", tmp_path / "copy.npz"):
        np.savez(tmp_path / "copy.npz", logits=logits[:600], labels=labels[:600])
        code, _, err = run(capsys, "evaluate", tmp_path / "test.npz", "--calibration", calibration, *common)
        assert code == 2 and "every evaluated sample (600) is in the calibration data too" in err
    _, out, _ = run(capsys, "evaluate", tmp_path / "test.npz", *common)
    assert "5-fold stratified cross-validation" in out  # the default: never the test data itself


def test_config_and_overrides(scores_file, capsys, tmp_path):
    common = ["--no-figures", "--quiet", "--out", tmp_path / "o"]
    _, out, _ = run(capsys, "evaluate", scores_file, "--config", "quick", "--bootstrap", "0", *common)
    assert "3-fold stratified" in out and "affine" in out and "bootstrap" not in out
    _, out, _ = run(capsys, "evaluate", scores_file, "--config", "abstain", "--method", "temperature",
                    "--bootstrap", "0", *common)
    assert "costs: 0-1 + abstain 0.1" in out and "affine" not in out
    (tmp_path / "bad.yaml").write_text("methods: [affine]\nfolds: 3\n")
    code, _, err = run(capsys, "evaluate", scores_file, "--config", tmp_path / "bad.yaml", *common)
    assert code == 2 and "unknown config keys ['folds']" in err
    # YAML 1.1 reads 1e-2 as a string ("'<=' not supported between 'int' and 'str'"); the configs read it as YAML 1.2 does
    (tmp_path / "exp.yaml").write_text("methods: [dirichlet-l2]\noptions: {dirichlet-l2: {reg_lambda: 1e-2}}\ncv: 3\n")
    code, out, err = run(capsys, "evaluate", scores_file, "--config", tmp_path / "exp.yaml", "--bootstrap", "0", *common)
    assert code == 0 and "dirichlet-l2" in out, err
    assert json.loads((tmp_path / "o" / "report.json").read_text())["options"] == {"dirichlet-l2": {"reg_lambda": 0.01}}


def test_calibrate_names_the_config_settings_it_does_not_use(scores_file, capsys, tmp_path):
    """calibrate fits one method on all the data: a config's methods, cv, seed, bootstrap and other
    methods' options were dropped without a word (a review), where evaluate warns."""
    config = tmp_path / "c.yaml"
    config.write_text("methods: [histogram]\ncv: 3\nseed: 4\noptions:\n  histogram: {n_bins: 5}\n  affine: {bias: false}\n")
    code, _, err = run(capsys, "calibrate", scores_file, "--method", "affine", "--config", config, "--save", tmp_path / "h.pt")
    assert code == 0 and err.startswith(f"torchcal: warning: {config}: cv, methods, seed, options for histogram not used by "
                                        f"calibrate, which fits one method (--method affine) on all the data given.\n")
    config.write_text("options:\n  affine: {bias: false}\n")
    code, _, err = run(capsys, "calibrate", scores_file, "--method", "affine", "--config", config, "--save", tmp_path / "h.pt")
    assert code == 0 and "warning" not in err


def test_the_seed_reaches_the_calibrators_own_folds(scores_file, tmp_path):
    """--seed is the seed of the folds: SVS's cross-validated regularisation ignored it (its
    cv_seed stayed 0; a review), unless the config's options set cv_seed."""
    from torchcal.data import load_scores
    from torchcal.report import evaluate

    scores = load_scores(scores_file)
    fitted = {seed: evaluate(scores, ["svs"], bootstrap=0, seed=seed).calibrator for seed in (0, 7)}
    expected = {seed: torchcal.StructuredVectorScaling(cv_seed=seed).fit(scores.logits, scores.labels) for seed in (0, 7)}
    for seed in (0, 7):
        assert fitted[seed].cv_seed == seed and fitted[seed].cv_losses_ == expected[seed].cv_losses_
    assert fitted[0].cv_losses_ != fitted[7].cv_losses_
    kept = evaluate(scores, ["svs"], bootstrap=0, seed=7, method_options={"svs": {"cv_seed": 3}}).calibrator
    assert kept.cv_seed == 3
    # the seed is saved with the calibrator (the diff review: it reloaded with cv_seed=0)
    report = evaluate(scores, ["svs"], bootstrap=0, seed=7)
    report.save(tmp_path / "r", figures=False)
    assert load_calibrator(tmp_path / "r" / "calibrator.pt")[1].cv_seed == 7
    assert json.loads((tmp_path / "r" / "report.json").read_text())["options"] == {"svs": {"cv_seed": 7}}


def test_config_options_for_a_method_not_run_are_named(scores_file, capsys, tmp_path, synthetic):
    """Options of a method the config does not run warn (they were ignored silently); with --method
    choosing some of the config's methods, leaving the others' options unused is the point."""
    config = tmp_path / "c.yaml"
    config.write_text("methods: [temperature]\noptions:\n  affine:\n    bias: false\n")
    common = ["--config", config, "--bootstrap", "0", "--no-figures", "--quiet", "--out", tmp_path / "o"]
    code, _, err = run(capsys, "evaluate", scores_file, *common)
    assert code == 0 and err == (f"torchcal: warning: {config}: the options for affine are not used: not among the "
                                 f"methods run (temperature); add it to methods.\n")
    code, _, err = run(capsys, "evaluate", scores_file, *common, "--method", "temperature")
    assert code == 0 and err == ""
    # a config's cv where the calibrators are fitted on separate data (the demo's preset ran silently
    # on the example's validation split, its "3-fold cross-validation" ignored)
    config.write_text("methods: [temperature]\ncv: 3\n")
    separate = tmp_path / "cal.npz"
    logits, labels = synthetic(3, 300, seed=5)
    np.savez(separate, logits=logits.astype(np.float32), labels=labels)
    code, _, err = run(capsys, "evaluate", scores_file, *common, "--calibration", separate)
    assert code == 0 and err == (f"torchcal: warning: {config}: cv is not used: the calibrators are fitted on separate "
                                 f"calibration data ({separate}).\n")
    # the same for a file's own validation split (review finding: evaluate let the config's cv
    # override it silently, where the demo warned); --cv on the command line chooses cross-validation
    with_split = tmp_path / "split.npz"
    with np.load(scores_file) as data:
        np.savez(with_split, logits=data["logits"], labels=data["labels"], logits_val=logits.astype(np.float32), labels_val=labels)
    code, out, err = run(capsys, "evaluate", with_split, *common)
    assert code == 0 and "cross-validation" not in out and err == (
        f"torchcal: warning: {config}: cv is not used: the calibrators are fitted on separate calibration data "
        f"(the validation split of {with_split}).\n")
    code, out, err = run(capsys, "evaluate", with_split, *common, "--cv", "2")
    assert code == 0 and "2-fold stratified cross-validation" in out and err == ""


def test_priors_costs_and_inputs(tmp_path, capsys):
    rs = np.random.RandomState(0)
    llr = rs.normal(size=400) * 2
    labels = (rs.uniform(size=400) < 1 / (1 + np.exp(-llr))).astype(int)
    (tmp_path / "s.csv").write_text("llr,label\n" + "".join(f"{s},{y}\n" for s, y in zip(llr, labels)))
    np.savetxt(tmp_path / "costs.csv", [[0, 1], [5, 0]], delimiter=",")
    code, out, _ = run(capsys, "evaluate", tmp_path / "s.csv", "--input", "llr", "--config", "binary",
                       "--priors", "0.7,0.3", "--costs", tmp_path / "costs.csv", "--bootstrap", "0",
                       "--no-figures", "--quiet", "--out", tmp_path / "o")
    assert code == 0
    assert "binary log-likelihood ratios (as requested), turned into posteriors with the given priors" in out
    assert "priors: 0.7, 0.3; costs: costs.csv" in out and "platt" in out and "isotonic" in out


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--costs", "abstain:0", "--costs abstain:ALPHA needs a finite ALPHA > 0"),  # was: "use normalize=False"
        ("--costs", "abstain:inf", "--costs abstain:ALPHA needs a finite ALPHA > 0"),
        ("--costs", "zeros.csv", "--costs: decision 0 costs 0 for every class that the labels' class frequencies give weight"),
        ("--costs", "free_for_two.csv", "--costs: decision 2 costs 0 for every class that --priors give weight"),
        ("--costs", "negative.csv", "--costs negative.csv: costs must be non-negative"),
        ("--costs", "wide.csv", "--costs wide.csv: costs must have shape (K, M) = (3, M)"),
        ("--priors", "0.5,0.3,0.3", "--priors: priors must sum to one"),
    ],
)
def test_bad_costs_and_priors_are_named_by_their_option(scores_file, capsys, tmp_path, option, value, message):
    """The library's messages reached the command line as they were: "use normalize=False" (no such
    option), "costs must have shape ...", "priors must sum to one", none naming the option."""
    np.savetxt(tmp_path / "zeros.csv", np.zeros((3, 3)), delimiter=",")
    np.savetxt(tmp_path / "negative.csv", [[0, 1, 1], [1, 0, -1], [1, 1, 0]], delimiter=",")
    np.savetxt(tmp_path / "wide.csv", np.ones((2, 3)), delimiter=",")
    np.savetxt(tmp_path / "free_for_two.csv", [[0, 1, 0], [1, 0, 0], [1, 1, 1]], delimiter=",")  # with priors (.5, .5, 0)
    priors = ["--priors", "0.5,0.5,0"] if value == "free_for_two.csv" else []
    value = str(tmp_path / value) if value.endswith(".csv") else value
    code, _, err = run(capsys, "evaluate", scores_file, option, value, *priors, "--cv", "2", "--bootstrap", "0", "--no-figures",
                       "--quiet", "--out", tmp_path / "o")
    assert code == 2 and message in err, err


def test_calibrate_and_apply_say_which_priors_their_nce_is_under(scores_file, capsys, tmp_path):
    """calibrate --priors printed NCE under the fit's priors, apply on the same file under the
    labels' class frequencies, neither saying so (review finding: 1.020 -> 0.562 against 0.814 -> 0.585)."""
    head = tmp_path / "head.pt"
    code, out, _ = run(capsys, "calibrate", scores_file, "--method", "affine", "--priors", "0.5,0.3,0.2", "--save", head)
    assert code == 0 and "NCE under --priors on these same samples" in out
    code, out, _ = run(capsys, "apply", head, scores_file, "--out", tmp_path / "out.npz")
    assert code == 0 and "NCE (at these labels' class frequencies)" in out


def test_a_method_list_may_have_spaces_after_its_commas(scores_file, capsys, tmp_path):
    """``--method "temperature, affine"`` (and a config's ``methods: temperature, affine``) was refused as
    "unknown method ' affine'" (review finding)."""
    code, _, err = run(capsys, "evaluate", scores_file, "--method", "temperature, affine", "--cv", "2", "--bootstrap", "0",
                       "--no-figures", "--quiet", "--out", tmp_path / "o")
    assert code == 0, err
    assert [m["method"] for m in json.loads((tmp_path / "o" / "report.json").read_text())["methods"]] == ["temperature", "affine"]


def test_priors_on_one_class_are_refused_naming_priors(scores_file, capsys, tmp_path):
    """Priors with one positive class leave nothing to normalise by: the error names --priors
    (review finding: it said "use normalize=False", which the command line has no option for)."""
    code, _, err = run(capsys, "evaluate", scores_file, "--priors", "0,1,0", "--cv", "2", "--bootstrap", "0",
                       "--no-figures", "--quiet", "--out", tmp_path / "o")
    assert code == 2 and "--priors gives every class but class 1 prior 0" in err and "normalize=False" not in err


def test_binary_llrs_without_priors_become_posteriors_with_the_class_frequencies(tmp_path, capsys):
    """The metrics assume the labels' class frequencies when given no priors; the LLRs were turned
    into posteriors with uniform priors instead, so on an 82/18 set the raw NCE read 2.4 instead
    of 1.0, and Cllr, a property of the LLRs alone, 1.9 bits instead of 1.07. A head fitted on LLRs
    keeps the priors they were read with, and ``apply`` reads new LLRs with them."""
    rs = np.random.RandomState(1)
    labels = (rs.uniform(size=1500) < 0.18).astype(int)
    llr = np.where(labels == 1, 1.0, -1.0) + 1.5 * rs.normal(size=1500)  # too sharp and shifted: miscalibrated
    np.savez(tmp_path / "llr.npz", llr=llr, labels=labels)
    frequencies = np.bincount(labels) / labels.size
    cllr = 0.5 * (np.logaddexp(0, -llr[labels == 1]).mean() + np.logaddexp(0, llr[labels == 0]).mean()) / np.log(2)
    raw = []
    for priors in ([], ["--priors", "data"], ["--priors", ",".join(repr(float(p)) for p in frequencies)]):
        code, _, err = run(capsys, "evaluate", tmp_path / "llr.npz", *priors, "--method", "platt", "--bootstrap", "0",
                           "--no-figures", "--quiet", "--out", tmp_path / "o")
        assert code == 0, err
        raw.append(json.loads((tmp_path / "o" / "report.json").read_text())["raw"])
    for report in raw:
        assert report["cllr"] == pytest.approx(cllr, rel=1e-9)
        assert report["nce"]["value"] == pytest.approx(raw[-1]["nce"]["value"], rel=1e-9)
    head = tmp_path / "head.pt"
    assert run(capsys, "calibrate", tmp_path / "llr.npz", "--method", "platt", "--priors", "0.7,0.3", "--save", head, "--quiet")[0] == 0
    np.save(tmp_path / "new_llr.npy", llr[:50])  # new LLRs, no labels
    assert run(capsys, "apply", head, tmp_path / "new_llr.npy", "--input", "llr", "--out", tmp_path / "a.npz", "--quiet")[0] == 0
    _, calibrator = load_calibrator(head)
    read_as_at_the_fit = torchcal.data.binary_scores_to_logits(torch.from_numpy(llr[:50]), "llr", priors=[0.7, 0.3])
    np.testing.assert_allclose(np.load(tmp_path / "a.npz")["logits"], calibrator(read_as_at_the_fit).numpy(), rtol=1e-6)


def test_the_calibrator_evaluate_fits_on_llrs_keeps_their_priors_for_apply(tmp_path, capsys):
    """evaluate's calibrator.pt is the head `calibrate --save` writes: fitted on LLRs read with the
    labels' class frequencies, it saves them, and `apply` reads new LLRs with them (it saved none,
    and apply read them with uniform priors: posteriors off by the log prior odds, log(0.2 / 0.8))."""
    rs = np.random.RandomState(2)
    labels = (rs.uniform(size=1000) < 0.2).astype(int)
    llr = np.where(labels == 1, 1.5, -1.5) + rs.normal(size=1000)
    np.savez(tmp_path / "llr.npz", llr=llr, labels=labels)
    np.save(tmp_path / "new.npy", rs.normal(size=50) * 2)  # new LLRs, no labels
    fit = ["--method", "platt", "--quiet"]
    assert run(capsys, "evaluate", tmp_path / "llr.npz", *fit, "--bootstrap", "0", "--no-figures", "--out", tmp_path / "rep")[0] == 0
    assert run(capsys, "calibrate", tmp_path / "llr.npz", *fit, "--save", tmp_path / "head.pt")[0] == 0
    for head, out in [(tmp_path / "rep" / "calibrator.pt", "a.npz"), (tmp_path / "head.pt", "b.npz")]:
        assert run(capsys, "apply", head, tmp_path / "new.npy", "--input", "llr", "--out", tmp_path / out, "--quiet")[0] == 0
    np.testing.assert_allclose(np.load(tmp_path / "a.npz")["logits"], np.load(tmp_path / "b.npz")["logits"], rtol=1e-5)
    np.testing.assert_allclose(torch.load(tmp_path / "rep" / "calibrator.pt")["llr_priors"].numpy(),
                               np.bincount(labels) / labels.size)


def test_calibrate_then_apply(scores_file, capsys, tmp_path):
    head = tmp_path / "head.pt"
    code, out, _ = run(capsys, "calibrate", scores_file, "--method", "affine", "--save", head)
    assert code == 0 and "fitted affine on 600 samples" in out
    new = tmp_path / "new_logits.npy"  # production data: scores without labels
    logits = np.random.RandomState(5).normal(size=(40, 3)).astype(np.float32) * 3
    np.save(new, logits)
    code, out, _ = run(capsys, "apply", head, new, "--out", tmp_path / "calibrated.npz")
    assert code == 0 and "applied affine to 40 samples" in out
    result = np.load(tmp_path / "calibrated.npz")
    _, calibrator = load_calibrator(head)
    np.testing.assert_allclose(result["logits"], calibrator(torch.from_numpy(logits)).numpy(), rtol=1e-6)
    np.testing.assert_allclose(result["probs"].sum(1), 1, rtol=1e-6)
    assert "labels" not in result.files
    code, _, err = run(capsys, "apply", head, tmp_path / "calibrated.npz", "--out", tmp_path / "x.npz")
    assert code == 0  # calibrated output holds logits + probs + no labels: readable again


def test_apply_to_labels_of_one_class_writes_and_reports_the_cross_entropy(scores_file, capsys, tmp_path):
    """Labels are optional for apply: a batch of one class is written, with the plain cross-entropy
    instead of the NCE, whose naive system scores 0 there."""
    head = tmp_path / "head.pt"
    assert run(capsys, "calibrate", scores_file, "--method", "temperature", "--save", head, "--quiet")[0] == 0
    logits = np.random.RandomState(3).normal(size=(50, 3)).astype(np.float32)
    np.savez(tmp_path / "batch.npz", logits=logits, labels=np.full(50, 1))
    code, out, err = run(capsys, "apply", head, tmp_path / "batch.npz", "--out", tmp_path / "cal.npz")
    assert code == 0 and err == "" and (tmp_path / "cal.npz").is_file()
    assert "every label is class 1: no NCE, which needs two classes" in out and "; cross-entropy " in out


def test_apply_reads_new_scores_as_the_fit_declared_them(capsys, tmp_path, synthetic):
    """Rounded probabilities, declared at the fit with --input probs: apply read new ones of the
    same kind as logits (NCE 0.663 -> 0.948 in the review's CIFAR-10 case) and said nothing. The
    head remembers the declaration, and apply says how it read the scores."""
    logits, labels = synthetic(3, 1200, seed=0)
    probs = np.round(torch.softmax(torch.from_numpy(logits).double(), 1).numpy(), 3)
    for name, rows in (("val", slice(0, 600)), ("test", slice(600, None))):
        np.savetxt(tmp_path / f"{name}.csv", np.column_stack([probs[rows], labels[rows]]), delimiter=",",
                   header="p0,p1,p2,label", comments="", fmt=["%.3f"] * 3 + ["%d"])
    head = tmp_path / "head.pt"
    assert run(capsys, "calibrate", tmp_path / "val.csv", "--input", "probs", "--method", "temperature", "--save", head, "--quiet")[0] == 0
    code, out, _ = run(capsys, "apply", head, tmp_path / "test.csv", "--out", tmp_path / "declared.npz")
    assert code == 0 and "(scores read as probabilities (as the calibrator's were: --input probs, saved with it)" in out
    code, out, _ = run(capsys, "apply", head, tmp_path / "test.csv", "--input", "probs", "--out", tmp_path / "explicit.npz")
    assert code == 0
    declared, explicit = (np.load(tmp_path / f"{name}.npz")["logits"] for name in ("declared", "explicit"))
    np.testing.assert_array_equal(declared, explicit)
    before, after = (float(x) for x in re.search(r"NCE \(at these labels. class frequencies\) (\d\.\d+) -> (\d\.\d+)", out).groups())
    assert after < before
    # evaluate's calibrator.pt remembers the declaration too (it had not: apply read logits, NCE 0.858 -> 0.905)
    assert run(capsys, "evaluate", tmp_path / "val.csv", "--input", "probs", "--method", "temperature", "--bootstrap", "0",
               "--no-figures", "--quiet", "--out", tmp_path / "rep")[0] == 0
    code, out, _ = run(capsys, "apply", tmp_path / "rep" / "calibrator.pt", tmp_path / "test.csv", "--out", tmp_path / "from_report.npz")
    assert code == 0 and "(scores read as probabilities (as the calibrator's were: --input probs, saved with it)" in out


def test_apply_reads_a_file_that_says_what_its_scores_are_as_it_says(capsys, tmp_path, synthetic):
    """The saved reading is for files that do not say: a head calibrated with --input logits read
    a file keyed 'probs' as logits (NCE 0.663 -> 0.853 on CIFAR-10 ResNet-110, exit 0), and one
    fitted on a 'probs' file refused the same model's logits file ("must lie in [0, 1]")."""
    logits, labels = synthetic(3, 1200, seed=2)
    probs = torch.softmax(torch.from_numpy(logits).double(), 1).numpy()
    np.savez(tmp_path / "val_logits.npz", logits=logits[:600], labels=labels[:600])
    np.savez(tmp_path / "val_probs.npz", probs=probs[:600], labels=labels[:600])
    np.savez(tmp_path / "test_logits.npz", logits=logits[600:], labels=labels[600:])
    np.savez(tmp_path / "test_probs.npz", probs=probs[600:], labels=labels[600:])
    for fitted_on, declared in (("val_logits", ["--input", "logits"]), ("val_probs", [])):
        head = tmp_path / f"{fitted_on}.pt"
        assert run(capsys, "calibrate", tmp_path / f"{fitted_on}.npz", *declared, "--method", "affine", "--save", head,
                   "--quiet")[0] == 0
        outputs = {}
        for test in ("test_logits", "test_probs"):
            code, out, err = run(capsys, "apply", head, tmp_path / f"{test}.npz", "--out", tmp_path / f"{test}_out.npz")
            assert code == 0, err
            if test == "test_probs":
                assert "(scores read as probabilities (as the file's key says)" in out
            outputs[test] = np.load(tmp_path / f"{test}_out.npz")["logits"]
        # affine calibration is invariant to per-row shifts: logits and log-probabilities agree
        np.testing.assert_allclose(outputs["test_logits"], outputs["test_probs"], rtol=0, atol=1e-5)


def test_files_read_as_different_kinds_are_refused(capsys, tmp_path, synthetic):
    """Exact probabilities to evaluate and rounded ones to calibrate on (or as --target): detection
    read the rounded ones as logits, fitted the calibrators on p and applied them to log p (on a
    LeNet-5's CIFAR-10 posteriors: RCL -172 %, "calibration would not help"; target priors of 0 and
    1). Refused, naming --input; with it, the evaluation says how the calibration file was read."""
    logits, labels = synthetic(3, 1200, seed=1)
    probs = torch.softmax(torch.from_numpy(logits).double(), 1).numpy()
    np.savez(tmp_path / "exact.npz", probs=probs[:600], labels=labels[:600])
    np.savetxt(tmp_path / "rounded.csv", np.column_stack([probs[600:], labels[600:]]), delimiter=",",
               header="p0,p1,p2,label", comments="", fmt=["%.3f"] * 3 + ["%d"])
    np.savetxt(tmp_path / "target.csv", probs[600:], delimiter=",", header="p0,p1,p2", comments="", fmt="%.3f")
    code, _, err = run(capsys, "evaluate", tmp_path / "exact.npz", "--calibration", tmp_path / "rounded.csv", "--method",
                       "temperature", "--bootstrap", "0", "--no-figures", "--quiet", "--out", tmp_path / "rep")
    assert code == 2 and "the calibration scores" in err and "as logits, although" in err and "--input" in err
    code, _, err = run(capsys, "calibrate", tmp_path / "exact.npz", "--method", "affine", "--target", tmp_path / "target.csv", "--quiet")
    assert code == 2 and "the --target scores" in err and "as logits, although" in err
    code, out, _ = run(capsys, "evaluate", tmp_path / "exact.npz", "--calibration", tmp_path / "rounded.csv", "--input", "probs",
                       "--method", "temperature", "--bootstrap", "0", "--no-figures", "--quiet", "--out", tmp_path / "rep")
    assert code == 0 and f"({tmp_path / 'rounded.csv'}, N = 600, read as probabilities (as requested); rows renormalised" in out
    # files whose keys say how to read them are read so, whatever the other file: log-probabilities
    # beside probabilities, two columns of binary probabilities beside one (both declared)
    np.savez(tmp_path / "log_probs.npz", log_probs=np.log(probs[600:]), labels=labels[600:])
    code, _, err = run(capsys, "evaluate", tmp_path / "log_probs.npz", "--calibration", tmp_path / "exact.npz", "--method",
                       "temperature", "--bootstrap", "0", "--no-figures", "--quiet", "--out", tmp_path / "rep")
    assert code == 0, err
    binary = probs[:, :2] / probs[:, :2].sum(1, keepdims=True)
    np.savez(tmp_path / "one.npz", probs=binary[:600, 1], labels=labels[:600] % 2)
    np.savez(tmp_path / "two.npz", probs=binary[600:], labels=labels[600:] % 2)
    code, _, err = run(capsys, "evaluate", tmp_path / "one.npz", "--calibration", tmp_path / "two.npz", "--input", "probs",
                       "--method", "temperature", "--bootstrap", "0", "--no-figures", "--quiet", "--out", tmp_path / "rep")
    assert code == 0, err
    # a calibrator fitted on scores detected as probabilities reads new ones as probabilities too (apply
    # read rounded ones as logits, NCE 0.671 -> 0.829)
    assert run(capsys, "evaluate", tmp_path / "exact.npz", "--method", "temperature", "--bootstrap", "0", "--no-figures",
               "--quiet", "--out", tmp_path / "rep")[0] == 0
    code, out, _ = run(capsys, "apply", tmp_path / "rep" / "calibrator.pt", tmp_path / "rounded.csv", "--out", tmp_path / "a.npz")
    assert code == 0 and "(scores read as probabilities (as the calibrator's were: --input probs, saved with it)" in out


def test_an_upper_case_npz_keeps_its_validation_split(capsys, tmp_path, synthetic):
    logits, labels = synthetic(3, 400, seed=0)
    with open(tmp_path / "RES.NPZ", "wb") as f:  # (np.savez appends ".npz" to a path of another case)
        np.savez(f, logits_val=logits[:150], labels_val=labels[:150], logits_test=logits[150:], labels_test=labels[150:])
    code, _, err = run(capsys, "calibrate", tmp_path / "RES.NPZ", "--method", "temperature", "--save", tmp_path / "h.pt")
    assert code == 0 and "on 150 samples" in err, err


def test_apply_reads_the_saved_head_once(scores_file, capsys, tmp_path, monkeypatch):
    """The calibrator, its LLR priors and its label shift come from one read of the head file."""
    head = tmp_path / "head.pt"
    assert run(capsys, "calibrate", scores_file, "--method", "temperature", "--save", head, "--quiet")[0] == 0
    reads = []
    real_load = torch.load

    def counted_load(f, *args, **kwargs):
        reads.append(f)
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counted_load)
    assert run(capsys, "apply", head, scores_file, "--out", tmp_path / "cal.npz", "--quiet")[0] == 0
    assert [f for f in reads if str(f) == str(head)] == [head]


def test_demo_on_the_bundled_example(capsys, tmp_path):
    code, out, _ = run(capsys, "demo", "--method", "temperature", "--bootstrap", "0", "--no-figures",
                       "--out", tmp_path / "demo")
    assert code == 0 and "ResNet-110 CIFAR-10 logits (Kängsepp, MIT)" in out
    assert "NCE 0.156 -> 0.091" in out and (tmp_path / "demo" / "calibrator.pt").is_file()


@pytest.mark.parametrize(
    "make, argv, message",
    [
        (None, ["evaluate", "{tmp}/missing.npz"], "no such file: {tmp}/missing.npz"),
        ({"x": np.zeros((4, 2)), "labels": [0, 1, 0, 1]}, ["evaluate", "{file}"], "no scores found: expected a key 'logits'"),
        ({"logits": np.zeros((4, 2))}, ["evaluate", "{file}"], "no labels found"),
        ({"logits": [[0, np.nan], [1, 2], [0, 0], [1, 1]], "labels": [0, 1, 0, 1]}, ["evaluate", "{file}"], "NaN"),
        ({"logits": np.zeros((4, 2)), "labels": [0, 1, 7, 1]}, ["evaluate", "{file}"], r"labels must lie in [0, 2)"),
        ({"logits": np.zeros((4, 2)), "labels": [0, 1, 1]}, ["evaluate", "{file}"], "labels has 3 entries but the scores have N = 4"),
        ("ok", ["evaluate", "{file}", "--method", "magic"], "unknown method 'magic'"),
        ("ok", ["evaluate", "{file}", "--method", "beta"], "method 'beta' is for K = 2 classes"),
        ("ok", ["evaluate", "{file}", "--priors", "0.5,0.5"], "--priors needs 3 numbers"),
        ("ok", ["evaluate", "{file}", "--costs", "abstain:x"], "abstain:ALPHA needs a number"),
        ("ok", ["evaluate", "{file}", "--cv", "1"], "--cv must be an integer >= 2 (the number of folds), got 1"),
        ("ok", ["evaluate", "{file}", "--config", "no-such-config"], "no config 'no-such-config'"),
        ("ok", ["evaluate", "{file}", "--cv", "3", "--calibration", "{file}"], "not allowed with argument --cv"),
        ("ok", ["evaluate", "{file}", "--bootstrap", "many"], "invalid int value: 'many'"),
        ("ok", ["calibrate", "{file}", "--method", "magic", "--save", "{tmp}/h.pt"], "unknown method 'magic'; choose from temperature, affine"),
        ("ok", ["apply", "{file}", "{file}", "--out", "{tmp}/x.npz"], "not a readable torch file"),
        ("ok", ["evaluate"], "the following arguments are required: SCORES"),
    ],
)
def test_bad_input_exits_2_with_one_line(make, argv, message, tmp_path, capsys, synthetic):
    file = tmp_path / "scores.npz"
    if make == "ok":
        logits, labels = synthetic(3, 60, seed=0)
        np.savez(file, logits=logits, labels=labels)
    elif make is not None:
        np.savez(file, **{k: np.asarray(v) for k, v in make.items()})
    argv = [a.format(tmp=tmp_path, file=file) for a in argv] + ["--out" if argv[0] not in ("apply", "calibrate") else "--quiet"]
    argv += [str(tmp_path / "o")] if argv[-1] == "--out" else []
    code, out, err = run(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("torchcal: error: "), err
    assert message.format(tmp=tmp_path) in lines[0]
    assert "Traceback" not in err and out == ""


def test_python_dash_m_exit_code(tmp_path):
    result = subprocess.run([sys.executable, "-m", "torchcal", "evaluate", str(tmp_path / "none.npz")],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip() == f"torchcal: error: no such file: {tmp_path / 'none.npz'}"


def test_uniform_priors_with_a_rare_class_under_the_default_bootstrap(tmp_path, capsys):
    """3 of 3,000 samples in the rarest class: 5 % of plain resamples miss it, the stratified bootstrap
    that prior-weighted metrics use never does (see torchcal.functional.bootstrap)."""
    rs = np.random.RandomState(0)
    labels = rs.randint(0, 3, 3000)
    labels[rs.permutation(3000)[:3]] = 3
    logits = rs.standard_normal((3000, 4)).astype(np.float32)
    logits[np.arange(3000), labels] += 2
    np.savez(tmp_path / "rare.npz", logits=logits, labels=labels)
    code, out, err = run(capsys, "evaluate", tmp_path / "rare.npz", "--method", "temperature", "--priors", "uniform",
                         "--no-figures", "--quiet", "--out", tmp_path / "o")
    assert code == 0, err
    assert "(95 % bootstrap intervals, 1000 replicates)" in out


# --- packaged presets, output formats, a light --help ------------------------------------------------

@pytest.mark.parametrize("spec", ["quick", "configs/quick.yaml", "./configs/quick.yaml"])
def test_presets_by_name_or_repository_path_from_any_directory(spec, scores_file, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ folder here
    code, out, err = run(capsys, "evaluate", scores_file, "--config", spec, "--bootstrap", "0", "--no-figures",
                         "--quiet", "--out", tmp_path / "o")
    assert code == 0, err
    assert "3-fold stratified cross-validation" in out and "temperature" in out and "affine" in out


def test_a_config_path_that_is_no_preset_is_an_error(scores_file, capsys, tmp_path):
    for spec in ("elsewhere/quick.yaml", str(tmp_path / "configs" / "quick.yaml")):
        code, _, err = run(capsys, "evaluate", scores_file, "--config", spec, "--out", tmp_path / "o")
        assert code == 2 and f"no config '{spec}': not a file, and not one of abstain, binary" in err


def test_apply_writes_the_format_its_extension_names(scores_file, capsys, tmp_path):
    from torchcal.data import load_scores

    head = tmp_path / "head.pt"
    assert run(capsys, "calibrate", scores_file, "--method", "affine", "--save", head, "--quiet")[0] == 0
    _, calibrator = load_calibrator(head)
    scores = load_scores(scores_file)
    with torch.no_grad():
        expected = calibrator(scores.logits)
    code, out, _ = run(capsys, "apply", head, scores_file, "--out", tmp_path / "cal.csv")
    assert code == 0 and f"posteriors, one column per class (prob_0, prob_1, ...) to {tmp_path / 'cal.csv'}" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal.csv", "head.pt", "scores.npz"]
    table = np.genfromtxt(tmp_path / "cal.csv", delimiter=",", names=True)
    assert table.dtype.names == ("prob_0", "prob_1", "prob_2", "label")
    np.testing.assert_allclose(np.stack([table[f"prob_{k}"] for k in range(3)], 1), expected.exp().numpy(), rtol=1e-8)
    assert load_scores(tmp_path / "cal.csv").read_as.startswith("probabilities (every row lies in [0, 1]")
    code, _, _ = run(capsys, "apply", head, scores_file, "--out", tmp_path / "cal.pt", "--quiet")
    saved = torch.load(tmp_path / "cal.pt")
    assert code == 0 and sorted(saved) == ["labels", "logits", "probs"]
    torch.testing.assert_close(saved["logits"], expected.float())
    code, _, err = run(capsys, "apply", head, scores_file, "--out", tmp_path / "cal.parquet")
    assert code == 2 and "--out" in err and "unsupported extension '.parquet'; use .npz, .pt, .csv" in err
    assert not (tmp_path / "cal.parquet").exists() and not (tmp_path / "cal.parquet.npz").exists()


def test_calibrate_says_what_it_is_fitting(scores_file, capsys, tmp_path):
    code, out, err = run(capsys, "calibrate", scores_file, "--method", "temperature", "--save", tmp_path / "h.pt")
    assert code == 0 and err == "fitting temperature on 600 samples ...\n" and "saved to" in out


def test_calibrate_fits_on_the_validation_split_of_a_file_that_has_one(capsys, tmp_path):
    """Like `evaluate`, `calibrate` keeps a file's main split for evaluation: on the bundled
    example it fitted the 10,000 test samples, which `evaluate --calibration` then scored."""
    from torchcal.data import EXAMPLE_PATH, load_scores

    code, out, err = run(capsys, "calibrate", EXAMPLE_PATH, "--method", "temperature", "--save", tmp_path / "h.pt")
    assert code == 0 and err == "fitting temperature on 5000 samples (the file's validation split) ...\n"
    val = load_scores(EXAMPLE_PATH, split="val")
    expected = torchcal.TemperatureScaling().fit(val.logits, val.labels)
    _, head = load_calibrator(tmp_path / "h.pt")
    assert float(head.temperature) == pytest.approx(float(expected.temperature), rel=1e-9)


def test_help_imports_no_heavy_module():
    """`torchcal --help` answers without importing torch, numpy, yaml or the workflow: the package
    imports its names lazily and the command line builds no subcommand's options for --help."""
    code = ("import sys\nfrom torchcal.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'yaml', 'torchcal', 'torch', 'tqdm')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "evaluate" in result.stdout and result.stdout.strip().splitlines()[-1] == "['torchcal', 'torchcal.cli']"


def test_calibrate_estimates_the_priors_of_unlabelled_target_scores(capsys, tmp_path):
    """Label shift from the command line: calibrate on the bundled ResNet-110 validation split, with
    --target its test split resampled to shifted priors (labels dropped). The printed priors are a
    NumPy EM (Saerens et al. 2002) on the saved head's calibrated target posteriors, and recover the
    drawn class proportions within four printed standard errors; --save stores them with the head."""
    from torchcal.data import EXAMPLE_PATH

    example = np.load(EXAMPLE_PATH)
    calibration = tmp_path / "cal.npz"
    np.savez(calibration, logits=example["logits_val"], labels=example["labels_val"])
    shifted = np.array([0.3, 0.2, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05])
    rng = np.random.default_rng(0)
    counts = (shifted * 2000).astype(int)
    rows = np.concatenate([rng.choice(np.flatnonzero(example["labels"] == k), n, replace=False) for k, n in enumerate(counts)])
    target = tmp_path / "target.npy"
    rows = rows[rng.permutation(len(rows))]
    np.save(target, example["logits"][rows])  # scores only

    head = tmp_path / "head.pt"
    code, out, _ = run(capsys, "calibrate", calibration, "--method", "affine", "--target", target, "--save", head)
    assert code == 0 and "estimated from 2000 unlabelled samples" in out
    printed = np.array([[float(x) for x in re.findall(r"class \d+: ([\d.]+) \+- ([\d.]+)", line)[0]]
                        for line in out.splitlines() if line.strip().startswith("class ")])
    priors, stderr = printed.T

    _, calibrator = load_calibrator(head)
    with torch.no_grad():
        posteriors = calibrator(torch.from_numpy(np.load(target))).exp().double().numpy()
    source = np.bincount(example["labels_val"], minlength=10) / len(example["labels_val"])
    reference = source.copy()
    for _ in range(5000):  # EM: the mean of the posteriors adapted to the current priors
        adapted = posteriors * reference / source
        reference = (adapted / adapted.sum(1, keepdims=True)).mean(0)
    np.testing.assert_allclose(priors, reference, atol=6e-5)
    assert np.all(np.abs(priors - counts / counts.sum()) < 4 * stderr) and np.all(stderr > 0)
    stored = torch.load(head, weights_only=True)["label_shift"]
    # adapted to: half a target sample added to each class (no class at probability 0)
    np.testing.assert_allclose(stored["target_priors"].numpy(), (2000 * priors + 0.5) / (2000 + 0.5 * 10), atol=6e-5)
    np.testing.assert_allclose(stored["source_priors"].numpy(), source)

    # `apply` adapts the head's posteriors to the saved target priors (Bayes' rule), which lowers
    # the log-loss under the shift; --no-label-shift gives the head's own posteriors
    code, out, _ = run(capsys, "apply", head, target, "--out", tmp_path / "adapted.npz")
    assert code == 0 and "adapted to the target priors" in out
    code, out, _ = run(capsys, "apply", head, target, "--out", tmp_path / "plain.npz", "--no-label-shift")
    assert code == 0 and "adapted" not in out
    adapted, plain = (np.load(tmp_path / f"{name}.npz")["logits"].astype(np.float64) for name in ("adapted", "plain"))
    np.testing.assert_allclose(np.exp(plain), posteriors, atol=2e-6)
    expected = posteriors * stored["target_priors"].numpy() / source
    np.testing.assert_allclose(np.exp(adapted), expected / expected.sum(1, keepdims=True), atol=2e-6)
    labels = example["labels"][rows]
    nll_adapted, nll_plain = (-x[np.arange(len(rows)), labels].mean() for x in (adapted, plain))
    assert nll_adapted < nll_plain - 0.01

    code, _, err = run(capsys, "calibrate", calibration, "--method", "affine")
    assert code == 2 and "--save PATH, --target" in err


def test_target_refuses_zero_source_priors_before_the_fit_and_names_them(scores_file, capsys, tmp_path):
    """--target re-weights by target / source priors: a zero from --priors, or a class the
    calibration data lack, is refused before anything is fitted, naming where it came from."""
    target = tmp_path / "target.npy"
    np.save(target, np.load(scores_file)["logits"][:100])
    code, _, err = run(capsys, "calibrate", scores_file, "--method", "affine", "--target", target, "--priors", "0.5,0.5,0")
    assert code == 2 and "--priors gives class 2 prior 0" in err and "fitting" not in err
    two_classes = tmp_path / "two.npz"
    with np.load(scores_file) as data:
        np.savez(two_classes, logits=data["logits"], labels=data["labels"] % 2)
    code, _, err = run(capsys, "calibrate", two_classes, "--method", "affine", "--target", target)
    assert code == 2 and f"{two_classes} has no sample of class 2" in err and "fitting" not in err


def test_target_names_where_the_source_priors_come_from(scores_file, capsys, tmp_path):
    """The printed source prior of each class is --priors where given (review finding: labelled
    "calibration data" while it printed the --priors value), else the class frequency."""
    target = tmp_path / "target.npy"
    np.save(target, np.load(scores_file)["logits"][:100])
    code, out, _ = run(capsys, "calibrate", scores_file, "--method", "affine", "--target", target, "--priors", "0.5,0.3,0.2")
    assert code == 0 and "(--priors: 0.3000)" in out and "calibration data" not in out
    frequencies = np.bincount(np.load(scores_file)["labels"], minlength=3) / len(np.load(scores_file)["labels"])
    code, out, _ = run(capsys, "calibrate", scores_file, "--method", "affine", "--target", target)
    assert code == 0 and f"(calibration data: {frequencies[1]:.4f})" in out
    # priors from a config: named by it (they were labelled "calibration data", the NCE "under --priors")
    config = tmp_path / "priors.yaml"
    config.write_text("priors: [0.5, 0.3, 0.2]\n")
    code, out, _ = run(capsys, "calibrate", scores_file, "--method", "affine", "--target", target, "--config", config,
                       "--save", tmp_path / "head.pt")
    assert code == 0 and f"({config}: priors: 0.3000)" in out and f"NCE under {config}: priors on" in out
    assert "calibration data" not in out and "--priors" not in out


def test_target_refuses_priors_for_a_method_without_a_class_bias(scores_file, capsys, tmp_path):
    """Temperature scaling fitted for --priors cannot move its posteriors to them, yet --target
    re-weighted them as if it had (as the LabelShiftAdapter did)."""
    target = tmp_path / "target.npy"
    np.save(target, np.load(scores_file)["logits"][:100])
    code, _, err = run(capsys, "calibrate", scores_file, "--method", "temperature", "--target", target, "--priors", "0.5,0.3,0.2")
    assert code == 2 and "temperature has no per-class bias" in err and "fitting" not in err
    code, _, err = run(capsys, "calibrate", scores_file, "--method", "temperature", "--target", target)
    assert code == 0


def test_target_file_is_read_and_checked_before_the_fit(scores_file, capsys, tmp_path, monkeypatch):
    """A missing --target, or one of another classifier (other K), was found only after the fit."""
    monkeypatch.setattr("torchcal.report.fit_calibrator", lambda *a, **k: pytest.fail("fitted before --target was checked"))
    code, _, err = run(capsys, "calibrate", scores_file, "--method", "affine", "--target", tmp_path / "none.npy")
    assert code == 2 and err == f"torchcal: error: no such file: {tmp_path / 'none.npy'}\n"
    np.save(tmp_path / "four.npy", np.zeros((10, 4)))
    code, _, err = run(capsys, "calibrate", scores_file, "--method", "affine", "--target", tmp_path / "four.npy")
    assert code == 2 and f"--target {tmp_path / 'four.npy'}: 4 classes, but {scores_file} has 3" in err


def test_target_warns_where_the_prior_estimate_stopped_short(scores_file, capsys, tmp_path, monkeypatch):
    import torchcal.label_shift

    capped = torchcal.label_shift.estimate_priors
    monkeypatch.setattr(torchcal.label_shift, "estimate_priors", lambda *a, **k: capped(*a, **k, max_iter=3))
    target = tmp_path / "target.npy"
    np.save(target, np.load(scores_file)["logits"][:100])
    code, out, err = run(capsys, "calibrate", scores_file, "--method", "affine", "--target", target)
    assert code == 0 and "class 2:" in out
    assert "warning: --target: the prior estimate stopped at the iteration cap (max_iter=3) after 3 EM" in err
    assert "the priors printed are where it stopped" in err and err.count("warning") == 1


def test_verbose_says_what_the_fits_are_doing(capsys, tmp_path):
    """`--verbose` shows every Newton step and every regularisation strength tried on stderr;
    without it, none of that."""
    from torchcal.data import EXAMPLE_PATH

    example = np.load(EXAMPLE_PATH)
    calibration = tmp_path / "cal.npz"
    np.savez(calibration, logits=example["logits_val"], labels=example["labels_val"])
    logger = logging.getLogger("torchcal")
    try:
        code, _, err = run(capsys, "calibrate", calibration, "--method", "dirichlet-odir", "--save", tmp_path / "h.pt", "--verbose")
    finally:  # the CLI configured the package's logger for the rest of the process
        logger.handlers.clear()
        logger.setLevel(logging.NOTSET)
    assert code == 0
    assert re.search(r"torchcal: Newton-CG \(5000 x 10, K = 10\) step 1 on float(32|64) passes: loss", err)
    assert re.search(r"torchcal: regularisation path: DirichletCalibration lambda = 1000, mu = 1000, out-of-fold loss 0\.\d+", err)
    code, _, err = run(capsys, "calibrate", calibration, "--method", "dirichlet-odir", "--save", tmp_path / "h.pt")
    assert code == 0 and "Newton-CG" not in err and "regularisation path" not in err


@pytest.mark.parametrize("method, steps", [
    ("temperature", [r"temperature Newton \(5000 x 10\) iteration 1: 1/T = 1, log-loss 0\.\d+, derivative"]),
    ("affine", [r"temperature Newton \(5000 x 10\) iteration 1:", r"Newton \(11 parameters\) step 1: loss 0\.\d+, max gradient"]),
    ("vector", [r"Newton \(20 parameters\) step 1: loss 0\.\d+, max gradient .*, step length 1, 2 evaluations"]),
])
def test_verbose_shows_the_newton_steps_of_the_one_parameter_and_linear_fits(method, steps, capsys, tmp_path):
    """--verbose logged nothing for temperature, affine and vector scaling: their solvers did not log."""
    from torchcal.data import EXAMPLE_PATH

    logger = logging.getLogger("torchcal")
    try:
        code, _, err = run(capsys, "calibrate", EXAMPLE_PATH, "--method", method, "--save", tmp_path / "h.pt", "--verbose", "--quiet")
    finally:  # the CLI configured the package's logger for the rest of the process
        logger.handlers.clear()
        logger.setLevel(logging.NOTSET)
    assert code == 0
    for step in steps:
        assert re.search(f"^torchcal: {step}", err, re.MULTILINE), err


def test_all_methods_are_those_for_the_number_of_classes():
    from torchcal.cli import _methods
    from torchcal.report import METHODS

    binary_only = {"platt", "beta", "quadratic"}
    assert _methods("all", 4) == [m for m in METHODS if m not in binary_only]
    assert _methods("all", 2) == list(METHODS)


def test_large_scores_make_evaluate_keep_freed_memory(scores_file, capsys, tmp_path, monkeypatch):
    """Above _LARGE_SCORES entries evaluate asks glibc (mallopt) to keep freed blocks: its
    temporaries were faulted in afresh each time (41 of 123 CPU s at 50,000 x 1,000). Before the
    figures it gives them back and returns to glibc's defaults (the figures in the kept heap took
    --method temperature at 50,000 x 1,000 from 2.8 to 7.9 GB). Small inputs leave the allocator
    alone; without glibc nothing happens."""
    import ctypes

    import torchcal.cli as cli

    calls = []

    class FakeLibc:
        def mallopt(self, option, value):
            calls.append((option, value))
            return 1

        def malloc_trim(self, pad):
            calls.append(("trim", pad))
            return 1

    monkeypatch.setattr(ctypes, "CDLL", lambda name: FakeLibc())
    common = ("--method", "temperature", "--cv", "2", "--bootstrap", "0", "--no-figures", "--quiet", "--out", tmp_path / "r")
    assert run(capsys, "evaluate", scores_file, *common)[0] == 0
    assert calls == []  # 600 x 3
    monkeypatch.setattr(cli, "_LARGE_SCORES", 1800)
    assert run(capsys, "evaluate", scores_file, *common)[0] == 0
    assert calls == [(-4, 0), (-1, 2**31 - 1), (-4, 65536), (-1, 128 * 1024), ("trim", 0)]  # M_MMAP_MAX, M_TRIM_THRESHOLD
    monkeypatch.setattr(ctypes, "CDLL", lambda name: (_ for _ in ()).throw(OSError(name)))
    assert run(capsys, "evaluate", scores_file, *common)[0] == 0


def test_apply_reads_a_log_odds_column_as_the_fit_read_it_in_any_file(real, capsys, tmp_path):
    """A head fitted on one column under the key 'logits' (a sigmoid head's log-odds) applied to the
    same numbers in an .npy read them as LLRs shifted by the new labels' prior log-odds: FVCAUS
    calibrated NCE 0.167 against 0.0075. The log-odds are saved as LLRs under uniform priors."""
    data = real("fvcaus_xvector-plda_ferrer")
    two = data["logits"].astype(np.float64)
    z, y = two[:, 1] - two[:, 0], data["labels"]
    np.savez(tmp_path / "fit.npz", logits=z[:40000], labels=y[:40000])
    np.savez(tmp_path / "new.npz", logits=z[40000:], labels=y[40000:])
    np.save(tmp_path / "new_logits.npy", z[40000:])
    np.save(tmp_path / "new_labels.npy", y[40000:])
    head = tmp_path / "head.pt"
    assert run(capsys, "calibrate", tmp_path / "fit.npz", "--method", "platt", "--save", head, "--quiet")[0] == 0
    outputs = []
    for name in ("new.npz", "new_logits.npy"):
        out = tmp_path / f"{name}.out.npz"
        assert run(capsys, "apply", head, tmp_path / name, "--out", out, "--quiet")[0] == 0
        outputs.append(np.load(out)["probs"])
    np.testing.assert_allclose(outputs[1], outputs[0], rtol=0, atol=1e-12)


def test_evaluate_refuses_calibration_data_of_one_class(capsys, tmp_path, synthetic):
    """calibrate refused labels of one class; evaluate fitted degenerate calibrators on such
    --calibration data (temperature: uniform posteriors; affine: NCE 11.2) and concluded that
    calibration would not help. Both the --calibration file and a file's validation split."""
    logits, labels = synthetic(3, 600, seed=4)
    np.savez(tmp_path / "scores.npz", logits=logits[:300], labels=labels[:300])
    np.savez(tmp_path / "one.npz", logits=logits[300:][labels[300:] == 0], labels=labels[300:][labels[300:] == 0])
    np.savez(tmp_path / "split.npz", logits=logits[:300], labels=labels[:300], logits_val=logits[300:][labels[300:] == 0],
             labels_val=labels[300:][labels[300:] == 0])
    options = ["--method", "temperature", "--bootstrap", "0", "--no-figures", "--quiet", "--out", tmp_path / "rep"]
    code, _, err = run(capsys, "evaluate", tmp_path / "scores.npz", "--calibration", tmp_path / "one.npz", *options)
    assert code == 2 and f"{tmp_path / 'one.npz'}: every label is class 0" in err
    code, _, err = run(capsys, "evaluate", tmp_path / "split.npz", *options)
    assert code == 2 and "(validation split): every label is class 0" in err
    assert not (tmp_path / "rep" / "calibrator.pt").exists()
