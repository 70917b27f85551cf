"""A torchrun-mode rank's terminal output, held until the session shows whether it uses the plugin.

A rank other than 0 writes its terminal report to its log, not to the terminal every rank shares,
but only in a session that runs distributed tests: a torchrun session that never uses the plugin
must print what it prints without it. Whether it does is known once the first test asking for the
plugin is collected, or collection ends without one; until then the rank's terminal reporter
writes into a :class:`HeldOutput`, which then either passes everything on to the terminal
(:meth:`HeldOutput.release`) or into the rank's log (:meth:`HeldOutput.divert`).
"""

from __future__ import annotations

from typing import IO, Any

import pytest

#: the held output of this process's terminal reporter (torchrun-mode ranks other than 0)
HELD_TERMINAL = pytest.StashKey["HeldOutput"]()


class HeldOutput:
    """A text stream that buffers until told where its text goes, then writes straight there."""

    def __init__(self, terminal: IO[str]) -> None:
        self._terminal = terminal
        self._target: IO[str] | None = None
        self._held: list[str] = []

    @property
    def held(self) -> bool:
        return self._target is None

    def write(self, text: str) -> int:
        if self._target is None:
            self._held.append(text)
        else:
            self._target.write(text)
        return len(text)

    def flush(self) -> None:
        if self._target is not None:
            self._target.flush()

    def isatty(self) -> bool:
        # the terminal writer decides on colours from this: as the terminal's, as without the plugin
        return self._terminal.isatty()

    def fileno(self) -> int:
        return (self._target or self._terminal).fileno()

    @property
    def encoding(self) -> str:
        return getattr(self._terminal, "encoding", "utf-8")

    def _send(self, target: IO[str]) -> None:
        if self._target is not None:
            return
        self._target = target
        target.write("".join(self._held))
        self._held.clear()
        target.flush()

    def release(self) -> None:
        """Everything held, and all that follows, to the terminal."""
        self._send(self._terminal)

    def divert(self, log: IO[str]) -> None:
        """Everything held, and all that follows, to ``log``."""
        self._send(log)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._terminal, name)
