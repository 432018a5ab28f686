"""The one cache of built test checkpoints (fixture kinds, acceptance kinds, torchtitan saves).

An entry is built into a temp dir next to its final place and renamed in whole, with
``_complete.json`` (every file's size and xxh3) written before the rename, so an interrupted or
concurrent build is never used; the first rename wins. Entries are made read-only and every
session checks the manifest on first use and again on each later use: a test that changed a
cached checkpoint fails loudly (tests that must write take a private copy, see
:func:`writable_copy`). A cache directory's name carries a hash of the sources that decide the
bytes, so changing them starts a new cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

import xxhash

COMPLETE = "_complete.json"


def base_dir() -> Path:
    """``$CKPTCONV_TEST_CACHE``, default ``~/.cache/ckptconv-tests``."""
    return Path(os.environ.get("CKPTCONV_TEST_CACHE") or Path.home() / ".cache" / "ckptconv-tests")


def hashed_dir(kind: str, folder: Path, sources: Iterable[str]) -> Path:
    """``base_dir()/<kind>-<torch version>-<hash of the sources' bytes>``: the cache directory of
    entries whose bytes those files decide."""
    import torch

    h = hashlib.sha256()
    for name in sources:
        h.update((folder / name).read_bytes())
    return base_dir() / f"{kind}-{torch.__version__}-{h.hexdigest()[:16]}"


def manifest(root: Path) -> dict[str, list]:
    """{relative path: [size, xxh3]} of every file under ``root`` but the manifest itself."""
    out = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != COMPLETE):
        out[path.relative_to(root).as_posix()] = [path.stat().st_size, xxhash.xxh3_64_hexdigest(path.read_bytes())]
    return out


def set_writable(root: Path, writable: bool) -> None:
    for path in [root, *root.rglob("*")]:
        if path.is_dir():
            path.chmod(0o755 if writable else 0o555)
        else:
            path.chmod(0o644 if writable else 0o444)


def remove(root: Path) -> None:
    if root.exists():
        set_writable(root, True)
        shutil.rmtree(root)


def is_intact(root: Path) -> bool:
    marker = root / COMPLETE
    return marker.is_file() and json.loads(marker.read_text()) == manifest(root)


def build_atomically(final: Path, build: Callable[[Path], Path | None]) -> Path:
    """Build an entry at ``final``: ``build(tmp)`` fills a fresh temp dir (returning the built
    directory when it is a subdirectory of ``tmp``); manifest, read-only, rename (first wins)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        built = build(tmp) or tmp
        (built / COMPLETE).write_text(json.dumps(manifest(built), indent=1))
        set_writable(built, False)
        built.chmod(0o755)  # the rename needs it writable (non-root)
        try:
            built.rename(final)
        except OSError:
            if not is_intact(final):
                raise
        final.chmod(0o555)
    finally:
        remove(tmp)
    return final


class FixtureCache:
    """A session's view of one cache directory: each entry built at most once, checked on use."""

    def __init__(self, root: Path, build: Callable[[str, Path], Path | None], names: Callable[[], object] | None = None):
        self.root = root
        self._build = build
        self._names = names
        self._checked: set[str] = set()

    def get(self, name: str) -> Path:
        """The entry ``name`` (built on first use), READ-ONLY."""
        if self._names is not None and name not in self._names():
            raise KeyError(f"unknown fixture {name!r}; known: {sorted(self._names())}")
        root = self.root / name
        if name in self._checked:
            if not is_intact(root):
                raise AssertionError(f"cached fixture {root} was modified during this session; tests must "
                                     "use a private copy (dcp_checkpoint_copy) to change a checkpoint")
            return root
        if not is_intact(root):
            remove(root)  # stale, damaged or half-built by an older layout: rebuild
            build_atomically(root, lambda tmp: self._build(name, tmp))
        self._checked.add(name)
        return root


def writable_copy(src: Path, dst: Path) -> Path:
    """A private writable copy of a cached entry (without its manifest)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(COMPLETE))
    set_writable(dst, True)
    return dst
