"""torchcal.data: file loaders, the bundled example, and the Ferrer & Ramos synthetic generator."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from torchcal.data import (
    EXAMPLE_PATH,
    binary_scores_to_logits,
    class_priors,
    ferrer_systems,
    gaussian_task,
    has_split,
    load_scores,
    mismatched_priors,
)


def _nll(logits, labels) -> float:
    """Mean cross-entropy in nats, computed in NumPy (independent of torchcal.functional)."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(1, keepdims=True))
    return float(-log_p[np.arange(len(labels)), np.asarray(labels)].mean())


@pytest.fixture
def small():
    rs = np.random.RandomState(0)
    return rs.normal(size=(50, 3)).astype(np.float32), rs.randint(0, 3, size=50)


# --- the bundled example ------------------------------------------------------------------------

def test_bundled_example_matches_the_published_numbers():
    test = load_scores(EXAMPLE_PATH)
    val = load_scores(EXAMPLE_PATH, split="val")
    assert (test.num_samples, test.num_classes, val.num_samples) == (10000, 10, 5000)
    assert test.read_as == "logits"
    # Kull et al. 2019 / Kängsepp: test error 6.44 %, log-loss 0.3583; validation NLL 0.3002 (SOURCES.md)
    assert float((test.logits.argmax(1) != test.labels).double().mean()) == pytest.approx(0.0644, abs=5e-5)
    assert _nll(test.logits, test.labels) == pytest.approx(0.3583, abs=5e-5)
    assert _nll(val.logits, val.labels) == pytest.approx(0.3002, abs=5e-5)
    assert has_split(EXAMPLE_PATH)
    licence = EXAMPLE_PATH.with_name("LICENSE-markus93-NN_calibration.MIT.txt").read_text()
    assert "Copyright (c) 2018 Markus" in licence


def test_a_torch_dict_with_the_npz_keys_keeps_its_validation_split(tmp_path, capsys):
    """A ``.pt`` dict with ``logits_val`` / ``labels_val`` was read without its split: the command
    line fitted a head on the test rows, where the same arrays in an ``.npz`` use the split
    (review finding)."""
    with np.load(EXAMPLE_PATH) as f:
        arrays = {k: torch.from_numpy(f[k]) for k in ("logits", "labels", "logits_val", "labels_val")}
    torch.save(arrays, tmp_path / "split.pt")
    torch.save((arrays["logits"], arrays["labels"]), tmp_path / "pair.pt")
    assert has_split(tmp_path / "split.pt") and not has_split(tmp_path / "pair.pt")
    val, test = load_scores(tmp_path / "split.pt", split="val"), load_scores(tmp_path / "split.pt")
    assert torch.equal(val.logits, arrays["logits_val"].float()) and torch.equal(val.labels, arrays["labels_val"].long())
    assert test.num_samples == 10000
    with pytest.raises(ValueError, match=r"a 'val' split is stored in a dict \(keys 'logits_val', 'labels_val'\); the file holds a tuple"):
        load_scores(tmp_path / "pair.pt", split="val")
    from torchcal.cli import main

    assert main(["calibrate", str(tmp_path / "split.pt"), "--method", "temperature", "--save", str(tmp_path / "head.pt")]) == 0
    assert "fitted temperature on 5000 samples (the file's validation split)" in capsys.readouterr().out


def test_half_a_validation_split_is_refused_naming_the_missing_key(small, tmp_path):
    logits, labels = small
    np.savez(tmp_path / "scores.npz", logits=logits, labels=labels, logits_val=logits)
    with pytest.raises(ValueError, match=r"scores.npz: has 'logits_val' but no 'labels_val' or 'targets_val'"):
        has_split(tmp_path / "scores.npz")
    np.savez(tmp_path / "labels.npz", logits=logits, labels=labels, targets_val=labels)
    with pytest.raises(ValueError, match=r"labels.npz: has 'targets_val' but no 'logits_val' or 'log_probs_val'"):
        has_split(tmp_path / "labels.npz")
    np.savez(tmp_path / "both.npz", logits=logits, labels=labels, probs_val=np.full((50, 3), 1 / 3), targets_val=labels)
    assert has_split(tmp_path / "both.npz") and load_scores(tmp_path / "both.npz", split="val").num_samples == 50


def test_bundled_example_is_the_shared_file(real):
    shared = real("cifar10_resnet110_kangsepp", bundled=False)
    with np.load(EXAMPLE_PATH) as bundled:
        for key in ("logits", "labels", "logits_val", "labels_val"):
            np.testing.assert_array_equal(bundled[key], shared[key])


# --- formats ------------------------------------------------------------------------------------

def test_probabilities_are_detected_only_when_provable(real, tmp_path):
    data = real("cifar10_lenet5_netcal")  # the origin stored probabilities; SOURCES.md: NLL 1.3699
    np.savez(tmp_path / "p.npz", logits=data["probs"], labels=data["labels"])
    scores = load_scores(tmp_path / "p.npz")
    assert scores.read_as.startswith("probabilities (every row lies in [0, 1] and sums to 1")
    assert _nll(scores.logits, scores.labels) == pytest.approx(1.3699, abs=5e-5)
    # the user overrides detection; softmax(p) is a different (and worse) posterior
    forced = load_scores(tmp_path / "p.npz", input="logits")
    assert forced.read_as == "logits (as requested)"
    torch.testing.assert_close(forced.logits, torch.from_numpy(data["probs"]))


def test_probs_key_says_probabilities(tmp_path):
    probs = np.array([[0.8, 0.2], [0.0, 1.0], [0.6, 0.4], [1 - 1e-25, 1e-25]])
    np.savez(tmp_path / "p.npz", probs=probs, labels=[0, 1, 1, 0])
    scores = load_scores(tmp_path / "p.npz")
    # (every probability the floor moves is counted, not only the zeros)
    assert "as the file's key says" in scores.read_as and "2 probabilities below 1e-20 (1 of them 0) floored at it" in scores.read_as
    np.testing.assert_allclose(scores.logits.softmax(1).numpy(), probs, atol=1e-15)


def test_rows_that_do_not_sum_to_one_stay_logits(tmp_path):
    """... and the note says that they lie in [0, 1] (review finding: probabilities rounded too far
    to detect were read as logits with no note)."""
    np.savez(tmp_path / "s.npz", logits=np.array([[0.2, 0.3], [0.5, 0.1]]), labels=[0, 1])
    read_as = load_scores(tmp_path / "s.npz").read_as
    assert read_as.startswith("logits, although every row lies in [0, 1] and sums to 1 within 0.5 (row 0)")
    assert read_as.endswith("Too far from 1 for rounded probabilities: input='probs' refuses them too")
    np.savez(tmp_path / "t.npz", logits=np.array([[0.2, 1.3], [0.5, 0.1]]), labels=[0, 1])
    assert load_scores(tmp_path / "t.npz").read_as == "logits"


