"""The one conversion pipeline every command runs.

A command (``converter/commands/*``) opens its source, plans (pure: the write tasks and what the
output will hold) and hands the plan to :func:`run_conversion` as a :class:`Conversion` value.
The pipeline then does, identically for every conversion::

    dry run? ── yes ──► the plan's description (nothing touched)
       │ no
    journal header (operation, source identity, output options)
    check (e.g. every non-tensor entry read and checked: a refused one leaves nothing behind)
    destination: lock, refuse / overwrite / resume            (run.destination, rank 0)
       (--resume of a conversion already complete: its result, nothing written)
    open the output (a writer for ``out``)                     Conversion.open_output
    prepare it (rank 0 first: create and size files)           Output.prepare
    adopt the tasks the journal says are done (--resume)       Output.adopt
    write the non-tensor entries (rank 0)                      Output.write_objects
    execute this rank's share of the tasks (journaled)         run.distributed / run.executor
    publish (rank 0, after every rank succeeded): adopt every rank's tasks, check what the
        writer is about to commit against the plan             Output.manifest, run.output_check
        (every planned tensor once, planned dtype and shape, no shared bytes: else an internal
        error, nothing published), record the conversion (.written-by-ckptconv.json), commit the
        output (its completion marker last), drop the journals Output.commit
    the result

Under torchrun every rank plans identically and runs the same pipeline (:mod:`converter.run.distributed`);
URL destinations are spooled and uploaded around it (:func:`conversion_command`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from converter.plan.copy_tasks import WriteTask
from converter.run import distributed, timings
from converter.run.destination import (
    COMPLETE,
    KIND_OF_OP,
    RESUME,
    UNIVERSAL,
    conversion_header,
    guarded,
    prepare,
    write_output_record,
)
from converter.run.executor import ExecStats, TaskSink, os_errors_as_storage_errors
from converter.run.journal import task_id
from converter.run.output_check import PlannedOutput, check_output
from converter.run.remote import remote_destination
from formats.base import CheckpointIndex
from formats.errors import InternalError
from formats.manifest import Manifest

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class ConversionResult:
    """What a conversion wrote."""

    dst: str
    tensors: int
    objects: int
    bytes: int
    seconds: float
    plan: str | None = None
    warnings: tuple[str, ...] = ()
    preview: dict | None = None  # from-universal --dry-run: the target plan (schemas/target-plan.schema.json)
    mesh: str | None = None  # from-universal: the target mesh
    world_size: int | None = None  # from-universal: ranks of the target job
    plan_choice: str | None = None  # from-universal --plan auto: the plan it chose and why (one line)
    already_complete: bool = False  # --resume found this conversion's complete output: nothing written
    steps: tuple[Any, ...] = ()  # every step of a run (converter.run.steps.StepOutcome), when converted in one go


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Output:
    """An output writer as the pipeline drives it (built by ``Conversion.open_output`` once the
    destination is ready; :mod:`converter.run.sinks` builds one per output format).

    ``sink`` takes the executor's tasks; ``prepare(resume)`` creates (or, resuming, reopens) the
    files: rank 0 first, then the other ranks with ``resume=True``; ``adopt(task, info)`` counts a
    task as written (one a journal or another rank finished; ``info`` is what its writer's
    ``close`` returned when ``needs_info``, else None); ``write_objects`` writes the non-tensor
    entries (rank 0); ``manifest()`` is what the writer is about to commit, from the metadata it
    will write (rank 0, after every task is adopted; the pipeline checks it against the plan);
    ``commit`` publishes the output, its completion marker last (rank 0); ``close`` releases the
    writer (after a failure, and on the other ranks after the commit); ``bytes_written(stats)`` is
    the result's byte count (every rank calls it; default: the bytes the executor wrote);
    ``record_files`` are the top-level files it writes beyond its format's own (named in the output
    record, so ``--overwrite`` may remove them).
    """

    sink: TaskSink
    commit: Callable[[], None]
    manifest: Callable[[], Manifest]
    prepare: Callable[[bool], None] = lambda resume: None
    adopt: Callable[[WriteTask, Any], None] = lambda task, info: None
    write_objects: Callable[[], None] | None = None
    close: Callable[[], None] = _nothing
    needs_info: bool = False
    bytes_written: Callable[[ExecStats], int] | None = None
    record_files: tuple[str, ...] = ()  # top-level files beyond the format's own, named in the output record


@dataclass(frozen=True)
class Conversion:
    """One planned conversion, as a command hands it to :func:`run_conversion`.

    ``op`` names the operation (the CLI command: journal header, progress label); ``index`` is the
    source's index (its identity goes into the journal header); ``reader`` is what the executor
    reads (the source, or a view of it); ``tasks`` the whole plan (every rank's); ``header_options``
    the options that shape the output, as the user writes them (``{"--mesh": "tp2,dp3"}``: a
    ``--resume`` must repeat them); ``open_output(out)`` builds the writer once ``out`` is ready;
    ``planned`` is the result as planned (entry counts, planned bytes, warnings, target mesh; the
    pipeline fills in where, how many bytes and how long); ``describe()`` is the dry run's text
    and, optionally, its JSON document (pure: it runs instead of everything else); ``check`` runs
    before the destination is touched (reading and checking what must be sound first);
    ``dry_run_warnings`` are printed beside the dry run's text (for warnings the text does not show);
    ``expected`` is what the output must hold (every tensor key with its dtype and shape, the
    non-tensor entries), from the plan: the output is checked against it before it is published.
    """

    op: str
    src: str | os.PathLike
    dst: str | os.PathLike
    index: CheckpointIndex
    reader: Any
    tasks: Sequence[WriteTask]
    header_options: Mapping[str, Any]
    open_output: Callable[[Path], Output]
    planned: ConversionResult
    describe: Callable[[], tuple[str, dict | None]]
    check: Callable[[], None] | None = None
    dry_run_warnings: tuple[str, ...] = ()
    expected: PlannedOutput | None = None


def dry_run_result(conv: Conversion) -> ConversionResult:
    """What ``--dry-run`` returns: the plan described, its counts and bytes; nothing written."""
    text, doc = conv.describe()
    p = conv.planned
    return ConversionResult(str(conv.dst), p.tensors, p.objects, p.bytes, 0.0, plan=text, preview=doc,
                            warnings=conv.dry_run_warnings, plan_choice=p.plan_choice)


def open_destination(src: str | os.PathLike, dst: str | os.PathLike, header: Mapping[str, Any],
                     options: Any) -> tuple[Path, Any, str]:
    """Prepare ``dst`` (rank 0) and open this rank's resume journal: ``(out, journal, what)``,
    ``what`` as :func:`prepare` found it (every rank learns it; no journal when :data:`COMPLETE`)."""
    dist = distributed.current()
    out, what = dist.from_leader(lambda: prepare(src, dst, header, overwrite=options.overwrite,
                                                 resume=options.resume, world=dist.world))
    if what == COMPLETE:
        return out, None, what
    journal = dist.journal(out, dict(header), resume=what == RESUME)
    return out, journal, what


def run_conversion(conv: Conversion, options: Any) -> ConversionResult:
    """Run ``conv`` with ``options`` (a :class:`converter.config.RunOptions`): the dry run, or
    destination, journal, resume, execute (this rank's share), publish; its result."""
    if options.dry_run:
        return dry_run_result(conv)
    if conv.expected is None:
        raise InternalError(f"internal error: {conv.op}: the conversion plans no output to check its output against")
    dist = distributed.current()
    timings.mark("planned")
    header = conversion_header(conv.op, conv.src, conv.index, conv.header_options)
    if conv.check is not None:
        conv.check()
    _fault("planned")
    out, journal, what = open_destination(conv.src, conv.dst, header, options)
    _fault("prepared")
    timings.mark("destination")
    if what == COMPLETE:  # --resume of a conversion that already finished: nothing to do
        return dataclasses.replace(conv.planned, dst=str(out), bytes=0, seconds=0.0, already_complete=True)
    output = conv.open_output(out)
    try:
        # rank 0 creates and sizes every file; the other ranks then open them without truncating
        dist.leader_first(lambda: output.prepare(what == RESUME), lambda: output.prepare(True))
        timings.mark("prepare")
        for task in conv.tasks:
            if journal.is_done(task):
                output.adopt(task, journal.info(task))
        if output.write_objects is not None:
            dist.on_leader(output.write_objects)
        gather = output.needs_info and dist.active
        stats, info = dist.execute(conv.tasks, conv.reader, output.sink, workers=options.workers,
                                   memory_budget=options.memory_budget, progress=options.progress,
                                   label=conv.op, journal=journal, gather_info=gather)
        written = output.bytes_written(stats) if output.bytes_written is not None else stats.bytes_written
        timings.mark("copy")

        def publish() -> None:
            if dist.active:  # every rank wrote its share: count the others' as written
                for task in conv.tasks:
                    output.adopt(task, info[task_id(task)] if gather else None)
            check_output(conv.op, conv.expected, output.manifest())  # before the marker: else nothing published
            write_output_record(out, header, output.record_files)  # before the marker: a complete output names its conversion
            output.commit()
            _fault("committed")
            dist.remove_journals(journal, out)

        dist.on_leader(publish)
        timings.mark("commit")
        if not dist.leader:
            output.close()
    except BaseException:
        output.close()
        raise
    journal.remove()
    return dataclasses.replace(conv.planned, dst=str(out), bytes=written, seconds=stats.seconds)


def _fault(point: str) -> None:
    """SIGKILL this process at ``point`` when the resume tests ask for it (``knobs.FAULT_KILL_AT``)."""
    from converter import knobs

    if knobs.FAULT_KILL_AT == point:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def conversion_command(op: str) -> Callable[[F], F]:
    """The wrapping of every conversion's API function ``fn(src, dst, ..., options=...)``: URL
    destinations spooled and uploaded, marker last (:func:`converter.run.remote.remote_destination`;
    streamed file by file when ``op`` writes a universal store, :data:`KIND_OF_OP`);
    the destination's lock held for the call and an interrupt saying how to resume
    (:func:`converter.run.destination.guarded`); OS errors as one-line StorageErrors naming ``op``."""

    def wrap(fn: F) -> F:
        streamed = KIND_OF_OP.get(op) == UNIVERSAL
        return remote_destination(guarded(os_errors_as_storage_errors(op)(fn)), streamed=streamed)

    return wrap
