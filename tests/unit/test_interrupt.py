"""The watchdog's interruption of the test in the main thread: a failure raised where the thread is
in Python, only while armed; the signal's previous handler back afterwards."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from pytest_megatron_fsdp.rank.interrupt import INTERRUPT_SIGNAL, MainThreadInterrupt


def _busy_in_python(interrupt: MainThreadInterrupt, deadline: float) -> None:
    """A test busy in Python, fired at from another thread 0.2 s in."""
    with interrupt.armed():
        threading.Timer(0.2, interrupt.fire, ["MFSDP-TIMEOUT: t exceeded its 1 s timeout"]).start()
        while time.monotonic() < deadline:
            time.sleep(0.01)


def test_a_fired_interrupt_fails_the_main_thread_where_it_is():
    interrupt = MainThreadInterrupt()
    before = signal.getsignal(INTERRUPT_SIGNAL)
    deadline = time.monotonic() + 30
    with pytest.raises(pytest.fail.Exception, match="MFSDP-TIMEOUT: t exceeded") as caught:
        _busy_in_python(interrupt, deadline)
    assert interrupt.fired
    assert time.monotonic() < deadline  # raised in the loop, not after it ran out
    assert any(entry.name == "_busy_in_python" for entry in caught.traceback)
    assert signal.getsignal(INTERRUPT_SIGNAL) == before


def test_nothing_is_fired_outside_a_test():
    interrupt = MainThreadInterrupt()
    with interrupt.armed():
        pass
    assert interrupt.fire("too late") is False
    assert not interrupt.fired


def test_nothing_is_armed_off_the_main_thread():
    interrupt = MainThreadInterrupt()
    fired: list[bool] = []

    def run() -> None:
        with interrupt.armed():
            fired.append(interrupt.fire("not here"))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=10)
    assert fired == [False]


def test_a_watchdog_late_for_its_test_cannot_fail_the_next_one():
    """Test 3's watchdog, slow to assemble its report, fires once the main thread runs test 4."""
    interrupt = MainThreadInterrupt()
    with interrupt.armed(4):
        assert interrupt.fire("MFSDP-TIMEOUT: test 3 exceeded its timeout", 3) is False
    assert not interrupt.fired
