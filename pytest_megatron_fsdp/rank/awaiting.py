"""A torchrun-mode rank whose session has not asked for megatron-fsdp yet (no option of it given):
inert until a collected test uses the plugin."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TextIO, cast

import pytest

from ..wire import pytest_compat
from ..wire.role import ProcessRole, RolePlugin, asks_for_plugin
from .held_terminal import HELD_TERMINAL, HeldOutput


class AwaitingUse(RolePlugin):
    """A torchrun-mode rank's plugin until its session asks for megatron-fsdp (no option given).

    It watches the tests being collected; the first that uses the plugin starts the rank's plugin
    (``start``: :meth:`.torchrun_rank.TorchrunRank.start_late`). A rank other than 0 holds
    its terminal output until then, or until collection ends without one, when everything held
    goes to the terminal as it would without the plugin.
    """

    NAME = "mfsdp-awaiting-use"

    def __init__(
        self, config: pytest.Config, role: ProcessRole, start: Callable[[pytest.Session], None]
    ) -> None:
        self.config = config
        self.role = role
        self._start = start
        self.started = False

    def registered(self) -> None:
        assert self.role.torchrun is not None
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None or self.role.torchrun.rank == 0:
            return
        held = self.config.stash[HELD_TERMINAL] = HeldOutput(sys.stdout)
        self.config.pluginmanager.unregister(reporter)
        holding = pytest_compat.TerminalReporter(self.config, cast(TextIO, held))  # a stream that holds
        self.config.pluginmanager.register(holding, "terminalreporter")

    @pytest.hookimpl(tryfirst=True)
    def pytest_itemcollected(self, item: pytest.Item) -> None:
        if self.started or not asks_for_plugin(item):
            return
        self.started = True
        self._start(item.session)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._release()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self._release()  # a session that ended before collection did (a collection error, -x)

    def _release(self) -> None:
        held = self.config.stash.get(HELD_TERMINAL, None)
        if held is not None and held.held:
            held.release()
