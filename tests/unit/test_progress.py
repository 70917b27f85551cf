"""Hung or slow (``rank/progress.py``): the signs of progress one look sees, the verdict on a test
whose ranks got nowhere or were still getting somewhere, and the beacons that share every rank's
progress through the store. The sessions that show the verdicts: tests/e2e/test_hang_or_slow.py."""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from pytest_megatron_fsdp.rank import progress
from pytest_megatron_fsdp.rank.progress import Look, ProgressBeacon
from pytest_megatron_fsdp.wire import explain
from pytest_megatron_fsdp.wire.explain import PostMortem, describe_death
from pytest_megatron_fsdp.wire.protocol import Verdict


def _look(at: float, cpu_s: float = 0.0, collectives=(("0", 5),), python_at=((1, 10),)) -> Look:
    return Look(at=at, cpu_s=cpu_s, collectives=collectives, python_at=python_at)


def test_a_completed_collective_is_progress():
    assert progress.progressed(_look(0), _look(1, collectives=(("0", 6),)), counts_cpu=False) == "collectives"


def test_a_move_in_python_is_progress():
    assert progress.progressed(_look(0), _look(1, python_at=((1, 11),)), counts_cpu=False) == "python"


def test_computing_is_progress_on_cpu_ranks_only():
    busy = _look(1, cpu_s=0.5)
    assert progress.progressed(_look(0), busy, counts_cpu=True) == "cpu"
    # a GPU rank's CPU spins while it waits for the GPU: no sign there
    assert progress.progressed(_look(0), busy, counts_cpu=False) is None


def test_a_rank_waiting_in_a_collective_makes_no_progress():
    # what a rank waiting in a gloo collective uses: well under a tenth of a core
    idle = _look(1, cpu_s=0.01)
    assert progress.progressed(_look(0), idle, counts_cpu=True) is None


@contextmanager
def _thread(target) -> Iterator[int]:
    stop = threading.Event()
    thread = threading.Thread(target=target, args=(stop,), daemon=True)
    thread.start()
    try:
        yield thread.ident or 0
    finally:
        stop.set()
        thread.join(5)


def test_a_look_sees_a_thread_blocked_in_c_stand_still_and_one_computing_use_cpu():
    progress.look(threading.get_ident())  # the first look imports torch's recorder
    with _thread(lambda stop: stop.wait(30)) as waiting:
        first = progress.look(waiting)
        time.sleep(0.3)
        # CPU use is the process's (this test runner's too): only the thread's own signs here
        assert progress.progressed(first, progress.look(waiting), counts_cpu=False) is None

    def compute(stop: threading.Event) -> None:
        while not stop.is_set():  # one C call at a time, GIL released: its stack barely moves
            hashlib.pbkdf2_hmac("sha256", b"x", b"salt", 20_000)

    with _thread(compute) as computing:
        first = progress.look(computing)
        time.sleep(0.3)
        assert progress.progressed(first, progress.look(computing), counts_cpu=True) is not None


def test_no_progress_for_the_bound_is_a_hang_before_the_timeout():
    assert progress.decide(elapsed_s=9, timeout_s=300, quiet_s=9, hang_after_s=10) is None
    verdict = progress.decide(elapsed_s=11, timeout_s=300, quiet_s=10.5, hang_after_s=10)
    assert verdict == Verdict(True, 11, 300, 10.5, 10, before_timeout=True)


def test_progress_within_the_bound_goes_on_until_the_timeout_then_is_too_slow():
    assert progress.decide(elapsed_s=299, timeout_s=300, quiet_s=1, hang_after_s=10) is None
    verdict = progress.decide(elapsed_s=300, timeout_s=300, quiet_s=1, hang_after_s=10)
    assert verdict is not None
    assert not verdict.hung
    assert not verdict.before_timeout


def test_at_a_timeout_shorter_than_the_bound_a_test_that_never_progressed_is_hung():
    verdict = progress.decide(elapsed_s=15, timeout_s=15, quiet_s=14.5, hang_after_s=60)
    assert verdict is not None
    assert verdict.hung
    assert not verdict.before_timeout


def test_at_a_short_timeout_the_setup_s_progress_does_not_make_a_hang_slow():
    # a 6 s test whose fixtures got somewhere in its first 2 s, then nothing
    verdict = progress.decide(elapsed_s=6, timeout_s=6, quiet_s=4, hang_after_s=60)
    assert verdict is not None
    assert verdict.hung
    # a 3 s test whose last progress was 2 s before its timeout: hung too
    short = progress.decide(elapsed_s=3, timeout_s=3, quiet_s=2, hang_after_s=60)
    assert short is not None
    assert short.hung
    slow = progress.decide(elapsed_s=6, timeout_s=6, quiet_s=1, hang_after_s=60)
    assert slow is not None
    assert not slow.hung


def test_a_long_test_quiet_for_less_than_the_bound_at_its_timeout_is_too_slow():
    verdict = progress.decide(elapsed_s=300, timeout_s=300, quiet_s=50, hang_after_s=60)
    assert verdict is not None
    assert not verdict.hung


def test_the_bound_off_leaves_the_timeout_alone():
    assert progress.decide(elapsed_s=200, timeout_s=300, quiet_s=200, hang_after_s=0) is None
    verdict = progress.decide(elapsed_s=300, timeout_s=300, quiet_s=300, hang_after_s=0)
    assert verdict is not None
    assert verdict.hung


