"""formats/fsutil.py's one rule for every path a checkpoint names (``source_path``, ``safe_join``):
the cached, component-wise resolution decides exactly as resolving the whole path would, for
plain files, directories and files that are symlinks (inside the root, out of it, in a loop)."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from formats import fsutil
from formats.errors import CorruptCheckpointError, DestinationError


@pytest.fixture
def tree(tmp_path):
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    for d in ("a/b", "c"):
        (root / d).mkdir(parents=True)
    outside.mkdir()
    (outside / "f").write_text("x")
    (root / "a/b/f").write_text("x")
    (root / "c/f").write_text("x")
    (root / "in_dir").symlink_to(root / "a")  # a directory link inside the root
    (root / "out_dir").symlink_to(outside)  # a directory link out of it
    (root / "a/in_file").symlink_to(root / "c/f")
    (root / "a/out_file").symlink_to(outside / "f")
    (root / "loop1").symlink_to(root / "loop2")
    (root / "loop2").symlink_to(root / "loop1")
    return root


NAMES = ["a", "b", "c", "f", "in_dir", "out_dir", "in_file", "out_file", "loop1", "missing"]


def _reference(root: Path, relative: str) -> bool:
    """Whether resolving the whole path lands inside the root (None: it cannot be resolved)."""
    base = root.resolve()
    try:
        target = (base / relative).resolve()
    except (RuntimeError, OSError):
        return None
    return target == base or base in target.parents


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_every_path_is_judged_as_resolving_it_whole_would(tree, depth):
    fsutil._RESOLVED.clear()
    for parts in itertools.product(NAMES, repeat=depth):
        relative = "/".join(parts)
        want = _reference(tree, relative)
        path, why = fsutil._join_problem(tree, relative, "the checkpoint directory")
        if want:
            assert path == (tree.resolve() / relative).resolve() and not why, relative
        else:
            assert path is None and why, relative
    # asked again, from the cache, the same answers
    for parts in itertools.product(NAMES, repeat=depth):
        relative = "/".join(parts)
        assert (fsutil._join_problem(tree, relative, "x")[0] is not None) == bool(_reference(tree, relative)), relative


def test_refusals_name_why(tree):
    with pytest.raises(CorruptCheckpointError, match="resolves outside"):
        fsutil.source_path(tree, "out_dir/f")
    with pytest.raises(CorruptCheckpointError, match="'..' leads outside"):
        fsutil.source_path(tree, "a/../../outside/f")
    with pytest.raises(CorruptCheckpointError, match="absolute path"):
        fsutil.source_path(tree, str(tree / "c/f"))
    with pytest.raises(DestinationError, match="control characters"):
        fsutil.safe_join(tree, "c/\x01f")
    with pytest.raises(CorruptCheckpointError, match="cannot resolve|resolves outside"):
        fsutil.source_path(tree, "loop1/f")
    assert fsutil.source_path(tree, "in_dir/b/f") == (tree / "a/b/f").resolve()
    assert os.path.samefile(fsutil.source_path(tree, "a/in_file"), tree / "c/f")
