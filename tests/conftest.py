"""Shared fixtures: the real logits in ../shared/data/real and seeded synthetic data."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from torchcal.data import EXAMPLE_PATH

REAL_DATA = Path(os.environ.get("TORCHCAL_REAL_DATA", Path(__file__).resolve().parents[2] / "shared" / "data" / "real"))


def load_real(name: str, bundled: bool = True) -> dict[str, np.ndarray]:
    """Load ``<name>.npz`` from the shared real-data folder; the file torchcal bundles
    (``torchcal/data/examples``) stands in for its shared copy unless ``bundled=False``. A test
    whose file is found in neither place is skipped, saying where the data come from."""
    path = REAL_DATA / f"{name}.npz"
    if not path.exists() and bundled and EXAMPLE_PATH.name == path.name:
        path = EXAMPLE_PATH
    if not path.exists():
        pytest.skip(
            f"real data {path.name} not found in {REAL_DATA}: these tests need the real classifier outputs the "
            f"project keeps beside the clone in ../shared/data/real (converted from public repositories, provenance "
            f"in its SOURCES.md); set TORCHCAL_REAL_DATA to a folder holding them"
        )
    with np.load(path, allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture
def real():
    return load_real


def make_synthetic(num_classes: int, n: int, seed: int, signal: float = 2.0) -> tuple[np.ndarray, np.ndarray]:
    """The anchor data of the reference notes (psrcal/dirichletcal anchors, section 6.1).

    Bayes posterior softmax(2 L); the returned logits S are over-confident and shifted per class.
    """
    rs = np.random.RandomState(seed)
    y = rs.randint(0, num_classes, size=n)
    latent = rs.standard_normal((n, num_classes))
    latent[np.arange(n), y] += signal
    scores = latent * np.linspace(2.0, 4.0, num_classes) + np.linspace(-1.0, 1.0, num_classes)
    return scores, y


@pytest.fixture
def synthetic():
    return make_synthetic


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """The suite runs many small tensor ops on shared 2-core machines, where two intra-op threads
    oversubscribe the cores and run several times slower than one. Session-scoped, so that it is
    also in force while module-scoped fixtures (fitted models, trained networks) are built."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_awkward(n: int, num_classes: int, seed: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (n, K) and labels with what trips up statistics computed column by column: tied
    scores (a fifth of the rows repeat one of three rows, with labels drawn row by row), and for
    K > 2 a class that never occurs (the last: an all-negative column). The labels are drawn from
    softmax(logits), so the columns are calibrated up to the removed class."""
    generator = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(n, num_classes, generator=generator, dtype=torch.float64)
    repeated = torch.rand(n, generator=generator) < 0.2
    logits[repeated] = logits[:3][torch.randint(0, 3, (int(repeated.sum()),), generator=generator)]
    labels = torch.multinomial(logits.softmax(1), 1, generator=generator).squeeze(1)
    if num_classes > 2:
        labels[labels == num_classes - 1] = 0
    return logits.to(dtype), labels


@pytest.fixture
def awkward():
    return make_awkward


def one_confidence_two_accuracies(n: int = 1000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Posteriors (N, 3), half (0.6, 0.3, 0.1) and half (0.6, 0.2, 0.2), and labels (N,) with class 0
    right 70 % and 50 % of the time: one confidence, 0.6, which their log-probabilities give as
    0.6 and one ulp below (the reproducer of a review of ties up to round-off)."""
    rs = np.random.default_rng(seed)
    split = rs.random(n) < 0.5
    probs = np.where(split[:, None], [0.6, 0.3, 0.1], [0.6, 0.2, 0.2])
    return probs, np.where(rs.random(n) < np.where(split, 0.7, 0.5), 0, 1)
