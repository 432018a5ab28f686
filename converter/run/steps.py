"""Every step of a run in one command (``export-hf RUN_DIR/ OUT/ --all-steps``, or a glob).

The step folders of a run directory (each a checkpoint: DCP, universal store, ...) are converted
one by one into ``OUT/<step>``, each through the one pipeline with its own destination, lock and
journal, as ``--resume`` (:mod:`converter.run.destination`): a step this conversion already
finished is skipped, one interrupted (a journal, no completion marker) is resumed, the others are
converted (a step another conversion wrote is refused, naming what differs: ``--overwrite``);
each output is checked once written; a source step still being written (no ``.metadata`` yet) is
left for a later run. A failed step does not stop the others; the run then fails, naming it.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from converter.run import distributed
from converter.run.destination import complete_marker
from converter.run.journal import JOURNAL_NAME
from formats.errors import CkptConvError, ConfigError, IncompleteCheckpointError

GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True)
class Step:
    """One step folder of a run and where its conversion goes."""

    name: str
    src: Path
    dst: Path


@dataclass(frozen=True)
class StepOutcome:
    """What happened to one step: ``converted``, ``resumed``, ``skipped`` (already converted),
    ``incomplete`` (its source is still being written), ``planned`` (dry run) or ``failed``."""

    name: str
    status: str
    detail: str = ""
    result: Any = None  # the step's ConversionResult


def is_pattern(src: str | os.PathLike) -> bool:
    """Whether ``src`` is a glob of step folders rather than one checkpoint."""
    return any(c in os.fspath(src) for c in GLOB_CHARS)


def _natural(name: str) -> tuple:
    from formats.hf import natural_key

    return natural_key(name)


def _is_step(path: Path) -> bool:
    """Whether ``path`` holds a checkpoint (complete or still being written)."""
    from converter.run.sources import detect_format

    try:
        detect_format(path)
    except IncompleteCheckpointError:
        return True
    except CkptConvError:
        return False
    return True


def find_steps(src: str | os.PathLike, out: str | os.PathLike) -> list[Step]:
    """The step folders of ``src`` (a run directory: its sub-folders holding a checkpoint; or a
    glob of folders), in natural order (``step-2`` before ``step-10``), each going to
    ``out/<its path below the run directory>``."""
    from formats.storage import is_remote

    if is_remote(src) or is_remote(out):
        raise ConfigError(f"{src} -> {out}: converting every step needs local directories")
    text = os.fspath(src)
    if is_pattern(text):
        found = sorted((Path(p) for p in glob.glob(text) if Path(p).is_dir()), key=lambda p: _natural(str(p)))
        if not found:
            raise ConfigError(f"{text}: no folder matches; check the pattern (quote it for the shell)")
        root = Path(os.path.commonpath([str(p.resolve()) for p in found])) if len(found) > 1 else found[0].parent.resolve()
        steps = [p for p in found if _is_step(p)]
        pairs = [(p.resolve().relative_to(root).as_posix(), p) for p in steps]
    else:
        run = Path(text)
        if not run.is_dir():
            raise ConfigError(f"{text}: no such directory; pass the run directory holding the step folders")
        if _is_step(run):
            raise ConfigError(f"{text}: is itself a checkpoint; --all-steps takes the folder holding the step folders")
        pairs = [(p.name, p) for p in sorted(run.iterdir(), key=lambda p: _natural(p.name))
                 if p.is_dir() and not p.name.startswith(".") and _is_step(p)]
    if not pairs:
        raise ConfigError(f"{text}: no step folder holds a checkpoint (DCP .metadata, universal ckptconv.json, ...)")
    return [Step(name, path, Path(out) / name) for name, path in pairs]


def step_state(dst: Path) -> str:
    """``new`` (absent or empty), ``done`` (a complete output), ``partial`` (an interrupted run's
    journal) or ``other`` (anything else: the step's own run says what is wrong); for the report
    only: what each step needs is the pipeline's ``--resume`` decision."""
    if not dst.is_dir() or not any(dst.iterdir()):
        return "new"
    if (dst / JOURNAL_NAME).is_file() and complete_marker(dst) is None:
        return "partial"
    if complete_marker(dst) is not None and not (dst / JOURNAL_NAME).is_file():
        return "done"
    return "other"


def run_steps(steps: Sequence[Step], convert: Callable[[Path, Path, Any], Any],
              check: Callable[[Path, Any], None], options: Any) -> list[StepOutcome]:
    """Convert each step (``convert(src, dst, options)``), then ``check(dst, result)`` it.

    Each step runs as ``--resume`` (``--overwrite`` when given): the pipeline starts a new one,
    continues an interrupted one from its journal, and answers "already complete" for one this
    conversion finished (a complete output of another conversion is refused, naming what differs).
    Rank 0 reads what each step holds before any is converted (every rank gets its answer). A step
    that fails is reported and the next one runs; an interrupt stops the run (the step's journal
    is kept for the next run)."""
    dist = distributed.current()
    states = dist.on_leader(lambda: [step_state(s.dst) for s in steps]) or []
    states = dist.gather(states)[0] if dist.active else states
    opts = dataclasses.replace(options, resume=not options.overwrite)
    outcomes = []
    for step, state in zip(steps, states):
        try:
            result = convert(step.src, step.dst, opts)
            if getattr(result, "already_complete", False):
                outcomes.append(StepOutcome(step.name, "skipped", "already converted"))
                continue
            if not options.dry_run:
                check(step.dst, result)
        except IncompleteCheckpointError as e:
            outcomes.append(StepOutcome(step.name, "incomplete", str(e)))
            continue
        except CkptConvError as e:
            outcomes.append(StepOutcome(step.name, "failed", str(e).splitlines()[0] if str(e) else type(e).__name__))
            continue
        status = "planned" if options.dry_run else "resumed" if state == "partial" and not options.overwrite else "converted"
        outcomes.append(StepOutcome(step.name, status, "", result))
    return outcomes


def steps_failure(outcomes: Sequence[StepOutcome]) -> CkptConvError | None:
    """One error naming the first failed step (and how many failed), or None."""
    failed = [o for o in outcomes if o.status == "failed"]
    if not failed:
        return None
    more = f" ({len(failed)} of {len(outcomes)} steps failed; the others are done)" if len(failed) > 1 else ""
    return CkptConvError(f"step {failed[0].name}: {failed[0].detail}{more}; fix it and rerun the same command "
                         "(converted steps are skipped)")
