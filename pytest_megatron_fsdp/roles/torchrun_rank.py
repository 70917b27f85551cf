"""A rank of a torchrun session the user started (or a task of an srun step): it runs its tests with
the other ranks and, on rank 0, reports them to the terminal. Inert until asked (:mod:`.awaiting`)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .. import options
from ..harness import coexist, owned_temp, pytest_compat
from ..harness.rank import RankDuties
from ..harness.session import TorchrunEnv
from .awaiting import AwaitingUse
from .deciding import PLUGINS, ProcessRole, Role, RolePlugin
from .ranks import RANK_TEMP, _RankRolePlugin
from .summary import show_summary

#: a torchrun-mode rank whose session has not asked for the plugin yet (see AwaitingUse)
_AWAITING = pytest.StashKey[bool]()


class TorchrunRankPlugin(_RankRolePlugin):
    """A rank of a torchrun session the user started (or of an srun step); rank 0 reports to the
    terminal. Inert until asked: where no option of the plugin is given, it starts only when a test
    that uses it is collected (:class:`AwaitingUse`)."""

    LAUNCHED = False
    DUTIES = RankDuties(
        reports_itself=True,
        relays_warnings=False,
        when_it_cannot_go_on="the session stops (every later test needs all ranks)",
        survives_timeouts=True,
    )

    @classmethod
    def prepare(cls, config: pytest.Config, role: ProcessRole) -> None:
        if not config.stash.get(_AWAITING, False) and not options.options_given(config):
            config.stash[_AWAITING] = True
            return
        if role.srun is not None:
            # what torchrun would have set: tests and libraries that read them see an srun rank alike
            for name, value in role.srun.torchrun_variables().items():
                os.environ.setdefault(name, value)
        super().prepare(config, role)

    @classmethod
    def _too_late_hint(cls, config: pytest.Config) -> str:
        if not config.stash.get(_AWAITING, False):
            return ""
        return (
            " In a torchrun session without megatron-fsdp options the emulation starts with the first "
            "distributed test collected: import megatron inside the tests, or give an option (e.g. "
            "--mfsdp-platform=cpu) so that it starts before any conftest or test module is imported."
        )

    @classmethod
    def before_configure(cls, config: pytest.Config, role: ProcessRole) -> None:
        assert role.torchrun is not None
        # Before pytest-randomly's configure, and also while awaiting use: every rank shuffles and
        # reseeds alike, or the first distributed test collected finds the ranks in different
        # orders (a launched rank set gets the parent's seed on its command line instead).
        coexist.agree_randomly_seed(config, role.torchrun)
        if config.stash.get(_AWAITING, False):
            return
        super().before_configure(config, role)

    @classmethod
    def _prepare_temp(cls, config: pytest.Config, torchrun: TorchrunEnv) -> None:
        """A temp tree of this rank's own in ``$TMPDIR``, removed when it ends.

        Importing megatron-core 0.19 makes torch's inductor cache dir (``$TMPDIR/torchinductor_<user>``),
        and pytest's basetemp would be ``$TMPDIR/pytest-of-<user>``: both would stay behind after
        every run. Set before any conftest or test module imports megatron; a cache dir the user
        chose (``TORCHINDUCTOR_CACHE_DIR``) is kept as it is.
        """
        private = Path(owned_temp.make(f"mfsdp-rank{torchrun.rank}-"))
        config.stash[RANK_TEMP] = private
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(private / "torchinductor"))

    @classmethod
    def _set_basetemp(cls, config: pytest.Config, torchrun: TorchrunEnv) -> None:
        # Every rank would number its own pytest-of-<user>/pytest-N in $TMPDIR (racing the others)
        # and leave it. An explicit --basetemp is split per rank and kept; otherwise the rank's
        # private temp tree holds it and goes at the session's end.
        if config.option.basetemp:
            given = Path(config.option.basetemp)
            given.mkdir(parents=True, exist_ok=True)  # pytest makes the rank's dir, not its parents
            config.option.basetemp = str(given / f"rank{torchrun.rank}")
        else:
            config.option.basetemp = str(config.stash[RANK_TEMP] / "basetemp")

    @classmethod
    def create(cls, config: pytest.Config, role: ProcessRole, values: options.SessionValues) -> RolePlugin:
        if config.stash.get(_AWAITING, False):
            return AwaitingUse(config, role, lambda session: cls.start_late(config, role, session))
        options.refuse_plain_mode_only(config)
        return cls._rank_plugin(config, role, values)

    @classmethod
    def start_late(cls, config: pytest.Config, role: ProcessRole, session: pytest.Session) -> None:
        """A session asked for the plugin by a collected test: do now what an early start does
        before the conftests are loaded and at configure (see :class:`AwaitingUse`)."""
        assert role.torchrun is not None
        cls.prepare(config, role)
        if role.torchrun.rank != 0:
            pytest_compat.stop_junit_xml(config)  # rank 0's file carries every rank's outcome
        basetemp = config.option.basetemp
        cls._set_basetemp(config, role.torchrun)
        if config.option.basetemp != basetemp:
            pytest_compat.renew_tmp_path_factory(config)
        plugin = cls._rank_plugin(config, role, options.session_values(config))
        config.pluginmanager.register(plugin, plugin.NAME)  # its pytest_configure runs now
        plugin.registered()
        plugin.pytest_sessionstart(session)

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        if hasattr(config, "workerinput") or self.torchrun.rank != 0:
            return  # other ranks must not overwrite rank 0's report
        show_summary(terminalreporter, config, "torchrun")
        not_run = self.runner.not_run_lines()
        if not_run:
            terminalreporter.write_sep("=", not_run[0])
            for nodeid in not_run[1:]:
                terminalreporter.write_line(nodeid)

    def registered(self) -> None:
        self._restore_sigterm: Callable[[], None] | None = None
        if self.torchrun.launched_by and threading.current_thread() is threading.main_thread():
            # srun ends a step (scancel, the time limit, a task that failed under --kill-on-bad-exit)
            # with SIGTERM, then SIGKILL after KillWait: SIGTERM ends the session as Ctrl-C does, so
            # that the rank's temp dirs and the session's shared dir go with it
            self._restore_sigterm = _interrupt_on(signal.SIGTERM)

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        super().pytest_unconfigure(config)
        restore = getattr(self, "_restore_sigterm", None)
        if restore is not None:
            restore()


def _interrupt_on(signum: int) -> Callable[[], None]:
    """``signum`` raises KeyboardInterrupt (a second one ends the process at once); returns the
    function that puts the previous handler back."""

    def handle(received: int, frame: Any) -> None:
        signal.signal(received, signal.SIG_DFL)  # a second one is not caught
        raise KeyboardInterrupt(f"signal {signal.Signals(received).name}")

    previous = signal.signal(signum, handle)

    def restore() -> None:
        signal.signal(signum, previous)

    return restore


PLUGINS[Role.TORCHRUN_RANK] = TorchrunRankPlugin
