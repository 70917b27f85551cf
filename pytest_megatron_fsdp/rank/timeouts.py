"""The two things a rank can do at a test's timeout (its watchdog's :class:`.watchdog.TimeoutPolicy`,
chosen by the rank's kind): go on with the next test, reporting its own session
(:class:`SurviveTimeouts`: a torchrun session or srun step the user started), or end, its parent
reporting the timeout and running the rest in a fresh rank set (:class:`EndAtTimeout`)."""

from __future__ import annotations

import contextlib
import faulthandler
import sys
import time
from contextlib import AbstractContextManager, nullcontext

import pytest

from ..wire import explain, flight_recorder
from .session import RANK_SESSION, RankSession
from .watchdog import Expiry, Watchdog, stacks_of_every_thread

#: How long after a test's timeout a rank that survives its timeouts (torchrun, srun) waits for its
#: main thread to come back to Python, where the interruption fails the test, before it reports the
#: session from its watchdog and ends: a thread stuck in C or C++ (a collective whose peers never
#: release it, a blocking call with the signal blocked) never does. The peers' outcome exchange
#: waits as long for it.
RECOVERY_GRACE_S = 20.0
#: How long past its process group's timeout a collective's failure may take to reach Python.
COLLECTIVE_MARGIN_S = 5.0
#: How long after interrupting the main thread the watchdog releases the process group itself, the
#: main thread not being back in Python by then: a rank stuck outside Python for good would hold
#: its peers in their collectives with it until the process-group timeout.
RELEASE_AFTER_S = 2.0


class SurviveTimeouts:
    """A rank that reports its own session (rank 0 to the user's terminal): a test's timeout
    interrupts the test, which fails, and the session goes on, as nobody else would run the later
    tests. Its watchdog watches the test alone: the outcome exchange after it has a bound of its
    own."""

    exchange_grace_s = RECOVERY_GRACE_S
    backup_after_timeout_s = RECOVERY_GRACE_S + 8

    def scopes(
        self, watch: AbstractContextManager[None]
    ) -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
        return watch, nullcontext()

    def at_timeout(self, watchdog: Watchdog, expiry: Expiry) -> None:
        """Its stacks and, on rank 0, every rank's aligned collectives into the failure, which is
        raised in the main thread where it is in Python (a peer's release of the process group
        brings a rank waiting in a collective back); the session goes on with the next test. A main
        thread that does not come back within :data:`RECOVERY_GRACE_S` ends the rank
        (:meth:`.watchdog.Watchdog.end_stuck`)."""
        item, rank, log = expiry.item, watchdog.rank, watchdog.log
        banner = explain.timeout_banner(
            item.nodeid, expiry.timeout, rank, interrupts=True, verdict=expiry.verdict
        )
        stacks = stacks_of_every_thread()
        with contextlib.suppress(OSError, ValueError):
            log.file.write(f"{banner}\n{stacks}")
            log.file.flush()
        watchdog.await_peer_dumps(item.nodeid)
        collectives: list[str] = []
        if rank == 0:
            collectives = flight_recorder.section(
                log.dir, watchdog.world_size, time.time_ns(), expiry.started_ns
            )
            with contextlib.suppress(OSError, ValueError):
                log.file.write("".join(f"{line}\n" for line in collectives))
        watchdog.interrupt.fire(explain.timed_out_in_rank(banner, collectives, stacks), expiry.index)
        if expiry.done.wait(RELEASE_AFTER_S):
            return
        # Not back in Python: in a collective (whose peers, interrupted, release the group and so
        # bring it back), or stuck for good, in which case peers waiting in a collective with it
        # are brought back by its release of the group here (gloo sees the connection close; a
        # group's abort or destroy does not end this rank's own wait in a collective).
        watchdog.release_peers()
        # A collective whose peers are stuck too (each waiting on the other, where no release
        # reaches: gloo closes a group's connections only once no work of it is in flight) fails
        # at the group's own timeout, which caps every group: the rank comes back by then.
        bound = watchdog.collective_bound_s()
        grace = RECOVERY_GRACE_S if bound is None else max(RECOVERY_GRACE_S, bound + COLLECTIVE_MARGIN_S)
        if grace > RECOVERY_GRACE_S:  # the backup in C, armed for the usual grace, waits as long
            faulthandler.dump_traceback_later(
                max(expiry.at + grace - time.monotonic(), 0) + self.backup_after_timeout_s - RECOVERY_GRACE_S,
                exit=True,
                file=log.file,
            )
        if expiry.done.wait(max(expiry.at + grace - time.monotonic(), 0)):
            return
        watchdog.end_stuck(
            item,
            banner,
            expiry.at,
            why=explain.main_thread_stuck(item.nodeid, rank, grace),
            not_run=explain.not_run(item.nodeid, rank),
            report_wait_s=grace + 7,
        )

    def not_run_after_stuck_peer(self, item: pytest.Item, peer: int) -> str | None:
        return explain.not_run(item.nodeid, peer)

    def report_stuck_session(
        self, watchdog: Watchdog, item: pytest.Item, banner: str, why: str, stacks: str, not_run: str
    ) -> bool:
        """Rank 0 reports the session whose main thread is stuck, from the watchdog thread: the
        test's failure and the later tests not run go through pytest's report hooks (the terminal,
        the JUnit file), then the session's end hooks write the JUnit file and the summary."""
        if watchdog.rank != 0:
            return False
        message = explain.stuck_failure(banner, why, stacks)
        with contextlib.suppress(Exception):  # whatever a hook raises, the rank ends after
            watchdog.log.release_terminal()
            # the rank session's close would wait for this thread's own main thread: it ends without
            watchdog.config.stash[RANK_SESSION] = None
            watchdog.stopped.failed_alone(item, message)
            watchdog.stopped.not_run_after(item, not_run)
            watchdog.config.hook.pytest_sessionfinish(
                session=item.session, exitstatus=pytest.ExitCode.TESTS_FAILED
            )
            sys.stdout.flush()
        return True