def test_npy_pairs_found_by_name_or_given(tmp_path, small):
    logits, labels = small
    np.save(tmp_path / "run1_logits.npy", logits)
    np.save(tmp_path / "run1_labels.npy", labels.astype(np.uint8))
    scores = load_scores(tmp_path / "run1_logits.npy")
    torch.testing.assert_close(scores.logits, torch.from_numpy(logits))
    assert scores.labels.dtype == torch.int64 and scores.labels.tolist() == labels.tolist()
    # Ferrer's layout: scores.npy + targets.npy, labels as (N, 1)
    folder = tmp_path / "ferrer"
    folder.mkdir()
    np.save(folder / "scores.npy", logits)
    np.save(folder / "targets.npy", labels[:, None])
    assert load_scores(folder / "scores.npy").labels.tolist() == labels.tolist()
    # both label words go with both forms: x_scores.npy + x_targets.npy as scores.npy + targets.npy
    np.save(folder / "run2_scores.npy", logits)
    np.save(folder / "run2_targets.npy", labels)
    assert load_scores(folder / "run2_scores.npy").labels.tolist() == labels.tolist()
    np.save(tmp_path / "other.npy", logits)
    assert load_scores(tmp_path / "other.npy", labels_path=tmp_path / "run1_labels.npy").num_samples == 50
    # labels.npy goes with logits.npy, scores.npy or probs.npy only, not with any file of the folder
    np.save(folder / "new_samples.npy", logits)
    assert load_scores(folder / "new_samples.npy", require_labels=False).labels is None


def test_torch_files(tmp_path, small):
    logits, labels = torch.from_numpy(small[0]), torch.from_numpy(small[1])
    torch.save({"logits": logits, "labels": labels}, tmp_path / "d.pt")
    torch.save((logits, labels), tmp_path / "t.pth")
    torch.save(logits, tmp_path / "only.pt")
    torch.save(labels, tmp_path / "labels.pt")
    for scores in (load_scores(tmp_path / "d.pt"), load_scores(tmp_path / "t.pth"),
                   load_scores(tmp_path / "only.pt", labels_path=tmp_path / "labels.pt")):
        torch.testing.assert_close(scores.logits, logits)
        assert torch.equal(scores.labels, labels)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("stored", ["bfloat16", "float16", "requires_grad", "sparse", "sparse_csr"])
def test_torch_files_hold_scores_as_models_leave_them(stored, tmp_path, small):
    """LLM logits in bfloat16, a model output saved without .detach(), a sparse tensor: read as the
    float32 scores they stand for (they ended in a traceback from NumPy)."""
    logits, labels = torch.from_numpy(small[0]).float(), torch.from_numpy(small[1])
    as_stored = {
        "bfloat16": logits.bfloat16(), "float16": logits.half(), "requires_grad": logits * torch.ones(1, requires_grad=True),
        "sparse": logits.to_sparse(), "sparse_csr": logits.to_sparse_csr(),
    }[stored]
    torch.save({"logits": as_stored, "labels": labels.to_sparse() if stored == "sparse" else labels}, tmp_path / "d.pt")
    scores = load_scores(tmp_path / "d.pt")
    assert scores.logits.dtype == torch.float32 and not scores.logits.requires_grad
    torch.testing.assert_close(scores.logits, as_stored.detach().to_dense().float())
    assert torch.equal(scores.labels, labels)


@pytest.mark.parametrize("suffix", [".npz", ".pt"])
def test_a_file_with_several_score_keys_gives_the_one_input_names(suffix, tmp_path):
    """An .npz holding logits and probs was refused with input="probs": logits were always read."""
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0], [-1.0, 0.0, 3.0]], dtype=torch.float64)
    probs, labels = logits.softmax(1), torch.tensor([0, 1, 2])
    path = tmp_path / f"both{suffix}"
    if suffix == ".npz":
        np.savez(path, logits=logits.numpy(), probs=probs.numpy(), labels=labels.numpy())
    else:
        torch.save({"logits": logits, "probs": probs, "labels": labels}, path)
    as_probs = load_scores(path, input="probs")
    assert as_probs.read_as == "probabilities (as requested)"
    torch.testing.assert_close(as_probs.logits.softmax(1), probs)
    assert load_scores(path).read_as == "logits"  # without input, logits win


def test_csv_with_a_label_column(tmp_path):
    (tmp_path / "s.csv").write_text("p_cat,label,p_dog\n0.9,0,0.1\n0.25,1,0.75\n0.5,1,0.5\n")
    scores = load_scores(tmp_path / "s.csv")
    assert scores.labels.tolist() == [0, 1, 1]
    np.testing.assert_allclose(scores.logits.exp().numpy(), [[0.9, 0.1], [0.25, 0.75], [0.5, 0.5]])
    assert scores.read_as.startswith("probabilities")


def test_binary_one_column(tmp_path):
    llr = np.array([-3.0, 0.5, 2.0])
    np.save(tmp_path / "llr_scores.npy", llr)  # no key says what the column is
    np.save(tmp_path / "llr_labels.npy", [0, 1, 1])
    scores = load_scores(tmp_path / "llr_scores.npy")
    assert scores.read_as.startswith("binary log-likelihood ratios (one score column with values above 1 or of both signs")
    # without priors, the labels' class frequencies (1/3, 2/3): those the metrics assume
    # (the labels file found beside the scores is named: review finding, its errors did not say which)
    assert scores.read_as.endswith("turned into posteriors with the labels' class frequencies (0.3333, 0.6667); labels from llr_labels.npy")
    np.testing.assert_allclose(scores.logits.softmax(1)[:, 1].numpy(), 1 / (1 + 0.5 * np.exp(-llr)))
    torch.testing.assert_close(scores.llr_priors, torch.tensor([1 / 3, 2 / 3], dtype=torch.float64))
    with_priors = load_scores(tmp_path / "llr_scores.npy", priors=[0.9, 0.1])
    np.testing.assert_allclose(with_priors.logits.softmax(1)[:, 1].numpy(), 1 / (1 + 9 * np.exp(-llr)))
    np.save(tmp_path / "unlabelled.npy", llr)  # no labels to count: uniform priors
    unlabelled = load_scores(tmp_path / "unlabelled.npy", input="llr", require_labels=False)
    np.testing.assert_allclose(unlabelled.logits.softmax(1)[:, 1].numpy(), 1 / (1 + np.exp(-llr)))
    assert unlabelled.read_as.endswith("uniform priors") and unlabelled.llr_priors.tolist() == [0.5, 0.5]
    np.savez(tmp_path / "p.npz", logits=[0.1, 0.7, 0.9], labels=[0, 1, 1])
    with pytest.raises(ValueError, match=r"probabilities of class 1 \(input='probs', --input probs\) or LLRs"):
        load_scores(tmp_path / "p.npz")
    probs = load_scores(tmp_path / "p.npz", input="probs")
    np.testing.assert_allclose(probs.logits.softmax(1)[:, 1].numpy(), [0.1, 0.7, 0.9])


def test_one_column_under_logits_is_a_sigmoid_heads_log_odds(real, tmp_path):
    """A sigmoid head's one logit saved as ``logits=z`` was read as an LLR and shifted by the
    labels' prior log-odds: on the FVCAUS x-vector scores (1.7 % targets) the cross-entropy came
    out 0.0163 against 0.17108 for the same posteriors as two columns; input='logits' was refused."""
    data = real("fvcaus_xvector-plda_ferrer")
    two = data["logits"].astype(np.float64)
    z = two[:, 1] - two[:, 0]
    np.savez(tmp_path / "head.npz", logits=z, labels=data["labels"])
    expected = _nll(two, data["labels"])
    scores = load_scores(tmp_path / "head.npz")
    assert scores.read_as.startswith("binary posterior log-odds of class 1, as a sigmoid head outputs (one column under the key 'logits'")
    assert scores.llr_priors.tolist() == [0.5, 0.5]  # log-odds are LLRs under uniform priors
    assert _nll(scores.logits, scores.labels) == pytest.approx(expected, rel=1e-12)
    np.save(tmp_path / "head_scores.npy", z)
    np.save(tmp_path / "head_labels.npy", data["labels"])
    as_said = load_scores(tmp_path / "head_scores.npy", input="logits")
    assert _nll(as_said.logits, as_said.labels) == pytest.approx(expected, rel=1e-12)
    # deployment priors do not move a sigmoid head's log-odds (they would an LLR's)
    with_priors = load_scores(tmp_path / "head.npz", priors=[0.9, 0.1])
    torch.testing.assert_close(with_priors.logits, scores.logits, rtol=0, atol=0)
    # values that also read as probabilities or log-probabilities: still the caller's choice, logits offered
    np.savez(tmp_path / "unit.npz", logits=[0.1, 0.7, 0.9], labels=[0, 1, 1])
    with pytest.raises(ValueError, match=r"or a sigmoid head's log-odds \(input='logits', --input logits\)"):
        load_scores(tmp_path / "unit.npz")


