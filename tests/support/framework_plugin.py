"""pytest hooks for the ``framework`` marker (registered by ``tests/conftest.py``; see :mod:`frameworks`).

* setup: a test marked ``framework("NAME", ...)`` skips where a named framework cannot run here;
* under ``CKPTCONV_REQUIRE_FRAMEWORKS=1`` a skipped ``framework`` test, and any skip whose reason
  is a missing framework (test or module), is reported as a failure with the skip's reason;
* at the end: the framework tests' count, outcomes and time per framework, against the budget
  (``CKPTCONV_FRAMEWORK_BUDGET_S``); past it the session fails under CKPTCONV_REQUIRE_FRAMEWORKS=1.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import pytest

import frameworks

#: Fixtures that run a framework's own code: every test using one must be marked ``framework``.
FRAMEWORK_FIXTURES = frozenset({"titan_checkpoint", "titan_moe_checkpoint"})


def names_of(item: pytest.Item) -> tuple[str, ...]:
    """The frameworks a test names in its ``framework`` markers (in order, once each)."""
    out: list[str] = []
    for mark in item.iter_markers("framework"):
        out += [n for n in mark.args if n not in out]
    return tuple(out)


def skip_text(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The reason of a skipped report ("" when it has none)."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr or "")


@dataclass
class _Tally:
    """Framework tests seen in this session: outcome and seconds (setup + call + teardown) per test."""

    names: dict[str, tuple[str, ...]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    outcome: dict[str, str] = field(default_factory=dict)

    def add(self, item: pytest.Item, report: pytest.TestReport) -> None:
        nodeid = report.nodeid
        self.names[nodeid] = names_of(item) or ("unnamed",)
        self.seconds[nodeid] += report.duration
        outcome = "error" if report.failed and report.when != "call" else report.outcome  # as pytest counts it
        if report.when == "call" or outcome != "passed":  # a failed setup/teardown decides
            if self.outcome.get(nodeid) in (None, "passed"):
                self.outcome[nodeid] = outcome

    def per_framework(self) -> dict[str, dict[str, float]]:
        """name -> {"tests", "seconds", <outcome>: count}; a test naming several counts under the
        first of them in :data:`frameworks.NAMES` order (transformers last: it is mostly the oracle)."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        order = {n: i for i, n in enumerate(frameworks.NAMES)}
        for nodeid, names in self.names.items():
            row = out[min(names, key=lambda n: order.get(n, len(order)))]
            row["tests"] += 1
            row["seconds"] += self.seconds[nodeid]
            row[self.outcome.get(nodeid, "passed")] += 1
        return out

    def total(self) -> float:
        return sum(self.seconds.values())


class FrameworkPlugin:
    """The hooks of the module docstring (one instance per session)."""

    def __init__(self) -> None:
        self.tally = _Tally()
        self.start = time.monotonic()
        self.over_budget: float | None = None

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            used = FRAMEWORK_FIXTURES.intersection(getattr(item, "fixturenames", ()))
            if used and item.get_closest_marker("framework") is None:
                raise pytest.UsageError(f"{item.nodeid} uses {', '.join(sorted(used))} (a framework's own save): "
                                        f"mark it @pytest.mark.framework(...)")
            for name in names_of(item):
                if name not in frameworks.NAMES:
                    raise pytest.UsageError(f"{item.nodeid}: unknown framework {name!r} in @pytest.mark.framework "
                                            f"(one of {', '.join(frameworks.NAMES)})")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        for name in names_of(item):
            reason = frameworks.skip_reason(name)
            if reason:
                pytest.skip(reason)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        report = yield
        marked = item.get_closest_marker("framework") is not None
        if report.skipped and not hasattr(report, "wasxfail") and frameworks.required():
            reason = skip_text(report)
            if marked or frameworks.means_missing(reason):
                report.outcome = "failed"
                report.longrepr = (f"{frameworks.REQUIRE_ENV}=1: this framework test may not skip; it skipped "
                                   f"because: {reason}")
        if marked:
            self.tally.add(item, report)
        return report

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector: pytest.Collector):
        report = yield
        if report.skipped and frameworks.required() and frameworks.means_missing(skip_text(report)):
            report.outcome = "failed"
            report.longrepr = (f"{frameworks.REQUIRE_ENV}=1: a module of framework tests may not skip; it skipped "
                               f"because: {skip_text(report)}")
        return report

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        total, budget = self.tally.total(), frameworks.budget_seconds()
        if total > budget:
            self.over_budget = total
            if frameworks.required() and session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.tally.names:
            return
        tr, budget = terminalreporter, frameworks.budget_seconds()
        tr.section("framework tests (time per framework: setup + call + teardown)")
        for name, row in sorted(self.tally.per_framework().items()):
            counts = ", ".join(f"{int(row[k])} {k}" for k in ("passed", "failed", "error", "skipped") if row.get(k))
            tr.write_line(f"{name:13s} {int(row['tests']):4d} tests ({counts}) {row['seconds']:8.1f} s")
        total = self.tally.total()
        tr.write_line(f"{'all':13s} {len(self.tally.names):4d} tests {total:19.1f} s of the "
                      f"{budget:.0f} s budget ({frameworks.BUDGET_ENV}); session {time.monotonic() - self.start:.1f} s")
        if self.over_budget is not None:
            tr.write_line(f"framework tests took {self.over_budget:.0f} s, over the {budget:.0f} s budget: mark the "
                          f"longest ones off the CI set or make them cheaper (README, Testing)", red=True)
