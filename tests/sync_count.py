"""Counting the host synchronisations a piece of CUDA code makes: a measuring instrument of the
tests (tests/test_cuda.py asserts counts) that benchmarks/bench_gpu.py also reports with. It lives
with the tests, its main user, and not in the package; the tests import it as ``sync_count`` (like
``conftest``), the benchmark, which puts the repository root on ``sys.path``, as ``tests.sync_count``."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch


def count_host_syncs(run: Callable[[], object]) -> int:
    """Run ``run()`` and return how many times it made the host wait for the current CUDA device,
    as ``torch.cuda.set_sync_debug_mode("warn")`` reports them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)
