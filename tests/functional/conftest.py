"""Shared by the functional suite: known upstream bugs as strict xfails, where they exist."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pytest_megatron_fsdp.fsdp.versions import KnownBug, no_longer_reproduces, xfail_reason

#: the xfail reason pytest prints per test (kept under this name for the suite's message tests)
short_reason = xfail_reason

#: the known bug a test marked itself strict-xfail for (set by ``known_bug``)
_MARKED_BUG = pytest.StashKey[KnownBug]()


@pytest.fixture
def known_bug(request: pytest.FixtureRequest) -> Callable[..., None]:
    """``known_bug(versions.SOME_BUG, raises=TypeError)``: a strict xfail on the megatron-core
    releases that have the bug (the test must fail there), an ordinary test where it is fixed.
    Where the test passes anyway, the failure says the bug no longer reproduces and what to change
    in the registry (:func:`pytest_megatron_fsdp.fsdp.versions.no_longer_reproduces`)."""

    def mark(bug: KnownBug, raises: type[BaseException] | None = None) -> None:
        if bug.present():
            request.node.stash[_MARKED_BUG] = bug
            request.applymarker(pytest.mark.xfail(strict=True, raises=raises, reason=xfail_reason(bug)))

    return mark


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    bug = item.stash.get(_MARKED_BUG, None)
    # pytest's strict XPASS: outcome "failed", longrepr "[XPASS(strict)] <reason>" and no traceback
    if bug is not None and report.failed and str(report.longrepr).startswith("[XPASS(strict)]"):
        report.longrepr = f"[XPASS(strict)] {no_longer_reproduces(bug)}"
    return report