def test_the_verdict_survives_the_store():
    verdict = Verdict(True, 11.2, 300.0, 10.4, 10.0, before_timeout=True)
    assert Verdict.from_json(verdict.to_json().encode()) == verdict


@pytest.mark.parametrize(
    ("verdict", "phrase", "banner"),
    [
        (
            Verdict(True, 11, 120, 10.2, 10, True),
            "hung (no progress on any rank for 10 s, the --mfsdp-hang-after bound, "
            "11 s into its 120 s timeout)",
            "hung on rank 1 (no progress on any rank for 10 s, the --mfsdp-hang-after bound, "
            "11 s into its 120 s timeout)",
        ),
        (
            Verdict(True, 15, 15, 14.6, 60, False),
            "exceeded its 15 s timeout (hung: no progress on any rank for 15 s)",
            "exceeded its 15 s timeout on rank 1 (hung: no progress on any rank for 15 s)",
        ),
        (
            Verdict(False, 15, 15, 0.4, 60, False),
            "exceeded its 15 s timeout (too slow: still progressing, last progress 0 s ago)",
            "exceeded its 15 s timeout on rank 1 (too slow: still progressing, last progress 0 s ago)",
        ),
        (None, "exceeded its 15 s timeout", "exceeded its 15 s timeout on rank 1"),
    ],
)
def test_the_banner_says_hung_or_too_slow_and_the_parent_reads_it_back(verdict, phrase, banner):
    timeout = 15 if verdict is None else verdict.timeout_s
    written = explain.timeout_banner("t.py::test_x[a b]", timeout, 1, True, verdict)
    assert written.startswith(f"MFSDP-TIMEOUT: t.py::test_x[a b] {banner}; stacks of every thread follow"), (
        written
    )
    log = f"START t.py::test_x[a b]\n{written}\nThread 0x1 (most recent call first):\n"
    assert explain.verdict_in(log) == phrase
    post_mortem = PostMortem(world_size=2, returncode=-9, timed_out=[1], verdict=explain.verdict_in(log))
    headline = describe_death(post_mortem, timeout).splitlines()[0]
    assert (
        headline
        == f"timed out: the test {phrase}; every rank's stacks were dumped and the rank set was killed"
    )


def test_a_log_without_a_banner_has_no_verdict():
    assert explain.verdict_in("START t.py::test_x\nFatal Python error: Aborted\n") is None


# -- beacons sharing progress through a store -----------------------------------------------------


@pytest.fixture
def store():
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=_seconds(10))
    yield master
    del master


def _seconds(s: float):
    import datetime

    return datetime.timedelta(seconds=s)


def _beacon(store, rank: int, thread_id: int) -> ProgressBeacon:
    """A beacon for rank ``rank`` watching thread ``thread_id``; in one process the ranks share their
    CPU use, so only the collectives and Python count."""
    import torch.distributed as dist

    def connect():
        return dist.TCPStore(
            "127.0.0.1", store.port, is_master=False, wait_for_workers=False, timeout=_seconds(10)
        )

    return ProgressBeacon(connect, rank, 2, thread_id, counts_cpu=False, interval_s=0.05)


def test_beacons_see_no_rank_progress_while_both_stand_still(store):
    with _thread(lambda stop: stop.wait(30)) as waiting:
        beacons = [_beacon(store, rank, waiting) for rank in (0, 1)]
        try:
            since = time.monotonic()
            time.sleep(1.0)
            for beacon in beacons:
                assert beacon.quiet_for(since) > 0.7, beacon.quiet_ranks(since)
        finally:
            for beacon in beacons:
                beacon.close()


def test_one_rank_getting_somewhere_is_progress_for_every_rank(store):
    def work(stop: threading.Event) -> None:
        while not stop.is_set():  # a look finds it at one line or the other (no period to alias)
            time.sleep(random.uniform(0.001, 0.01))
            time.sleep(random.uniform(0.001, 0.01))

    with _thread(lambda stop: stop.wait(30)) as waiting, _thread(work) as computing:
        beacons = [_beacon(store, 0, waiting), _beacon(store, 1, computing)]
        try:
            since = time.monotonic()
            time.sleep(1.0)
            # rank 0 stands still, rank 1 moves in Python: rank 0's beacon sees rank 1's progress
            assert beacons[0].quiet_for(since) < 0.5, beacons[0].quiet_ranks(since)
            quiet = beacons[0].quiet_ranks(since)
            assert quiet[0] > 0.7, quiet
            assert quiet[1] < 0.5, quiet
        finally:
            for beacon in beacons:
                beacon.close()


def test_a_hang_one_rank_declares_is_seen_by_the_other(store):
    with _thread(lambda stop: stop.wait(30)) as waiting:
        beacons = [_beacon(store, rank, waiting) for rank in (0, 1)]
        try:
            verdict = Verdict(True, 11, 300, 10, 10, before_timeout=True)
            assert beacons[1].hang_declared(3) is None
            beacons[0].declare_hang(3, verdict)
            # a store's set is not acknowledged: another client sees it a moment later (the
            # watchdogs ask once a second)
            deadline = time.monotonic() + 5
            while beacons[1].hang_declared(3) is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert beacons[1].hang_declared(3) == verdict
            assert beacons[1].hang_declared(4) is None
        finally:
            for beacon in beacons:
                beacon.close()
