"""The destination of a conversion, in one place for every command: lock, identity, resume, overwrite.

Every conversion (``to-universal``, ``from-universal``, ``export-hf``, ``import-hf``) calls
:func:`converter.run.pipeline.open_destination` once it has planned, and is wrapped in :func:`guarded`:

* **Lock.** ``<dst>/.ckptconv-lock`` is ``flock``-ed for the whole run and names its holder (pid,
  host, command, start time). A second run on the same destination is refused with one line naming
  the holder; a lock left by a dead process is free (the kernel drops ``flock`` locks with their
  process) and simply taken over. Under torchrun rank 0 holds it for the job.
* **Identity.** The journal header (:func:`conversion_header`) records the operation, the source
  (path, a fingerprint of its index, and name/size/mtime of its top-level files) and the options
  that shape the output; the commit keeps it in the output record ``<dst>/.written-by-ckptconv.json``
  (written just before the completion marker). ``--resume`` is idempotent: it starts the conversion in a missing
  or empty destination, continues the same conversion's partial output, and finds a complete output
  of the same conversion already done (exit 0, nothing written); another source, other options, or
  a complete output of another conversion are refused with one line saying what differs.
* **Overwrite.** ``--overwrite`` removes only what ckptconv would have written there (a universal
  store, a DCP checkpoint, an HF export, complete or partial: :func:`foreign_entries`), never
  following a link; anything else is refused, naming what was found.
* **Interrupts.** SIGINT (and SIGTERM under the CLI) stop the executor within about a second;
  :func:`guarded` turns the interrupt into :class:`Interrupted`, whose message says whether
  ``--resume`` can continue.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as _dt
import functools
import json
import os
import re
import shutil
import signal
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from converter.run.journal import JOURNAL_NAME
from formats.errors import DestinationError, clip

F = TypeVar("F", bound=Callable[..., Any])

LOCK_NAME = ".ckptconv-lock"
#: What :func:`prepare` found: start the conversion, continue a partial one, or nothing to do.
START, RESUME, COMPLETE = "start", "resume", "complete"
#: Written into every output just before its completion marker: what tells ckptconv's own DCP
#: outputs from a checkpoint torch or a training job wrote (which --overwrite never deletes), and
#: the conversion that wrote it (its journal header: source identity and options), which lets
#: ``--resume`` find that same conversion complete. (--overwrite replaces any HF file set, with
#: the record or without.)
OUTPUT_RECORD = ".written-by-ckptconv.json"
RANK_DIR_RE = re.compile(r"\.ckptconv-rank-\d+")

UNIVERSAL, DCP, HF = "universal store", "DCP checkpoint", "Hugging Face export"
DEEPSPEED = "DeepSpeed universal checkpoint"
DCP_ST = "DCP safetensors checkpoint"
#: from-universal writing DCP's per-rank safetensors storage (``--format dcp-safetensors``).
FROM_UNIVERSAL_ST = "from-universal --format dcp-safetensors"
MEGATRON_LEGACY = "Megatron legacy checkpoint"
#: from-universal writing Megatron-LM's legacy checkpoint (``--format megatron-legacy``).
FROM_UNIVERSAL_LEGACY = "from-universal --format megatron-legacy"
#: Megatron-LM's tracker file: written last, the legacy checkpoint's completion marker.
LEGACY_TRACKER = "latest_checkpointed_iteration.txt"
#: The output kind of each operation.
KIND_OF_OP = {"to-universal": UNIVERSAL, "import-hf": UNIVERSAL, "import-ds": UNIVERSAL, "from-universal": DCP,
              FROM_UNIVERSAL_ST: DCP_ST, FROM_UNIVERSAL_LEGACY: MEGATRON_LEGACY, "export-hf": HF, "consolidate": HF, "export-ds": DEEPSPEED}
#: The completion marker of a DCP safetensors output (torch's form has none; its readers ignore it),
#: written last, after the output record.
ST_MARKER = ".ckptconv-complete.json"  # formats.dcp_safetensors.COMPLETE_MARKER (read there: not imported here)
#: What each rank's ``dcp.load`` opens, beside a from-universal DCP output's ``.metadata``
#: (written before it; ``ckptconv files`` reads it; schemas/loads.schema.json).
LOADS_MANIFEST = ".ckptconv-loads.json"
LOADS_SCHEMA = "ckptconv.loads/1"
#: The folder of the per-rank files beside the consolidated ones (``--consolidate``).
SHARDED_DIR = "sharded"
_SHARD = r"shard-\d+-model-\d+-of-\d+\.safetensors"

# ----------------------------------------------------------------------------------------------
# the file sets ckptconv writes (what --overwrite may remove)

_TMP = r"\.{name}\.tmp-\d+"  # formats.fsutil.atomic_write_bytes's temp file
#: Framework files carried beside DCP's (formats.dcp.framework_files: Megatron's metadata.json, common.pt).
_FRAMEWORK = [r"metadata\.json", r"common\.pt", _TMP.format(name=r"(metadata\.json|common\.pt)")]
_OWN_FILES = {
    UNIVERSAL: [r"ckptconv\.json", r"zarr\.json", _TMP.format(name=r"ckptconv\.json"), *_FRAMEWORK],
    DCP: [r"\.metadata", r"__\d+_\d+\.distcp", r"__\d+\.metadata", _TMP.format(name=r"\.metadata"),
          r"\.__\d+\.metadata\.tmp-\d+", re.escape(LOADS_MANIFEST), _TMP.format(name=re.escape(LOADS_MANIFEST)),
          re.escape(ST_MARKER), _TMP.format(name=re.escape(ST_MARKER)), *_FRAMEWORK],
    HF: [r"model\.safetensors", r"model-\d+-of-\d+\.safetensors", r"model(-\d+-of-\d+)?\.safetensors\.tmp",
         r"model\.safetensors\.index\.json", r"config\.json",
         _TMP.format(name=r"(config\.json|model\.safetensors\.index\.json)")],
    DEEPSPEED: [r"latest_universal", _TMP.format(name=r"latest_universal")],
    # the consolidated files and their index are HF's names
    DCP_ST: [_SHARD, _SHARD + r"\.tmp", re.escape(ST_MARKER), _TMP.format(name=re.escape(ST_MARKER))],
    MEGATRON_LEGACY: [re.escape(LEGACY_TRACKER), _TMP.format(name=re.escape(LEGACY_TRACKER))],
}
_COMMON_FILES = [re.escape(JOURNAL_NAME), re.escape(LOCK_NAME), re.escape(OUTPUT_RECORD),
                 _TMP.format(name=re.escape(OUTPUT_RECORD))]
_OWN_DIRS = {UNIVERSAL: ("tensors", "objects")}
#: Entries whose presence says "ckptconv (or a DCP save) wrote this directory" (a store's root
#: zarr.json file too: what an interrupted --overwrite leaves once the marker and journal are gone).
_SIGNATURES = [r"ckptconv\.json", r"zarr\.json", r"\.metadata", r"__\d+_\d+\.distcp", r".*\.safetensors(\.tmp)?",
               r"model\.safetensors\.index\.json", re.escape(JOURNAL_NAME), re.escape(LOCK_NAME),
               re.escape(OUTPUT_RECORD), r"latest_universal", re.escape(ST_MARKER), re.escape(LEGACY_TRACKER)]
#: Files of a DCP checkpoint (either storage form), which are ckptconv's only with its record or
#: journal beside them.
_CHECKPOINT_FILES = re.compile(r"\.metadata|__\d+_\d+\.distcp|__\d+\.metadata|" + _SHARD)
#: Files that mark each kind of output complete (written last).
MARKERS = {UNIVERSAL: "ckptconv.json", DCP: ".metadata", HF: "model.safetensors.index.json",
           DEEPSPEED: "latest_universal", DCP_ST: ST_MARKER, MEGATRON_LEGACY: LEGACY_TRACKER}

_FILE_RE = re.compile("|".join(f"(?:{p})" for k in _OWN_FILES for p in _OWN_FILES[k] + _COMMON_FILES))
_SIG_RE = re.compile("|".join(f"(?:{p})" for p in _SIGNATURES))
_CHUNK_RE = re.compile(r"\d+|\.\d+\.tmp")
#: A safetensors-backend chunk file (formats/universal/safetensors_backend.py) and its temp name.
_ST_CHUNK_RE = re.compile(r"\.?(c|\d+(\.\d+)*)\.safetensors(\.tmp)?")
_OBJECT_RE = re.compile(r"\d{6}\.pt")
_SHARD_FILE_RE = re.compile(_SHARD + r"(\.tmp)?")
_RANK_MD_RE = re.compile(r"__\d+\.metadata")


def owned_path(rel: str) -> bool:
    """Whether ckptconv writes a file at ``rel`` (a POSIX path relative to the destination) in
    one of its outputs (universal store, DCP checkpoint, HF export) or their bookkeeping."""
    parts = rel.split("/")
    name = parts[-1]
    if len(parts) == 1:
        return bool(_FILE_RE.fullmatch(name))
    top = parts[0]
    if RANK_DIR_RE.fullmatch(top):
        return len(parts) == 2 and name == JOURNAL_NAME
    if top == SHARDED_DIR:
        return len(parts) == 2 and bool(_SHARD_FILE_RE.fullmatch(name))
    if top == "objects":
        return len(parts) == 2 and bool(_OBJECT_RE.fullmatch(name))
    if top != "tensors":
        return False
    if len(parts) == 2:
        return name == "zarr.json"
    if len(parts) == 3:
        # c: the chunk of a 0-d array; <i>.safetensors: a safetensors-backend chunk
        return name in ("zarr.json", "c", ".c.tmp") or bool(_ST_CHUNK_RE.fullmatch(name))
    return parts[2] == "c" and all(p.isdigit() for p in parts[3:-1]) and bool(_CHUNK_RE.fullmatch(name))


def _tree_is_ours(top: Path) -> str | None:
    """None when every entry under the universal store folder ``top`` (``tensors`` or ``objects``)
    is one ckptconv writes; else the first foreign entry (relative to the store)."""
    if top.is_symlink() or not top.is_dir():
        return None  # a link is removed, never followed
    for dirpath, dirnames, filenames in os.walk(top):
        rel = Path(dirpath).relative_to(top.parent)
        depth = len(rel.parts)  # 1: tensors/ or objects/, 2: an array, 3: its c/, ...
        for name in filenames:
            if not owned_path((rel / name).as_posix()):
                return (rel / name).as_posix()
        for name in dirnames:
            path = Path(dirpath, name)
            ok = top.name == "tensors" and (depth == 1 or (depth == 2 and name == "c") or (
                depth >= 3 and name.isdigit()))
            if path.is_symlink() or not ok:
                return (rel / name).as_posix() + "/"
    return None


#: Files of an export-ds tag folder (``<tag>/``): the model-states files, ``zero/optimizer_state.pt``
#: and ``zero/<fqn>/<state>.pt``, with the temp names they are written under.
_DS_TOP = re.compile(r"(mp_rank_00|zero_pp_rank_0_mp_rank_00)_model_states\.pt(\.tmp-\d+)?|"
                     r"\.(mp_rank_00|zero_pp_rank_0_mp_rank_00)_model_states\.pt\.tmp-\d+")
_DS_OPTIM = re.compile(r"\.?optimizer_state\.pt(\.tmp-\d+)?")
_DS_ATOM = re.compile(r"[^/.][^/]*\.pt|\.[^/]+\.pt\.tmp")


def _sharded_is_ours(top: Path) -> str | None:
    """None when ``top`` (a ``sharded/`` folder) holds only per-rank safetensors files (and their
    temp names); else the first foreign entry, relative to the destination."""
    if top.is_symlink():
        return None  # unlinked, never followed
    for entry in sorted(os.scandir(top), key=lambda e: e.name):
        if entry.is_symlink() or not entry.is_file() or not _SHARD_FILE_RE.fullmatch(entry.name):
            return f"{top.name}/{entry.name}" + ("/" if entry.is_dir(follow_symlinks=False) else "")
    return None


def _ds_tree_is_ours(top: Path) -> str | None:
    """None when the folder ``top`` holds only what export-ds writes in a tag folder; else the
    first foreign entry (relative to the destination)."""
    if top.is_symlink():
        return None  # unlinked, never followed
    for dirpath, dirnames, filenames in os.walk(top):
        rel = Path(dirpath).relative_to(top.parent)
        depth = len(rel.parts)  # 1: <tag>, 2: zero, 3: zero/<fqn>
        pattern = {1: _DS_TOP, 2: _DS_OPTIM, 3: _DS_ATOM}.get(depth)
        for name in filenames:
            if pattern is None or not pattern.fullmatch(name) or os.path.islink(os.path.join(dirpath, name)):
                return (rel / name).as_posix()
        for name in dirnames:
            if os.path.islink(os.path.join(dirpath, name)) or not (depth == 1 and name == "zero" or depth == 2):
                return (rel / name).as_posix() + "/"
    return None


_LEGACY_ITER = re.compile(r"iter_\d{7,}|release")
_LEGACY_RANK = re.compile(r"mp_rank_\d{2,}(_\d{3,}){0,2}")
_LEGACY_FILE = re.compile(r"(model_optim_rng|distrib_optim)\.pt")


def _legacy_tree_is_ours(top: Path) -> str | None:
    """None when ``top`` is an ``iter_*`` folder holding only what a megatron-legacy target
    writes (``mp_rank_*/model_optim_rng.pt``, ``distrib_optim.pt``); else the first foreign entry."""
    if top.is_symlink():
        return None
    if not _LEGACY_ITER.fullmatch(top.name):
        return top.name + "/"
    for dirpath, dirnames, filenames in os.walk(top):
        rel = Path(dirpath).relative_to(top.parent)
        depth = len(rel.parts)  # 1: iter_*, 2: mp_rank_*
        for name in filenames:
            if depth != 2 or not _LEGACY_FILE.fullmatch(name) or os.path.islink(os.path.join(dirpath, name)):
                return (rel / name).as_posix()
        for name in dirnames:
            if depth != 1 or not _LEGACY_RANK.fullmatch(name) or os.path.islink(os.path.join(dirpath, name)):
                return (rel / name).as_posix() + "/"
    return None


def foreign_entries(out: Path) -> tuple[list[str], bool]:
    """(entries of ``out`` ckptconv would not have written there, whether any entry is a
    signature of a ckptconv output). Folders are named with a trailing ``/``."""
    foreign: list[str] = []
    signed = False
    # an export-ds tag folder is ckptconv's only beside its output record or journal (a DeepSpeed
    # universal checkpoint that ds_to_universal.py wrote looks the same)
    recorded = (out / OUTPUT_RECORD).is_file() or (out / JOURNAL_NAME).is_file()
    extra = recorded_files(out)
    for entry in sorted(os.scandir(out), key=lambda e: e.name):
        name = entry.name
        if _SIG_RE.fullmatch(name) and not (name == "zarr.json" and entry.is_symlink()):  # (a link alone: no sign)
            signed = True
        if entry.is_dir(follow_symlinks=False):
            if RANK_DIR_RE.fullmatch(name):
                continue
            if name in _OWN_DIRS[UNIVERSAL]:
                bad = _tree_is_ours(Path(entry.path))
                if bad is not None:
                    foreign.append(bad)
                continue
            if name == SHARDED_DIR and recorded:  # the per-rank files of a --consolidate output
                bad = _sharded_is_ours(Path(entry.path))
                if bad is None:
                    continue
            if recorded and not name.startswith("."):
                tree = _legacy_tree_is_ours if _LEGACY_ITER.fullmatch(name) else _ds_tree_is_ours
                bad = tree(Path(entry.path))
                if bad is None:
                    continue
            foreign.append(name + "/")
        elif entry.is_symlink() and name in _OWN_DIRS[UNIVERSAL]:
            continue  # a link where ckptconv puts a folder: unlinked, never followed
        elif not _FILE_RE.fullmatch(name) and not (name in extra and not entry.is_symlink()):
            foreign.append(name)
    return foreign, signed


def refuse_foreign_keys(dst: str, rels: list[str]) -> None:
    """For ``--overwrite`` of a URL destination: refuse unless every object under it (``rels``,
    relative paths) is one a ckptconv output holds."""
    _refuse_unrecorded(unrecorded_checkpoint([r for r in rels if "/" not in r]), dst)
    foreign = sorted(r for r in rels if not owned_path(r))
    signed = any("/" not in r and _SIG_RE.fullmatch(r) for r in rels)
    if foreign or not signed:
        raise DestinationError(
            f"{dst}: not a ckptconv output (found {_listing(foreign or sorted(rels))}); --overwrite only replaces "
            "an empty prefix or a previous ckptconv output: remove those objects yourself or choose another prefix"
        )


def _listing(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _empty_except_lock(out: Path) -> bool:
    return all(e.name == LOCK_NAME for e in os.scandir(out))


def _clear(out: Path) -> None:
    """Remove every entry of ``out`` but the lock; links are unlinked, never followed. The
    completion markers go first, then the journal, then the data: an interrupted clear leaves
    neither a complete-looking output nor a journal naming chunks already deleted."""
    first = (*MARKERS.values(), "model.safetensors", JOURNAL_NAME)
    last = len(first) + 1  # the output record goes last: what an interrupted clear leaves is still ours

    def order(e: os.DirEntry) -> int:  # (rank-local metadata with the markers: what dcp.load would read)
        if e.name in first:
            return first.index(e.name)
        return last if e.name == OUTPUT_RECORD else len(first) - 1 if _RANK_MD_RE.fullmatch(e.name) else len(first)

    entries = sorted(os.scandir(out), key=order)
    for entry in entries:
        if entry.name == LOCK_NAME:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)  # never follows links inside (fd-based rmtree)
        else:
            os.unlink(entry.path)


def complete_marker(out: Path) -> str | None:
    """The completion marker of the ckptconv output in ``out`` (None: not complete); a link is
    never a marker (ckptconv writes none)."""
    # a DCP safetensors output's marker follows its (HF) index; an unsharded HF export:
    # model.safetensors is renamed in last
    for name in (ST_MARKER, *MARKERS.values(), "model.safetensors"):
        if (out / name).is_file() and not (out / name).is_symlink():
            return name
    return None


def _kind_of_marker(marker: str, out: Path | None = None) -> str:
    if marker == ST_MARKER and out is not None and _read_bookkeeping(out / ST_MARKER, "format") == "dcp":
        return f"{DCP} with rank-local metadata"  # from-universal --local-files rank|node
    return {"ckptconv.json": UNIVERSAL, ".metadata": DCP, "latest_universal": DEEPSPEED, ST_MARKER: DCP_ST,
            LEGACY_TRACKER: MEGATRON_LEGACY}.get(marker, HF)


# ----------------------------------------------------------------------------------------------
# the lock


@dataclass
class DestinationLock:
    """The ``flock`` on ``<dst>/.ckptconv-lock``, held until :meth:`release`."""

    path: Path
    fd: int

    def release(self) -> None:
        """Drop the lock and remove the lock file (only while it is still this lock's file)."""
        if self.fd < 0:
            return
        try:
            st, cur = os.fstat(self.fd), os.stat(self.path, follow_symlinks=False)
            if (st.st_dev, st.st_ino) == (cur.st_dev, cur.st_ino):
                os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1


def _holder_text(raw: bytes) -> str:
    try:
        doc = json.loads(raw.decode())
        return (f"pid {doc['pid']} on {doc['host']}, `{doc['command']}`, since {doc['since']}")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "a process that has not written its name yet"


def lock_holder(out: Path) -> str | None:
    """Who holds the lock of ``out`` now (None: nobody; a lock file of a dead process is free)."""
    import fcntl

    try:
        fd = os.open(out / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder_text(os.pread(fd, 4096, 0))
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _command_line() -> str:
    args = [os.path.basename(sys.argv[0]) if sys.argv else "python", *sys.argv[1:]]
    if args and args[0] in ("__main__.py", "-m"):
        args[0] = "ckptconv"
    text = " ".join(args)
    return clip(text, 300)  # whole words, "..." when cut


def acquire_lock(out: Path) -> DestinationLock:
    """Lock ``out`` for this process, or refuse with one line naming the holder."""
    import fcntl

    path = out / LOCK_NAME
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise DestinationError(f"{path}: cannot create the lock file ({e.strerror}); remove it if it is a "
                                   "link, or choose another destination") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_text(os.pread(fd, 4096, 0))
            os.close(fd)
            raise DestinationError(
                f"{out}: another ckptconv run is writing here ({holder}); wait for it to finish or stop it, then rerun"
            ) from None
        try:  # the holder before us may have removed the file after we opened it: lock the new one
            st, cur = os.fstat(fd), os.stat(path, follow_symlinks=False)
            same = (st.st_dev, st.st_ino) == (cur.st_dev, cur.st_ino)
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            continue
        since = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        doc = {"pid": os.getpid(), "host": socket.gethostname(), "command": _command_line(), "since": since}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(doc).encode(), 0)
        return DestinationLock(path, fd)


#: Locks taken during the current guarded call (released when it returns).
_HELD: contextvars.ContextVar[list[DestinationLock] | None] = contextvars.ContextVar("ckptconv_locks", default=None)


# ----------------------------------------------------------------------------------------------
# identity


def _top_files(src: str | os.PathLike) -> list[list[Any]] | None:
    """[name, size, mtime_ns] of the regular files directly in a local ``src`` (None for a URL)."""
    from formats.storage import is_remote, local_path

    if is_remote(src):
        return None
    root = local_path(src)
    out = []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.name.startswith(".ckptconv-"):
            continue
        if entry.is_file():
            st = entry.stat()
            out.append([entry.name, st.st_size, st.st_mtime_ns])
    return out


def source_identity(src: str | os.PathLike, index: Any) -> dict[str, Any]:
    """What makes a source this source: its path, a fingerprint of its index (keys, dtypes,
    shapes, chunks) and the name, size and modification time of its top-level files (the
    ``.metadata`` / ``ckptconv.json`` / safetensors files and, for DCP and HF, the data)."""
    from converter.run.journal import index_fingerprint
    from formats.storage import source_label

    return {"path": source_label(src), "index": index_fingerprint(index), "files": _top_files(src)}


def option_value(value: Any) -> Any:
    """How an option is recorded in the journal header: a name or number as given; a file (a plan,
    key map or config) with a hash of its contents; another object (a mapping, a KeyMap given to
    the Python API) by a hash of its repr."""
    import xxhash

    if value is None or isinstance(value, (int, float, bool)):
        return value
    if isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        if os.path.isfile(text):
            return f"{text} (contents {xxhash.xxh3_64_hexdigest(Path(text).read_bytes())})"
        return text
    if isinstance(value, Mapping):
        value = json.dumps(value, sort_keys=True, default=repr)
    return f"(contents {xxhash.xxh3_64_hexdigest(repr(value).encode())})"


def conversion_header(op: str, src: str | os.PathLike, index: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    """The journal header of a conversion: operation, tool version, source identity and the
    options that shape its output (``{"--mesh": "tp2,dp3", ...}``, as the user would write them)."""
    from converter import __version__

    return {"op": op, "tool": __version__, "source": source_identity(src, index), "options": dict(options)}


def header_difference(old: Any, new: Mapping[str, Any]) -> str | None:
    """Why the journal header ``old`` is not the conversion ``new`` (None: the same conversion)."""
    if not isinstance(old, dict) or not {"op", "source", "options"} <= set(old):
        return "it was written by another ckptconv version"
    if old == new:
        return None
    if old["op"] != new["op"]:
        return f"it ran {old['op']}, this run is {new['op']}"
    was, now = old["source"], new["source"]
    if was.get("path") != now.get("path"):
        return f"it converted {was.get('path')}, this run converts {now.get('path')}"
    if was.get("index") != now.get("index"):
        return f"the source {now.get('path')} has other tensors or chunks than it had then"
    if was.get("files") != now.get("files"):
        before = {f[0]: f[1:] for f in was.get("files") or []}
        after = {f[0]: f[1:] for f in now.get("files") or []}
        changed = sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))
        return (f"the source {now.get('path')} changed since (size or modification time of "
                f"{_listing(changed, 3)})")
    for name in sorted(old["options"].keys() | new["options"].keys()):
        a, b = old["options"].get(name), new["options"].get(name)
        if a != b:
            return f"it ran with {_option_text(name, a)}, this run with {_option_text(name, b)}"
    if old.get("tool") != new.get("tool"):
        return f"it was written by ckptconv {old.get('tool')}, this is {new.get('tool')}"
    extra = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    return f"its {', '.join(extra)} differ"


