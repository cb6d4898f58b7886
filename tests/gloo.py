"""Running a test's worker in several CPU processes joined in one gloo group: the one piece of
scaffolding of the data-parallel tests. The tests import it as ``gloo`` (like ``conftest``)."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def spawn_gloo(worker: Callable[..., None], nprocs: int, *args: Any) -> None:
    """Run ``worker(rank, *args)`` in ``nprocs`` processes of one gloo group on this machine, one
    intra-op thread each; raises if any of them does. ``worker`` must be a module-level function."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_run, args=(worker, nprocs, port, args), nprocs=nprocs, join=True)


def _run(rank: int, worker: Callable[..., None], world_size: int, port: int, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        worker(rank, *args)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Every process has finished its collectives and written its results. It leaves without
    # tearing the group down: gloo's teardown (in destroy_process_group or at interpreter exit)
    # aborted a worker now and then under load ("terminate called without an active exception")
    # even after a barrier; see pytorch/pytorch#179291.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
