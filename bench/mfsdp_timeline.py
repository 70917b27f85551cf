"""pytest's milestones for the benchmarks' per-phase breakdown (see ``bench/timeline.py``).

Loaded with ``-p mfsdp_timeline`` (``bench/`` on ``PYTHONPATH``); a launched rank set gets the same
``-p`` from the plain-mode parent. Events: ``configured``, ``collected``, ``session-up`` (the
plugin's ``pytest_collection_finish`` ran: in a rank, the process group is up), ``protocol-start``
(in a plain-mode parent: where it hands the test to its rank set), ``setup-start``, ``call-start``,
``teardown-start``, ``teardown-end``, ``test-done`` (the test's report is out: in a rank, after the
harness's after-test check and the ranks' agreement), ``session-finish``.
"""

from __future__ import annotations

import pytest
import timeline

timeline.install()
record = timeline.record


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    record("configured")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_collection_finish(session: pytest.Session):
    record("collected")
    try:
        return (yield)
    finally:
        record("session-up")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    record("protocol-start")
    return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item):
    record("setup-start")
    return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_call(item: pytest.Item):
    record("call-start")
    return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    record("teardown-start")
    try:
        return (yield)
    finally:
        record("teardown-end")


def pytest_runtest_logfinish(nodeid: str) -> None:
    record("test-done")


def pytest_sessionfinish(session: pytest.Session) -> None:
    record("session-finish")
