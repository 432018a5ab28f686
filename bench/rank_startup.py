"""Start-up cost per rank of a ``from-universal`` run under ``torchrun`` (or one process): from
process start to the first byte it would copy.

Each rank opens the checkpoint (parses ``.metadata``, builds and checks the index), plans the
target layout and the copy tasks (pieces are computed lazily), joins the job, prepares the output
files, takes its share of the tasks and computes the pieces of its own tasks, then stops: the
copy itself is not run (the synthetic checkpoints' data files are sparse). Prints one JSON line
per rank: wall and CPU seconds to that point, tasks in the whole plan and in this rank's share,
peak RSS.

    python bench/rank_startup.py CKPT OUT --mesh tp2,dp32
    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/rank_startup.py CKPT OUT --mesh tp2,dp32
"""

from __future__ import annotations

import time

START_WALL, START_CPU = time.perf_counter(), time.process_time()

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from converter.run import distributed  # noqa: E402
from converter.config import RunOptions  # noqa: E402


class _Stop(Exception):
    """Raised where the copy would start."""


def _execute(self, tasks, reader, sink, **kw):  # stands in for Dist.execute
    mine = distributed.share(tasks, self.rank, self.world)
    copies = sum(len(p.copies) for t in mine for p in t.pieces)  # this rank's pieces, as execute computes them
    print(json.dumps({
        "rank": self.rank, "world": self.world, "tasks": len(tasks), "my_tasks": len(mine), "my_copies": copies,
        "startup_wall_s": round(time.perf_counter() - START_WALL, 2),
        "startup_cpu_s": round(time.process_time() - START_CPU, 2),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20), 3),
    }), flush=True)
    raise _Stop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--mesh", required=True)
    ap.add_argument("--plan", default="llama")
    a = ap.parse_args()
    dist = distributed.init_from_env()
    distributed.Dist.execute = _execute
    from converter.commands.from_universal import from_universal

    try:
        from_universal(a.src, a.out, a.mesh, plan=a.plan, options=RunOptions(overwrite=True, workers=1))
    except _Stop:
        pass
    if dist.leader:
        shutil.rmtree(a.out, ignore_errors=True)


if __name__ == "__main__":
    main()
