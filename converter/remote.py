"""Remote destinations (``s3://``, ``gs://``, any fsspec URL): spool locally, upload, marker last.

The writers need local files (``pwrite``, ``rename``, ``fsync``), so a conversion whose
destination is a URL writes into a local spool directory first (``--spool-dir``, env
``CKPTCONV_SPOOL_DIR``, default the system temp dir). When the conversion has finished, every
file is uploaded (a thread pool, ``--workers`` wide; each file is deleted from the spool once
uploaded) and the completion marker -- ``ckptconv.json`` for a universal store, ``.metadata`` for
DCP, ``model.safetensors.index.json`` (or the single ``model.safetensors``) for HF -- strictly
last, so an interrupted upload never looks complete. The spool needs room for the whole output.

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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from converter import knobs
from formats.errors import ConfigError, DestinationError
from formats.storage import RemoteStorage, is_remote, is_url, local_path, remote_errors

F = TypeVar("F", bound=Callable[..., Any])

#: Files whose presence marks an output complete; uploaded after everything else.
MARKERS = ("ckptconv.json", ".metadata", "model.safetensors.index.json")
#: Local-only bookkeeping that is never uploaded.
_SKIP_PREFIXES = (".ckptconv-journal",)


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
        with remote_errors(dst):
            st.fs.rm(st._key(""), recursive=True)
            st.fs.invalidate_cache(st._key(""))
    return st


def spool_root(options: Any) -> Path:
    """A fresh spool directory under ``--spool-dir`` / ``CKPTCONV_SPOOL_DIR`` / the temp dir."""
    base = getattr(options, "spool_dir", None) or knobs.SPOOL_DIR or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="ckptconv-spool-", dir=base))


def _files(out: Path) -> tuple[list[str], list[str]]:
    """(data files, marker files) under ``out``, as relative POSIX names; markers in upload order."""
    data, markers = [], []
    for dirpath, _, names in os.walk(out):
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
    markers.sort(key=lambda m: (m == "ckptconv.json", m))
    return data, markers


def upload(out: Path, st: RemoteStorage, workers: int) -> int:
    """Upload the spooled output: data files in parallel (each deleted once uploaded), then the
    markers one by one. Returns the bytes uploaded."""
    data, markers = _files(out)

    def put(rel: str) -> int:
        local = out / rel
        size = local.stat().st_size
        with remote_errors(st.root / rel):
            st.fs.put_file(str(local), st._key(rel))
        local.unlink()
        return size

    with ThreadPoolExecutor(max(1, workers)) as pool:
        total = sum(pool.map(put, sorted(data)))
    for rel in markers:
        total += put(rel)
    with remote_errors(st.url):
        st.fs.invalidate_cache(st._key(""))
    return total


def _check_supported(options: Any, dst: str) -> None:
    from converter import distributed

    if getattr(options, "resume", False):
        raise ConfigError(f"{dst}: --resume needs a local destination; rerun with --overwrite (the conversion "
                          "starts over), or convert to a local directory and copy it up")
    if distributed.current().active:
        raise ConfigError(f"{dst}: a URL destination is not supported under torchrun yet; write to a shared "
                          "filesystem path and copy it up, or run on one process")


def remote_destination(fn: F) -> F:
    """Decorate ``fn(src, dst, ..., options=...)``: a URL ``dst`` is spooled locally and uploaded
    (marker last); ``file://`` URLs become local paths; local paths pass through untouched."""

    @functools.wraps(fn)
    def wrapper(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
        if not is_remote(dst):
            return fn(src, local_path(dst) if is_url(dst) else dst, *args, **kwargs)
        options = _options(fn, args, kwargs)
        if options.dry_run:
            return fn(src, dst, *args, **kwargs)
        _check_supported(options, dst)
        st = prepare_remote(src, str(dst), options.overwrite)
        spool = spool_root(options)
        try:
            result = fn(src, spool / "out", *args, **kwargs)
            upload(spool / "out", st, options.workers)
        finally:
            shutil.rmtree(spool, ignore_errors=True)
        return dataclasses.replace(result, dst=str(dst))

    return wrapper  # type: ignore[return-value]
