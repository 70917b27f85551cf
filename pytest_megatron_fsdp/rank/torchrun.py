"""A rank of a torchrun session the user started (or a task of an srun step): it runs its tests with
the other ranks and, on rank 0, reports them to the terminal. Inert until asked (:mod:`.awaiting`)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from .. import options
from ..wire import coexist, pytest_compat
from ..wire.role import ProcessRole, Role, RolePlugin
from ..wire.torchrun_env import TorchrunEnv
from . import owned_temp
from .awaiting import AwaitingUse
from .plugin import RANK_TEMP, RUN_TEMP, RankPlugin, register
from .timeouts import SurviveTimeouts
from .watchdog import TimeoutPolicy

#: a torchrun-mode rank whose session has not asked for the plugin yet (see AwaitingUse)
_AWAITING = pytest.StashKey[bool]()


@dataclass(frozen=True)
class TorchrunRank:
    """A rank of a torchrun session the user started, or of an srun step (a
    :class:`.plugin.RankKind`): rank 0 reports to the terminal; a temp tree of its own holds what
    would stay behind in ``$TMPDIR``. Inert until asked: where no option of the plugin is given, it
    starts only when a test that uses it is collected (:class:`AwaitingUse`)."""

    reports_itself: ClassVar[bool] = True
    relays_warnings: ClassVar[bool] = False
    when_it_cannot_go_on: ClassVar[str] = "the session stops (every later test needs all ranks)"
    timeouts: ClassVar[TimeoutPolicy] = SurviveTimeouts()
    log_dir_chosen_by_parent: ClassVar[bool] = False

    def prepare(self, config: pytest.Config, role: ProcessRole) -> bool:
        if not config.stash.get(_AWAITING, False) and not options.options_given(config):
            config.stash[_AWAITING] = True
            return False
        if role.srun is not None:
            # what torchrun would have set: tests and libraries that read them see an srun rank alike
            for name, value in role.srun.torchrun_variables().items():
                os.environ.setdefault(name, value)
        return True

    def make_own_temp(self, torchrun: TorchrunEnv) -> Path | None:
        """A temp tree of this rank's own in ``$TMPDIR``, removed when it ends.

        Importing megatron-core 0.19 makes torch's inductor cache dir (``$TMPDIR/torchinductor_<user>``),
        and pytest's basetemp would be ``$TMPDIR/pytest-of-<user>``: both would stay behind after
        every run. Set before any conftest or test module imports megatron; a cache dir the user
        chose (``TORCHINDUCTOR_CACHE_DIR``) is kept as it is.
        """
        private = Path(owned_temp.make(f"mfsdp-rank{torchrun.rank}-"))
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(private / "torchinductor"))
        return private

    def too_late_hint(self, config: pytest.Config) -> str:
        if not config.stash.get(_AWAITING, False):
            return ""
        return (
            " In a torchrun session without megatron-fsdp options the emulation starts with the first "
            "distributed test collected: import megatron inside the tests, or give an option (e.g. "
            "--mfsdp-platform=cpu) so that it starts before any conftest or test module is imported."
        )

    def before_configure(self, config: pytest.Config, torchrun: TorchrunEnv) -> bool:
        # Before pytest-randomly's configure, and also while awaiting use: every rank shuffles and
        # reseeds alike, or the first distributed test collected finds the ranks in different
        # orders (a launched rank set gets the parent's seed on its command line instead).
        coexist.agree_randomly_seed(config, torchrun)
        return not config.stash.get(_AWAITING, False)

    def basetemp(self, config: pytest.Config, torchrun: TorchrunEnv) -> str:
        # Every rank would number its own pytest-of-<user>/pytest-N in $TMPDIR (racing the others)
        # and leave it. An explicit --basetemp is split per rank and kept; otherwise the rank's
        # private temp tree holds it and goes at the session's end.
        if config.option.basetemp:
            given = Path(config.option.basetemp)
            given.mkdir(parents=True, exist_ok=True)  # pytest makes the rank's dir, not its parents
            return str(given / f"rank{torchrun.rank}")
        if options.value_of(config, "foreign-suite").value:
            # A suite written for GPUs may share files between its ranks through the parent of
            # pytest's basetemp, as every rank's $TMPDIR/pytest-of-<user> is under plain pytest
            # (Megatron-LM's tmp_path_dist_ckpt: mktemp(...).parent.parent / "tmp_dist_ckpt"): the
            # ranks of this launch share that parent, as they share an explicit --basetemp's.
            run = owned_temp.shared_with_siblings("mfsdp-run-", torchrun.run_id)
            config.stash[RUN_TEMP] = run
            return str(run / f"rank{torchrun.rank}")
        return str(config.stash[RANK_TEMP] / "basetemp")

    def configure(self, config: pytest.Config, role: ProcessRole) -> RolePlugin | None:
        if config.stash.get(_AWAITING, False):
            return AwaitingUse(config, role, lambda session: self.start_late(config, role, session))
        options.refuse_plain_mode_only(config)
        return None

    def start_late(self, config: pytest.Config, role: ProcessRole, session: pytest.Session) -> None:
        """A session asked for the plugin by a collected test: do now what an early start does
        before the conftests are loaded and at configure (see :class:`AwaitingUse`)."""
        assert role.torchrun is not None
        RankPlugin.prepare(config, role)
        if role.torchrun.rank != 0:
            pytest_compat.stop_junit_xml(config)  # rank 0's file carries every rank's outcome
        basetemp = config.option.basetemp
        config.option.basetemp = self.basetemp(config, role.torchrun)
        if config.option.basetemp != basetemp:
            pytest_compat.renew_tmp_path_factory(config)
        plugin = RankPlugin.build(config, role, options.session_values(config))
        config.pluginmanager.register(plugin, plugin.NAME)  # its pytest_configure runs now
        plugin.registered()
        plugin.pytest_sessionstart(session)

    def shared_root(self, config: pytest.Config, given: str | None) -> str | None:
        return given

    def before_ranks_connect(self, items: list[pytest.Item]) -> None:
        # a foreign suite's own flaky marks are the suite's, unchanged: such a test runs once
        foreign = bool(items) and options.session_values(items[0].config).foreign_suite
        coexist.refuse_rerunfailures_under_torchrun(items, refuse_flaky_marks=not foreign)

    def install_signal_handlers(
        self, torchrun: TorchrunEnv, tests_running: Callable[[], bool], on_signal: Callable[[str], None]
    ) -> Callable[[], None] | None:
        if threading.current_thread() is not threading.main_thread():
            return None
        if torchrun.launched_by:
            # srun ends a step (scancel, the time limit, a task that failed under --kill-on-bad-exit)
            # with SIGTERM, then SIGKILL after KillWait: SIGTERM ends the session as Ctrl-C does, so
            # that the rank's temp dirs and the session's shared dir go with it
            restore = _interrupt_on(signal.SIGTERM)
        else:
            # torchrun's agent passes a SIGTERM or SIGINT it gets (a CI cancel) on to the ranks as
            # SIGTERM, then SIGKILLs them 30 s later; it also stops the other ranks with SIGTERM
            # once one exits non-zero, which after the last test is the normal end of a session
            # with failures (rank 0 may still be writing its JUnit file): only while tests run does
            # SIGTERM end the session as Ctrl-C does, every result so far reported, the rest named
            restore = _interrupt_on(signal.SIGTERM, only_while=tests_running)
        stop_watching = _watch_for(signal.SIGTERM, on_signal)

        def undo() -> None:
            stop_watching()
            restore()

        return undo


def _interrupt_on(signum: int, only_while: Callable[[], bool] = lambda: True) -> Callable[[], None]:
    """``signum`` raises KeyboardInterrupt while ``only_while()`` (a second one ends the process at
    once; outside, the signal's default action ends it); returns the function that puts the
    previous handler back."""

    def handle(received: int, frame: Any) -> None:
        signal.signal(received, signal.SIG_DFL)  # a second one is not caught
        if not only_while():
            signal.raise_signal(received)
            return
        raise KeyboardInterrupt(f"signal {signal.Signals(received).name}")

    previous = signal.signal(signum, handle)

    def restore() -> None:
        signal.signal(signum, previous)

    return restore


def _watch_for(signum: int, on_signal: Callable[[str], None]) -> Callable[[], None]:
    """Calls ``on_signal("signal <NAME>")`` from a thread of its own when ``signum`` arrives. The
    handler above runs only once the main thread is back in Python, which one waiting in a
    collective whose peer is gone never is; the C-level handler writes every signal that has a
    Python handler to the wakeup fd at once, which this thread reads. Returns what stops it."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    name = f"signal {signal.Signals(signum).name}"

    def watch() -> None:
        while True:
            try:
                data = os.read(read_end, 64)
            except OSError:
                return
            if not data:  # the write end closed: stopped
                return
            if signum in data:
                on_signal(name)

    thread = threading.Thread(target=watch, name="mfsdp-signal-watch", daemon=True)
    thread.start()

    def stop() -> None:
        signal.set_wakeup_fd(previous)
        os.close(write_end)
        thread.join(5)
        os.close(read_end)

    return stop


register(Role.TORCHRUN_RANK, TorchrunRank())