def _bundled_probabilities(n=2000):
    with np.load(EXAMPLE_PATH) as f:
        z, y = f["logits"][:n].astype(np.float64), f["labels"][:n]
    p = np.exp(z - z.max(1, keepdims=True))
    return p / p.sum(1, keepdims=True), y


def _write_csv(path, probs, labels, decimals):
    header = ",".join(f"p{k}" for k in range(probs.shape[1])) + ",label\n"
    path.write_text(header + "".join(",".join(f"{v:.{decimals}f}" for v in row) + f",{y}\n" for row, y in zip(probs, labels)))


def test_probabilities_written_with_four_decimals_are_detected(tmp_path):
    """Rounded to 4 decimals, 10 columns sum to 1 within 5e-4: still provably probabilities. Their
    zeros stand for anything below 5e-5, and are floored there."""
    probs, labels = _bundled_probabilities()
    _write_csv(tmp_path / "p4.csv", probs, labels, 4)
    rounded = np.loadtxt(tmp_path / "p4.csv", delimiter=",", skiprows=1)[:, :-1]
    assert np.abs(rounded.sum(1) - 1).max() > 1e-4  # the case the old 1e-4 tolerance read as logits
    scores = load_scores(tmp_path / "p4.csv")
    assert scores.read_as.startswith("probabilities (every row lies in [0, 1]")
    floored = np.maximum(rounded, 5e-5)
    log_p = np.log(floored / floored.sum(1, keepdims=True))
    assert _nll(scores.logits, scores.labels) == pytest.approx(-log_p[np.arange(len(labels)), labels].mean(), rel=1e-12)
    assert load_scores(tmp_path / "p4.csv", input="probs").logits.equal(scores.logits)


def test_probabilities_rounded_to_six_decimals_as_pandas_writes_them_are_floored_there(tmp_path):
    """``df.round(6).to_csv()`` writes values below 1e-4 with an exponent (``1.3e-05``, ``1e-06``),
    which had marked the file as not rounded: its zeros were floored at 1e-20, 46 nats each (the
    CIFAR-100 ResNet-20 cross-entropy 1.2138 for 1.1940 from its logits, where the floor at half
    the last digit gives 1.1928: a review finding). The exponent counts in the decimals."""
    probs, labels = _bundled_probabilities()
    header = ",".join(f"p{k}" for k in range(probs.shape[1])) + ",label\n"
    text = "".join(",".join(repr(round(float(v), 6)) for v in row) + f",{y}\n" for row, y in zip(probs, labels))
    assert "e-05," in text and ",0.0," in text
    (tmp_path / "p6.csv").write_text(header + text)
    scores = load_scores(tmp_path / "p6.csv", input="probs")
    assert re.search(r"probabilities below 5e-07 \(\d+ of them 0\) floored at it$", scores.read_as)
    rounded = np.loadtxt(tmp_path / "p6.csv", delimiter=",", skiprows=1)[:, :-1]
    floored = np.maximum(rounded, 5e-7)
    log_p = np.log(floored / floored.sum(1, keepdims=True))
    assert _nll(scores.logits, scores.labels) == pytest.approx(-log_p[np.arange(len(labels)), labels].mean(), rel=1e-12)
    # R's write.csv of four decimals writes 0.0001 .. 0.0009 as 1e-04 .. 9e-04, an exponent of -4
    # (it had marked the file as not rounded: floored at 1e-20, a second diff review)
    r_style = "".join(",".join(f"{v:.0e}" if 0 < v < 1e-3 else f"{v:g}" for v in np.round(row, 4)) + f",{y}\n"
                      for row, y in zip(probs, labels))
    assert "e-04," in r_style
    (tmp_path / "r4.csv").write_text(header + r_style)
    assert re.search(r"probabilities below 5e-05 \(\d+ of them 0\) floored at it$", load_scores(tmp_path / "r4.csv", input="probs").read_as)


def test_probabilities_in_scientific_notation_are_not_taken_for_rounded_ones(tmp_path):
    """``%.2e`` writes significant digits, not decimals: 1.00e-06 must stay 1e-6, not be floored at
    5e-5 as if the file held four decimals (its first rows' 5.00e-01 .. 5.00e-02; a review finding
    against the exponent rule above). Only exponents below -4, as Python writes small numbers of a
    fixed-decimals file, count as decimals."""
    probs, labels = _bundled_probabilities(300)
    probs[200:, :] = 1e-6 / 9
    probs[np.arange(200, 300), labels[200:]] = 1 - 1e-6
    header = ",".join(f"p{k}" for k in range(10)) + ",label\n"
    text = "".join(",".join(f"{v:.2e}" for v in row) + f",{y}\n" for row, y in zip(probs, labels))
    (tmp_path / "sci.csv").write_text(header + text)
    scores = load_scores(tmp_path / "sci.csv", input="probs")
    assert "floored" not in scores.read_as
    written = np.loadtxt(tmp_path / "sci.csv", delimiter=",", skiprows=1)[:, :-1]
    log_p = np.log(written / written.sum(1, keepdims=True))
    np.testing.assert_allclose(torch.log_softmax(scores.logits.double(), 1).numpy(), log_p, rtol=1e-12, atol=1e-12)


def test_probabilities_with_round_off_below_zero_are_probabilities(tmp_path):
    """A last class computed as ``1 - sum(others)`` in float32 goes to -2.4e-7: read silently as
    logits (cross-entropy 1.53 where 0.358 is right) and refused under input="probs" (review
    finding). Round-off outside [0, 1] is clamped, in one column too."""
    probs, labels = _bundled_probabilities()
    probs = probs.astype(np.float32)
    probs[:, -1] = 1 - probs[:, :-1].sum(1)
    assert probs.min() < 0
    np.savez(tmp_path / "complete.npz", logits=probs, labels=labels)
    detected = load_scores(tmp_path / "complete.npz")
    assert detected.read_as.startswith("probabilities (every row lies in [0, 1]")
    assert load_scores(tmp_path / "complete.npz", input="probs").logits.equal(detected.logits)
    clamped = np.maximum(probs.clip(0, 1).astype(np.float64), 1e-20)
    assert _nll(detected.logits, detected.labels) == pytest.approx(-np.log(clamped[np.arange(len(labels)), labels]).mean(), rel=1e-6)
    column = np.array([0.2, -1e-9, 0.7, 1 + 1e-9])
    np.savez(tmp_path / "column.npz", probs=column, labels=np.array([0, 0, 1, 1]))
    torch.testing.assert_close(load_scores(tmp_path / "column.npz").logits.exp()[:, 1].double(),
                               torch.tensor([0.2, 0.0, 0.7, 1.0], dtype=torch.float64), rtol=0, atol=1e-12)