def _option_text(name: str, value: Any) -> str:
    return f"{name} {value}" if value is not None else f"no {name}"


#: Most bytes read for a journal's header line (it lists the source's top-level files).
MAX_HEADER_BYTES = 64 << 20


def _read_header(out: Path) -> Any:
    """The header of the journal in ``out``; None if absent or unreadable (:func:`_read_bookkeeping`)."""
    return _read_bookkeeping(out / JOURNAL_NAME, "header", first_line=True)


def _read_bookkeeping(path: Path, field: str, first_line: bool = False) -> Any:
    """``field`` of the JSON document in the file ``path`` (its first line only with
    ``first_line``); None if absent or unreadable. A link or anything but a regular file is never
    read (a source directory may be hostile), nor more than :data:`MAX_HEADER_BYTES`."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.readline(MAX_HEADER_BYTES) if first_line else f.read(MAX_HEADER_BYTES)
        return json.loads(data)[field]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    finally:
        os.close(fd)


def _strip_rank(header: Any) -> Any:
    if isinstance(header, dict):
        return {k: v for k, v in header.items() if k not in ("world", "rank")}
    return header


def _describe_header(header: Any) -> str:
    if isinstance(header, dict) and isinstance(header.get("source"), dict):
        return f"ckptconv {header.get('op')} from {header['source'].get('path')}"
    if isinstance(header, dict) and header.get("op"):
        return f"ckptconv {header.get('op')}"
    return "ckptconv"


# ----------------------------------------------------------------------------------------------
# checks


def _check_overlap(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    from formats.storage import is_remote, local_path

    d = Path(dst).resolve()
    if is_remote(src):
        return d
    s = local_path(src).resolve()
    if d == s or s in d.parents:
        raise DestinationError(f"{dst}: destination is inside the source {src}; choose a directory outside it")
    if d in s.parents:
        raise DestinationError(f"{dst}: destination contains the source {src}; choose another directory")
    return d


def write_complete_marker(out: Path, doc: Mapping[str, Any]) -> None:
    """Mark a DCP safetensors output in ``out`` complete (its last file; ``doc``: what it holds)."""
    from formats.fsutil import atomic_write_bytes

    atomic_write_bytes(out / ST_MARKER, (json.dumps(dict(doc), sort_keys=True, indent=1) + "\n").encode())


def write_loads_manifest(out: Path, loads: Sequence[Sequence[str]]) -> None:
    """Record in ``out`` the files each rank's ``dcp.load`` opens (``loads[rank]``: names in ``out``).
    Written just before the completion marker, whose directory fsync makes this rename durable too
    (one directory fsync for both, as for the data files before them)."""
    from formats.fsutil import atomic_write_bytes

    names = sorted({n for files in loads for n in files}, key=_file_order)
    at = {n: i for i, n in enumerate(names)}
    doc = {"schema": LOADS_SCHEMA, "world_size": len(loads), "files": names,
           "loads": [[at[n] for n in files] for files in loads]}
    atomic_write_bytes(out / LOADS_MANIFEST, json.dumps(doc, separators=(",", ":")).encode(), sync_dir=False)


def _file_order(name: str) -> tuple:
    m = re.fullmatch(r"__(\d+)_(\d+)\.distcp", name)
    return (1, int(m.group(1)), int(m.group(2))) if m else (0, 0, name)


def write_output_record(out: Path, header: Mapping[str, Any], files: Sequence[str] = ()) -> None:
    """Mark the output in ``out`` as ckptconv's and name the conversion ``header`` (its journal
    header, less the rank) that wrote it; written just before the output's completion marker.
    ``files``: the top-level files it writes beyond its format's own (an ``export-hf --like``
    copies the base's tokenizer and config files and uses its shard names), which ``--overwrite``
    may then remove."""
    from formats.fsutil import atomic_write_bytes

    record: dict[str, Any] = {"written_by": "ckptconv", "op": header.get("op"), "tool": header.get("tool")}
    if "source" in header:  # a whole journal header (an early record before the data names no conversion)
        record["conversion"] = _strip_rank(dict(header))
    if files:
        record["files"] = sorted(set(files))
    atomic_write_bytes(out / OUTPUT_RECORD, json.dumps(record, sort_keys=True, default=str).encode())


def recorded_files(out: Path) -> frozenset[str]:
    """The extra top-level files the output record in ``out`` names (plain names, no paths)."""
    try:
        doc = json.loads((out / OUTPUT_RECORD).read_bytes())
    except (OSError, ValueError):
        return frozenset()
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, list):
        return frozenset()
    return frozenset(f for f in files if isinstance(f, str) and f and "/" not in f and f not in (".", ".."))


def unrecorded_checkpoint(names: list[str]) -> list[str]:
    """The DCP checkpoint files among the top-level ``names`` of a destination when neither
    ckptconv's output record nor its journal is there (a checkpoint ckptconv did not write)."""
    if OUTPUT_RECORD in names or JOURNAL_NAME in names:
        return []
    return sorted(n for n in names if _CHECKPOINT_FILES.fullmatch(n))


