"""The adapter that reads pytest-xdist's private worker queue, pinned to the installed pytest-xdist."""

from __future__ import annotations

import contextlib
import inspect
from collections import deque
from types import SimpleNamespace

import pytest

from pytest_megatron_fsdp.parent import xdist_queue


class WorkerInteractor:  # the adapter finds xdist's plugin by this class name
    def __init__(self, nextitem_index, queued) -> None:
        self.nextitem_index = nextitem_index
        self.torun = SimpleNamespace(lock=lambda: contextlib.nullcontext(deque(queued)))


def _config(*plugins, worker: bool = True):
    config = SimpleNamespace(pluginmanager=SimpleNamespace(get_plugins=lambda: list(plugins)))
    if worker:
        config.workerinput = {"workerid": "gw0", "workercount": 2}
    return config


ITEMS = ["a", "b", "c", "d", "e"]


def test_a_plain_session_runs_everything_from_the_current_test_on():
    assert xdist_queue.upcoming(_config(worker=False), ITEMS, "c") == ["c", "d", "e"]


def test_a_worker_runs_the_current_test_then_the_next_and_the_queued_ones():
    config = _config(WorkerInteractor(3, [4, "shutdown"]))
    assert xdist_queue.upcoming(config, ITEMS, "b", version=(3, 8)) == ["b", "d", "e"]


@pytest.mark.parametrize("version", [(3, 7), (4, 0), (3,)])
def test_an_unsupported_xdist_gets_only_the_current_test(version):
    config = _config(WorkerInteractor(3, [4]))
    assert xdist_queue.upcoming(config, ITEMS, "b", version=version) == ["b"]


def test_an_unreadable_xdist_version_gets_only_the_current_test(monkeypatch):
    monkeypatch.setattr(xdist_queue, "xdist_version", lambda: None)
    assert xdist_queue.upcoming(_config(WorkerInteractor(3, [4])), ITEMS, "b") == ["b"]


def test_an_unknown_queue_layout_gets_only_the_current_test():
    interactor = WorkerInteractor(3, [4])
    del interactor.torun
    assert xdist_queue.upcoming(_config(interactor), ITEMS, "b", version=(3, 8)) == ["b"]


def test_the_installed_xdist_is_supported_and_has_the_layout_read():
    """Fails on a pytest-xdist outside SUPPORTED: read its xdist/remote.py, then widen the range."""
    remote = pytest.importorskip("xdist.remote")
    assert xdist_queue.supported(xdist_queue.xdist_version()), xdist_queue.xdist_version()
    init = inspect.getsource(remote.WorkerInteractor.__init__)
    assert "self.torun = TestQueue(" in init
    assert "self.nextitem_index" in init
    assert inspect.isgeneratorfunction(inspect.unwrap(remote.TestQueue.lock))
