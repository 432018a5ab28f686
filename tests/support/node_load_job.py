"""A torchrun entry point for the load proofs of :mod:`load_worker` across (simulated) nodes.

``python node_load_job.py JOBS OUT``: ``JOBS`` is a pickle of ``(layout, [LoadJob, ...])``; every
process torchrun starts joins the gloo world torchrun set up (``--nnodes`` launchers, each its own
node), and runs :func:`load_worker.load_jobs_worker`. A job's path may name ``{node}``: this
process's node (torchrun's ``GROUP_RANK``), i.e. the node's own local folder; ``{rank}`` as in
:class:`load_worker.LoadJob`.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from load_worker import load_jobs_worker
from worlds import leave


def main() -> None:
    jobs_file, out_dir = sys.argv[1:3]
    layout, jobs = pickle.loads(Path(jobs_file).read_bytes())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # torchrun's env: MASTER_ADDR/PORT from the rendezvous, RANK, WORLD_SIZE
    node = os.environ["GROUP_RANK"]
    jobs = [dataclasses.replace(j, path=j.path.replace("{node}", node)) for j in jobs]
    try:
        load_jobs_worker(dist.get_rank(), dist.get_world_size(), layout, jobs, out_dir)
    finally:
        leave()


if __name__ == "__main__":
    main()
