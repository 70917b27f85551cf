"""What a rank reports when its session stops before its last test (a signal, a peer or its own main
thread that never came back): the test failed as this rank alone saw it, each later test not run, by
name; and the peer that never came back, told once rank 0 has reported."""

from __future__ import annotations

import pytest

from ..wire import explain
from ..wire.explain import headlined_failure
from ..wire.reports import build_report, log_not_run
from .log import RankLog
from .session import RankSession


class StoppedSession:
    """The reports of a session that stops early, through pytest's report hooks (the terminal, the
    JUnit file), and what the terminal summary says of the tests not run."""

    def __init__(self, log: RankLog) -> None:
        self._log = log
        #: the tests the session did not run after a rank never came back from a timeout
        self._not_run: list[str] = []
        #: set when a peer never came back from a timeout (or a signal): rank 0 tells it once the
        #: session is reported (at unconfigure), so that its end cannot stop rank 0 first
        self._stuck_peer_session: RankSession | None = None

    def peer_waits_for_the_report(self, rank_session: RankSession) -> None:
        """A peer stays until rank 0 has reported the session (:meth:`reported`)."""
        self._stuck_peer_session = rank_session

    def reported(self) -> None:
        """The JUnit file and the summary are written: on rank 0, the peer that never came back may
        end."""
        if self._stuck_peer_session is not None and self._log.rank == 0:
            self._stuck_peer_session.mark_reported()

    def failed_alone(self, item: pytest.Item, message: str) -> None:
        """``item`` failed with ``message`` as this rank alone reports it (no agreement: the session
        cannot go on)."""
        for when, outcome in (("setup", "passed"), ("call", "failed"), ("teardown", "passed")):
            report = build_report(
                item, when, outcome, headlined_failure(item, message) if outcome == "failed" else None
            )
            item.ihook.pytest_runtest_logreport(report=report)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)

    def not_run_after(self, after: pytest.Item, reason: str) -> None:
        """Each test after ``after`` is reported not run, with ``reason`` (the session ends here; see
        :func:`..wire.reports.log_not_run`)."""
        items = after.session.items
        self._not_run = log_not_run(items[items.index(after) + 1 :] if after in items else [], reason)
        if self._not_run:
            self._log.line(f"{len(self._not_run)} tests not run: {reason}")

    def not_run_lines(self) -> list[str]:
        """The terminal summary's section on the tests not run after a rank never came back from a
        timeout (empty when every test ran)."""
        if not self._not_run:
            return []
        return [explain.tests_not_run_heading(len(self._not_run)), *self._not_run]
