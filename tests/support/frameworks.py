"""The frameworks whose OWN code the ``framework``-marked tests run, and what CI requires of them.

A test that runs a framework's own trainer, loader, engine or adapter is marked
``@pytest.mark.framework("NAME", ...)`` with the frameworks it needs (:data:`NAMES`; a bare
``@pytest.mark.framework`` is allowed, and then only the test's own skips decide). The root
``conftest.py`` then

* skips it with the install hint of :func:`skip_reason` where a named framework cannot run here;
* under ``CKPTCONV_REQUIRE_FRAMEWORKS=1`` (``.ci/run`` sets it when ``CI`` is set) turns every skip
  of a ``framework`` test, and every skip whose reason is a missing framework, into a failure: a CI
  run with a framework missing is red, never green with skips;
* reports the framework tests' count and time per framework at the end of the session (the budget
  check of README's Testing section: :func:`budget_seconds`).
"""

from __future__ import annotations

import importlib.util
import os
from importlib.metadata import PackageNotFoundError, version

#: Environment variable that turns framework skips into failures (CI sets it).
REQUIRE_ENV = "CKPTCONV_REQUIRE_FRAMEWORKS"
#: Environment variable for the framework step's time budget in seconds (the session fails past it
#: under CKPTCONV_REQUIRE_FRAMEWORKS=1).
BUDGET_ENV = "CKPTCONV_FRAMEWORK_BUDGET_S"
#: The framework step's budget: CI's limit is 90 min; the default suite (~10 min on 2 cores), the
#: installs and the framework step together must leave a third of it spare (<= 60 min).
DEFAULT_BUDGET_S = 50 * 60

#: framework name -> (distribution, pinned version or None, install hint). torchtitan and megatron
#: are checked by their support modules (which know their extra dependencies too).
PINS = {
    "torchtitan": ("torchtitan", "0.3.0", "bash .ci/install_titan.sh"),
    "megatron": ("megatron-core", "0.19.2", "bash .ci/install_megatron.sh"),
    "deepspeed": ("deepspeed", "0.19.8", "bash .ci/install_deepspeed.sh"),
    "transformers": ("transformers", None, "pip install -e '.[test]'"),
}
NAMES = tuple(PINS)

#: Substrings of skip reasons that mean "a framework is missing" (the support modules' and
#: ``pytest.importorskip``'s messages): such a skip fails under CKPTCONV_REQUIRE_FRAMEWORKS=1
#: even on a test that is not marked ``framework``.
MISSING_MARKERS = (".ci/install_", *(f"could not import '{m}" for m in ("torchtitan", "megatron", "deepspeed",
                                                                         "transformers")))


def required() -> bool:
    """Whether framework skips are failures (``CKPTCONV_REQUIRE_FRAMEWORKS=1``)."""
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


def budget_seconds() -> float:
    """The framework step's time budget (``CKPTCONV_FRAMEWORK_BUDGET_S``, default 50 min)."""
    return float(os.environ.get(BUDGET_ENV) or DEFAULT_BUDGET_S)


def skip_reason(name: str) -> str | None:
    """Why framework ``name`` cannot run here (None: it can). Unknown names are a test bug."""
    if name not in PINS:
        raise ValueError(f"unknown framework {name!r} in @pytest.mark.framework (one of {', '.join(NAMES)})")
    if name == "torchtitan":
        import titan_support

        return titan_support.skip_reason()
    if name == "megatron":
        import megatron_support

        return megatron_support.skip_reason()
    dist, pin, hint = PINS[name]
    if importlib.util.find_spec(name) is None:
        return f"{name} is not installed (run {hint})"
    try:
        got = version(dist)
    except PackageNotFoundError:
        return f"{dist} has no package metadata (run {hint})"
    if pin is not None and got != pin:
        return f"{dist} {got} is installed; these tests need {pin} (run {hint})"
    return None


def means_missing(reason: str) -> bool:
    """Whether a skip reason says a framework is missing (see :data:`MISSING_MARKERS`)."""
    return any(m in reason for m in MISSING_MARKERS)
