"""After each test the ranks agree on its outcome through the store, with bounded waits: a failure on
one rank fails the test on all, carrying that rank's traceback and captured output; the warnings of
every rank are merged; a process group a rank released during the test is rebuilt on every rank."""

from __future__ import annotations

import datetime
import json
import time
from typing import Any

import pytest

from ..wire import warnings_relay
from .agreement import merge_reports, summarise
from .log import RankLog
from .session import RankSession, SessionCannotGoOn, first_line

#: How long a rank whose foreign test failed outside a collective waits for its peers to be done
#: with that test before it aborts its process groups under them (they may wait in a
#: collective of it this rank never enters): well inside the watchdog's no-progress bound, long
#: enough for peers on a loaded machine to finish the test's own work.
PEERS_IN_THE_TEST_WAIT_S = 15.0


class OutcomeExchange:
    """One rank's side of the outcome exchange after each test, and what it must tell its peers
    there: whether it released the process group during the test."""

    def __init__(self, rank: int, log: RankLog, grace_s: float) -> None:
        """``grace_s``: how long past a test's deadline the exchange waits for the peers (a rank
        that survives its timeouts: as long as a peer's watchdog gives that peer to come back)."""
        self._rank = rank
        self._log = log
        self._grace_s = grace_s
        #: this rank released the process group during the current test: every rank renews it after
        self.released = False
        #: a foreign suite's test failed on this rank outside a collective: before the outcomes are
        #: exchanged, peers still in the test are looked for (see agree)
        self.failed_outside_a_collective = False
        #: the current test's warnings, every rank's merged (set by agree)
        self.test_warnings: list[dict[str, Any]] = []

    def mark_released(self) -> None:
        """This rank released the process group (from any thread): it is rebuilt after the test."""
        self.released = True

    def agree(
        self,
        item: pytest.Item,
        index: int,
        reports: list[pytest.TestReport],
        rank_session: RankSession,
        deadline: float,
        warnings_data: list[dict[str, Any]] | None = None,
    ) -> list[pytest.TestReport]:
        """Exchange every rank's phase outcomes (and warnings) through the store; return the agreed
        reports (the warnings, merged, go to :attr:`test_warnings`)."""
        mine = {r.when: summarise(r) for r in reports}
        if self.failed_outside_a_collective:
            self.failed_outside_a_collective = False
            self._bring_back_peers_in_the_default_group(item, index, rank_session, deadline)
        # a test that destroyed the session's default group (or replaced it): every rank renews it
        released = self.released or not rank_session.holds_default_group()
        self.released = False
        # Bounded by the test's own deadline, past which the watchdog ends a launched rank anyway.
        # A rank that survives its timeouts waits as long past it as a peer's watchdog gives that
        # peer to come back from the timeout (a fresh bound where the test timed out); a peer that
        # does not come back says so (PeerStuck). In an srun step a peer that is gone (no sign of
        # life) ends the wait sooner (PeersGone).
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
                datetime.timedelta(seconds=max(deadline - time.monotonic(), 0) + self._grace_s + 5),
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
                    f"rank {rank} ran {data['nodeid']!r} while rank {self._rank} ran {item.nodeid!r}"
                )
            per_rank[rank] = data["phases"]
            per_rank_warnings[rank] = data.get("warnings", [])
            renew |= data["released"]
        self.test_warnings = warnings_relay.merge(per_rank_warnings)
        if renew:
            rank_session.renew()  # every rank decides alike: all saw the same flags
            self._log.line(
                f"process group rebuilt after {item.nodeid} (generation {rank_session.generation})"
            )
        return merge_reports(item, reports, per_rank, self._rank, self._log.dir)

    def _bring_back_peers_in_the_default_group(
        self, item: pytest.Item, index: int, rank_session: RankSession, deadline: float
    ) -> None:
        """A foreign test failed here outside a collective (its own groups are freed already):
        peers still in the test :data:`PEERS_IN_THE_TEST_WAIT_S` later may wait in a collective of
        the default group this rank never enters (Megatron-LM's tests end with
        ``Utils.destroy_model_parallel()``, a barrier, after their asserts). Aborting this rank's
        process groups brings them back, the test fails alone and the next one runs; every
        rank renews the default group after it (decided before this rank's outcome is posted, so
        every rank reads the same flag). Peers that are all accounted for (passed, or failed as
        this rank did) keep every group: a class-scoped fixture's group outlives the failure."""
        wait_s = max(min(PEERS_IN_THE_TEST_WAIT_S, deadline - time.monotonic()), 0.0)
        still = rank_session.peers_still_in_the_test(f"test/{index}", wait_s)
        if still:
            rank_session.abort_default_group()
            self.released = True
            names = ", ".join(map(str, still))
            self._log.line(
                f"{item.nodeid}: rank{'s' if len(still) > 1 else ''} {names} still in the test "
                f"{wait_s:g} s after it failed here: aborted this rank's process groups"
            )
