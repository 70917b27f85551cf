"""Worker side: what a torchrun rank does beyond running its tests.

* only rank 0 talks to the terminal; every rank keeps a log file (``rank<R>.log``) with its own
  report, failures written the moment they happen, and stack dumps;
* all ranks must have collected the same tests in the same order (checked through the store);
* after each test the ranks agree on its outcome through the store, with bounded waits: a failure
  on one rank fails the test on all, carrying that rank's traceback and captured output;
* a watchdog per test: on expiry it dumps every thread's stack (faulthandler); a launched rank then
  ends (its parent runs the rest in a fresh rank set), a torchrun-mode or srun rank interrupts the
  test, which fails, and goes on (and where its main thread never comes back, reports the session
  from the watchdog thread and ends);
* in a rank set launched by the plugin (plain-pytest mode) rank 0 streams the agreed reports to the
  parent session as JSON lines.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import functools
import json
import logging
import os
import shutil
import signal
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
from types import TracebackType
from typing import IO, Any, Literal, TextIO, cast

import pytest

from ..environment import DistributedSpec
from ..wire import coexist, explain, flight_recorder, protocol, pytest_compat, rank_dir, warnings_relay
from ..wire.explain import headlined_failure
from ..wire.protocol import (
    BATCH_FILE_DEST,
    REPORT_FILE_DEST,
    SPEC,
    TIMEOUT_EXIT_CODE,
    encode_event,
    read_batch,
    spec_of,
)
from ..wire.reports import NOT_RUN, build_report
from ..wire.torchrun_env import TorchrunEnv
from . import progress
from .agreement import merge_reports, summarise
from .held_terminal import HELD_TERMINAL
from .interrupt import MainThreadInterrupt
from .session import (
    RANK_SESSION,
    PeerStuck,
    RankSession,
    SessionCannotGoOn,
    first_line,
    forget_dtensor_shardings,
)

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
#: How long a rank whose foreign test failed outside a collective waits for its peers to be done
#: with that test before it closes the default group's connections under them (they may wait in a
#: collective of it this rank never enters): well inside the watchdog's no-progress bound, long
#: enough for peers on a loaded machine to finish the test's own work.
PEERS_IN_THE_TEST_WAIT_S = 15.0
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
        gives (a test without the marker in a torchrun rank session); ``release_test_groups``: a
        foreign suite's (see :meth:`review_report`), what frees the process groups the current test
        made, returning how many were alive."""
        self.config = config
        self.torchrun = torchrun
        self.rank = torchrun.rank
        self._log_dir = log_dir
        #: seconds the ranks wait for each other's collection (the process-group timeout)
        self._agreement_timeout_s = agreement_timeout_s
        self._unmarked_settings = unmarked_settings
        self.duties = duties
        self._report_file = config.getoption(REPORT_FILE_DEST)
        self.events: IO[str] | None = None
        self._test_index = 0
        self._released = False
        #: --mfsdp-distributed-logs: keep torch.distributed's DEBUG/INFO records in captured logs
        self._distributed_logs = distributed_logs
        #: torchrun mode: this rank's own temp tree, removed at unconfigure (or by the watchdog)
        self._private_temp = private_temp
        #: a launched rank set sends its tests' warnings to the parent (unless -p no:warnings)
        self._relay_warnings = duties.relays_warnings and warnings_relay.active(config)
        #: the current test's warnings, every rank's merged (set by _exchange_outcomes)
        self._test_warnings: list[dict[str, Any]] = []
        #: fails the running test from the watchdog at its timeout (ranks that survive timeouts)
        self._interrupt = MainThreadInterrupt()
        #: the tests the session did not run after a rank never came back from a timeout
        self._not_run: list[str] = []
        #: whether the current test's agreed reports went through pytest's hooks
        self._reported = False
        #: the test this rank runs now (None between tests), for a signal's watcher thread
        self._running_item: pytest.Item | None = None
        #: set once the main thread took a signal that ends the session (KeyboardInterrupt)
        self._interrupt_taken = threading.Event()
        #: set when a peer never came back from a timeout: rank 0 tells it once the session is
        #: reported (at unconfigure), so that its end cannot stop rank 0 first
        self._stuck_peer_session: RankSession | None = None
        self._release_test_groups = release_test_groups
        #: a foreign suite's test failed on this rank outside a collective: before the outcomes are
        #: exchanged, peers still in the test are looked for (see _exchange_outcomes)
        self._failed_outside_a_collective = False

    def open_log(self, config: pytest.Config) -> None:
        """The rank's log, fault handlers and event stream; its terminal report to the log where
        another process reports. Called from the role plugin's ``pytest_configure``, as it is
        registered from the main plugin's trylast pytest_configure: the cache dir (the default log
        dir) and the terminal reporter exist by then."""
        log_dir = self._log_dir()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = rank_dir.log_path(log_dir, self.rank)
        self.log: IO[str] = open(self.log_path, "w", buffering=1)  # noqa: SIM115 (lives as long as the rank)
        rank_dir.pid_path(log_dir, self.rank).write_text(str(os.getpid()))
        # An earlier session's timeout markers and flight records (torchrun mode reuses its log dir;
        # a launched rank set's is emptied by the parent): a marker naming the same test would end
        # the wait for this session's peers early, an old record would be aligned as theirs.
        for suffix in (rank_dir.EXPIRED, rank_dir.ALIGNED):
            rank_dir.marker_path(log_dir, self.rank, suffix).unlink(missing_ok=True)
        flight_recorder.remove_dumps(log_dir, self.rank)
        # `kill -USR1 <pid>` (the plain-mode parent's backup watchdog does) dumps every thread's stack.
        faulthandler.register(signal.SIGUSR1, file=self.log, all_threads=True)
        # A fatal signal (SIGSEGV, SIGABRT, ...) dumps them into this rank's log too, which failure
        # reports quote per rank; pytest's own handler would write them to the shared torchrun output.
        faulthandler.enable(file=self.log, all_threads=True)
        if self._report_file and self.rank == 0:
            self.events = open(self._report_file, "a", buffering=1)  # noqa: SIM115
        self._log(
            f"rank {self.rank} of {self.torchrun.world_size} (local rank {self.torchrun.local_rank}), "
            f"pid {os.getpid()}"
        )
        if self.rank != 0 or not self.duties.reports_itself:
            self._quiet_terminal(config)

    def quiet_distributed_logs(self) -> None:
        """Filter torch.distributed's DEBUG/INFO records out of pytest's log handlers (unless
        ``--mfsdp-distributed-logs``)."""
        if self._distributed_logs:
            return
        # pytest's handlers for captured logs (and live/file logging): records reach them from any
        # logger, so filtering here quiets the reports without touching anyone's logging setup.
        logging_plugin = self.config.pluginmanager.get_plugin("logging-plugin")
        for name in ("caplog_handler", "report_handler", "log_cli_handler", "log_file_handler"):
            handler = getattr(logging_plugin, name, None)
            if isinstance(handler, logging.Handler):
                handler.addFilter(_WarningsAndAbove())

    # -- output -------------------------------------------------------------------------------------

    def _log(self, text: str) -> None:
        self.log.write(f"[{time.strftime('%H:%M:%S')}] {text}\n")

    def _event(self, event: protocol.Event) -> None:
        if self.events is not None:
            self.events.write(encode_event(event))

    def _quiet_terminal(self, config: pytest.Config) -> None:
        """This rank's terminal report goes to its log file (rank 0's reaches the user)."""
        old = config.pluginmanager.get_plugin("terminalreporter")
        if old is None:
            return
        held = config.stash.get(HELD_TERMINAL, None)
        if held is not None and held.held:
            # a session that turned out to use the plugin: what its reporter wrote so far, and the
            # rest, go to the log (its reporter keeps its state: collection counts, errors)
            held.divert(self.log)
            old._tw.hasmarkup = False
        else:
            config.pluginmanager.unregister(old)
            quiet = pytest_compat.TerminalReporter(config, cast(TextIO, self.log))
            config.pluginmanager.register(quiet, "terminalreporter")
        if config.getoption("capture") == "no":
            # Nothing captures this rank's output, so point its stdout/stderr at the log too.
            sys.stdout.flush()
            sys.stderr.flush()
            self._terminal_fd = os.dup(2)  # for the one line that must reach the user (_tell_terminal)
            os.dup2(self.log.fileno(), 1)
            os.dup2(self.log.fileno(), 2)

    def close_log(self) -> None:
        if not hasattr(self, "log"):
            return
        faulthandler.unregister(signal.SIGUSR1)
        # Before the log closes; pytest's faulthandler plugin, unconfigured after this one, then
        # restores its own.
        faulthandler.disable()
        if self.events is not None:
            self.events.close()
        self.log.close()
        if self._stuck_peer_session is not None and self.rank == 0:
            # the JUnit file and the summary are written: the peer that never came back may end
            self._stuck_peer_session.mark_reported()

    def not_run_lines(self) -> list[str]:
        """The terminal summary's section on the tests not run after a rank never came back from a
        timeout (empty when every test ran)."""
        if not self._not_run:
            return []
        return [explain.tests_not_run_heading(len(self._not_run)), *self._not_run]

    # -- collection ---------------------------------------------------------------------------------

    def select_batch(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        """In a rank set the plugin launched: exactly the parent's batch, in the parent's order."""
        batch_file = config.getoption(BATCH_FILE_DEST)
        if batch_file is None:
            return
        batch = read_batch(Path(batch_file))
        by_id = {item.nodeid: item for item in items}
        selected = []
        for nodeid, spec in batch:
            if nodeid in by_id:
                by_id[nodeid].stash[SPEC] = spec  # as the parent resolved it: not resolved again here
                selected.append(by_id[nodeid])
        chosen = set(selected)
        deselected = [item for item in items if item not in chosen]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
        items[:] = selected

    def check_same_collection(self, session: pytest.Session, rank_session: RankSession) -> None:
        """All ranks run the same tests in the same order, or none runs anything."""
        mine = [item.nodeid for item in session.items]
        seed = coexist.randomly_seed(self.config)
        collected = rank_session.exchange(
            "collect",
            json.dumps({"nodeids": mine, "randomly_seed": seed}),
            datetime.timedelta(seconds=self._agreement_timeout_s),
        )
        first = json.loads(collected[0])
        reference = first["nodeids"]
        for rank in range(1, self.torchrun.world_size):
            data = json.loads(collected[rank])
            theirs = data["nodeids"]
            if theirs == reference:
                continue
            if data["randomly_seed"] != first["randomly_seed"]:
                raise pytest.UsageError(
                    f"ranks collected their tests in different orders "
                    f"({_first_difference(reference, theirs, rank)}): pytest-randomly shuffled them with "
                    f"--randomly-seed={first['randomly_seed']} on rank 0 and "
                    f"--randomly-seed={data['randomly_seed']} on rank {rank}; give every rank the same "
                    "seed (--randomly-seed=N on the command line) or disable it (-p no:randomly)"
                )
            raise pytest.UsageError(
                f"ranks collected different tests: {_first_difference(reference, theirs, rank)}; "
                "every rank must collect the same tests in the same order (check for rank-dependent "
                "collection, e.g. conftest code reading RANK, or files differing between nodes)"
            )
        self._event(protocol.Collected(nodeids=mine))

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
        self._log(rank_dir.start_line(item.nodeid, timeout))
        self._event(protocol.Started(nodeid=item.nodeid))
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
                self._check_after_test(item, reports, rank_session)
            try:
                merged = self._exchange_outcomes(
                    item, index, reports, rank_session, deadline, warnings_relay.to_data(caught)
                )
            except SessionCannotGoOn as exc:
                if exc.__cause__ is not None:  # the whole story for the log; the report gets one line
                    self._log("".join(traceback.format_exception(exc.__cause__)).rstrip())
                merged = self._alone(item, reports, str(exc))
                if isinstance(exc, PeerStuck) and survives:
                    # no later test can run: each is reported as not run, by name, with the reason
                    self._stuck_peer_session = rank_session
                    self._log_merged(item, merged)
                    self._report_not_run(item, explain.not_run(item.nodeid, exc.rank))
                    return True
        for line in rank_session.run_after_agreement():
            self._log(f"after {item.nodeid}: {line}")
        self._log_merged(item, merged)
        return True

    def _report_interrupted(self, item: pytest.Item, rank_session: RankSession, why: str) -> None:
        self._log(f"{item.nodeid}: {why}")
        # a peer whose main thread could not take the signal ends once rank 0 has reported
        self._stuck_peer_session = rank_session
        with contextlib.suppress(Exception):  # a peer waiting in a collective comes back
            rank_session.release_peers()
        self._released = True
        # The fixtures' teardown now, while the rank session is up: pytest would tear them down at
        # the session's end, after this plugin has closed the session they need.
        with contextlib.suppress(Exception):
            pytest_compat.teardown_local_state(item, None)
        if not self._reported:
            self._report_failed_alone(item, explain.interrupted(item.nodeid, self.rank, why))
        self._report_not_run(item, explain.not_run_after_interrupt(item.nodeid, why))

    def _report_failed_alone(self, item: pytest.Item, message: str) -> None:
        """``item`` failed with ``message`` as this rank alone reports it (no agreement: the session
        cannot go on), through pytest's report hooks (the terminal, the JUnit file)."""
        for when, outcome in (("setup", "passed"), ("call", "failed"), ("teardown", "passed")):
            report = build_report(
                item, when, outcome, headlined_failure(item, message) if outcome == "failed" else None
            )
            item.ihook.pytest_runtest_logreport(report=report)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)

    def _log_merged(self, item: pytest.Item, merged: list[pytest.TestReport]) -> None:
        self._reported = True
        if self._test_warnings:
            self._event(protocol.Warnings(nodeid=item.nodeid, warnings=self._test_warnings))
        for report in merged:
            item.ihook.pytest_runtest_logreport(report=report)
            data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
            self._event(protocol.Report(report=data))
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        self._event(protocol.Finished(nodeid=item.nodeid))

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
            _drop_locals(exc.__traceback__)
            rank_session.release_peers()
            self._released = True
        return reports

    def _report_not_run(self, after: pytest.Item, reason: str) -> None:
        """Each test after ``after`` is reported not run, with ``reason`` (the session ends here): an
        error in its setup (a JUnit ``error``, a failed session), never a skip, which would count
        a test nobody ran as an accepted outcome; its terminal status is ``NOT RUN``
        (:data:`NOT_RUN`)."""
        items = after.session.items
        later = items[items.index(after) + 1 :] if after in items else []
        for item in later:
            item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
            for when, outcome, longrepr in (
                ("setup", "failed", headlined_failure(item, reason)),
                ("teardown", "passed", None),
            ):
                report = build_report(item, when, outcome, longrepr, attributes={NOT_RUN: True})
                item.ihook.pytest_runtest_logreport(report=report)
            item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        self._not_run = [item.nodeid for item in later]
        if later:
            self._log(f"{len(later)} tests not run: {reason}")

    def _alone(
        self, item: pytest.Item, reports: list[pytest.TestReport], why: str
    ) -> list[pytest.TestReport]:
        """The test's reports when this rank cannot go on with its peers (they are gone, or the
        process group could not be rebuilt): it fails with ``why`` (this rank's own failure, if any,
        follows), and the session stops after it: no later test can have every rank."""
        message = f"megatron-fsdp: {why}; {self.duties.when_it_cannot_go_on}"
        self._log(f"{item.nodeid}: {message}")
        if self.rank != 0:
            self._tell_terminal(f"{message} (rank {self.rank}, test {item.nodeid})")
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

    def _check_after_test(
        self, item: pytest.Item, reports: list[pytest.TestReport], rank_session: RankSession
    ) -> None:
        """The checks fixtures registered for after the test (``RankSession.after_test``); a problem
        fails the test's teardown report (or joins it as a section when teardown already failed)."""
        _release_failed_test_frames(item)
        # The next test's meshes may compare equal to this one's, over other groups (a changed
        # model-parallel layout, a renewed process group): no cached sharding may carry this one's.
        forget_dtensor_shardings()

        def check() -> None:
            problems = rank_session.run_after_test_checks()
            if problems:
                pytest.fail("\n".join(problems), pytrace=False)

        call = pytest.CallInfo.from_call(check, when="teardown")
        if call.excinfo is None:
            return
        # Not through the makereport hook: that would release the peers and renew the process
        # group, which a problem found after the test (no collective in flight) does not need.
        found = pytest.TestReport.from_item_and_call(item, call)
        teardown = next((r for r in reports if r.when == "teardown"), None)
        if teardown is None:
            reports.append(found)
        elif teardown.failed:
            teardown.sections.append(("megatron-fsdp: after the test", found.longreprtext))
        else:
            teardown.outcome = "failed"
            teardown.longrepr = found.longrepr
        self._log(f"after {item.nodeid}: {found.longreprtext}")

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
            and _raised_in_torch_distributed(call.excinfo)
        ):
            # One failure, one report: a fixture teardown's collective after a failure released the
            # process group (here or on a peer) cannot succeed, and its error only echoes that
            # failure, which is reported already. The teardown counts as done; its error stays in
            # this rank's log and in a report section.
            echo = call.excinfo.exconly()
            self._log(f"{item.nodeid}: teardown collective after the release skipped: {echo}")
            report.outcome = "passed"
            report.longrepr = None
            report.sections.append(
                ("teardown collective skipped", f"the process group was released after the failure: {echo}")
            )
        if report.failed:
            # Now, before the ranks agree: a peer stuck in a collective can hold the agreed report
            # back until the process-group timeout, or for good if this rank set is then killed.
            self.log.write(
                f"{rank_dir.failed_line(report.nodeid, report.when, self.rank)}\n{report.longreprtext}\n"
            )
            self.log.flush()
        if rank_session is not None and (report.failed or (report.skipped and report.when == "call")):
            in_collective = call.excinfo is not None and _raised_in_torch_distributed(call.excinfo)
            if call.excinfo is not None:
                _drop_locals(call.excinfo.tb)
            if self._release_test_groups is not None and not in_collective and not self._interrupt.fired:
                # A foreign suite's test that failed outside a collective, not at its timeout: a
                # peer waiting in one waits on a group this test made (freed now), or on a group
                # that outlives the test (the default group, a class-scoped fixture's, which the
                # rest of its scope uses): those stay, as no collective of theirs broke here. A skip
                # releases nothing.
                if report.failed:
                    freed = self._release_test_groups()
                    self._log(f"{item.nodeid}: released the {freed} process groups the test made")
                    self._failed_outside_a_collective = True
                return report
            # Peers may be waiting in a collective this rank will never enter: let them fail now
            # rather than wait out the process-group timeout. The group is rebuilt after the test.
            rank_session.release_peers()
            self._released = True
        return report

    def log_agreed(self, report: pytest.TestReport) -> None:
        if report.failed and self.config.stash.get(RANK_SESSION, None) is not None:
            # the agreed report (it quotes every failing rank); this rank's own failure was logged
            # by makereport as it happened
            self.log.write(
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
            flight_recorder.dump(rank_dir.dump_path(self.log_path.parent, self.rank))
            if self.duties.survives_timeouts:
                self._interrupt_at_timeout(item, timeout, verdict, done, expired_at, started_ns)
            else:
                self._end_at_timeout(nodeid, timeout, verdict)

        # Backup in C, should the GIL never come back to the thread above.
        backup = timeout + (RECOVERY_GRACE_S + 8 if self.duties.survives_timeouts else 10)
        faulthandler.dump_traceback_later(backup, exit=True, file=self.log)
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
            self.log.write(f"{banner}\n{stacks}")
            self.log.flush()
        self._await_peer_dumps(nodeid)
        collectives: list[str] = []
        if self.rank == 0 and self.duties.reports_itself:
            log_dir, world = self.log_path.parent, self.torchrun.world_size
            collectives = flight_recorder.section(log_dir, world, time.time_ns(), started_ns)
            with contextlib.suppress(OSError, ValueError):
                self.log.write("".join(f"{line}\n" for line in collectives))
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
            self._log(why)
            self.log.write(stacks)
            self.log.flush()
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
        self._release_terminal()
        # the rank session's close would wait for this thread's own main thread: it ends without
        self.config.stash[RANK_SESSION] = None
        self._report_failed_alone(item, message)
        self._report_not_run(item, not_run)
        self.config.hook.pytest_sessionfinish(session=session, exitstatus=pytest.ExitCode.TESTS_FAILED)
        sys.stdout.flush()

    def _release_peers(self) -> None:
        """From a watcher's thread, the main thread not back: release the process group, so that
        peers waiting with this rank in a collective come back."""
        rank_session: RankSession | None = self.config.stash.get(RANK_SESSION, None)
        if rank_session is not None:
            with contextlib.suppress(Exception):  # a group already gone: nothing to release
                rank_session.release_peers()
            self._released = True

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
        for stream in (self.log, sys.stderr):
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

    def _tell_terminal(self, line: str) -> None:
        """One line to the terminal from a rank whose report goes to its log."""
        fd = getattr(self, "_terminal_fd", None)
        if fd is not None:
            os.write(fd, (line + "\n").encode())
            return
        self._release_terminal()
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def _release_terminal(self) -> None:
        """Stop pytest's capture (this process ends without a report), so what the watchdog writes
        to stderr reaches the terminal, or torchrun's output, instead of the test's captured output."""
        capman = self.config.pluginmanager.get_plugin("capturemanager")
        if capman is None:
            return
        with contextlib.suppress(Exception):  # the capture in another state: stderr stays as it is
            capman.suspend_global_capture(in_=False)

    def _await_peer_dumps(self, nodeid: str) -> None:
        """Stay until every rank has dumped for ``nodeid`` (bounded): torchrun stops the others as
        soon as one rank exits, and the timers start a little apart on each rank, so the first to
        expire would otherwise take the peers' flight records and stacks with it."""
        log_dir = self.log_path.parent
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

    def _exchange_outcomes(
        self,
        item: pytest.Item,
        index: int,
        reports: list[pytest.TestReport],
        rank_session: RankSession,
        deadline: float,
        warnings_data: list[dict[str, Any]] | None = None,
    ) -> list[pytest.TestReport]:
        """Exchange every rank's phase outcomes (and warnings) through the store; return the agreed
        reports (the warnings, merged, go to ``self._test_warnings``)."""
        mine = {r.when: summarise(r) for r in reports}
        if self._failed_outside_a_collective:
            self._failed_outside_a_collective = False
            self._bring_back_peers_in_the_default_group(item, index, rank_session, deadline)
        # a test that destroyed the session's default group (or replaced it): every rank renews it
        released = self._released or not rank_session.holds_default_group()
        self._released = False
        # Bounded by the test's own deadline, past which the watchdog ends a launched rank anyway.
        # A rank that survives its timeouts waits as long past it as a peer's watchdog gives that
        # peer to come back from the timeout (a fresh bound where the test timed out); a peer that
        # does not come back says so (PeerStuck). In an srun step a peer that is gone (no sign of
        # life) ends the wait sooner (PeersGone).
        grace = RECOVERY_GRACE_S if self.duties.survives_timeouts else 0.0
        try:
            exchanged = rank_session.exchange(
                f"test/{index}",
                json.dumps(
                    {
                        "nodeid": item.nodeid,
                        "phases": mine,
                        "released": released,
                        "warnings": warnings_data or [],
                    }
                ),
                datetime.timedelta(seconds=max(deadline - time.monotonic(), 0) + grace + 5),
                f"the outcome of {item.nodeid}",
            )
            outcomes = [json.loads(value) for value in exchanged]
        except RuntimeError as exc:  # torch's DistStoreError, DistNetworkError
            raise SessionCannotGoOn(
                f"the ranks' outcomes of the test could not be exchanged through the rendezvous store: "
                f"{type(exc).__name__}: {first_line(exc)}"
            ) from exc
        per_rank: dict[int, dict[str, Any]] = {}
        per_rank_warnings: dict[int, list[dict[str, Any]]] = {}
        renew = False
        for rank, data in enumerate(outcomes):
            if data["nodeid"] != item.nodeid:
                raise pytest.UsageError(
                    f"rank {rank} ran {data['nodeid']!r} while rank {self.rank} ran {item.nodeid!r}"
                )
            per_rank[rank] = data["phases"]
            per_rank_warnings[rank] = data.get("warnings", [])
            renew |= data["released"]
        self._test_warnings = warnings_relay.merge(per_rank_warnings)
        if renew:
            rank_session.renew()  # every rank decides alike: all saw the same flags
            self._log(f"process group rebuilt after {item.nodeid} (generation {rank_session.generation})")
        log_dir = self.log_path.parent
        return merge_reports(item, reports, per_rank, self.rank, log_dir)

    def _bring_back_peers_in_the_default_group(
        self, item: pytest.Item, index: int, rank_session: RankSession, deadline: float
    ) -> None:
        """A foreign test failed here outside a collective (its own groups are freed already):
        peers still in the test :data:`PEERS_IN_THE_TEST_WAIT_S` later may wait in a collective of
        the default group this rank never enters (Megatron-LM's tests end with
        ``Utils.destroy_model_parallel()``, a barrier, after their asserts). Closing the default
        group's connections brings them back, the test fails alone and the next one runs; every
        rank renews the default group after it (decided before this rank's outcome is posted, so
        every rank reads the same flag). Peers that are all accounted for (passed, or failed as
        this rank did) keep every group: a class-scoped fixture's group outlives the failure."""
        wait_s = max(min(PEERS_IN_THE_TEST_WAIT_S, deadline - time.monotonic()), 0.0)
        still = rank_session.peers_still_in_the_test(f"test/{index}", wait_s)
        if still:
            rank_session.abort_default_group()
            self._released = True
            names = ", ".join(map(str, still))
            self._log(
                f"{item.nodeid}: rank{'s' if len(still) > 1 else ''} {names} still in the test "
                f"{wait_s:g} s after it failed here: closed the default group's connections"
            )


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


def _raised_in_torch_distributed(excinfo: pytest.ExceptionInfo[BaseException]) -> bool:
    """Whether the exception came out of torch.distributed (a collective, or the missing group)."""
    import torch.distributed

    root = os.path.dirname(torch.distributed.__file__) + os.sep
    return any(str(entry.path).startswith(root) for entry in excinfo.traceback)


class _WarningsAndAbove(logging.Filter):
    """Drops torch.distributed's own DEBUG/INFO records (DCP's event log, c10d's): about 20 per
    checkpoint save or load, none of which says anything about a failure."""

    PREFIXES = ("c10d-", "torch.distributed")

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.name.startswith(self.PREFIXES)


def _drop_locals(tb: TracebackType | None) -> None:
    """Let go of what a failed test's frames hold, before its process group is released: a group
    one of them still references (the frame of the collective the test was interrupted in, or
    failed in) keeps its connections when destroyed, and a peer waiting in a collective this rank
    never enters then waits until the group's timeout (gloo: neither its destroy nor its abort
    closes them while the backend lives; torch 2.14.1). The report is made already; ``--pdb``
    finds no locals in these frames afterwards."""
    for frame, _line in traceback.walk_tb(tb):
        with contextlib.suppress(Exception):  # the snapshot pytest's report took (Python < 3.13)
            frame.f_locals.clear()
        with contextlib.suppress(RuntimeError):  # a frame still running keeps its locals
            frame.clear()


def _release_failed_test_frames(item: pytest.Item) -> None:
    """Drop pytest's reference to a test that failed in its call, as pytest does before the next.

    pytest keeps the failure in ``sys.last_value`` / ``sys.last_traceback`` for post-mortem
    debugging, which is over once the report is made (``--pdb`` runs during the call). Its frames
    hold the test's locals, its model among them, until the next failure replaces them. Clearing
    the frames is not enough: ``frame.clear()`` keeps the ``f_locals`` snapshot that pytest's
    failure report took (Python 3.11 and 3.12).
    """
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)
    # pytest-rerunfailures keeps each failed phase's ExceptionInfo on the item until its own rerun
    # protocol ends (for the whole session where it reruns nothing). A rank never reruns in place
    # (the parent reruns a test in a fresh rank set), so a rank needs none of them.
    excinfos = getattr(item, "_rerun_condition_excinfos", None)
    if isinstance(excinfos, dict):
        excinfos.clear()


def _first_difference(reference: list[str], theirs: list[str], rank: int) -> str:
    for position, (a, b) in enumerate(zip(reference, theirs, strict=False)):
        if a != b:
            return f"at position {position} rank 0 has {a!r} but rank {rank} has {b!r}"
    if len(reference) != len(theirs):
        longer, who = (reference, 0) if len(reference) > len(theirs) else (theirs, rank)
        extra = longer[min(len(reference), len(theirs))]
        return (
            f"rank 0 collected {len(reference)} tests, rank {rank} {len(theirs)}; "
            f"first extra test on rank {who}: {extra!r}"
        )
    return "identical"