def test_probabilities_rounded_too_far_for_detection_are_named(tmp_path):
    """At K = 100, probabilities rounded to two decimals sum to 1 within 0.1 only: read as logits
    with no note (NCE 0.866 against 0.266), and refused under input="probs" (review finding)."""
    gen = np.random.default_rng(0)
    logits = 4 * gen.standard_normal((2000, 100))
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs = np.round(probs / probs.sum(1, keepdims=True), 2)
    labels = probs.argmax(1)
    np.savez(tmp_path / "p.npz", logits=probs, labels=labels)
    deviation = np.abs(probs.sum(1) - 1).max()
    assert deviation > 0.05
    detected = load_scores(tmp_path / "p.npz")
    assert detected.read_as.startswith(f"logits, although every row lies in [0, 1] and sums to 1 within {deviation:.2g}")
    forced = load_scores(tmp_path / "p.npz", input="probs")
    renormalised = np.maximum(probs / probs.sum(1, keepdims=True), 1e-20)
    np.testing.assert_allclose(forced.logits.numpy(), np.log(renormalised), rtol=1e-12)
    # a row that rounds to all zeros (K = 300) is refused, not renormalised by 0 (the diff review)
    zeros = np.full((3, 300), 1 / 300).round(2)
    zeros[1:] = 0
    zeros[1:, 0] = 1
    np.savez(tmp_path / "zeros.npz", probs=zeros, labels=np.array([0, 0, 0]))
    with pytest.raises(ValueError, match="rows of probabilities must sum to one; row 0 sums to 0"):
        load_scores(tmp_path / "zeros.npz")


def test_csv_layouts_of_other_tools(tmp_path):
    """Review findings: pandas' header of column numbers (a frame without names) was refused as no
    header; ';'-separated files got "line 2 has 11 cells (truncated?)"; a whitespace-only last line
    was a truncated row; an empty cell's error named no line."""
    probs, labels = _bundled_probabilities()
    logits = np.log(np.maximum(probs[:50], 1e-20))
    np.save(tmp_path / "labels.npy", labels[:50])
    header = ",".join(str(i) for i in range(10))
    rows = "\n".join(",".join(repr(float(v)) for v in row) for row in logits)
    (tmp_path / "numbered.csv").write_text(f"{header}\n{rows}\n   \n")
    read = load_scores(tmp_path / "numbered.csv", labels_path=tmp_path / "labels.npy")
    np.testing.assert_array_equal(read.logits.numpy(), logits)
    (tmp_path / "semicolon.csv").write_text(header.replace(",", ";") + "\n" + rows.replace(",", ";") + "\n")
    with pytest.raises(ValueError, match="separated by ';': torchcal reads comma-separated values"):
        load_scores(tmp_path / "semicolon.csv", labels_path=tmp_path / "labels.npy")
    (tmp_path / "empty_cell.csv").write_text(f"{header}\n{rows}\n" + ",".join(["0.1"] * 5 + [""] + ["0.1"] * 4) + "\n")
    np.save(tmp_path / "labels51.npy", labels[:51])
    with pytest.raises(ValueError, match="line 52, column '5' holds ''"):
        load_scores(tmp_path / "empty_cell.csv", labels_path=tmp_path / "labels51.npy")
    (tmp_path / "no_header.csv").write_text(rows + "\n")
    with pytest.raises(ValueError, match="needs a header row"):
        load_scores(tmp_path / "no_header.csv", labels_path=tmp_path / "labels.npy")
    # the numbered header is said so, from 3 columns: a headerless file of two columns whose first row
    # is 0, 1 (a row of probabilities) lost that row (the diff review); blank lines before a header
    assert read.read_as.endswith("; its line 1, the column numbers 0..9, read as the header")
    (tmp_path / "two.csv").write_text("0,1\n0.3,0.7\n0.8,0.2\n")
    with pytest.raises(ValueError, match="the first line, '0,1', may be pandas' column numbers or a row of scores"):
        load_scores(tmp_path / "two.csv", require_labels=False)
    (tmp_path / "blank_first.csv").write_text("\n  \na,b,label\n0.3,0.7,1\n0.8,0.2,0\n")
    assert load_scores(tmp_path / "blank_first.csv").logits.shape == (2, 2)
    # line numbers count the blank lines before the header (the second diff review)
    (tmp_path / "blank_bad.csv").write_text("\n\n\na,b,c,label\n1,2,3,0\n1,x,3,0\n")
    with pytest.raises(ValueError, match="line 6, column 'b' holds 'x'"):
        load_scores(tmp_path / "blank_bad.csv")
    (tmp_path / "blank_short.csv").write_text("\n\n\na,b,c,label\n1,2,3,0\n1,3,0\n")
    with pytest.raises(ValueError, match="line 6 has 3"):
        load_scores(tmp_path / "blank_short.csv")


def test_labels_files_with_a_byte_order_mark_or_as_a_dict(tmp_path):
    """A labels .txt with Excel's byte-order mark was refused (the same lines as .csv loaded), and a
    labels .pt holding {'labels': tensor} was told to map class names to integers (review finding)."""
    probs, labels = _bundled_probabilities()
    np.save(tmp_path / "scores.npy", np.log(np.maximum(probs[:20], 1e-20)))
    (tmp_path / "labels.txt").write_text("\n".join(map(str, labels[:20])) + "\n", encoding="utf-8-sig")
    torch.save({"labels": torch.from_numpy(labels[:20])}, tmp_path / "labels.pt")
    for name in ("labels.txt", "labels.pt"):
        assert load_scores(tmp_path / "scores.npy", labels_path=tmp_path / name).labels.tolist() == labels[:20].tolist()
    torch.save({"y": torch.from_numpy(labels[:20])}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"a dict without a key 'labels' or 'targets'; found keys \['y'\]"):
        load_scores(tmp_path / "scores.npy", labels_path=tmp_path / "other.pt")


def test_long_double_scores_load_as_float64(tmp_path):
    """NumPy's longdouble, which torch has no type for, raised a raw TypeError (the second diff review)."""
    logits = np.random.default_rng(0).standard_normal((30, 3))
    np.savez(tmp_path / "ld.npz", logits=logits.astype(np.longdouble), labels=np.arange(30) % 3)
    read = load_scores(tmp_path / "ld.npz")
    assert read.logits.dtype == torch.float64 and np.array_equal(read.logits.numpy(), logits)


def test_big_endian_scores_load(tmp_path):
    """Scores saved big-endian (``>f4``) raised torch's "byte order ... not supported"; labels so
    saved already loaded (review finding)."""
    probs, labels = _bundled_probabilities()
    logits = np.log(np.maximum(probs, 1e-20)).astype(np.float32)
    for dtype in (np.float32, np.float64):  # (big-endian float64 was read as float32: the diff review)
        np.savez(tmp_path / "big.npz", logits=logits.astype(np.dtype(dtype).newbyteorder(">")), labels=labels.astype(">i8"))
        np.savez(tmp_path / "native.npz", logits=logits.astype(dtype), labels=labels)
        big, native = load_scores(tmp_path / "big.npz"), load_scores(tmp_path / "native.npz")
        assert big.logits.dtype == native.logits.dtype and big.logits.equal(native.logits) and big.labels.equal(native.labels)


