"""A watchdog per test: on expiry (the test's timeout, or a hang: no rank got anywhere for the
no-progress bound) it writes torch's record of this rank's collectives and what the rank's role
does at a timeout (its :class:`TimeoutPolicy`, see :mod:`.timeouts`): a launched rank ends (its
parent runs the rest in a fresh rank set); a torchrun-mode or srun rank interrupts the test, which
fails, and goes on (and where its main thread never comes back, reports the session from the
watchdog thread and ends)."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import NoReturn, Protocol

import pytest

from ..environment import DistributedSpec
from ..wire import flight_recorder, protocol, rank_dir
from ..wire.protocol import TIMEOUT_EXIT_CODE
from ..wire.torchrun_env import TorchrunEnv
from . import progress
from .interrupt import MainThreadInterrupt
from .log import RankLog
from .session import RANK_SESSION, RankSession
from .stopped import StoppedSession

#: How long a rank whose test timed out waits for the peers' flight records and stacks before it
#: exits (a peer whose thread cannot get the GIL is dumped by faulthandler's C watchdog instead).
PEER_DUMP_GRACE_S = 5.0


class TimeoutPolicy(Protocol):
    """What a rank does when a test's watchdog expires, chosen by the rank's role (its kind): the
    difference between a rank that reports its own session and one whose parent reports it."""

    #: how long past a test's deadline the outcome exchange waits for the peers
    exchange_grace_s: float
    #: how long past a test's timeout faulthandler's C backup dumps the stacks and ends the process,
    #: should the GIL never come back to the watchdog's thread
    backup_after_timeout_s: float

    def scopes(
        self, watch: AbstractContextManager[None]
    ) -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
        """Around what the test's ``watch`` runs: (around the test, around the test and the outcome
        exchange after it); the other is a no-op."""

    def at_timeout(self, watchdog: Watchdog, expiry: Expiry) -> None:
        """From the watchdog's thread, once the test's record of collectives is written."""

    def not_run_after_stuck_peer(self, item: pytest.Item, peer: int) -> str | None:
        """Why this rank reports the tests after ``item`` not run, its peer ``peer`` never back from
        a timeout (None: this rank reports none; the test failed alone, as when peers are gone)."""

    def report_stuck_session(
        self, watchdog: Watchdog, item: pytest.Item, banner: str, why: str, stacks: str, not_run: str
    ) -> bool:
        """From the watchdog's thread, the main thread never back: whether this rank reported the
        session from here (else it waits until rank 0 has)."""


class Expiry:
    """A test's watchdog that expired: the test, its settings and when."""

    def __init__(
        self,
        item: pytest.Item,
        timeout: float,
        verdict: protocol.Verdict,
        done: threading.Event,
        started_ns: int,
        index: int,
    ) -> None:
        self.item = item
        #: the test's number in this rank's session
        self.index = index
        self.timeout = timeout
        self.verdict = verdict
        #: set once the main thread is done with the test (it came back)
        self.done = done
        #: the test's start (time.time_ns(): flight records' clock)
        self.started_ns = started_ns
        self.at = time.monotonic()


