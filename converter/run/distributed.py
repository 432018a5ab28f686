"""Scale-out: one conversion split across the ranks of a ``torchrun`` job (gloo, CPU only).

Run any conversion under ``torchrun --nnodes N --nproc-per-node M -m converter <command> ...``.
Every rank plans identically (plans are pure), takes its share of the write tasks
(:func:`share`: balanced by bytes, deterministic), writes only those, and rank 0 publishes the
metadata after every rank reported success. Steps that must happen once (preparing the
destination, sizing files, committing) run on rank 0 and every rank learns their outcome; a failure
on any rank makes every rank raise, so nothing is published and the command exits non-zero on all
ranks. Each rank keeps its own resume journal (rank 0's at the usual place, rank ``r``'s in
``<dst>/.ckptconv-rank-<r>/``); the journal header names the world size, so ``--resume`` needs
the same world size (another one is refused as "a different conversion").

URL destinations (``s3://...``, :mod:`converter.run.remote`) work for universal outputs
(``to-universal``, ``import-hf``): every rank spools and uploads its own chunk files; rank 0 uploads
the metadata and, once every rank reported a successful upload (an agreed step), the marker.
DCP / HF outputs to a URL are refused under torchrun (their files are shared by the ranks).

Node-local destinations (``from-universal --local-files node --ranks-per-node K --node-local-dst``):
:func:`per_node` splits the job into one :class:`Dist` per node (a gloo subgroup of its K
processes, torchrun's ``--nproc-per-node``). Each node is then a conversion of its own, into DST on
its own storage: its local rank 0 prepares, journals and publishes that node's files, the
node's processes share only that node's tasks, and a node's outcome (complete, failed, resumed)
is its own; no node writes to or waits for another node's folder.

Outside torchrun (or with ``WORLD_SIZE=1``) :func:`current` is a one-rank context whose every
method runs locally: the conversions behave exactly as before. Python API users under torchrun
call :func:`init_from_env` themselves before converting.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import heapq
import os
import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any, TypeVar

from converter.run.executor import ExecStats, PieceWriter, TaskSink, execute
from converter.run.journal import JOURNAL_NAME, Journal, task_id
from converter.plan.copy_tasks import WriteTask
from formats import errors

T = TypeVar("T")

#: Per-task cost added to its bytes when balancing (a file to create, a metadata record).
TASK_OVERHEAD_BYTES = 4096
#: Runs of neighbouring tasks per rank's share when balancing (more: finer balance, fewer source
#: chunks kept whole in one process).
RUNS_PER_RANK = 8
#: Seconds a collective waits for a peer before the run fails.
TIMEOUT_SECONDS = float(os.environ.get("CKPTCONV_DIST_TIMEOUT", "1800") or 1800)
RANK_DIR = ".ckptconv-rank-{}"


def assign(tasks: Sequence[WriteTask], world: int) -> list[int]:
    """Pure: the owning rank of each task; every rank computes the same answer from the same plan,
    whatever order it lists its tasks in.

    A tensor's tasks, in box order, are cut into runs of at most 1/:data:`RUNS_PER_RANK` of a
    rank's share of the bytes (a task larger than that is a run by itself); the runs go largest
    first (ties by their first task's id) to the least-loaded rank (ties by rank number). Tasks
    next to each other in a tensor read the same source chunks (a store chunk across two target
    ranks' boxes), so keeping them on one rank keeps each chunk's parts in one process, where the
    source check sees them all (no rank reads the parts another copied: :mod:`formats.integrity`).
    """
    if world <= 1:
        return [0] * len(tasks)
    cost = [t.nbytes + TASK_OVERHEAD_BYTES for t in tasks]
    cap = max(1, sum(cost) // (RUNS_PER_RANK * world))
    order = sorted(range(len(tasks)), key=lambda i: (tasks[i].key, tasks[i].box.offsets, task_id(tasks[i])))
    runs: list[tuple[int, str, list[int]]] = []
    for _, group in groupby(order, key=lambda i: tasks[i].key):
        run: list[int] = []
        size = 0
        for i in group:
            if run and size + cost[i] > cap:
                runs.append((-size, task_id(tasks[run[0]]), run))
                run, size = [], 0
            run.append(i)
            size += cost[i]
        runs.append((-size, task_id(tasks[run[0]]), run))
    runs.sort(key=lambda r: (r[0], r[1]))
    loads = [(0, r) for r in range(world)]
    owners = [0] * len(tasks)
    for neg, _, run in runs:
        load, rank = heapq.heappop(loads)
        for i in run:
            owners[i] = rank
        heapq.heappush(loads, (load - neg, rank))
    return owners


def _has_journal(where: Path) -> bool:
    try:
        return (where / JOURNAL_NAME).stat().st_size > 0
    except FileNotFoundError:
        return False


def share(tasks: Sequence[WriteTask], rank: int, world: int) -> list[WriteTask]:
    """Pure: the tasks rank ``rank`` of ``world`` writes, in plan order."""
    if world <= 1:
        return list(tasks)
    return [t for t, owner in zip(tasks, assign(tasks, world)) if owner == rank]


@dataclass(frozen=True)
class Dist:
    """This process's place in the conversion job: rank ``rank`` of ``world``."""

    rank: int = 0
    world: int = 1
    group: Any = None  # the process group of the collectives (None: the whole job)
    node: int | None = None  # per_node: the node this group of ranks is

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    # -- collectives -------------------------------------------------------------------------

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (``[obj]`` on one rank)."""
        if not self.active:
            return [obj]
        import torch.distributed as td

        out: list[Any] = [None] * self.world
        td.all_gather_object(out, obj, group=self.group)
        return out

    def agree(self, error: BaseException | None) -> None:
        """Every rank learns whether any rank failed; then all raise (the failed one its own error)."""
        if not self.active:
            if error is not None:
                raise error
            return
        reports = self.gather(None if error is None else (type(error).__name__, _first_line(error)))
        if error is not None:
            raise error
        failed = [(r, rep) for r, rep in enumerate(reports) if rep is not None]
        if failed:
            rank, (name, message) = failed[0]
            if name in ("KeyboardInterrupt", "Interrupted", "Terminated"):  # a peer was stopped: stop too
                from converter.run.destination import Terminated

                raise Terminated()
            cls = getattr(errors, name, None)
            if not (isinstance(cls, type) and issubclass(cls, errors.CkptConvError)):
                cls, message = errors.CkptConvError, f"internal error: {name}: {message}"
            where = "" if self.node is None else f" on node {self.node}"
            raise cls(f"rank {rank} of {self.world}{where} failed, nothing was published: {message}")

    def collective(self, fn: Callable[[], T], *, leader_only: bool = False) -> T | None:
        """Run ``fn`` (on every rank, or rank 0 only), then agree on the outcome."""
        result, error = None, None
        if self.leader or not leader_only:
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised by agree on every rank
                error = e
        self.agree(error)
        return result

    def on_leader(self, fn: Callable[[], T], others: T | None = None) -> T | None:
        """Rank 0 runs ``fn``; every rank waits and learns the outcome; others get ``others``."""
        result = self.collective(fn, leader_only=True)
        return result if self.leader else others

    def from_leader(self, fn: Callable[[], T]) -> T:
        """Rank 0 runs ``fn``; every rank waits and gets its result (which must pickle)."""
        result = self.collective(fn, leader_only=True)
        return self.gather(result if self.leader else None)[0] if self.active else result  # type: ignore[return-value]

    def leader_first(self, leader: Callable[[], Any], others: Callable[[], Any]) -> None:
        """Rank 0 runs ``leader`` (e.g. create and size files), then the others run ``others``
        (e.g. open them without truncating); each step agreed."""
        self.on_leader(leader)
        self.collective(lambda: None if self.leader else others())

    # -- journals ----------------------------------------------------------------------------

    def journal(self, out: Path, header: dict[str, Any], resume: bool) -> Journal:
        """This rank's resume journal (opened on every rank, outcome agreed).

        Resuming needs the world size of the interrupted run (each rank's share depends on it):
        :func:`converter.run.destination.prepare` checked that on rank 0. A rank whose journal is
        missing or empty (the run stopped before that rank wrote its header line, and so before
        it wrote any data) starts a new one.
        """

        def open_journal() -> Journal:
            where = Path(out)
            hdr = header
            if self.active:
                hdr = {**header, "world": self.world, "rank": self.rank}
                if not self.leader:
                    where = where / RANK_DIR.format(self.rank)
                    where.mkdir(exist_ok=True)
            if resume and not (self.leader or _has_journal(where)):
                return Journal(where, hdr)
            return Journal.resume(where, hdr) if resume else Journal(where, hdr)

        return self.collective(open_journal)  # type: ignore[return-value]

    def remove_journals(self, journal: Journal | None, out: Path) -> None:
        """After the commit: drop this rank's journal (rank 0 also sweeps every rank's folder)."""
        if journal is not None:
            journal.remove()
        if self.active and self.leader:
            for p in Path(out).glob(RANK_DIR.format("*")):
                shutil.rmtree(p, ignore_errors=True)

    # -- execution ---------------------------------------------------------------------------

    def execute(self, tasks: Sequence[WriteTask], reader: Any, sink: TaskSink, *, journal: Journal | None = None,
                gather_info: bool = False, **kw: Any) -> tuple[ExecStats, dict[str, Any]]:
        """Run this rank's share of ``tasks``; agree on success; sum the stats over ranks.

        With ``gather_info`` the second value maps every task id of the whole plan (written now or
        by an interrupted run) to what its writer's ``close`` returned (e.g. a checksum).
        """
        mine = share(tasks, self.rank, self.world)
        recording = _RecordingSink(sink)
        stats, error = ExecStats(), None
        try:
            prefix = f"[rank {self.rank}/{self.world}]" if self.active else ""
            if self.node is not None:
                prefix = f"[node {self.node}{' ' + prefix[1:-1] if prefix else ''}]"
            stats = execute(mine, reader, recording, journal=journal, progress_prefix=prefix, **kw)
            sink.sync()
        except BaseException as e:  # noqa: BLE001 - re-raised by agree on every rank
            error = e
        self.agree(error)
        info: dict[str, Any] = {}
        if gather_info:
            if journal is not None:
                info.update(journal.done)
            info.update(recording.info)
        parts = self.gather((stats.tasks, stats.bytes_written, stats.bytes_read, stats.seconds,
                             stats.peak_reserved, info))
        total = ExecStats(
            tasks=sum(p[0] for p in parts), bytes_written=sum(p[1] for p in parts),
            bytes_read=sum(p[2] for p in parts), seconds=max(p[3] for p in parts),
            peak_reserved=max(p[4] for p in parts),
        )
        merged: dict[str, Any] = {}
        for p in parts:
            merged.update(p[5])
        return total, merged

    def shutdown(self) -> None:
        """Leave the process group (a final barrier first)."""
        global _CURRENT
        if self.active and self.group is None:
            import torch.distributed as td

            if td.is_initialized():
                td.destroy_process_group()
        _CURRENT = Dist()


class _RecordingSink:
    """Passes tasks to ``sink`` and remembers what each task's writer ``close`` returned."""

    def __init__(self, sink: TaskSink) -> None:
        self.sink = sink
        self.info: dict[str, Any] = {}
        self._lock = threading.Lock()

    def open(self, task: WriteTask) -> PieceWriter:
        return _RecordingWriter(self, task, self.sink.open(task))

    def sync(self) -> None:
        self.sink.sync()

    def __getattr__(self, name: str) -> Any:  # the sink's shared_files / sync_files, where it has them
        if name in ("shared_files", "sync_files"):
            return getattr(self.sink, name)
        raise AttributeError(name)


class _RecordingWriter:
    def __init__(self, owner: _RecordingSink, task: WriteTask, inner: PieceWriter) -> None:
        self.owner, self.task, self.inner = owner, task, inner

    def file_offset(self, piece: Any) -> int | None:
        place = getattr(self.inner, "file_offset", None)
        return None if place is None else place(piece)

    def write(self, piece: Any, data: Any) -> None:
        self.inner.write(piece, data)

    def close(self) -> Any:
        info = self.inner.close()
        with self.owner._lock:
            self.owner.info[task_id(self.task)] = info
        return info


def _first_line(e: BaseException) -> str:
    text = str(e)
    return text.splitlines()[0] if text else ""


_CURRENT = Dist()


def current() -> Dist:
    """The distributed context of this process (one rank unless :func:`init_from_env` joined a job)."""
    return _CURRENT


def env_world() -> tuple[int, int]:
    """(rank, world size) torchrun put in the environment; (0, 1) outside torchrun."""
    try:
        return int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        raise errors.ConfigError("RANK / WORLD_SIZE must be integers (set by torchrun)") from None


def init_from_env() -> Dist:
    """Join the torchrun job described by the environment (gloo); a no-op for one process."""
    global _CURRENT
    rank, world = env_world()
    if world <= 1:
        return _CURRENT
    import torch.distributed as td

    if not td.is_initialized():
        td.init_process_group("gloo", timeout=_dt.timedelta(seconds=TIMEOUT_SECONDS))
    _CURRENT = Dist(td.get_rank(), td.get_world_size())
    watch_launcher()
    return _CURRENT


def local_world() -> int:
    """Processes per node torchrun started (``LOCAL_WORLD_SIZE``; 1 outside torchrun)."""
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    except ValueError:
        raise errors.ConfigError("LOCAL_WORLD_SIZE must be an integer (set by torchrun)") from None


def node_place(ranks_per_node: int, target_world: int) -> int:
    """The target node whose files this process writes into a node-local destination: its node
    of the launcher (``RANK // K``). Pure over the environment, so every process checks the same
    and refuses in one line before any collective: the launcher must have the target job's shape,
    ``--nproc-per-node K`` (``ranks_per_node``) on ``target_world / K`` nodes."""
    rank, world = env_world()
    local = local_world()
    if "WORLD_SIZE" not in os.environ and target_world > 1:
        raise errors.ConfigError(
            f"--node-local-dst: run it under torchrun --nnodes {target_world // ranks_per_node} --nproc-per-node "
            f"{ranks_per_node} (one launcher per node of the target job)")
    if local != ranks_per_node:
        raise errors.ConfigError(
            f"--node-local-dst: --ranks-per-node {ranks_per_node}, but torchrun started {local} process(es) per node; "
            f"each node's processes write that node's {ranks_per_node} ranks' files: launch --nproc-per-node "
            f"{ranks_per_node}")
    if world != target_world:
        raise errors.ConfigError(
            f"--node-local-dst: the mesh has {target_world} ranks ({target_world // ranks_per_node} nodes of "
            f"{ranks_per_node}), but torchrun started {world // local} node(s) of {local}: launch --nnodes "
            f"{target_world // ranks_per_node} --nproc-per-node {ranks_per_node}")
    return rank // ranks_per_node


@contextlib.contextmanager
def per_node(ranks_per_node: int) -> Iterator[Dist]:
    """Within the block, :func:`current` is this node's :class:`Dist`: local rank of the
    ``ranks_per_node`` consecutive ranks of its node, collectives in their gloo subgroup (every
    process of the job creates every node's group, in node order, as torch requires)."""
    global _CURRENT
    job = _CURRENT
    k = ranks_per_node
    if job.world % k:
        raise errors.ConfigError(f"--ranks-per-node {k} does not divide the job's {job.world} processes")
    node = job.rank // k
    group = None
    if job.active and k > 1:
        import torch.distributed as td

        for n in range(job.world // k):  # new_group is collective over the whole job
            g = td.new_group(ranks=list(range(n * k, (n + 1) * k)),
                             timeout=_dt.timedelta(seconds=TIMEOUT_SECONDS))
            if n == node:
                group = g
    _CURRENT = Dist(job.rank % k, k if job.active else 1, group, node)
    try:
        yield _CURRENT
    finally:
        _CURRENT = job


#: Seconds between two checks that the launcher (torchrun) still lives.
LAUNCHER_POLL_SECONDS = 0.5
#: Seconds a rank whose launcher died has to stop on its own (SIGTERM) before it exits hard.
LAUNCHER_GRACE_SECONDS = 5.0
_WATCHING: list[int] = []


def watch_launcher() -> None:
    """Stop this rank when the process that launched it (torchrun's agent) dies.

    torchrun starts each rank in its own session, so a launcher killed with SIGKILL leaves its
    ranks running, and rank 0 could publish an output the job no longer owns. A daemon thread
    polls the parent pid; when the rank is orphaned it sends itself SIGTERM (the CLI turns it into
    an interrupt: workers stop, nothing is published, the journal is kept for ``--resume``), and
    exits hard if the rank is still alive :data:`LAUNCHER_GRACE_SECONDS` later (a collective that
    waits for a dead peer).
    """
    if _WATCHING:
        return
    parent = os.getppid()
    _WATCHING.append(parent)

    def watch() -> None:
        import signal
        import time

        while os.getppid() == parent:
            time.sleep(LAUNCHER_POLL_SECONDS)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(LAUNCHER_GRACE_SECONDS)
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="ckptconv-launcher-watch", daemon=True).start()


__all__ = ["Dist", "assign", "share", "current", "init_from_env", "env_world", "local_world", "node_place",
           "per_node", "JOURNAL_NAME"]