def _refuse_unrecorded(found: list[str], dst: Any) -> None:
    if found:
        raise DestinationError(
            f"{dst}: holds a checkpoint ckptconv did not write (found {_listing(found)}, no {OUTPUT_RECORD}); "
            "--overwrite only replaces ckptconv's own outputs: delete it yourself or choose another path"
        )


def _refuse_foreign(out: Path, dst: Any, what: str) -> None:
    if what == "--overwrite":
        _refuse_unrecorded(unrecorded_checkpoint([e.name for e in os.scandir(out)]), dst)
    foreign, signed = foreign_entries(out)
    if foreign or not signed:
        found = _listing(foreign or sorted(e.name for e in os.scandir(out)))
        does = ("only continues a ckptconv output" if what == "--resume" else
                "only replaces an empty directory or a previous ckptconv output")
        raise DestinationError(
            f"{dst}: not a ckptconv output (found {found}); {what} {does}: remove those files yourself or choose "
            "another path"
        )


def _check_no_links(out: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(out):
        for name in dirnames + filenames:
            if os.path.islink(os.path.join(dirpath, name)):
                raise DestinationError(
                    f"{os.path.join(dirpath, name)}: a symlink inside the partial destination; ckptconv never "
                    "writes through links: remove it, or start over with --overwrite"
                )


def prepare(src: str | os.PathLike, dst: str | os.PathLike, header: Mapping[str, Any], *, overwrite: bool,
            resume: bool, world: int = 1) -> tuple[Path, str]:
    """Lock ``dst`` and make it ready for the conversion ``header`` (run on rank 0 only):
    ``(out, what to do)``, one of :data:`START`, :data:`RESUME`, :data:`COMPLETE`.

    * resume: a missing or empty ``dst`` starts the conversion; the journal of the same conversion
      (same operation, source, output options and world size) continues it; a complete output of
      the same conversion (its :data:`OUTPUT_RECORD`) is :data:`COMPLETE` (a journal left by a
      run stopped after its marker is dropped); anything else is refused;
    * overwrite: ``dst`` may hold only a ckptconv output (complete or partial), which is removed;
    * otherwise ``dst`` must be empty or absent.

    Nothing is created in a directory that is refused. The lock is held until the guarded call
    returns (:func:`guarded`).
    """
    out = _check_overlap(src, dst)
    if out.exists() and not out.is_dir():
        raise DestinationError(f"{dst}: exists and is not a directory; choose a new path")
    if out.is_dir():
        _check_contents(out, dst, header, overwrite, resume, world, locked=False)
    out.mkdir(parents=True, exist_ok=True)
    lock = acquire_lock(out)
    held = _HELD.get()
    try:
        what = _check_contents(out, dst, header, overwrite, resume, world, locked=True)
    except BaseException:
        lock.release()
        raise
    if held is None:  # an unguarded caller: nothing would release it later
        lock.release()
    else:
        held.append(lock)
    return out, what


def _check_contents(out: Path, dst: Any, header: Mapping[str, Any], overwrite: bool, resume: bool, world: int,
                    locked: bool) -> str:
    """Refuse what ``out`` holds, or (``locked``, overwrite) clear it; what to do there."""
    if not locked and (holder := lock_holder(out)) is not None:
        raise DestinationError(
            f"{dst}: another ckptconv run is writing here ({holder}); wait for it to finish or stop it, then rerun"
        )
    if resume:
        if _nothing_written(out):
            return START
        _refuse_foreign(out, dst, "--resume")
        what = _check_resume(out, dst, header, world)
        if what == COMPLETE and locked:
            _drop_stale_journals(out)
        return what
    if not _empty_except_lock(out):
        if not overwrite:
            _refuse_non_empty(out, dst)
        _refuse_foreign(out, dst, "--overwrite")
        if locked:
            _clear(out)
    return START


def _nothing_written(out: Path) -> bool:
    """Whether ``out`` holds nothing a conversion wrote: only the lock, torchrun rank folders
    without a journal, or an empty journal (a run stopped before its journal's first line, which
    precedes every output file)."""
    for entry in os.scandir(out):
        if entry.name == LOCK_NAME:
            continue
        if entry.name == JOURNAL_NAME and entry.is_file(follow_symlinks=False) and entry.stat().st_size == 0:
            continue
        if RANK_DIR_RE.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
            continue  # rank journals without rank 0's: nothing was written yet
        return False
    return True


def _drop_stale_journals(out: Path) -> None:
    """Remove the journals a run stopped between its commit and their removal left beside its
    complete output (what the commit would have removed next)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(out / JOURNAL_NAME)
    for entry in os.scandir(out):
        if RANK_DIR_RE.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)


def _refuse_non_empty(out: Path, dst: Any) -> None:
    if (out / JOURNAL_NAME).is_file() and complete_marker(out) is None:
        raise DestinationError(
            f"{dst}: holds the partial output of an interrupted {_describe_header(_read_header(out))}; pass "
            "--resume to continue it or --overwrite to start over"
        )
    marker = complete_marker(out)
    if marker is not None and not foreign_entries(out)[0]:
        raise DestinationError(
            f"{dst}: already holds a complete {_kind_of_marker(marker, out)} ({marker}); pass --overwrite to replace it "
            "or choose a new path"
        )
    raise DestinationError(f"{dst}: destination is not empty; pass --overwrite to replace it or choose a new path")


def _written_from(out: Path, marker: str) -> str:
    """`` (written from SRC)`` when the marker records its source (a universal store's does)."""
    if marker != "ckptconv.json":
        return ""
    try:
        return f" written from {json.loads((out / marker).read_bytes())['source']['path']}"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def _recorded_conversion(out: Path) -> Any:
    """The conversion header :func:`write_output_record` kept in ``out`` (None: none, or unreadable)."""
    return _read_bookkeeping(out / OUTPUT_RECORD, "conversion")


def _check_resume(out: Path, dst: Any, header: Mapping[str, Any], world: int) -> str:
    marker = complete_marker(out)
    if marker is not None:
        done = _recorded_conversion(out)
        why = (f"its {OUTPUT_RECORD} names no conversion: an older ckptconv or another tool wrote it" if done is None
               else header_difference(done, header))
        if why is None:
            return COMPLETE
        raise DestinationError(
            f"{dst}: already holds a complete {_kind_of_marker(marker, out)} ({marker}{_written_from(out, marker)}) of "
            f"another conversion ({why}): nothing to resume; pass --overwrite instead of --resume to convert again"
        )
    if not (out / JOURNAL_NAME).is_file():
        raise DestinationError(
            f"{dst}: nothing to resume (no {JOURNAL_NAME}); run without --resume (add --overwrite to replace it)"
        )
    _check_no_links(out)
    old = _read_header(out)
    was_world = old.get("world", 1) if isinstance(old, dict) else 1
    if was_world != world:
        raise DestinationError(
            f"{dst}: the interrupted conversion there ran on {was_world} rank(s), this run has {world}; resume it "
            "with the same world size (torchrun --nnodes/--nproc-per-node), or --overwrite to start over"
        )
    why = header_difference(_strip_rank(old), header)
    if why is not None:
        raise DestinationError(
            f"{dst}: cannot resume: the interrupted run there was a different conversion ({why}); rerun it "
            "exactly as before, or pass --overwrite to start over"
        )
    return RESUME


def unfinished_message(path: Path) -> str | None:
    """For a local directory without a completion marker that a ckptconv run is writing (or was
    writing when it was stopped): what it is and what to do; None otherwise."""
    try:
        if not path.is_dir() or complete_marker(path) is not None:
            return None
    except OSError:
        return None
    holder = lock_holder(path)
    header = _read_header(path)
    what = _describe_header(header)
    kind = KIND_OF_OP.get(header.get("op")) if isinstance(header, dict) else None
    if holder is not None:
        return (f"{path}: incomplete: a running {what} is writing it ({holder}); wait for it to finish")
    if header is None:
        return None
    return (f"{path}: incomplete {kind or 'output'}: the {what} that wrote it was stopped before it finished; "
            f"rerun that command with --resume to finish it (or with --overwrite to start over)")


# ----------------------------------------------------------------------------------------------
# interrupts


class Interrupted(KeyboardInterrupt):
    """A conversion stopped by SIGINT / SIGTERM; ``str()`` says what to do next."""

    def __init__(self, message: str, signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.signum = signum

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "aborted"


class Terminated(KeyboardInterrupt):
    """Raised in the main thread by the CLI's SIGTERM handler."""

    signum = signal.SIGTERM


def _interrupted(e: KeyboardInterrupt, locks: list[DestinationLock]) -> Interrupted:
    signum = getattr(e, "signum", signal.SIGINT)
    how = "terminated" if signum == signal.SIGTERM else "interrupted"
    if isinstance(e, Interrupted):
        return e
    outs = [lk.path.parent for lk in locks]
    if outs and (outs[0] / JOURNAL_NAME).is_file() and complete_marker(outs[0]) is None:
        return Interrupted(f"aborted ({how}); the partial output in {outs[0]} is kept: rerun the same command "
                           "with --resume to continue", signum)
    return Interrupted(f"aborted ({how})", signum)


def guarded(fn: F) -> F:
    """Decorate a conversion: locks taken by :func:`prepare` during the call are released when it
    returns or fails, and an interrupt becomes :class:`Interrupted` (saying whether ``--resume``
    continues it)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        locks: list[DestinationLock] = []
        token = _HELD.set(locks)
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt as e:
            raise _interrupted(e, locks) from None
        finally:
            _HELD.reset(token)
            for lock in locks:
                lock.release()

    return run  # type: ignore[return-value]
