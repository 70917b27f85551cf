"""srun ranks watch each other (``RankSession.wait_for_peers``), in process over a real TCPStore: a
peer whose heartbeat stops is named within the silence bound, a live slow peer is waited for up to
the caller's timeout (which is raised as before), and a store that is gone is said to be gone."""

from __future__ import annotations

import datetime
import subprocess
import sys
import threading
import time

import pytest

torch_distributed = pytest.importorskip("torch.distributed")

from pytest_megatron_fsdp.harness import session as session_module  # noqa: E402
from pytest_megatron_fsdp.harness.session import PeersGone, RankSession  # noqa: E402


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
    rank_session.heartbeat = object()  # an srun rank: it counts on heartbeats
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
    monkeypatch.setattr(session_module, "PEER_SILENCE_S", 1.0)
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
            watcher.wait_for_peers(["test/0/1"], datetime.timedelta(seconds=4), "X")
        assert 4 <= time.monotonic() - started < 12
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
