"""Ranks wait for each other through the store, in process over a real TCPStore.

srun ranks watch each other (``RankSession.wait_for_peers``): a peer whose heartbeat stops is named
within the silence bound, a live slow peer is waited for up to the caller's timeout (which is raised
as before), and a store that is gone is said to be gone. A rebuilt process group
(``RankSession.renew``) is a rendezvous: no rank goes on before every rank has it."""

from __future__ import annotations

import datetime
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

torch_distributed = pytest.importorskip("torch.distributed")

from pytest_megatron_fsdp.environment import DistEnv  # noqa: E402
from pytest_megatron_fsdp.rank import session as session_module  # noqa: E402
from pytest_megatron_fsdp.rank.session import PeersGone, RankSession, SessionCannotGoOn  # noqa: E402


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _watching_session(store) -> RankSession:
    """A RankSession's waiting half, on ``store`` (no process group: nothing else is used)."""
    rank_session = RankSession.__new__(RankSession)
    rank_session._rendezvous_store = store
    rank_session.store = torch_distributed.PrefixStore("mfsdp", store)
    rank_session.counts_on_heartbeats = True  # an srun rank: it counts on heartbeats
    rank_session._signs_of_life = {}
    rank_session.peers_gone = False
    return rank_session


@pytest.fixture
def store():
    return torch_distributed.TCPStore(
        "127.0.0.1", _free_port(), world_size=1, is_master=True, timeout=datetime.timedelta(seconds=10)
    )


def test_a_silent_peer_is_named(store, monkeypatch):
    monkeypatch.setattr(session_module, "PEER_SILENCE_S", 1.0)
    watcher = _watching_session(store)
    watcher.store.set("test/0/0", "mine")
    store.set("mfsdp-alive/1", "7")  # rank 1 beat once, then stopped
    started = time.monotonic()
    with pytest.raises(PeersGone, match=r"^rank 1 gave no sign of life for 1 s while this rank waited for X"):
        watcher.wait_for_peers(["test/0/0", "test/0/1"], datetime.timedelta(seconds=60), "X")
    assert time.monotonic() - started < 15
    assert watcher.peers_gone


def test_a_live_peer_is_waited_for_until_the_callers_timeout(store, monkeypatch):
    # The silence bound is 15 beats: a loaded machine (the integration tier beside this one) has
    # starved the beating thread for a whole second.
    monkeypatch.setattr(session_module, "PEER_SILENCE_S", 3.0)
    watcher = _watching_session(store)
    stop = threading.Event()

    def beat() -> None:
        count = 0
        while not stop.wait(0.2):
            count += 1
            store.set("mfsdp-alive/1", str(count))

    thread = threading.Thread(target=beat)
    thread.start()
    try:
        started = time.monotonic()
        with pytest.raises(torch_distributed.DistStoreError):  # the caller's timeout, as before
            watcher.wait_for_peers(["test/0/1"], datetime.timedelta(seconds=6), "X")
        assert 6 <= time.monotonic() - started < 15
        assert not watcher.peers_gone
        store.set("mfsdp/test/1/1", "theirs")  # and an outcome that comes is simply taken
        watcher.wait_for_peers(["test/1/1"], datetime.timedelta(seconds=4), "X")
    finally:
        stop.set()
        thread.join()


def test_a_store_that_is_gone_is_said_to_be(tmp_path):
    port = _free_port()
    host = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import datetime, time, torch.distributed as d\n"
            f"s = d.TCPStore('127.0.0.1', {port}, world_size=1, is_master=True, wait_for_workers=False)\n"
            "print('up', flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert host.stdout.readline().strip() == "up"
        client = torch_distributed.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10), wait_for_workers=False
        )
        watcher = _watching_session(client)
        host.kill()
        host.wait()
        with pytest.raises(PeersGone, match=r"the rendezvous store \(hosted by rank 0\) is gone"):
            watcher.wait_for_peers(["test/0/1"], datetime.timedelta(seconds=30), "X")
    finally:
        host.kill()
        host.wait()


def _rebuilding_session(store, init=lambda: None, timeout_s: float = 0.5) -> RankSession:
    """Rank 0 of 2 whose process group ``init`` stands for (no backend: what renew adds is tested)."""
    rank_session = _watching_session(store)
    rank_session.env = DistEnv(
        rank=0,
        world_size=2,
        local_rank=0,
        device="cpu",
        backend="gloo",
        platform="cpu",
        shared_dir=Path("/unused"),
    )
    rank_session.counts_on_heartbeats = False  # a launched rank set: the parent watches the ranks
    rank_session.generation = 0
    rank_session._pg_timeout = datetime.timedelta(seconds=timeout_s)
    rank_session._on_release = []
    rank_session.release_peers = lambda: None
    rank_session._init_process_group = init
    return rank_session


def test_a_rebuilt_process_group_is_a_rendezvous_of_every_rank(store):
    # gloo's init returns on one rank before the other has connected; a rank that then failed its
    # next test at once destroyed the group under its peer's init. renew waits for every rank's.
    rank0 = _rebuilding_session(store, timeout_s=30)
    done = threading.Event()
    thread = threading.Thread(target=lambda: (rank0.renew(), done.set()))
    thread.start()
    try:
        assert not done.wait(0.5), "renew returned before rank 1 had its group"
        # rank 1, on a connection of its own (a wait holds its connection until it returns)
        rank1 = torch_distributed.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False)
        assert rank1.check(["mfsdp/rebuilt/1/0"])  # rank 0 said it has its own
        rank1.set("mfsdp/rebuilt/1/1", "1")
        assert done.wait(5.0)
        assert rank0.generation == 1
    finally:
        thread.join(10)


def _raise(error: Exception):
    def init() -> None:
        raise error

    return init


@pytest.mark.parametrize(
    ("init", "error"),
    [
        (lambda: None, r"DistStoreError: .*wait timeout"),  # rank 1 never has its group
        (_raise(RuntimeError("Connection closed by peer")), r"RuntimeError: Connection closed by peer$"),
    ],
)
def test_a_rebuild_this_rank_cannot_complete_ends_its_session_naming_why(store, init, error):
    rank0 = _rebuilding_session(store, init)
    with pytest.raises(
        SessionCannotGoOn,
        match=r"^the process group could not be rebuilt after the test \(generation 1\): " + error,
    ):
        rank0.renew()
