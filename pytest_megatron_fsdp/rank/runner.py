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
import faulthandler
import functools
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from ..environment import DistributedSpec
from ..wire import explain, flight_recorder, protocol, pytest_compat, rank_dir, warnings_relay
from ..wire.explain import headlined_failure
from ..wire.protocol import TIMEOUT_EXIT_CODE, spec_of
from ..wire.torchrun_env import TorchrunEnv
from . import after_test, collection, progress
from .exchange import OutcomeExchange
from .interrupt import MainThreadInterrupt
from .log import RankLog
from .session import (
    RANK_SESSION,
    PeerStuck,
    RankSession,
    SessionCannotGoOn,
)
from .stopped import StoppedSession

#: How long a rank whose test timed out waits for the peers' flight records and stacks before it
#: exits (a peer whose thread cannot get the GIL is dumped by faulthandler's C watchdog instead).
PEER_DUMP_GRACE_S = 5.0

#: How long after a test's timeout a rank that survives its timeouts (torchrun, srun) waits for its
#: main thread to come back to Python, where the interruption fails the test, before it reports the
#: session from its watchdog and ends: a thread stuck in C or C++ (a collective whose peers never
#: release it, a blocking call with the signal blocked) never does. The peers' outcome exchange
#: waits as long for it.
RECOVERY_GRACE_S = 20.0
#: How long after interrupting the main thread the watchdog releases the process group itself, the
#: main thread not being back in Python by then: a rank stuck outside Python for good would hold
#: its peers in their collectives with it until the process-group timeout.
RELEASE_AFTER_S = 2.0
#: After a signal that ends the session (SIGTERM: a CI cancel), how long the main thread has to take
#: it in Python before the rank releases its process group, and then as long again before the rank
#: reports the session from another thread and ends: torchrun SIGKILLs its ranks 30 s after its
#: SIGTERM.
SIGNAL_GRACE_S = 3.0
#: How long a rank ended that way waits for rank 0's report before it ends: within those 30 s too.
SIGNAL_REPORT_WAIT_S = 15.0


