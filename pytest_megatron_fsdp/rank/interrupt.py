"""Failing the test that runs in the main thread from another thread (the rank's watchdog), as
pytest-timeout's signal method does: a signal to the main thread, whose handler raises pytest's
failure where the thread is in Python. The handler is installed only while a test runs."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import pytest

#: the signal sent to the main thread (pytest-timeout's signal method uses it too; the watchdog
#: turns pytest-timeout's timer off around the tests it times)
INTERRUPT_SIGNAL = signal.SIGALRM


class MainThreadInterrupt:
    """Raises ``pytest.fail(message)`` in the main thread while it is armed (around a test)."""

    def __init__(self) -> None:
        #: held while arming, disarming and firing: no signal reaches the main thread without the
        #: handler (its default action would end the process)
        self._lock = threading.Lock()
        self._armed = False
        #: the test the handler is armed for (the rank's test index): a watchdog late for its own
        #: test cannot fail the next one
        self._test = -1
        self._message = ""
        #: whether the current test was interrupted
        self.fired = False

    @contextmanager
    def armed(self, test: int = 0) -> Iterator[None]:
        """The handler in place for the block, for test number ``test`` (the main thread only:
        nothing is armed elsewhere)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self.fired = False
        previous = signal.signal(INTERRUPT_SIGNAL, self._raise)
        with self._lock:
            self._armed, self._test = True, test
        try:
            yield
        finally:
            try:
                with self._lock:
                    self._armed = False
            finally:
                # Also where the interruption landed while this thread waited for the lock (the
                # handler raised out of the wait): the fire that sent it is over, no other may follow.
                self._armed = False
                signal.signal(INTERRUPT_SIGNAL, previous)

    def fire(self, message: str, test: int = 0) -> bool:
        """Interrupt test number ``test`` in the main thread with ``message``; False where it is not
        armed for that test (it is over)."""
        with self._lock:
            if not self._armed or self._test != test:
                return False
            self._message = message
            self.fired = True
            signal.pthread_kill(threading.main_thread().ident or 0, INTERRUPT_SIGNAL)
            return True

    def _raise(self, signum: int, frame: FrameType | None) -> None:
        __tracebackhide__ = True
        if self._message:
            message, self._message = self._message, ""  # one failure per interruption
            pytest.fail(message, pytrace=True)
