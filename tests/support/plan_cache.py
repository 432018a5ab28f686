"""A private ``--plan torchtitan:`` / ``python:`` plan cache for a test module (the plans from code
are cached on disk and in memory; a test module must neither read nor leave a shared one).

Use: ``from plan_cache import private_plan_cache  # noqa: F401`` (autouse, once per module)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="module")
def private_plan_cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("CKPTCONV_PLAN_CACHE", str(tmp_path_factory.mktemp("plans")))
    from converter.plan import from_code as code_plans

    code_plans._load.cache_clear()
    yield
    mp.undo()
    code_plans._load.cache_clear()