@dataclass(frozen=True)
class RankDuties:
    """What a rank does that depends on who reports its session: its parent (a launched rank set)
    or its own rank 0 (a torchrun session or srun step the user started). The role that holds the
    :class:`RankRunner` chooses them."""

    #: rank 0 reports to the user's terminal, and a rank whose test timed out writes its stacks and
    #: the ranks' aligned collectives there (else a parent reports everything from the logs)
    reports_itself: bool
    #: the tests' warnings go to the parent (unless -p no:warnings)
    relays_warnings: bool
    #: what becomes of the session when a rank cannot go on with its peers (said in the failure)
    when_it_cannot_go_on: str
    #: a test's timeout interrupts the test, which fails, and the session goes on (a rank that
    #: reports its own session: nobody else would run the later tests); else the rank ends
    survives_timeouts: bool = False


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
        duties: RankDuties,
        distributed_logs: bool = False,
        private_temp: Path | None = None,
        release_test_groups: Callable[[], int] | None = None,
    ) -> None:
        """``unmarked_settings``: the settings of a test neither the parent's batch nor its marker
        gives (a test without the marker in a torchrun rank session); ``private_temp``: torchrun
        mode's own temp tree of this rank, removed at unconfigure (or by the watchdog);
        ``release_test_groups``: a foreign suite's (see :meth:`review_report`), what frees the
        process groups the current test made, returning how many were alive."""
        self.config = config
        self.torchrun = torchrun
        self.rank = torchrun.rank
        #: seconds the ranks wait for each other's collection (the process-group timeout)
        self._agreement_timeout_s = agreement_timeout_s
        self._unmarked_settings = unmarked_settings
        self.duties = duties
        self._test_index = 0
        self.log = RankLog(config, torchrun, log_dir, distributed_logs)
        #: a launched rank set sends its tests' warnings to the parent (unless -p no:warnings)
        self._relay_warnings = duties.relays_warnings and warnings_relay.active(config)
        self._stopped = StoppedSession(self.log)
        # A rank that survives its timeouts waits past a test's deadline as long as a peer's
        # watchdog gives that peer to come back from the timeout.
        self._exchange = OutcomeExchange(
            self.rank, self.log, RECOVERY_GRACE_S if duties.survives_timeouts else 0.0
        )
        self._private_temp = private_temp
        #: fails the running test from the watchdog at its timeout (ranks that survive timeouts)
        self._interrupt = MainThreadInterrupt()
        #: whether the current test's agreed reports went through pytest's hooks
        self._reported = False
        #: the test this rank runs now (None between tests), for a signal's watcher thread
        self._running_item: pytest.Item | None = None
        #: set once the main thread took a signal that ends the session (KeyboardInterrupt)
        self._interrupt_taken = threading.Event()
        self._release_test_groups = release_test_groups

    def open_log(self, config: pytest.Config) -> None:
        """The rank's log (:meth:`.log.RankLog.open`): only rank 0 of a rank set that reports
        itself keeps the terminal."""
        self.log.open(config, quiet_terminal=self.rank != 0 or not self.duties.reports_itself)

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
        self._release_peers()
        if self._interrupt_taken.wait(SIGNAL_GRACE_S):
            return
        self._end_stuck(
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
        survives = self.duties.survives_timeouts
        # A rank that survives its timeouts watches the test alone: the outcome exchange after it has
        # a bound of its own. A launched rank ends at the timeout, exchange included (its parent
        # runs the rest of the batch in a fresh rank set).
        watch = self._watchdog(item, settings, index)
        around_exchange, around_test = (nullcontext(), watch) if survives else (watch, nullcontext())
        with around_exchange:
            relay: AbstractContextManager[list[warnings.WarningMessage]] = (
                warnings_relay.capture() if self._relay_warnings else nullcontext([])
            )
            with relay as caught, around_test:
                reports = self._run_interruptibly(item, nextitem, rank_session)
                after_test.check_after_test(item, reports, rank_session, self.log)
            try:
                merged = self._exchange.agree(
                    item, index, reports, rank_session, deadline, warnings_relay.to_data(caught)
                )
            except SessionCannotGoOn as exc:
                if exc.__cause__ is not None:  # the whole story for the log; the report gets one line
                    self.log.line("".join(traceback.format_exception(exc.__cause__)).rstrip())
                merged = self._alone(item, reports, str(exc))
                if isinstance(exc, PeerStuck) and survives:
                    # no later test can run: each is reported as not run, by name, with the reason
                    self._stopped.peer_waits_for_the_report(rank_session)
                    self._log_merged(item, merged)
                    self._stopped.not_run_after(item, explain.not_run(item.nodeid, exc.rank))
                    return True
        for line in rank_session.run_after_agreement():
            self.log.line(f"after {item.nodeid}: {line}")
        self._log_merged(item, merged)
        return True

    def _report_interrupted(self, item: pytest.Item, rank_session: RankSession, why: str) -> None:
        self.log.line(f"{item.nodeid}: {why}")
        # a peer whose main thread could not take the signal ends once rank 0 has reported
        self._stopped.peer_waits_for_the_report(rank_session)
        with contextlib.suppress(Exception):  # a peer waiting in a collective comes back
            rank_session.release_peers()
        self._exchange.mark_released()
        # The fixtures' teardown now, while the rank session is up: pytest would tear them down at
        # the session's end, after this plugin has closed the session they need.
        with contextlib.suppress(Exception):
            pytest_compat.teardown_local_state(item, None)
        if not self._reported:
            self._stopped.failed_alone(item, explain.interrupted(item.nodeid, self.rank, why))
        self._stopped.not_run_after(item, explain.not_run_after_interrupt(item.nodeid, why))

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
        self, item: pytest.Item, nextitem: pytest.Item | None, rank_session: RankSession
    ) -> list[pytest.TestReport]:
        """pytest's run of the test, which the watchdog may interrupt at its timeout (a rank that
        survives its timeouts): the failure is raised where the main thread is, in a phase, so the
        phase fails; an interruption that lands between phases, in pytest's own code, fails the
        test here."""
        reports: list[pytest.TestReport] = []
        try:
            with self._interrupt.armed():
                reports = pytest_compat.runtestprotocol(item, nextitem=nextitem, log=False)
        except pytest.fail.Exception as exc:
            if not self._interrupt.fired:
                raise
            with contextlib.suppress(Exception):  # the fixtures' teardown, as far as it goes
                pytest_compat.teardown_local_state(item, nextitem)
            interruption: BaseException = exc
            when: Literal["call", "teardown"] = "teardown" if reports else "call"
            call = pytest.CallInfo.from_call(functools.partial(_raise, interruption), when)
            reports.append(pytest.TestReport.from_item_and_call(item, call))
            after_test.drop_locals(exc.__traceback__)
            rank_session.release_peers()
            self._exchange.mark_released()
        return reports

    def _alone(
        self, item: pytest.Item, reports: list[pytest.TestReport], why: str
    ) -> list[pytest.TestReport]:
        """The test's reports when this rank cannot go on with its peers (they are gone, or the
        process group could not be rebuilt): it fails with ``why`` (this rank's own failure, if any,
        follows), and the session stops after it: no later test can have every rank."""
        message = f"megatron-fsdp: {why}; {self.duties.when_it_cannot_go_on}"
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
            and report.failed
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
            if call.excinfo is not None:
                after_test.drop_locals(call.excinfo.tb)
            if self._release_test_groups is not None and not in_collective and not self._interrupt.fired:
                # A foreign suite's test that failed outside a collective, not at its timeout: a
                # peer waiting in one waits on a group this test made (freed now), or on a group
                # that outlives the test (the default group, a class-scoped fixture's, which the
                # rest of its scope uses): those stay, as no collective of theirs broke here. A skip
                # releases nothing.
                if report.failed:
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

    @contextmanager
    def _watchdog(self, item: pytest.Item, settings: DistributedSpec, index: int) -> Iterator[None]:
        nodeid = item.nodeid
        timeout = settings.timeout_s
        done = threading.Event()
        started_ns = time.time_ns()
        started = time.monotonic()

        def expire() -> None:
            verdict = self._await_verdict(done, index, started, timeout, settings.hang_after_s)
            if verdict is None:
                return
            expired_at = time.monotonic()
            # First, before the slower stack dumps (torchrun stops the other ranks as soon as one
            # exits): torch's record of this rank's collectives, beside its log, for rank 0 (or the
            # parent) to align.
            flight_recorder.dump(rank_dir.dump_path(self.log.dir, self.rank))
            if self.duties.survives_timeouts:
                self._interrupt_at_timeout(item, timeout, verdict, done, expired_at, started_ns)
            else:
                self._end_at_timeout(nodeid, timeout, verdict)

        # Backup in C, should the GIL never come back to the thread above.
        backup = timeout + (RECOVERY_GRACE_S + 8 if self.duties.survives_timeouts else 10)
        faulthandler.dump_traceback_later(backup, exit=True, file=self.log.file)
        thread = threading.Thread(target=expire, name="mfsdp-watchdog", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            faulthandler.cancel_dump_traceback_later()

    def _await_verdict(
        self, done: threading.Event, index: int, started: float, timeout: float, hang_after_s: float
    ) -> protocol.Verdict | None:
        """Until test ``index`` (begun at monotonic ``started``) is done (None), hangs (no rank got
        anywhere for the no-progress bound, or a peer found that) or reaches its timeout: the
        verdict then. Without a rank session's beacon, the timeout alone."""
        rank_session: RankSession | None = self.config.stash.get(RANK_SESSION, None)
        beacon = rank_session.beacon if rank_session is not None else None
        while True:
            now = time.monotonic()
            quiet = beacon.quiet_for(started) if beacon is not None else None
            if beacon is not None and (declared := beacon.hang_declared(index)) is not None:
                return declared
            verdict = progress.decide(now - started, timeout, quiet, hang_after_s)
            if verdict is not None:
                if beacon is not None and verdict.hung and verdict.before_timeout:
                    beacon.declare_hang(index, verdict)
                return verdict
            if done.wait(min(started + timeout - now, progress.LOOK_INTERVAL_S)):
                return None

    def _interrupt_at_timeout(
        self,
        item: pytest.Item,
        timeout: float,
        verdict: protocol.Verdict,
        done: threading.Event,
        expired_at: float,
        started_ns: int,
    ) -> None:
        """A rank that survives its timeouts (torchrun, srun): its stacks and, on rank 0, every
        rank's aligned collectives into the failure, which is raised in the main thread where it is
        in Python (a peer's release of the process group brings a rank waiting in a collective
        back); the session goes on with the next test. A main thread that does not come back within
        :data:`RECOVERY_GRACE_S` ends the rank (:meth:`_end_stuck`)."""
        nodeid = item.nodeid
        banner = explain.timeout_banner(nodeid, timeout, self.rank, interrupts=True, verdict=verdict)
        stacks = _stacks_of_every_thread()
        with contextlib.suppress(OSError, ValueError):
            self.log.file.write(f"{banner}\n{stacks}")
            self.log.file.flush()
        self._await_peer_dumps(nodeid)
        collectives: list[str] = []
        if self.rank == 0 and self.duties.reports_itself:
            log_dir, world = self.log.dir, self.torchrun.world_size
            collectives = flight_recorder.section(log_dir, world, time.time_ns(), started_ns)
            with contextlib.suppress(OSError, ValueError):
                self.log.file.write("".join(f"{line}\n" for line in collectives))
        self._interrupt.fire(explain.timed_out_in_rank(banner, collectives, stacks))
        if done.wait(RELEASE_AFTER_S):
            return
        # Not back in Python: in a collective (whose peers, interrupted, release the group and so
        # bring it back), or stuck for good, in which case peers waiting in a collective with it
        # are brought back by its release of the group here (gloo sees the connection close; a
        # group's abort or destroy does not end this rank's own wait in a collective).
        self._release_peers()
        if done.wait(max(expired_at + RECOVERY_GRACE_S - time.monotonic(), 0)):
            return
        self._end_stuck(
            item,
            banner,
            expired_at,
            why=explain.main_thread_stuck(item.nodeid, self.rank, RECOVERY_GRACE_S),
            not_run=explain.not_run(item.nodeid, self.rank),
        )

    def _end_stuck(
        self,
        item: pytest.Item,
        banner: str,
        expired_at: float,
        why: str,
        not_run: str,
        report_wait_s: float = RECOVERY_GRACE_S + 7,
    ) -> None:
        """The main thread never came back (from the timeout, or to take a signal; ``why`` says
        which): tell the peers (they stop waiting for this rank's outcome), report the session from
        here on rank 0 (every result so far, this test failed, the rest reported ``not_run``: JUnit
        file and summary), leave once rank 0 has reported (at most ``report_wait_s`` after
        ``expired_at``), end."""
        stacks = _stacks_of_every_thread()
        with contextlib.suppress(OSError, ValueError):
            self.log.line(why)
            self.log.file.write(stacks)
            self.log.file.flush()
        rank_session: RankSession | None = self.config.stash.get(RANK_SESSION, None)
        if rank_session is not None:
            rank_session.mark_stuck(why)
        if self.rank == 0 and self.duties.reports_itself:
            message = explain.stuck_failure(banner, why, stacks)
            with contextlib.suppress(Exception):  # whatever a hook raises, the rank ends below
                self._report_from_watchdog(item, message, not_run)
            if rank_session is not None:
                rank_session.mark_closing()
                rank_session.mark_reported()
        elif rank_session is not None:
            # torchrun stops every rank as soon as one exits: rank 0 reports first
            rank_session.mark_closing()
            rank_session.wait_reported(expired_at + report_wait_s)
        self._remove_temp_trees(rank_session)
        save_coverage()  # os._exit skips the atexit handler that would write it
        os._exit(TIMEOUT_EXIT_CODE)

    def _report_from_watchdog(self, item: pytest.Item, message: str, not_run: str) -> None:
        """Rank 0's report of a session whose main thread is stuck, from the watchdog thread: the
        test's failure and the later tests not run go through pytest's report hooks (the terminal,
        the JUnit file), then the session's end hooks write the JUnit file and the summary."""
        session = item.session
        self.log.release_terminal()
        # the rank session's close would wait for this thread's own main thread: it ends without
        self.config.stash[RANK_SESSION] = None
        self._stopped.failed_alone(item, message)
        self._stopped.not_run_after(item, not_run)
        self.config.hook.pytest_sessionfinish(session=session, exitstatus=pytest.ExitCode.TESTS_FAILED)
        sys.stdout.flush()

    def _release_peers(self) -> None:
        """From a watcher's thread, the main thread not back: release the process group, so that
        peers waiting with this rank in a collective come back."""
        rank_session: RankSession | None = self.config.stash.get(RANK_SESSION, None)
        if rank_session is not None:
            with contextlib.suppress(Exception):  # a group already gone: nothing to release
                rank_session.release_peers()
            self._exchange.mark_released()

    def _remove_temp_trees(self, rank_session: RankSession | None) -> None:
        """This process ends without teardown or unconfigure: its temp trees go now. ``rank_session``:
        the session's, taken before a report from the watchdog dropped it from the stash."""
        if rank_session is not None and self.rank == 0:
            shutil.rmtree(rank_session.env.shared_dir, ignore_errors=True)
        if self._private_temp is not None:
            shutil.rmtree(self._private_temp, ignore_errors=True)

    def _end_at_timeout(self, nodeid: str, timeout: float, verdict: protocol.Verdict) -> None:
        """A launched rank: its stacks into its log, and the rank ends (its parent reports the
        timeout from the logs and runs the rest of the batch in a fresh rank set)."""
        # This process ends here, without teardown or unconfigure, and may be killed any time
        # once a peer has seen its marker below (torchrun stops the others as soon as one
        # rank exits): its temp trees go now, before it tells the peers it is done.
        self._remove_temp_trees(self.config.stash.get(RANK_SESSION, None))
        banner = explain.timeout_banner(nodeid, timeout, self.rank, interrupts=False, verdict=verdict)
        for stream in (self.log.file, sys.stderr):
            try:
                stream.write(banner + "\n")
                stream.flush()
                faulthandler.dump_traceback(file=stream, all_threads=True)
                stream.flush()
            except (OSError, ValueError):
                pass
        self._await_peer_dumps(nodeid)
        save_coverage()  # os._exit skips the atexit handler that would write it
        os._exit(TIMEOUT_EXIT_CODE)

    def _await_peer_dumps(self, nodeid: str) -> None:
        """Stay until every rank has dumped for ``nodeid`` (bounded): torchrun stops the others as
        soon as one rank exits, and the timers start a little apart on each rank, so the first to
        expire would otherwise take the peers' flight records and stacks with it."""
        log_dir = self.log.dir
        rank_dir.marker_path(log_dir, self.rank, rank_dir.EXPIRED).write_text(nodeid)
        markers = [
            rank_dir.marker_path(log_dir, r, rank_dir.EXPIRED) for r in range(self.torchrun.world_size)
        ]
        deadline = time.monotonic() + PEER_DUMP_GRACE_S
        while time.monotonic() < deadline:
            try:
                if all(m.read_text() == nodeid for m in markers):
                    return
            except OSError:
                pass  # a peer has not got there yet
            time.sleep(0.05)


def _raise(exc: BaseException) -> None:
    raise exc


def _stacks_of_every_thread() -> str:
    """faulthandler's dump of every thread's Python stack, as text (it writes to a file only)."""
    with tempfile.TemporaryFile("w+") as dump:
        faulthandler.dump_traceback(file=dump, all_threads=True)
        dump.seek(0)
        return dump.read()


def save_coverage() -> bool:
    """Write the data of the coverage measurement running in this process, if one is (``pytest
    --cov``, ``coverage run``, or a rank coverage started through its subprocess patch); whether
    it wrote. Needed before ``os._exit``, which skips coverage's own atexit save. Imports nothing:
    without a running measurement coverage is not loaded, or has no current instance."""
    coverage = sys.modules.get("coverage")
    current = getattr(getattr(coverage, "Coverage", None), "current", None)
    measurement = current() if callable(current) else None
    if measurement is None:
        return False
    try:
        measurement.save()  # as coverage's own os._exit patch does: the measurement may go on
    except Exception:  # noqa: BLE001 - the rank is ending on a timeout either way
        return False
    return True