def test_rounded_probabilities_are_named_and_renormalised_on_request(tmp_path):
    probs, labels = _bundled_probabilities()
    _write_csv(tmp_path / "p2.csv", probs, labels, 2)
    rounded = np.loadtxt(tmp_path / "p2.csv", delimiter=",", skiprows=1)[:, :-1]
    deviation = np.abs(rounded.sum(1) - 1).max()
    assert 1e-3 < deviation < 0.05
    detected = load_scores(tmp_path / "p2.csv")
    assert detected.read_as.startswith(f"logits, although every row lies in [0, 1] and sums to 1 within {deviation:.2g}")
    assert "pass input='probs' (--input probs) to renormalise the rows" in detected.read_as
    forced = load_scores(tmp_path / "p2.csv", input="probs")
    assert f"rows renormalised, they summed to 1 only within {deviation:.2g}" in forced.read_as
    # zeros floored at 1e-3 / K: half the last digit, 0.005, would add up to 0.045 to a row
    renormalised = np.maximum(rounded / rounded.sum(1, keepdims=True), 1e-4)
    np.testing.assert_allclose(forced.logits.numpy(), np.log(renormalised), rtol=1e-12)
    bad = probs.copy()
    bad[0] = bad[0] * 0.8  # a row summing to 0.8 is no rounding error
    np.savez(tmp_path / "bad.npz", logits=bad, labels=labels)
    assert "within 0.2 (row 0)" in load_scores(tmp_path / "bad.npz").read_as
    with pytest.raises(ValueError, match="row 0 sums to 0.8"):
        load_scores(tmp_path / "bad.npz", input="probs")


def test_one_column_of_log_probabilities_of_class_1(real, tmp_path):
    data = real("sst2_gpt2-0shot_ferrer")  # log-posteriors; SOURCES.md: accuracy 0.5865
    log_p1 = data["logits"][:, 1].astype(np.float64)
    np.savez(tmp_path / "logits.npz", logits=log_p1, labels=data["labels"])
    with pytest.raises(ValueError, match=r"every value <= 0: say whether it holds log-probabilities of class 1 "
                                         r"\(input='log_probs', --input log_probs\) or LLRs"):
        load_scores(tmp_path / "logits.npz")
    np.savez(tmp_path / "log_probs.npz", log_probs=log_p1, labels=data["labels"])
    for scores in (load_scores(tmp_path / "logits.npz", input="log_probs"), load_scores(tmp_path / "log_probs.npz")):
        assert scores.read_as.startswith("binary log-probabilities of class 1")
        error = float((scores.logits.argmax(1) != scores.labels).double().mean())
        assert error == pytest.approx(1 - 0.5865, abs=5e-5)
        np.testing.assert_allclose(scores.logits.softmax(1)[:, 1].numpy(), np.exp(log_p1), rtol=1e-12)
    mixed = np.r_[log_p1[:-1], 0.5]  # one positive value: no log-probability, so LLRs (no key says logits)
    np.save(tmp_path / "llr_scores.npy", mixed)
    np.save(tmp_path / "llr_labels.npy", data["labels"])
    assert load_scores(tmp_path / "llr_scores.npy").read_as.startswith("binary log-likelihood ratios (one score column with values above 1 or of both signs")
    with pytest.raises(ValueError, match="log-probabilities must be <= 0"):
        load_scores(tmp_path / "llr_scores.npy", input="log_probs")
    # rows of probabilities declared as log-probabilities were taken as they came (NCE 1.374 against 0.432)
    np.savez(tmp_path / "two_probs.npz", probs=np.exp(np.c_[np.log1p(-np.exp(log_p1)), log_p1]), labels=data["labels"])
    with pytest.raises(ValueError, match=r"log-probabilities must be <= 0; found positive values \(up to 0.\d+\)"):
        load_scores(tmp_path / "two_probs.npz", input="log_probs")


def test_binary_scores_to_logits_bayes_rule():
    # Ferrer eq. 46: P(H2|x) = 1 / (1 + P1/P2 / LR)
    llr = torch.tensor([-1.0, 0.0, 2.197])
    post = binary_scores_to_logits(llr, "llr", priors=[0.9, 0.1]).softmax(1)[:, 1]
    torch.testing.assert_close(post, 1 / (1 + 9 / llr.double().exp()))
    assert binary_scores_to_logits(torch.tensor([[1.0]])).isfinite().all()
    with pytest.raises(ValueError, match="Are these LLRs"):
        binary_scores_to_logits(torch.tensor([1.5]))


# --- bad input: one clear ValueError naming the file ---------------------------------------------

@pytest.mark.parametrize(
    "content, message",
    [
        ({"scores_x": np.zeros((3, 2)), "labels": [0, 1, 0]}, r"no scores found: expected a key 'logits'"),
        ({"logits": np.zeros((3, 2))}, r"no labels found"),
        ({"logits": np.array([[0.0, np.nan], [1, 2], [0, 0]]), "labels": [0, 1, 0]}, r"1 NaN or infinite"),
        ({"logits": np.zeros((3, 2)), "labels": [0, 2, 0]}, r"must lie in \[0, 2\)"),
        ({"logits": np.zeros((3, 2)), "labels": [0, 1]}, r"labels has 2 entries but the scores have N = 3"),
        ({"logits": np.zeros((3, 2)), "labels": [0.0, 1.5, 0.0]}, r"whole numbers"),
        ({"logits": np.array(["a", "b"]), "labels": [0, 1]}, r"array of numbers"),
    ],
)
def test_bad_content_raises_one_clear_error(tmp_path, content, message):
    np.savez(tmp_path / "bad.npz", **content)
    with pytest.raises(ValueError, match=message) as info:
        load_scores(tmp_path / "bad.npz")
    assert str(info.value).startswith(str(tmp_path / "bad.npz")) and "\n" not in str(info.value)


def test_bad_files(tmp_path, small):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_scores(tmp_path / "missing.npz")
    (tmp_path / "junk.npz").write_text("not a zip")
    with pytest.raises(ValueError, match="not a readable .npz"):
        load_scores(tmp_path / "junk.npz")
    (tmp_path / "s.txt").write_text("1 2")
    with pytest.raises(ValueError, match="unsupported file type"):
        load_scores(tmp_path / "s.txt")
    np.save(tmp_path / "lonely.npy", small[0])
    with pytest.raises(ValueError, match="no labels file found next to it"):
        load_scores(tmp_path / "lonely.npy")
    (tmp_path / "noheader.csv").write_text("0.1,0.9,1\n")
    with pytest.raises(ValueError, match="needs a header row"):
        load_scores(tmp_path / "noheader.csv")
    with pytest.raises(ValueError, match=r"only .npz files and .pt/.pth dicts store a 'val' split"):
        load_scores(tmp_path / "lonely.npy", split="val")


# --- synthetic data (Ferrer §4.8 / Ferrer & Ramos App. C) ----------------------------------------

def test_gaussian_task_draws_exactly_what_scipy_draws():
    stats = pytest.importorskip("scipy.stats")
    task = gaussian_task(3, num_samples=1000, prior1=0.8, layout="simplex", seed=3)
    means = np.eye(3) * np.sqrt(0.5)
    np.random.seed(3)  # the authors' code: legacy global seed, then one rvs call per class
    expected = np.concatenate([stats.multivariate_normal.rvs(m, 0.15, n) for m, n in zip(means, [800, 99, 99])])
    np.testing.assert_array_equal(task.features.numpy(), expected)
    llk = np.stack([stats.multivariate_normal.logpdf(expected, m, 0.15) for m in means], axis=1)
    np.testing.assert_allclose(task.log_likelihoods.numpy(), llk, rtol=1e-12)
    assert task.labels.tolist() == [0] * 800 + [1] * 99 + [2] * 99


def test_distort_likelihoods_takes_arrays_and_keeps_the_device():
    """A NumPy array raised a TypeError and a tensor off the CPU a device error: the shift was a
    CPU tensor built from the input's dtype (review finding)."""
    from torchcal.data.synthetic import distort_likelihoods

    llk = np.array([[0.0, -1.0, -2.0], [-3.0, 0.5, 1.0]])
    expected = 0.5 * llk + np.array([0.5, 0.0, 0.0])
    np.testing.assert_array_equal(distort_likelihoods(llk).numpy(), expected)
    assert distort_likelihoods(torch.from_numpy(llk).to("meta")).is_meta
    np.testing.assert_array_equal(distort_likelihoods(np.array([[-3, -1], [-2, -5]])).numpy(), [[-1.0, -0.5], [-0.5, -2.5]])


