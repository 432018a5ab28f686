"""Shared fixtures: real DCP checkpoints built once and cached across sessions.

``dcp_checkpoint(kind)`` returns the DCP directory of a fixture kind (see ``ckpt_factory.KINDS``);
``fixture_info(path)`` (in ckpt_factory) reads its ``_fixture.json``.

Cache: ``$CKPTCONV_TEST_CACHE`` (default ``~/.cache/ckptconv-tests``) / ``<torch version>-<hash of
ckpt_factory.py + models.py>`` / ``<kind>/{ckpt/, _fixture.json, _complete.json}``. A kind is built
into a temp dir and renamed in whole, with ``_complete.json`` (a manifest of every file's size and
xxh3 hash) written first, so an interrupted build is never used and a change to the factory or
model source starts a new cache. The cache itself (build atomically, manifest, read-only,
checked on every use) is ``tests/support/fixture_cache.py``, shared by the fixture kinds, the
acceptance kinds and the torchtitan saves.

CACHED CHECKPOINTS ARE SHARED AND MUST NEVER BE MODIFIED. They are made read-only (no effect for
root), and every ``dcp_checkpoint(kind)`` call re-checks the manifest: a test that changed a cached
checkpoint fails the next user loudly. Tests that need to corrupt, delete or write next to a
checkpoint take ``dcp_checkpoint_copy(kind)`` (a private writable copy under ``tmp_path``).

Imports: this directory and the repository root are put on ``sys.path``, so both
``from ckpt_factory import ...`` and ``from oracle import ...`` work.
"""

from __future__ import annotations

import hashlib
import os
import sys
import uuid
from pathlib import Path
from typing import Callable

import pytest