class Watchdog:
    """Each test's watchdog, and what a rank whose main thread cannot go on does from another thread:
    release its peers, report, end."""

    def __init__(
        self,
        config: pytest.Config,
        torchrun: TorchrunEnv,
        log: RankLog,
        policy: TimeoutPolicy,
        stopped: StoppedSession,
        private_temp: Path | None,
        on_release: Callable[[], None],
    ) -> None:
        """``private_temp``: torchrun mode's own temp tree of this rank, removed by the watchdog when
        it ends the process; ``on_release``: told when the watchdog released the process group."""
        self.config = config
        self.rank = torchrun.rank
        self.world_size = torchrun.world_size
        self.log = log
        self.policy = policy
        self.stopped = stopped
        self._private_temp = private_temp
        self._on_release = on_release
        #: fails the running test from the watchdog at its timeout (ranks that survive timeouts)
        self.interrupt = MainThreadInterrupt()

    @contextmanager
    def watch(self, item: pytest.Item, settings: DistributedSpec, index: int) -> Iterator[None]:
        """Watch test number ``index`` until the block ends."""
        timeout = settings.timeout_s
        done = threading.Event()
        started_ns = time.time_ns()
        started = time.monotonic()

        def expire() -> None:
            verdict = self._await_verdict(done, index, started, timeout, settings.hang_after_s)
            if verdict is None:
                return
            expiry = Expiry(item, timeout, verdict, done, started_ns, index)
            # First, before the slower stack dumps (torchrun stops the other ranks as soon as one
            # exits): torch's record of this rank's collectives, beside its log, for rank 0 (or the
            # parent) to align.
            why_not = flight_recorder.dump(rank_dir.dump_path(self.log.dir, self.rank))
            if why_not is not None:  # the report's collectives section will lack this rank: say why
                with contextlib.suppress(OSError, ValueError):
                    self.log.file.write(f"flight recorder: {why_not}\n")
            self.policy.at_timeout(self, expiry)

        # Backup in C, should the GIL never come back to the thread above.
        faulthandler.dump_traceback_later(
            timeout + self.policy.backup_after_timeout_s, exit=True, file=self.log.file
        )
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

    def await_peer_dumps(self, nodeid: str) -> None:
        """Stay until every rank has dumped for ``nodeid`` (bounded): torchrun stops the others as
        soon as one rank exits, and the timers start a little apart on each rank, so the first to
        expire would otherwise take the peers' flight records and stacks with it."""
        log_dir = self.log.dir
        rank_dir.marker_path(log_dir, self.rank, rank_dir.EXPIRED).write_text(nodeid)
        markers = [rank_dir.marker_path(log_dir, r, rank_dir.EXPIRED) for r in range(self.world_size)]
        deadline = time.monotonic() + PEER_DUMP_GRACE_S
        while time.monotonic() < deadline:
            try:
                if all(m.read_text() == nodeid for m in markers):
                    return
            except OSError:
                pass  # a peer has not got there yet
            time.sleep(0.05)

    def release_peers(self) -> None:
        """From a watcher's thread, the main thread not back: release the process group, so that
        peers waiting with this rank in a collective come back."""
        rank_session: RankSession | None = self.config.stash.get(RANK_SESSION, None)
        if rank_session is not None:
            with contextlib.suppress(Exception):  # a group already gone: nothing to release
                rank_session.release_peers()
            self._on_release()

    def collective_bound_s(self) -> float | None:
        """How long the collective the main thread waits in can wait at most (the session's
        process-group timeout, which caps every group), or None when it waits in none."""
        rank_session: RankSession | None = self.config.stash.get(RANK_SESSION, None)
        frame = sys._current_frames().get(threading.main_thread().ident or 0)
        while rank_session is not None and frame is not None:
            if frame.f_code.co_filename.endswith(_C10D_FILE):
                return rank_session.pg_timeout_s
            frame = frame.f_back
        return None

    def end_stuck(
        self, item: pytest.Item, banner: str, expired_at: float, why: str, not_run: str, report_wait_s: float
    ) -> NoReturn:
        """The main thread never came back (from the timeout, or to take a signal; ``why`` says
        which): tell the peers (they stop waiting for this rank's outcome), report the session from
        here where the policy has this rank report it (every result so far, this test failed, the
        rest reported ``not_run``: JUnit file and summary), leave once rank 0 has reported (at most
        ``report_wait_s`` after ``expired_at``), end."""
        stacks = stacks_of_every_thread()
        with contextlib.suppress(OSError, ValueError):
            self.log.line(why)
            self.log.file.write(stacks)
            self.log.file.flush()
        rank_session: RankSession | None = self.config.stash.get(RANK_SESSION, None)
        if rank_session is not None:
            rank_session.mark_stuck(why)
        if self.policy.report_stuck_session(self, item, banner, why, stacks, not_run):
            if rank_session is not None:
                rank_session.mark_closing()
                rank_session.mark_reported()
        elif rank_session is not None:
            # torchrun stops every rank as soon as one exits: rank 0 reports first
            rank_session.mark_closing()
            rank_session.wait_reported(expired_at + report_wait_s)
        self.end(rank_session)

    def end(self, rank_session: RankSession | None) -> NoReturn:
        """This process ends here, without teardown or unconfigure: its temp trees go now.
        ``rank_session``: the session's, taken before a report from the watchdog dropped it from the
        stash."""
        self.remove_temp_trees(rank_session)
        self.exit()

    def exit(self) -> NoReturn:
        """End the process now, with the exit code that says a test timed out."""
        save_coverage()  # os._exit skips the atexit handler that would write it
        os._exit(TIMEOUT_EXIT_CODE)

    def remove_temp_trees(self, rank_session: RankSession | None) -> None:
        """The temp trees of a process that ends without teardown or unconfigure: the session's
        shared dir (rank 0) and this rank's own."""
        if rank_session is not None and self.rank == 0:
            shutil.rmtree(rank_session.env.shared_dir, ignore_errors=True)
        if self._private_temp is not None:
            shutil.rmtree(self._private_temp, ignore_errors=True)


#: the module of torch's collectives, as it ends a frame's file name
_C10D_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")


def stacks_of_every_thread() -> str:
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