def test_priors_and_truncated_class_sizes():
    torch.testing.assert_close(class_priors(4, 0.7), torch.tensor([0.7, 0.1, 0.1, 0.1], dtype=torch.float64))
    torch.testing.assert_close(mismatched_priors(3), torch.tensor([0.05, 0.05, 0.9], dtype=torch.float64))
    # reference §C.2: truncation gives [90000, 9999] for K = 2 (0.1 is 1 - 0.9 in floating point)
    assert torch.bincount(gaussian_task(2, num_samples=100_000).labels).tolist() == [90000, 9999]
    # sizes that leave a class empty, and variances that are no variances, are refused (a review:
    # gaussian_task(2, 1) gave no sample, (10, 10) 9 samples all of class 0, nan a LinAlgError)
    with pytest.raises(ValueError, match=r"num_samples=10 leaves class 1 no sample .*use num_samples >= 91"):
        gaussian_task(10, num_samples=10)
    assert min(torch.bincount(gaussian_task(10, num_samples=91).labels).tolist()) == 1
    with pytest.raises(ValueError, match="num_samples=1 leaves class 0 no sample"):
        gaussian_task(2, num_samples=1)
    for variance in (math.nan, math.inf, 0.0):
        with pytest.raises(ValueError, match="variance must be positive and finite"):
            gaussian_task(2, num_samples=100, variance=variance)


def test_ferrer_table4_uncalibrated_rows():
    """Ferrer Table 4 (K = 10, seed 0), rows Datap and Mismp: NEC (0-1), NCE and NBS to 2 decimals."""
    task = gaussian_task(10)
    y = task.labels.numpy()
    prior = np.bincount(y) / len(y)
    published = {  # system: (NEC, XE, BR), normalised with the test-data priors
        "Datap-cal": (0.25, 0.13, 0.21), "Datap-mc1": (0.29, 0.17, 0.26), "Datap-mc2": (0.25, 0.57, 0.70),
        "Mismp-cal": (1.11, 0.50, 0.86), "Mismp-mc1": (0.70, 0.48, 0.70), "Mismp-mc2": (1.11, 0.99, 1.58),
    }
    systems = ferrer_systems(task)
    for name, (nec, xe, br) in published.items():
        p = systems[name].exp().numpy()
        error = np.mean(p.argmax(1) != y)
        nce = -np.mean(np.log(p[np.arange(len(y)), y])) / -(prior * np.log(prior)).sum()
        nbs = np.mean(((p - np.eye(10)[y]) ** 2).sum(1)) / (prior * (1 - prior)).sum()
        assert (round(error / (1 - prior.max()), 2), round(nce, 2), round(nbs, 2)) == (nec, xe, br), name
    # text facts (reference §C.2): Mismp-cal and Datap-cal disagree on 9.9 % of the decisions
    disagree = (systems["Mismp-cal"].argmax(1) != systems["Datap-cal"].argmax(1)).double().mean()
    assert float(disagree) == pytest.approx(0.099, abs=5e-4)


def test_scores_without_labels_load_only_when_allowed(tmp_path, small):
    np.save(tmp_path / "new.npy", small[0])
    scores = load_scores(tmp_path / "new.npy", require_labels=False)
    assert scores.labels is None and scores.logits.shape == (50, 3)
    torch.save(torch.from_numpy(small[0]), tmp_path / "new.pt")
    with pytest.raises(ValueError, match="holds scores only"):
        load_scores(tmp_path / "new.pt")


