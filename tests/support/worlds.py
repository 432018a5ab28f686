"""Gloo worlds of local processes for the tests, joined through a rendezvous FILE.

Every world rendezvouses with ``init_method="file://..."`` (torch's FileStore) in a fresh private
directory: no TCP port is picked, released and then raced for by another test or engineer on the
same machine (gloo's own connections bind their ports themselves). Worlds started by ``torchrun
--standalone`` need nothing of this: its agent binds its TCPStore on port 0 and shares it with the
ranks (torch 2.13 ``use_agent_store``).

:func:`run_world` runs ``fn(rank, world, *args)`` in ``world`` processes; :func:`rendezvous` gives
a fresh init method to worlds started another way, which :func:`join` joins.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Imported once by the forkserver, then inherited by every forked rank. Only site-packages
# modules: Python 3.11's forkserver ignores the parent's sys.path when preloading (and swallows
# the ImportError), so this directory's modules are imported by each child instead (cheap).
PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
]


@contextlib.contextmanager
def rendezvous() -> Iterator[str]:
    """A fresh ``file://`` init method for one world; its directory is removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="ckptconv-rdzv-"))
    try:
        yield (root / "store").as_uri()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def join(rank: int, world: int, init_method: str) -> None:
    """Join the gloo world of ``init_method`` (one CPU thread per rank: many ranks share 2 cores)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)


def leave() -> None:
    """Leave the world (after a barrier, so no rank tears down a peer still sending)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _entry(rank: int, fn: Callable, world: int, init_method: str, args: tuple) -> None:
    if world > 1:
        join(rank, world, init_method)
    else:
        torch.set_num_threads(1)
    try:
        fn(rank, world, *args)
    finally:
        leave()


def start_method() -> str:
    """"forkserver" (torch imported once per session, then forked: a rank starts in well under a
    second instead of ~4 CPU-seconds); override with $CKPTCONV_TEST_START_METHOD=spawn."""
    method = os.environ.get("CKPTCONV_TEST_START_METHOD", "forkserver")
    if method == "forkserver":
        import multiprocessing

        multiprocessing.set_forkserver_preload(PRELOAD)  # no effect once the server runs
    return method


def run_world(fn: Callable, world: int, args: tuple = (), timeout: float = 300.0) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes joined in a gloo group.

    A world of 1 gets no process group. ``fn`` must be importable (module level). Raises when a
    rank fails or when the world runs past ``timeout`` seconds (the processes are then killed).
    """
    with rendezvous() as init_method:
        ctx = mp.start_processes(_entry, args=(fn, world, init_method, args), nprocs=world, join=False,
                                 start_method=start_method())
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"gloo world of {world} running {fn.__name__} exceeded {timeout}s")