class EndAtTimeout:
    """A rank of a set its parent launched: at a test's timeout its stacks go into its log and the
    rank ends; the parent reports the timeout from the logs and runs the rest of the batch in a
    fresh rank set. The outcome exchange is watched too: past the test's deadline the rank ends
    anyway."""

    exchange_grace_s = 0.0
    backup_after_timeout_s = 10.0

    def scopes(
        self, watch: AbstractContextManager[None]
    ) -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
        return nullcontext(), watch

    def at_timeout(self, watchdog: Watchdog, expiry: Expiry) -> None:
        nodeid = expiry.item.nodeid
        # This process ends here, without teardown or unconfigure, and may be killed any time
        # once a peer has seen its marker below (torchrun stops the others as soon as one
        # rank exits): its temp trees go now, before it tells the peers it is done.
        rank_session: RankSession | None = watchdog.config.stash.get(RANK_SESSION, None)
        watchdog.remove_temp_trees(rank_session)
        banner = explain.timeout_banner(
            nodeid, expiry.timeout, watchdog.rank, interrupts=False, verdict=expiry.verdict
        )
        for stream in (watchdog.log.file, sys.stderr):
            try:
                stream.write(banner + "\n")
                stream.flush()
                faulthandler.dump_traceback(file=stream, all_threads=True)
                stream.flush()
            except (OSError, ValueError):
                pass
        watchdog.await_peer_dumps(nodeid)
        watchdog.exit()

    def not_run_after_stuck_peer(self, item: pytest.Item, peer: int) -> str | None:
        return None  # the parent runs the later tests in a fresh rank set

    def report_stuck_session(
        self, watchdog: Watchdog, item: pytest.Item, banner: str, why: str, stacks: str, not_run: str
    ) -> bool:
        return False  # the parent reports a launched rank set, from the logs