def test_csv_written_by_pandas_with_its_index(tmp_path):
    pd = pytest.importorskip("pandas")
    probs, labels = _bundled_probabilities(300)
    frame = pd.DataFrame(probs, columns=[f"p{k}" for k in range(10)]).assign(label=labels)
    frame.to_csv(tmp_path / "with_index.csv")  # pandas' default writes the row index, unnamed, first
    frame.to_csv(tmp_path / "without_index.csv", index=False)
    with_index, without = load_scores(tmp_path / "with_index.csv"), load_scores(tmp_path / "without_index.csv")
    assert with_index.num_classes == 10 and with_index.logits.equal(without.logits)
    assert with_index.read_as == without.read_as + "; the first column (no name, whole numbers) is a row index as pandas writes it, left out"
    assert _nll(with_index.logits, with_index.labels) == pytest.approx(-np.log(probs[np.arange(300), labels]).mean(), rel=1e-8)
    # the index of a slice or a shuffled frame, and a file with Excel's byte-order mark, too
    frame.iloc[100:].to_csv(tmp_path / "slice.csv")
    assert load_scores(tmp_path / "slice.csv").logits.equal(without.logits[100:])
    shuffled = frame.sample(frac=1.0, random_state=0)
    shuffled.to_csv(tmp_path / "shuffled.csv")
    assert load_scores(tmp_path / "shuffled.csv").labels.tolist() == shuffled["label"].tolist()
    frame.to_csv(tmp_path / "excel.csv", encoding="utf-8-sig")
    assert load_scores(tmp_path / "excel.csv").logits.equal(without.logits)
    frame[["label", *frame.columns[:-1]]].to_csv(tmp_path / "label_first.csv", index=False, encoding="utf-8-sig")
    assert load_scores(tmp_path / "label_first.csv").labels.tolist() == labels.tolist()
    # a named index (df.index.name = "id") was read as an 11th class: an index-like name over
    # distinct whole numbers, or the row numbers 0..N-1 under any name, is an index too
    shuffled.rename_axis("id").to_csv(tmp_path / "id.csv")
    read = load_scores(tmp_path / "id.csv")
    assert read.num_classes == 10 and read.labels.tolist() == shuffled["label"].tolist()
    assert read.read_as.endswith("; the first column ('id', whole numbers) is a row index as pandas writes it, left out")
    frame.rename_axis("row_number").to_csv(tmp_path / "range.csv")
    read = load_scores(tmp_path / "range.csv")
    assert read.logits.equal(without.logits) and read.read_as.endswith("('row_number', the row numbers 0..N-1) is a row index as pandas writes it, left out")
    # ... from 3 rows: one row of max-subtracted logits whose first class is the top one (0) was
    # read as K - 1 classes, its label pointing at the wrong column (review finding)
    (tmp_path / "one_row.csv").write_text("c0,c1,c2,label\n0.0,-1.5,-0.25,0\n")
    assert load_scores(tmp_path / "one_row.csv").logits.tolist() == [[0.0, -1.5, -0.25]]
    # an unnamed index of repeated values (frames concatenated: 0..4999 twice) and a shuffled
    # index named "image_id" were read as an 11th class: an empty header and a name ending in
    # "_id" are never a class's, whatever whole numbers they hold
    frame.set_index(frame.index // 2).to_csv(tmp_path / "repeated.csv")
    assert load_scores(tmp_path / "repeated.csv").logits.equal(without.logits)
    shuffled.rename_axis("image_id").to_csv(tmp_path / "image_id.csv")
    assert load_scores(tmp_path / "image_id.csv").num_classes == 10
    # any other first column of shuffled or fractional values under a name is data
    shuffled.rename_axis("p_extra").to_csv(tmp_path / "named.csv")
    assert load_scores(tmp_path / "named.csv").num_classes == 11


def test_tests_use_the_bundled_file_without_the_shared_folder(tmp_path, monkeypatch):
    import conftest

    monkeypatch.setattr(conftest, "REAL_DATA", tmp_path)  # a fresh clone: no ../shared beside it
    data = conftest.load_real("cifar10_resnet110_kangsepp")
    with np.load(EXAMPLE_PATH) as bundled:
        np.testing.assert_array_equal(data["logits_val"], bundled["logits_val"])
    with pytest.raises(pytest.skip.Exception, match=r"cifar10_resnet20_ferrer.npz not found in .*shared/data/real .*SOURCES.md.*TORCHCAL_REAL_DATA"):
        conftest.load_real("cifar10_resnet20_ferrer")
    with pytest.raises(pytest.skip.Exception, match="cifar10_resnet110_kangsepp.npz not found"):
        conftest.load_real("cifar10_resnet110_kangsepp", bundled=False)


def test_a_torch_file_of_numpy_arrays_says_what_to_save_instead(tmp_path):
    """torch.load(weights_only=True) refuses NumPy arrays; its message (cut to its first line, with
    terminal escape codes) listed no remedy."""
    torch.save({"logits": np.zeros((4, 3)), "labels": np.array([0, 1, 2, 0])}, tmp_path / "numpy.pt")
    with pytest.raises(ValueError, match=r"unpickles nothing else \(e\.g\. NumPy arrays.*save tensors \(torch\.from_numpy\), or use \.npz"):
        load_scores(tmp_path / "numpy.pt")


def test_npz_members_that_are_not_used_are_neither_read_nor_sized(tmp_path, monkeypatch):
    """An object array of metadata made the whole file unreadable, and a large array of features
    beside small logits had it refused for memory."""
    from torchcal.data import loading

    logits, labels = np.random.default_rng(0).normal(size=(300, 10)), np.arange(300) % 10
    np.savez(tmp_path / "meta.npz", logits=logits, labels=labels, meta=np.array([{"model": "resnet"}], dtype=object))
    assert np.array_equal(load_scores(tmp_path / "meta.npz").logits.numpy(), logits)
    np.savez(tmp_path / "features.npz", logits=logits, labels=labels, features=np.zeros((300, 4096)))
    monkeypatch.setattr(loading, "_available_memory", lambda: 2 * 2**20)  # 2 MiB: the logits fit, the features not
    assert np.array_equal(load_scores(tmp_path / "features.npz").logits.numpy(), logits)
    np.savez(tmp_path / "big.npz", logits=np.zeros((3000, 100)), labels=np.arange(3000) % 100)
    with pytest.raises(ValueError, match="the array 'logits' of shape \\(3000, 100\\).*too large"):
        load_scores(tmp_path / "big.npz")
    np.savez(tmp_path / "object_logits.npz", logits=np.array([object()] * 3), labels=[0, 1, 0])
    with pytest.raises(ValueError, match="not a readable .npz file"):
        load_scores(tmp_path / "object_logits.npz")


def test_csv_with_two_label_columns_is_refused(tmp_path):
    """The second label-named column was read as one more class's scores (K = 11 of 10)."""
    (tmp_path / "two.csv").write_text("c0,c1,target,label\n0.5,1.0,1,1\n2.0,0.1,0,0\n")
    with pytest.raises(ValueError, match="2 label columns \\('target', 'label'\\)"):
        load_scores(tmp_path / "two.csv")


def test_csv_rows_of_another_width_say_which_way_they_differ(tmp_path):
    """A row with a trailing comma (one empty cell more than the header) was asked whether the file
    was truncated (a fuzz review); a short row still is."""
    for row, hint in (("0.1,0.9,1,", "a trailing comma?"), ("0.1,0.9,1,0.5", "a column without a name"), ("0.1,0.9", "is the file truncated?")):
        path = tmp_path / "scores.csv"
        path.write_text(f"c0,c1,label\n0.2,0.8,0\n{row}\n")
        with pytest.raises(ValueError, match=rf"every CSV row must have 3 cells, like the header; line 3 has \d \({hint}"):
            load_scores(path)


def test_labels_csv_with_a_header_as_pandas_writes_it(tmp_path):
    logits, labels = np.random.default_rng(1).normal(size=(20, 3)), np.arange(20) % 3
    np.save(tmp_path / "s.npy", logits)
    for name, text in [
        ("plain", "".join(f"{y}\n" for y in labels)),
        ("series", "label\n" + "".join(f"{y}\n" for y in labels)),  # Series.to_csv(index=False)
        ("indexed", ",label\n" + "".join(f"{i},{y}\n" for i, y in enumerate(labels))),  # Series.to_csv()
        ("other", "id,target,weight\n" + "".join(f"{i},{y},1.0\n" for i, y in enumerate(labels))),
    ]:
        (tmp_path / f"{name}.csv").write_text(text)
        assert load_scores(tmp_path / "s.npy", labels_path=tmp_path / f"{name}.csv").labels.tolist() == labels.tolist()
    # pandas' Series.to_csv(header=False) writes the index first: its second column is the labels
    (tmp_path / "no_header.csv").write_text("".join(f"{i},{y}\n" for i, y in enumerate(labels)))
    assert load_scores(tmp_path / "s.npy", labels_path=tmp_path / "no_header.csv").labels.tolist() == labels.tolist()
    (tmp_path / "two_columns.csv").write_text("".join(f"{y},{y}\n" for y in labels))
    with pytest.raises(ValueError, match="without a header needs one number per line, got rows of \\[2\\] columns"):
        load_scores(tmp_path / "s.npy", labels_path=tmp_path / "two_columns.csv")
    (tmp_path / "ambiguous.csv").write_text("a,b\n" + "".join(f"{y},{y}\n" for y in labels))
    with pytest.raises(ValueError, match="needs one column named 'label'"):
        load_scores(tmp_path / "s.npy", labels_path=tmp_path / "ambiguous.csv")


def test_a_nan_probability_is_named_as_such():
    with pytest.raises(ValueError, match="found 1 NaN and 0 infinite values"):
        binary_scores_to_logits(torch.tensor([0.2, float("nan")]))


def test_labels_files_that_read_wrong_are_named(small, tmp_path):
    """Review findings: pandas writes the header ``0`` for an unnamed Series, which was read as a
    first label and the error blamed the counts; float labels beyond int64 were named as the
    wrapped value (-9223372036854775808); probabilities saved in bfloat16, whose rounding moves a
    row's sum by up to 2^-8, were read as logits (NLL 1.55 for 0.38)."""
    logits, labels = small
    np.save(tmp_path / "s.npy", logits)
    (tmp_path / "labels.csv").write_text("0\n" + "\n".join(str(int(v)) for v in labels) + "\n")
    with pytest.raises(ValueError, match=r"labels.csv has one entry more than the scores have rows, and its first line is '0'"):
        load_scores(tmp_path / "s.npy", labels_path=tmp_path / "labels.csv")
    np.save(tmp_path / "huge.npy", np.full(len(labels), 1e20))
    with pytest.raises(ValueError, match=r"labels must be class indices 0..K-1; found 1e\+20"):
        load_scores(tmp_path / "s.npy", labels_path=tmp_path / "huge.npy")
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(3 * torch.randn(2000, 10, generator=g, dtype=torch.float64), 1)
    stored = probs.to(torch.bfloat16)
    assert float((stored.double().sum(1) - 1).abs().max()) > 1e-3  # (else this tests nothing)
    torch.save({"probs": stored, "labels": torch.zeros(2000, dtype=torch.long)}, tmp_path / "keyed.pt")
    torch.save({"logits": stored, "labels": torch.zeros(2000, dtype=torch.long)}, tmp_path / "bf16.pt")
    read = load_scores(tmp_path / "bf16.pt")
    assert read.read_as.startswith("probabilities")
    torch.testing.assert_close(read.logits.double(), load_scores(tmp_path / "keyed.pt").logits.double(), rtol=0, atol=0)
    torch.testing.assert_close(torch.log_softmax(read.logits.double(), 1), probs.log(), rtol=0, atol=2e-2)


def test_half_precision_probability_files_are_floored_at_what_their_zeros_stand_for(real, tmp_path):
    """Probabilities stored in float16 (zeros below 2^-25) and a bfloat16 column of class-1
    probabilities (ones above 1 - 2^-9): load_scores and binary_scores_to_logits floored them at
    1e-20, 5.5 % and 25 % above the logits' cross-entropy (a review of the metrics' fix, which had
    not reached them)."""
    from torchcal.data import binary_scores_to_logits
    from torchcal.functional import cross_entropy

    data = real("cifar10_resnet110_kangsepp")
    logits, labels = torch.from_numpy(data["logits_val"]).double(), torch.from_numpy(data["labels_val"])
    np.savez(tmp_path / "p16.npz", probs=torch.softmax(logits, 1).half().numpy(), labels=labels.numpy())
    loaded = load_scores(tmp_path / "p16.npz")
    assert "below 2.98023e-08" in loaded.read_as
    assert float(cross_entropy(loaded.logits, loaded.labels)) == pytest.approx(float(cross_entropy(logits, labels)), rel=5e-3)

    # the same in a .pt file: its tensor was widened to float32 before the floor was chosen (a
    # review: 0.3166 for 0.3002 here, and 0.2148 for 0.1711 for FVCAUS's bfloat16 column below)
    torch.save({"probs": torch.softmax(logits, 1).half(), "labels": labels}, tmp_path / "p16.pt")
    from_torch = load_scores(tmp_path / "p16.pt")
    assert from_torch.logits.equal(loaded.logits) and "below 2.98023e-08" in from_torch.read_as

    data = real("fvcaus_xvector-plda_ferrer")
    logits, labels = torch.from_numpy(data["logits"]).double(), torch.from_numpy(data["labels"])
    p1 = torch.sigmoid(logits[:, 1] - logits[:, 0])
    for stored in (torch.bfloat16, torch.float16):
        read = binary_scores_to_logits(p1.to(stored), "probability")
        assert float(cross_entropy(read, labels)) == pytest.approx(float(cross_entropy(logits, labels)), rel=1e-2)
        torch.save({"probs": p1.to(stored), "labels": labels}, tmp_path / "p1.pt")
        assert load_scores(tmp_path / "p1.pt").logits.equal(read)


def test_a_csv_of_probabilities_rounded_to_decimals_is_floored_at_half_its_last_digit(real, tmp_path):
    """netcal's CIFAR-10 WRN-16-4 posteriors written with 4 decimals: 48 true-class cells read
    0.0000 (true probabilities up to 4.8e-5). Floored at 1e-20 (46 nats each) they scored 0.539
    nats for the 0.378 of the float32 posteriors; at 5e-5, the half unit of the last digit, the
    score is within 4 % of it. Numbers written in full (shortest round trip) keep the 1e-20 floor."""
    from torchcal.functional import cross_entropy

    data = real("cifar10_wrn16-4_netcal")
    logits, labels = torch.from_numpy(data["logits"]).double(), torch.from_numpy(data["labels"])
    probs = torch.softmax(logits, 1).float().numpy()
    _write_csv(tmp_path / "p4.csv", probs, labels.numpy(), 4)
    read = load_scores(tmp_path / "p4.csv")
    assert "probabilities below 5e-05 (" in read.read_as
    exact = float(cross_entropy(logits, labels))
    assert float(cross_entropy(read.logits, read.labels)) == pytest.approx(exact, rel=0.04)
    table = np.loadtxt(tmp_path / "p4.csv", delimiter=",", skiprows=1)
    floored = np.maximum(table[:, :-1], 5e-5)  # (the rows sum to 1 within 1e-3: not renormalised)
    assert _nll(np.log(floored), labels.numpy()) == pytest.approx(float(cross_entropy(read.logits, read.labels)), rel=1e-12)

    header = ",".join(f"p{k}" for k in range(10)) + ",label\n"
    (tmp_path / "full.csv").write_text(header + "".join(",".join(repr(float(v)) for v in row) + f",{y}\n"
                                                        for row, y in zip(probs[:300], labels[:300].tolist())))
    np.savez(tmp_path / "full.npz", probs=np.loadtxt(tmp_path / "full.csv", delimiter=",", skiprows=1)[:, :-1], labels=labels[:300])
    assert load_scores(tmp_path / "full.csv").logits.equal(load_scores(tmp_path / "full.npz").logits)


def test_a_long_csv_reads_as_numpy_reads_it(tmp_path):
    """The reader parses rows into blocks (its memory is the numbers', not Python's strings'):
    a file of several blocks, with blank lines, equals numpy.loadtxt's reading."""
    rs = np.random.RandomState(0)
    logits, labels = rs.normal(size=(9000, 4)), rs.randint(0, 4, size=9000)
    lines = ["a,b,c,d,label"] + [",".join(repr(float(v)) for v in row) + f",{y}" for row, y in zip(logits, labels)]
    lines.insert(5000, "")
    (tmp_path / "long.csv").write_text("\n".join(lines) + "\n")
    read = load_scores(tmp_path / "long.csv")
    assert read.logits.dtype == torch.float64 and read.logits.numpy().tolist() == logits.tolist()
    assert read.labels.tolist() == labels.tolist()


def test_one_rounded_column_of_probabilities_or_log_probabilities(tmp_path):
    """One column of a CSV written with 2 decimals: probabilities 0.00 and 1.00 floored at 5e-4
    (1e-3 / K, below half the last digit), and the note counts them as they were (the diff
    review: it counted them after the floor, "0 of them 0"); log-probabilities are not floored at
    their text's unit (their logs are exact enough; the note had claimed a floor never applied)."""
    (tmp_path / "p.csv").write_text("p,label\n0.00,1\n1.00,0\n0.30,1\n0.70,0\n")
    read = load_scores(tmp_path / "p.csv", input="probs")
    assert read.read_as.endswith("; 2 probabilities below 0.0005 (2 of them 0) floored at it")
    np.testing.assert_allclose(read.logits.softmax(1)[:, 1].numpy(), [5e-4, 1 - 5e-4, 0.3, 0.7], rtol=1e-12)
    (tmp_path / "lp.csv").write_text("lp,label\n-0.0000,0\n-12.0000,1\n-0.5000,1\n-1.0000,0\n")
    read = load_scores(tmp_path / "lp.csv", input="log_probs")
    assert read.read_as.endswith("; 1 probabilities below 1e-20 (1 of them 0) floored at it")
    np.testing.assert_allclose(read.logits.softmax(1)[:, 1].numpy(), np.exp([0.0, -12.0, -0.5, -1.0]), rtol=1e-12)
    # float16 log-probabilities are exp'd in float64: their note named float16's floor, never applied
    np.savez(tmp_path / "lp16.npz", log_probs=np.array([-0.0, -20.0, -0.5, -1.0, -40.0], dtype=np.float16), labels=[0, 1, 1, 0, 1])
    read = load_scores(tmp_path / "lp16.npz")
    assert read.read_as.endswith("; 1 probabilities below 1e-20 (1 of them 0) floored at it")
    np.testing.assert_allclose(read.logits.softmax(1)[1:, 1].numpy(), np.exp([-20.0, -0.5, -1.0, -40.0]), rtol=1e-3)
