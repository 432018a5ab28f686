"""Remote destinations (``s3://``, ``gs://``, any fsspec URL): spool locally, upload, marker last.

The writers need local files (``pwrite``, ``rename``), so a conversion whose destination is a URL
writes into a local spool directory (``--spool-dir``, env ``CKPTCONV_SPOOL_DIR``, default the
system temp dir) and uploads from there; the completion marker -- ``ckptconv.json`` for a
universal store, ``.metadata`` for DCP, ``model.safetensors.index.json`` (or the single
``model.safetensors``) for HF -- goes up strictly last, so an interrupted run never looks complete.

* Universal outputs (``to-universal``, ``import-hf``) stream: each chunk / object file is uploaded
  as soon as the writer makes it final (:func:`spool_hook`, a pool of :func:`upload_threads`) and deleted
  from the spool. Uploads waiting hold at most ``--memory-budget`` bytes of spool, and a slow
  upload blocks the writer (back-pressure), so the spool never holds more than about twice the
  memory budget. The ``zarr.json`` files and the marker go up at the end.
* DCP and HF outputs (``from-universal``, ``export-hf``) are ``pwrite``-n into files that are final
  only when the writer closes them all, so the spool needs room for the whole output; the free
  space is checked up front (one-line StorageError naming ``--spool-dir``).
* Under torchrun (universal outputs only) every rank spools and uploads its own chunks; rank 0
  uploads the metadata and, after every rank reported a successful upload, the marker.

The hook is a decorator on the API functions (``to_universal``, ``from_universal``, ``export_hf``,
``import_hf``), all shaped ``fn(src, dst, ..., options=...)``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from converter import knobs
from formats.errors import ConfigError, DestinationError, StorageError
from formats.storage import RemoteStorage, is_remote, is_url, local_path

F = TypeVar("F", bound=Callable[..., Any])

#: Files whose presence marks an output complete; uploaded after everything else.
MARKERS = ("ckptconv.json", ".metadata", "model.safetensors.index.json", ".ckptconv-complete.json")
#: Markers uploaded after the other markers (a DCP safetensors output's marker follows its index).
_LAST = ("ckptconv.json", ".ckptconv-complete.json")
#: Local-only bookkeeping that is never uploaded.
_SKIP_PREFIXES = (".ckptconv-journal", ".ckptconv-rank-", ".ckptconv-lock")
#: API functions whose output (a universal store) is uploaded while the conversion runs.
STREAMED = ("to_universal", "import_hf")
#: Extra spool room asked for beyond the planned output bytes of a DCP / HF output.
SPOOL_SLACK_BYTES = 16 << 20
#: Fewest upload threads (each is one request in flight; small files are latency-bound).
MIN_UPLOAD_THREADS = 8


def upload_threads(workers: int) -> int:
    """Upload threads for ``--workers``: uploads wait on the network, not the CPU, so at least
    :data:`MIN_UPLOAD_THREADS`."""
    return max(MIN_UPLOAD_THREADS, workers)


def _bind(fn: Callable[..., Any], src: Any, dst: Any, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    return inspect.signature(fn).bind(src, dst, *args, **kwargs)


def _options(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    from converter.config import RunOptions

    bound = inspect.signature(fn).bind_partial(None, None, *args, **kwargs)
    return bound.arguments.get("options") or RunOptions()


def _overlaps(src: Any, dst: str) -> bool:
    if not is_url(src):
        return False
    a, b = str(src).rstrip("/") + "/", dst.rstrip("/") + "/"
    return a.startswith(b) or b.startswith(a)


def prepare_remote(src: Any, dst: str, overwrite: bool) -> RemoteStorage:
    """Check a URL destination: outside the source, empty (or emptied with ``overwrite``)."""
    if _overlaps(src, dst):
        raise DestinationError(f"{dst}: destination overlaps the source {src}; choose another prefix")
    st = RemoteStorage(dst)
    names = st.list()
    if names and not overwrite:
        raise DestinationError(f"{dst}: destination is not empty; pass --overwrite to replace it or choose a new prefix")
    if names:
        from converter.run.destination import refuse_foreign_keys

        refuse_foreign_keys(dst, st.list_all())
        st.remove_all()
    return st


def spool_root(options: Any) -> Path:
    """A fresh spool directory under ``--spool-dir`` / ``CKPTCONV_SPOOL_DIR`` / the temp dir."""
    base = getattr(options, "spool_dir", None) or knobs.SPOOL_DIR or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="ckptconv-spool-", dir=base))


def check_spool_space(spool: Path, need: int, dst: str, what: str) -> None:
    """StorageError (one line, naming ``--spool-dir``) when the spool's filesystem has less than
    ``need`` bytes free."""
    from converter.units import human_bytes

    free = shutil.disk_usage(spool).free
    if free < need:
        raise StorageError(
            f"{spool.parent}: the spool for {dst} needs {human_bytes(need)} ({need} bytes; {what}) but its filesystem "
            f"has {human_bytes(free)} ({free} bytes) free; "
            "pass --spool-dir (or CKPTCONV_SPOOL_DIR) on a filesystem with room"
        )


def _files(out: Path) -> tuple[list[str], list[str]]:
    """(data files, marker files) under ``out``, as relative POSIX names; markers in upload order."""
    data, markers = [], []
    for dirpath, dirnames, names in os.walk(out):
        dirnames[:] = [d for d in dirnames if not d.startswith(_SKIP_PREFIXES)]
        for name in names:
            rel = Path(dirpath, name).relative_to(out).as_posix()
            # writers' temp files (".x.tmp", ".x.tmp-<pid>", "model-...safetensors.tmp") never go up;
            # after a successful run there are none
            if name.startswith(_SKIP_PREFIXES) or (name.startswith(".") and ".tmp" in name) or name.endswith(".safetensors.tmp"):
                continue
            (markers if rel in MARKERS else data).append(rel)
    singles = [d for d in data if d.endswith(".safetensors") and "/" not in d]
    if not markers and len(singles) == 1:  # an unsharded HF export: the file is the marker
        data.remove(singles[0])
        markers.append(singles[0])
    markers.sort(key=lambda m: (m in _LAST, m))
    return data, markers


def _put(out: Path, st: RemoteStorage, rel: str) -> int:
    """Upload ``out/rel`` to ``st/rel`` and delete the local file; its size."""
    local = out / rel
    size = local.stat().st_size
    st.put_file(local, rel)
    local.unlink()
    return size


class Uploader:
    """Uploads files of the spool ``out`` as they become final (a pool of ``workers`` threads).

    :meth:`__call__` (the writer's ``on_file_final`` hook) queues one file; it blocks while the
    queued-and-uploading files hold ``limit`` bytes or more (back-pressure on the writer), and
    raises the first upload error (so the conversion fails, and no marker is uploaded).
    """

    def __init__(self, out: Path, st: RemoteStorage, workers: int, limit: int) -> None:
        self.out, self.st, self.limit = out, st, max(1, limit)
        self._pool = ThreadPoolExecutor(upload_threads(workers), thread_name_prefix="ckptconv-upload")
        self._cond = threading.Condition()
        self._pending = 0  # bytes queued or uploading
        self._futures: list[Future] = []
        self._error: BaseException | None = None
        self.uploaded = 0
        self.peak_pending = 0

    def __call__(self, rel: str) -> None:
        size = (self.out / rel).stat().st_size
        with self._cond:
            while self._error is None and self._pending and self._pending + size > self.limit:
                self._cond.wait()
            if self._error is not None:
                raise self._error
            self._pending += size
            self.peak_pending = max(self.peak_pending, self._pending)
            self._futures.append(self._pool.submit(self._upload, rel, size))

    def _upload(self, rel: str, size: int) -> None:
        try:
            _put(self.out, self.st, rel)
        except BaseException as e:  # noqa: BLE001 - handed to the writer's thread and to drain()
            with self._cond:
                self._error = self._error or e
        finally:
            with self._cond:
                self._pending -= size
                self.uploaded += size
                self._cond.notify_all()

    def drain(self) -> None:
        """Wait for every queued upload; raise the first upload error."""
        with self._cond:
            futures, self._futures = self._futures, []
        for f in futures:
            f.result()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Stop: queued uploads not started are dropped (after a failure)."""
        with self._cond:
            self._error = self._error or StorageError("upload stopped")
            self._cond.notify_all()
        self._pool.shutdown(wait=True, cancel_futures=True)


#: Resolved spool output dir -> its uploader, while a streamed conversion runs (see spool_hook).
_SPOOLS: dict[str, Uploader] = {}


def spool_hook(out: str | os.PathLike) -> Callable[[str], None] | None:
    """The ``on_file_final`` hook for a writer whose root is ``out``: the uploader when ``out`` is
    the spool of a URL destination, else None (a local destination: nothing to do)."""
    return _SPOOLS.get(str(Path(out).resolve()))


def upload(out: Path, st: RemoteStorage, workers: int, *, data: bool = True, markers: bool = True) -> int:
    """Upload what is left in the spool: data files in parallel (each deleted once uploaded), then
    the markers one by one. Returns the bytes uploaded."""
    data_files, marker_files = _files(out)
    total = 0
    if data:
        with ThreadPoolExecutor(upload_threads(workers)) as pool:
            total += sum(pool.map(lambda rel: _put(out, st, rel), sorted(data_files)))
    if markers:
        for rel in marker_files:
            total += _put(out, st, rel)
        st.refresh()
    return total


def _check_supported(streamed: bool, options: Any, dst: str, dist: Any) -> None:
    if getattr(options, "resume", False):
        raise ConfigError(f"{dst}: --resume needs a local destination; rerun with --overwrite (the conversion "
                          "starts over), or convert to a local directory and copy it up")
    if dist.active and not streamed:
        raise ConfigError(f"{dst}: a URL destination for a DCP or HF output is not supported under torchrun (every "
                          "rank writes into the same files); write to a shared filesystem path and copy it up, "
                          "or run on one process")


def _planned_bytes(fn: Callable[..., Any], src: Any, dst: Any, args: tuple, kwargs: dict, options: Any) -> int:
    """The output bytes a dry run of the same call plans."""
    bound = _bind(fn, src, dst, args, kwargs)
    bound.arguments["options"] = dataclasses.replace(options, dry_run=True)
    return int(fn(*bound.args, **bound.kwargs).bytes)


def _finish(out: Path, st: RemoteStorage, uploader: Uploader, workers: int, dist: Any) -> None:
    """Upload what is left, then (after every rank succeeded) the marker, from rank 0."""
    error: BaseException | None = None
    try:
        uploader.drain()
        if dist.leader:  # the others' leftovers (zarr.json copies) are rank 0's too
            upload(out, st, workers, markers=False)
    except BaseException as e:  # noqa: BLE001 - re-raised by agree on every rank
        error = e
    dist.agree(error)
    dist.on_leader(lambda: upload(out, st, workers, data=False))


def remote_destination(fn: F, streamed: bool | None = None) -> F:
    """Decorate ``fn(src, dst, ..., options=...)``: a URL ``dst`` is spooled locally and uploaded
    (marker last); ``file://`` URLs become local paths; local paths pass through untouched.
    ``streamed``: the output (a universal store) is uploaded file by file while ``fn`` runs
    (default: ``fn`` is one of :data:`STREAMED`)."""
    streamed = fn.__name__ in STREAMED if streamed is None else streamed

    @functools.wraps(fn)
    def wrapper(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
        from converter.run import distributed

        if not is_remote(dst):
            return fn(src, local_path(dst) if is_url(dst) else dst, *args, **kwargs)
        options = _options(fn, args, kwargs)
        if options.dry_run:
            return fn(src, dst, *args, **kwargs)
        dist = distributed.current()
        _check_supported(streamed, options, str(dst), dist)
        st = dist.on_leader(lambda: prepare_remote(src, str(dst), options.overwrite))
        st = st if st is not None else RemoteStorage(str(dst))
        spool = spool_root(options)
        out = spool / "out"
        out.mkdir()
        uploader = Uploader(out, st, options.workers, options.memory_budget)
        try:
            if streamed:
                need = 2 * options.memory_budget
                check_spool_space(spool, need, str(dst), "uploads in flight: twice --memory-budget")
                _SPOOLS[str(out.resolve())] = uploader
            else:
                need = _planned_bytes(fn, src, dst, args, kwargs, options) + SPOOL_SLACK_BYTES
                check_spool_space(spool, need, str(dst), "the whole output: DCP and HF files upload when complete")
            result = fn(src, out, *args, **kwargs)
            _finish(out, st, uploader, options.workers, dist)
        except KeyboardInterrupt as e:  # the spool goes away: --resume cannot continue a URL destination
            import signal

            from converter.run.destination import Interrupted

            signum = getattr(e, "signum", signal.SIGINT)
            how = "terminated" if signum == signal.SIGTERM else "interrupted"
            raise Interrupted(f"aborted ({how}); {dst} was not marked complete: rerun with --overwrite "
                              "(a URL destination cannot be resumed)", signum) from None
        finally:
            _SPOOLS.pop(str(out.resolve()), None)
            uploader.close()
            shutil.rmtree(spool, ignore_errors=True)
        return dataclasses.replace(result, dst=str(dst))

    return wrapper  # type: ignore[return-value]
