"""A rank of a set the plain-mode parent launched: it runs the parent's batch and streams the agreed
reports back; the parent shows and writes everything."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from ..wire import protocol
from ..wire.role import ProcessRole, Role, RolePlugin
from ..wire.torchrun_env import TorchrunEnv
from .plugin import register
from .timeouts import EndAtTimeout
from .watchdog import TimeoutPolicy


@dataclass(frozen=True)
class LaunchedRank:
    """A rank of a set the parent launched (a :class:`.plugin.RankKind`): the parent asked for the
    plugin, chose the log dir and shows and writes everything; the batch's working dir, which the
    parent removes even if the rank set is killed, holds the rank's temp dirs."""

    reports_itself: ClassVar[bool] = False
    relays_warnings: ClassVar[bool] = True
    when_it_cannot_go_on: ClassVar[str] = "this rank set stops; the later tests run in a fresh one"
    timeouts: ClassVar[TimeoutPolicy] = EndAtTimeout()
    log_dir_chosen_by_parent: ClassVar[bool] = True

    def prepare(self, config: pytest.Config, role: ProcessRole) -> bool:
        return True  # its parent asked for the plugin

    def make_own_temp(self, torchrun: TorchrunEnv) -> Path | None:
        return None  # its pytest temp dir is in the batch dir (basetemp)

    def too_late_hint(self, config: pytest.Config) -> str:
        return ""

    def before_configure(self, config: pytest.Config, torchrun: TorchrunEnv) -> bool:
        return True  # pytest-randomly's seed: the parent's, on the rank's command line

    def basetemp(self, config: pytest.Config, torchrun: TorchrunEnv) -> str:
        # inside the batch's working dir, which the parent removes
        return str(protocol.batch_dir(config) / f"tmp-rank{torchrun.rank}")

    def configure(self, config: pytest.Config, role: ProcessRole) -> RolePlugin | None:
        return None

    def shared_root(self, config: pytest.Config, given: str | None) -> str | None:
        return str(protocol.batch_dir(config)) if given is None else given

    def before_ranks_connect(self, items: list[pytest.Item]) -> None:
        """Nothing: the parent reruns a failed test in a fresh rank set (pytest-rerunfailures)."""

    def install_signal_handlers(
        self, torchrun: TorchrunEnv, tests_running: Callable[[], bool], on_signal: Callable[[str], None]
    ) -> Callable[[], None] | None:
        return None  # the parent's handlers end the rank set


register(Role.LAUNCHED_RANK, LaunchedRank())
