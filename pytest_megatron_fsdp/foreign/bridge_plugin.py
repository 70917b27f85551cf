"""A CPU rank of a foreign suite watches for Megatron-Bridge (:mod:`..foreign.bridge`): rank 0
prints each switch in one line once collection shows the suite imported ``megatron.bridge``; the rank
undoes the watch at its end. Registered by :meth:`.ranks.RankPlugin.prepare` with the foreign-suite
layer."""

from __future__ import annotations

import pytest

from . import bridge as foreign_bridge


class BridgeSwitchesReport:
    """The session start's lines for Bridge's switches (rank 0), and the watch undone at unconfigure."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if self.rank != 0 or reporter is None or not foreign_bridge.bridge_seen():
            return
        for line in foreign_bridge.switch_lines():
            reporter.write_line(line)

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        foreign_bridge.unwatch()


def watch(config: pytest.Config, rank: int) -> None:
    """Bridge's switches armed in this rank (before any conftest or test module is imported)."""
    foreign_bridge.watch()
    config.pluginmanager.register(BridgeSwitchesReport(rank), "mfsdp-foreign-bridge")