TESTS_DIR = Path(__file__).resolve().parent
SUPPORT_DIR = TESTS_DIR / "support"  # the shared factories, workers and helpers every test folder imports
for _p in (str(TESTS_DIR.parent), str(TESTS_DIR), str(SUPPORT_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

import ckpt_factory  # noqa: E402
import fixture_cache  # noqa: E402
from hypothesis import settings as _hypothesis_settings  # noqa: E402

def pytest_configure(config: pytest.Config) -> None:
    """The ``framework`` marker's hooks (tests/support/framework_plugin.py): skips of framework tests
    fail under CKPTCONV_REQUIRE_FRAMEWORKS=1, and their time per framework is reported."""
    import framework_plugin

    config.pluginmanager.register(framework_plugin.FrameworkPlugin(), "ckptconv-frameworks")


# CI runs property tests with a fixed seed so a landing is reproducible; locally they explore.
_hypothesis_settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    _hypothesis_settings.load_profile("ci")

def source_hash() -> str:
    """Hash of the sources that determine the fixtures' bytes."""
    h = hashlib.sha256()
    for name in ("ckpt_factory.py", "models.py"):
        h.update((SUPPORT_DIR / name).read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """Where fixtures of this torch version and factory source live."""
    return fixture_cache.base_dir() / f"{torch.__version__}-{source_hash()}"


def _build_kind(kind: str, tmp: Path) -> Path:
    ckpt_factory.make_checkpoint(kind, tmp)
    return tmp / kind


class CheckpointCache:
    """Session view of the fixture cache: ``get(kind)`` is the kind's ``ckpt/`` (built at most
    once, manifest-checked on every use)."""

    def __init__(self, cache: Path):
        self.cache = cache
        self._entries = fixture_cache.FixtureCache(cache, _build_kind, names=lambda: ckpt_factory.KINDS)

    def get(self, kind: str) -> Path:
        return self._entries.get(kind) / "ckpt"


@pytest.fixture(scope="session")
def checkpoint_cache() -> CheckpointCache:
    return CheckpointCache(cache_dir())


@pytest.fixture(scope="session")
def dcp_checkpoint(checkpoint_cache: CheckpointCache) -> Callable[[str], Path]:
    """``dcp_checkpoint(kind) -> Path`` of a cached, READ-ONLY fixture checkpoint."""
    return checkpoint_cache.get


@pytest.fixture
def dcp_checkpoint_copy(checkpoint_cache: CheckpointCache, tmp_path: Path) -> Callable[[str], Path]:
    """``dcp_checkpoint_copy(kind) -> Path``: a private writable copy (with its _fixture.json)."""

    def copy(kind: str) -> Path:
        src = checkpoint_cache.get(kind).parent
        return fixture_cache.writable_copy(src, tmp_path / f"copy-{kind}-{uuid.uuid4().hex[:6]}") / "ckpt"

    return copy


# ---------------------------------------------------------------------------------------------
# A real S3-compatible server on loopback (moto's server mode), for tests/test_s3.py

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-west-2"}


def _start_moto(timeout: float = 60.0):
    """``python -m moto.server -H 127.0.0.1 -p 0``: the server binds a port itself (no port picked
    here and raced for), and the endpoint is the one its "Running on" line names once it listens.
    A thread keeps reading its log (the request lines), so the server never blocks on a full pipe."""
    import queue
    import re
    import subprocess
    import threading

    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    found: queue.Queue = queue.Queue()

    def read_log() -> None:
        for line in proc.stderr:
            m = re.search(r"Running on (http://127\.0\.0\.1:\d+)", line)
            if m:
                found.put(m.group(1))
        found.put(None)  # the server exited

    threading.Thread(target=read_log, daemon=True).start()
    try:
        endpoint = found.get(timeout=timeout)
    except queue.Empty:
        endpoint = None
    if endpoint is None:
        proc.kill()
        raise RuntimeError(f"moto server did not start listening within {timeout:.0f} s (exit {proc.poll()})")
    return proc, endpoint


@pytest.fixture(scope="session")
def s3_server():
    """Start moto's S3 server on loopback (skip when moto is not installed); yields the endpoint
    URL. The credentials and endpoint reach s3fs/botocore through the environment
    (``AWS_ENDPOINT_URL``), set for the session and restored afterwards."""
    import importlib.util

    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("s3fs") is None:
        pytest.skip("moto[server] and s3fs are needed for the S3 tests (pip install -e '.[test]')")
    proc, endpoint = _start_moto()
    env = dict(S3_ENV, AWS_ENDPOINT_URL=endpoint)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield endpoint
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.kill()
        proc.wait(timeout=30)


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh, empty bucket on the loopback server; yields ``s3://<bucket>``."""
    import boto3

    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(
        Bucket=name, CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    return f"s3://{name}"


# ---------------------------------------------------------------------------------------------
# torchtitan 0.3.0's own Trainer checkpoints (tests/support/tests/support/titan_support.py), cached like the fixtures above


def titan_cache_dir() -> Path:
    """Where torchtitan checkpoints of this torch version and support source live (titan_support.py
    decides what is trained and saved; titan_worker.py only runs it and reports)."""
    h = hashlib.sha256()
    h.update((SUPPORT_DIR / "titan_support.py").read_bytes())
    return cache_dir().parent / f"titan-{torch.__version__}-{h.hexdigest()[:16]}"


def _titan_build(mesh: str, tmp: Path, model: str | None = None) -> None:
    if model is None:
        import titan_support

        titan_support.build_checkpoint(mesh, tmp)
    else:
        import titan_moe_support

        titan_moe_support.build_checkpoint(mesh, tmp, model)


_titan_entries: dict[str | None, fixture_cache.FixtureCache] = {}


def _titan_get(mesh: str, model: str | None = None) -> Path:
    """A cached torchtitan save on ``mesh``: Llama 3 debugmodel, or the MoE ``model``
    (``MODEL/FLAVOR``, built by titan_moe_support.py, whose source keys its own cache)."""
    if model not in _titan_entries:
        cache = titan_cache_dir()
        if model is not None:
            h = hashlib.sha256((SUPPORT_DIR / "titan_moe_support.py").read_bytes() + model.encode())
            cache = cache.parent / f"{cache.name}-moe-{h.hexdigest()[:12]}"
        _titan_entries[model] = fixture_cache.FixtureCache(cache, lambda m, tmp: _titan_build(m, tmp, model))
    return _titan_entries[model].get(mesh)


@pytest.fixture(scope="session")
def titan_checkpoint() -> Callable[[str], Path]:
    """``titan_checkpoint(mesh) -> Path`` of a cached, READ-ONLY directory holding a torchtitan
    0.3.0 Trainer save on ``mesh`` (``"dp4"``, ``"tp2,dp2"``): ``ckpt/`` (step 2), ``reference.pt``
    (torch's ``dcp_to_torch_save`` of it), ``train.json`` (losses of steps 1-3). Skips without
    torchtitan."""
    import titan_support

    reason = titan_support.skip_reason()
    if reason:
        pytest.skip(reason)
    return _titan_get


@pytest.fixture(scope="session")
def titan_moe_checkpoint() -> Callable[[str, str], Path]:
    """``titan_moe_checkpoint(mesh, model="deepseek_v3/debugmodel") -> Path``: as
    :func:`titan_checkpoint` for a torchtitan MoE model (``mesh`` may hold ``ep``)."""
    import titan_support

    reason = titan_support.skip_reason()
    if reason:
        pytest.skip(reason)
    return lambda mesh, model="deepseek_v3/debugmodel": _titan_get(mesh, model)
