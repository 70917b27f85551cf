"""A torchrun rank's held terminal output (``rank.held_terminal``): nothing reaches the terminal
until the session shows whether it uses the plugin; then all of it, in order, goes to one place."""

from __future__ import annotations

import io

from pytest_megatron_fsdp.rank.held_terminal import HeldOutput


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_released_output_reaches_the_terminal_whole_and_in_order():
    terminal = _Terminal()
    held = HeldOutput(terminal)
    held.write("=== test session starts ===\n")
    held.write("collected 2 items\n")
    assert terminal.getvalue() == ""  # held
    assert held.isatty()  # colours as the terminal's: the reporter prints what it would without the plugin
    held.release()
    held.write("2 passed\n")
    assert terminal.getvalue() == "=== test session starts ===\ncollected 2 items\n2 passed\n"
    assert not held.held


def test_diverted_output_goes_to_the_log_and_never_to_the_terminal():
    terminal, log = _Terminal(), io.StringIO()
    held = HeldOutput(terminal)
    held.write("header\n")
    held.divert(log)
    held.write("report\n")
    held.release()  # too late: it went to the log already
    held.write("more\n")
    assert terminal.getvalue() == ""
    assert log.getvalue() == "header\nreport\nmore\n"
