"""Worker side: what a torchrun rank does around its tests, with its collaborators:

* its log, event stream and terminal (:mod:`.log`): only rank 0 of a rank set that reports itself
  talks to the terminal; every rank keeps a log file with its own report;
* all ranks must have collected the same tests in the same order (:mod:`.collection`);
* after each test the ranks agree on its outcome through the store (:mod:`.exchange`);
* a watchdog per test (:mod:`.watchdog`), whose behaviour at a timeout is the role's
  (:mod:`.timeouts`): a launched rank ends, a torchrun-mode or srun rank interrupts the test and
  goes on;
* a session that stops early reports each later test not run (:mod:`.stopped`);
* in a rank set launched by the plugin (plain-pytest mode) rank 0 streams the agreed reports to the
  parent session as JSON lines.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import pytest

from ..environment import DistributedSpec
from ..wire import explain, protocol, pytest_compat, rank_dir, warnings_relay
from ..wire.explain import headlined_failure
from ..wire.protocol import spec_of
from ..wire.reports import build_report
from ..wire.torchrun_env import TorchrunEnv
from . import after_test, collection
from .exchange import OutcomeExchange
from .log import RankLog
from .session import RANK_SESSION, PeerStuck, RankSession, SessionCannotGoOn
from .stopped import StoppedSession
from .watchdog import TimeoutPolicy, Watchdog

#: After a signal that ends the session (SIGTERM: a CI cancel), how long the main thread has to take
#: it in Python before the rank releases its process group, and then as long again before the rank
#: reports the session from another thread and ends: torchrun SIGKILLs its ranks 30 s after its
#: SIGTERM.
SIGNAL_GRACE_S = 3.0
#: How long a rank ended that way waits for rank 0's report before it ends: within those 30 s too.
SIGNAL_REPORT_WAIT_S = 15.0


class RankRunner:
    """What every torchrun rank does around its tests: its log, the collection check, the watchdog,
    the outcome exchange, the events to a parent. A plain object with no pytest hooks: a rank's role
    plugin (``rank.plugin``) holds one and calls it from its hooks."""

    def __init__(
        self,
        config: pytest.Config,
        torchrun: TorchrunEnv,
        log_dir: Callable[[], Path],
        agreement_timeout_s: float,
        unmarked_settings: Callable[[pytest.Item], DistributedSpec],
        timeouts: TimeoutPolicy,
        relays_warnings: bool,
        when_it_cannot_go_on: str,
        distributed_logs: bool = False,
        private_temp: Path | None = None,
        release_test_groups: Callable[[], int] | None = None,
    ) -> None:
        """``unmarked_settings``: the settings of a test neither the parent's batch nor its marker
        gives (a test without the marker in a torchrun rank session); ``timeouts``: what the rank
        does at a test's timeout (its role's); ``relays_warnings``: the tests' warnings go to the
        parent (unless -p no:warnings); ``when_it_cannot_go_on``: what becomes of the session when
        a rank cannot go on with its peers (said in the failure); ``private_temp``: torchrun mode's
        own temp tree of this rank, removed at unconfigure (or by the watchdog);
        ``release_test_groups``: a foreign suite's (see :meth:`review_report`), what frees the
        process groups the current test made, returning how many were alive."""
        self.config = config
        self.torchrun = torchrun
        self.rank = torchrun.rank
        #: seconds the ranks wait for each other's collection (the process-group timeout)
        self._agreement_timeout_s = agreement_timeout_s
        self._unmarked_settings = unmarked_settings
        self._timeouts = timeouts
        self._when_it_cannot_go_on = when_it_cannot_go_on
        self._test_index = 0
        self.log = RankLog(config, torchrun, log_dir, distributed_logs)
        self._relay_warnings = relays_warnings and warnings_relay.active(config)
        self._stopped = StoppedSession(self.log)
        self._exchange = OutcomeExchange(self.rank, self.log, timeouts.exchange_grace_s)
        self._watchdog = Watchdog(
            config, torchrun, self.log, timeouts, self._stopped, private_temp, self._exchange.mark_released
        )
        #: whether the current test's agreed reports went through pytest's hooks
        self._reported = False
        #: the test this rank runs now (None between tests), for a signal's watcher thread
        self._running_item: pytest.Item | None = None
        #: set once the main thread took a signal that ends the session (KeyboardInterrupt)
        self._interrupt_taken = threading.Event()
        self._release_test_groups = release_test_groups

    def open_log(self, config: pytest.Config, quiet_terminal: bool) -> None:
        """The rank's log (:meth:`.log.RankLog.open`)."""
        self.log.open(config, quiet_terminal)

    def close_log(self) -> None:
        self.log.close()
        # the JUnit file and the summary are written: the peer that never came back may end
        self._stopped.reported()

    def not_run_lines(self) -> list[str]:
        return self._stopped.not_run_lines()

    def check_same_collection(self, session: pytest.Session, rank_session: RankSession) -> None:
        """All ranks run the same tests in the same order, or none runs anything."""
        mine = collection.check_same_collection(
            session, rank_session, self.torchrun.world_size, self._agreement_timeout_s
        )
        self.log.event(protocol.Collected(nodeids=mine))

    # -- running ------------------------------------------------------------------------------------

    def settings_for(self, item: pytest.Item) -> DistributedSpec:
        """The test's settings, resolved once: the parent's in a launched rank set (its batch), the
        marker's at collection in a torchrun rank session, else those of an unmarked test."""
        spec = spec_of(item)
        return spec if spec is not None else self._unmarked_settings(item)

    def times_its_tests(self) -> bool:
        """Whether the watchdog times every test here (a rank session runs), so pytest-timeout sets
        no timer of its own. Its SIGALRM would fail the test on this rank alone, mid-collective, and
        its timer thread would end this rank alone, each at a time of its own (an ini ``timeout``
        reaches every rank a parent launches); the watchdog ends every rank at the test's one
        timeout, in which pytest-timeout's settings are a source (``options.value_of``)."""
        return self.config.stash.get(RANK_SESSION, None) is not None

    def run(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        """Run ``item`` with the other ranks and log the agreed reports (None: no rank session, the
        test runs as pytest runs it)."""
        rank_session: RankSession | None = self.config.stash.get(RANK_SESSION, None)
        if rank_session is None:
            return None
        self._running_item = item
        try:
            return self._run(item, nextitem, rank_session)
        except KeyboardInterrupt as exc:
            # a signal (SIGTERM from torchrun's agent or srun: a CI cancel) ends the session: this
            # test fails and each later one is reported not run, by name, before pytest ends the
            # session as interrupted (rank 0's JUnit file and summary carry them)
            self._interrupt_taken.set()
            self._report_interrupted(item, rank_session, str(exc) or "KeyboardInterrupt")
            raise
        except pytest.UsageError:
            raise
        except Exception as exc:  # noqa: BLE001  (this plugin's own code failed around the test)
            # Out of pytest's run of a test, an error would end the session as an INTERNALERROR with
            # this test's and every later test's result lost: the test fails with the traceback (if
            # not reported already) and each later test is named not run; the session stops here,
            # as the ranks may no longer be in step.
            self._report_harness_error(item, rank_session, exc)
            return True
        finally:
            self._running_item = None

    def signal_received(self, why: str) -> None:
        """From a signal watcher's thread: a signal that ends the session arrived (``why``: which).
        The main thread takes it where it is in Python (:meth:`run` reports the session); one stuck
        outside Python, in a collective whose peer is gone, would not: after
        :data:`SIGNAL_GRACE_S` this thread releases the process group, and the main thread still
        not back, reports the session itself and ends the rank, within torchrun's 30 s."""
        item = self._running_item
        if item is None or self._interrupt_taken.wait(SIGNAL_GRACE_S):
            return
        self._watchdog.release_peers()
        if self._interrupt_taken.wait(SIGNAL_GRACE_S):
            return
        self._watchdog.end_stuck(
            item,
            explain.interrupted(item.nodeid, self.rank, why),
            time.monotonic(),
            why=explain.signal_not_taken(item.nodeid, self.rank, 2 * SIGNAL_GRACE_S),
            not_run=explain.not_run_after_interrupt(item.nodeid, why),
            report_wait_s=SIGNAL_REPORT_WAIT_S,
        )

    def _run(self, item: pytest.Item, nextitem: pytest.Item | None, rank_session: RankSession) -> bool:
        index = self._test_index
        self._test_index += 1
        self._reported = False
        settings = self.settings_for(item)
        timeout = settings.timeout_s
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        self.log.line(rank_dir.start_line(item.nodeid, timeout))
        self.log.event(protocol.Started(nodeid=item.nodeid))
        deadline = time.monotonic() + timeout
        # The role's policy says what the watchdog watches: the test alone (a rank that survives its
        # timeouts: the outcome exchange after it has a bound of its own), or the exchange too (a
        # launched rank, which ends at the timeout).
        watch = self._watchdog.watch(item, settings, index)
        around_test, around_exchange = self._timeouts.scopes(watch)
        with around_exchange:
            relay: AbstractContextManager[list[warnings.WarningMessage]] = (
                warnings_relay.capture() if self._relay_warnings else nullcontext([])
            )
            with relay as caught, around_test:
                reports = self._run_interruptibly(item, nextitem, rank_session, index)
                after_test.check_after_test(item, reports, rank_session, self.log)
            try:
                merged = self._exchange.agree(
                    item, index, reports, rank_session, deadline, warnings_relay.to_data(caught)
                )
            except SessionCannotGoOn as exc:
                if exc.__cause__ is not None:  # the whole story for the log; the report gets one line
                    self.log.line("".join(traceback.format_exception(exc.__cause__)).rstrip())
                merged = self._alone(item, reports, str(exc))
                if isinstance(exc, PeerStuck) and (
                    reason := self._timeouts.not_run_after_stuck_peer(item, exc.rank)
                ):
                    # no later test can run: each is reported as not run, by name, with the reason
                    self._stopped.peer_waits_for_the_report(rank_session)
                    self._log_merged(item, merged)
                    self._stopped.not_run_after(item, reason)
                    return True
        for line in rank_session.run_after_agreement():
            self.log.line(f"after {item.nodeid}: {line}")
        self._log_merged(item, merged)
        return True

    def _report_interrupted(self, item: pytest.Item, rank_session: RankSession, why: str) -> None:
        self.log.line(f"{item.nodeid}: {why}")
        self._stop_after(
            item,
            rank_session,
            explain.interrupted(item.nodeid, self.rank, why),
            explain.not_run_after_interrupt(item.nodeid, why),
        )

    def _report_harness_error(self, item: pytest.Item, rank_session: RankSession, exc: Exception) -> None:
        trace = "".join(traceback.format_exception(exc)).rstrip()
        self.log.line(f"{item.nodeid}: {trace}")
        reason = explain.not_run_after_harness_error(item.nodeid, self.rank)
        self._stop_after(item, rank_session, explain.harness_error(item.nodeid, self.rank, trace), reason)
        item.session.shouldstop = reason

    def _stop_after(self, item: pytest.Item, rank_session: RankSession, failure: str, not_run: str) -> None:
        """The session ends with ``item``: it fails with ``failure`` (unless reported already), each
        later test is reported not run with ``not_run``, the peers are released."""
        # a peer whose main thread could not come back ends once rank 0 has reported
        self._stopped.peer_waits_for_the_report(rank_session)
        with contextlib.suppress(Exception):  # a peer waiting in a collective comes back
            rank_session.release_peers()
        self._exchange.mark_released()
        # The fixtures' teardown now, while the rank session is up: pytest would tear them down at
        # the session's end, after this plugin has closed the session they need.
        with contextlib.suppress(Exception):
            pytest_compat.teardown_local_state(item, None)
        if not self._reported:
            self._stopped.failed_alone(item, failure)
        self._stopped.not_run_after(item, not_run)

    def _log_merged(self, item: pytest.Item, merged: list[pytest.TestReport]) -> None:
        self._reported = True
        if self._exchange.test_warnings:
            self.log.event(protocol.Warnings(nodeid=item.nodeid, warnings=self._exchange.test_warnings))
        for report in merged:
            item.ihook.pytest_runtest_logreport(report=report)
            data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
            self.log.event(protocol.Report(report=data))
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        self.log.event(protocol.Finished(nodeid=item.nodeid))

    def _run_interruptibly(
        self, item: pytest.Item, nextitem: pytest.Item | None, rank_session: RankSession, index: int
    ) -> list[pytest.TestReport]:
        """pytest's run of the test, which the watchdog may interrupt at its timeout (a rank that
        survives its timeouts): the failure is raised where the main thread is, in a phase, so the
        phase fails; an interruption that lands between phases, in pytest's own code, fails the
        test here."""
        reports: list[pytest.TestReport] = []
        try:
            with self._watchdog.interrupt.armed(index):
                reports = pytest_compat.runtestprotocol(item, nextitem=nextitem, log=False)
        except pytest.fail.Exception as exc:
            if not self._watchdog.interrupt.fired:
                raise
            reports = [self._interrupted_between_phases(item, nextitem, exc)]
            with contextlib.suppress(Exception):  # a group its watchdog released already
                rank_session.release_peers()
            self._exchange.mark_released()
        return reports

    def _interrupted_between_phases(
        self, item: pytest.Item, nextitem: pytest.Item | None, interruption: BaseException
    ) -> pytest.TestReport:
        """The test's failure when its interruption was raised in pytest's own code: its fixtures
        torn down as far as they go, the failure reported as the call's. Whatever else goes wrong
        on the way (a fixture's teardown that fails, a report pytest cannot render from frames a
        released group left behind) is logged and the test fails all the same: an error here
        would end the session (an INTERNALERROR) with every later test lost."""
        try:
            pytest_compat.teardown_local_state(item, nextitem)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001  (a fixture's pytest.fail is no Exception)
            self.log.line(f"{item.nodeid}: its fixtures' teardown after the interruption: {exc!r}")
        try:
            call = pytest.CallInfo.from_call(functools.partial(_raise, interruption), "call")
            report = pytest.TestReport.from_item_and_call(item, call)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001  (a second interruption is no Exception either)
            trace = "".join(traceback.format_exception(exc))
            self.log.line(f"{item.nodeid}: reporting its interruption: {trace}")
            report = build_report(item, "call", "failed", headlined_failure(item, str(interruption)))
        after_test.drop_exception_locals(interruption)
        return report

    def _alone(
        self, item: pytest.Item, reports: list[pytest.TestReport], why: str
    ) -> list[pytest.TestReport]:
        """The test's reports when this rank cannot go on with its peers (they are gone, or the
        process group could not be rebuilt): it fails with ``why`` (this rank's own failure, if any,
        follows), and the session stops after it: no later test can have every rank."""
        message = f"megatron-fsdp: {why}; {self._when_it_cannot_go_on}"
        self.log.line(f"{item.nodeid}: {message}")
        if self.rank != 0:
            self.log.tell_terminal(f"{message} (rank {self.rank}, test {item.nodeid})")
        failed = next((r for r in reports if r.when == "call"), None) or reports[-1]
        own = failed.longreprtext if failed.failed else ""
        failed.outcome = "failed"
        failed.longrepr = headlined_failure(
            item, message + (f"\n\nthis rank's own failure (rank {self.rank}):\n{own}" if own else "")
        )
        # rides on the report to a launching parent, which runs the rest of the batch in a fresh rank set
        failed.mfsdp_rank_set_stopped = True  # type: ignore[attr-defined]
        item.session.shouldstop = message
        return reports

    def review_report(
        self, item: pytest.Item, call: pytest.CallInfo[None], report: pytest.TestReport
    ) -> pytest.TestReport:
        """A phase's report as this rank made it (from the role's ``pytest_runtest_makereport``):
        logged at once when failed, the peers released; a teardown collective that only echoes a
        released failure counts as done."""
        rank_session: RankSession | None = self.config.stash.get(RANK_SESSION, None)
        if (
            rank_session is not None
            and report.when == "teardown"
            # failed, or taken by pytest for the xfail of an xfail-marked test
            and (report.failed or hasattr(report, "wasxfail"))
            and call.excinfo is not None
            and rank_session.collectives_released()
            and after_test.raised_in_torch_distributed(call.excinfo)
        ):
            # One failure, one report: a fixture teardown's collective after a failure released the
            # process group (here or on a peer) cannot succeed, and its error only echoes that
            # failure, which is reported already. The teardown counts as done; its error stays in
            # this rank's log and in a report section.
            echo = call.excinfo.exconly()
            self.log.line(f"{item.nodeid}: teardown collective after the release skipped: {echo}")
            report.outcome = "passed"
            report.longrepr = None
            with contextlib.suppress(AttributeError):
                del report.wasxfail  # the test's own xfail, if any, is its call's
            report.sections.append(
                ("teardown collective skipped", f"the process group was released after the failure: {echo}")
            )
        if report.failed:
            # Now, before the ranks agree: a peer stuck in a collective can hold the agreed report
            # back until the process-group timeout, or for good if this rank set is then killed.
            self.log.file.write(
                f"{rank_dir.failed_line(report.nodeid, report.when, self.rank)}\n{report.longreprtext}\n"
            )
            self.log.file.flush()
        if rank_session is not None and (report.failed or (report.skipped and report.when == "call")):
            in_collective = call.excinfo is not None and after_test.raised_in_torch_distributed(call.excinfo)
            report.mfsdp_in_a_collective = in_collective  # type: ignore[attr-defined]  # to the agreement
            if call.excinfo is not None:
                after_test.drop_exception_locals(call.excinfo.value)
            if (
                self._release_test_groups is not None
                and not in_collective
                and not self._watchdog.interrupt.fired
            ):
                # A foreign suite's test that failed outside a collective, not at its timeout: a
                # peer waiting in one waits on a group this test made (freed now), or on a group
                # that outlives the test (the default group, a class-scoped fixture's, which the
                # rest of its scope uses): those stay, as no collective of theirs broke here. A skip
                # releases nothing; an expected failure (a strict xfail's) failed here all the same.
                if report.failed or hasattr(report, "wasxfail"):
                    freed = self._release_test_groups()
                    self.log.line(f"{item.nodeid}: released the {freed} process groups the test made")
                    self._exchange.failed_outside_a_collective = True
                return report
            # Peers may be waiting in a collective this rank will never enter: let them fail now
            # rather than wait out the process-group timeout. The group is rebuilt after the test.
            rank_session.release_peers()
            self._exchange.mark_released()
        return report

    def log_agreed(self, report: pytest.TestReport) -> None:
        if report.failed and self.config.stash.get(RANK_SESSION, None) is not None:
            # the agreed report (it quotes every failing rank); this rank's own failure was logged
            # by makereport as it happened
            self.log.file.write(
                f"{rank_dir.agreed_failure_line(report.nodeid, report.when)}\n{report.longreprtext}\n"
            )


def _raise(exc: BaseException) -> None:
    raise exc
