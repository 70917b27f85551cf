"""The three roles a pytest process plays with this plugin: decided once, one plugin object each.

* :attr:`Role.PARENT`: a plain pytest session (also a pytest-xdist controller or worker). Its
  plugin is the controller (:class:`ParentPlugin`): it runs each distributed test in a rank set it
  launches through torchrun and reports it here like any other test.
* :attr:`Role.LAUNCHED_RANK`: a rank of a set the parent launched (:class:`LaunchedRankPlugin`): it
  runs the parent's batch and streams the agreed reports back.
* :attr:`Role.TORCHRUN_RANK`: a rank of a torchrun session the user started
  (:class:`TorchrunRankPlugin`): it runs its tests with the other ranks and, on rank 0, reports
  them to the terminal.

:func:`decide` is the only place that reads the torchrun environment, an srun step's Slurm
variables (mapped to torchrun's by :mod:`.harness.slurm`: every task of a multi-task srun step is a
torchrun-mode rank) and the launched-by-parent flag (``tests/unit/test_layering.py`` holds that).
The entry module (:mod:`.plugin`) decides the role before any conftest is loaded, asks the role's
class to prepare the process (a CPU rank's CUDA emulation, a rank's temp dirs), and registers the
role's one plugin object at configure.

Inert until asked: a session that never uses the plugin behaves as without it. The plugin is
*asked* by any of its options (a ``--mfsdp-*`` flag, an ``MFSDP_*`` environment variable, an
``mfsdp_*`` ini key), or by a collected test that carries ``@pytest.mark.distributed`` or
``@pytest.mark.mfsdp_config`` or uses one of its fixtures (all of which build on ``dist_env``);
a launched rank is asked by its parent. Until then: no signal handlers (the parent installs its
SIGTERM/SIGINT handlers with its first rank set), and in a torchrun-mode rank no CUDA emulation, no
environment variables set, no temp tree, basetemp or JUnit path changed, no log file or fault
handler, no logging filters, and a rank other than 0 holds its terminal report until collection
shows whether the session is asked (:mod:`.harness.held_terminal`): released to the terminal when
it is not, to the rank's log when it is.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from . import cpu_mode, marker, options
from .fsdp import versions
from .harness import coexist, owned_temp, protocol, slurm
from .harness.controller import Controller, install_signal_handlers, plan_platforms, remember_items
from .harness.gpu_slices import GpuSliceError
from .harness.held_terminal import HELD_TERMINAL, HeldOutput
from .harness.platform import PlatformChoice, select_platform
from .harness.rank import RankPlugin
from .harness.session import RANK_SESSION, RankSession, TorchrunEnv, check_collectives
from .reporting import metrics


class Role(enum.Enum):
    PARENT = "plain-mode parent"
    LAUNCHED_RANK = "launched rank"
    TORCHRUN_RANK = "torchrun-mode rank"


@dataclass(frozen=True)
class ProcessRole:
    """This process's role, and what torchrun told it (None in the parent)."""

    role: Role
    torchrun: TorchrunEnv | None
    #: the srun step this process is a task of, where srun (not torchrun) started the ranks
    srun: slurm.SlurmStep | None = None

    @property
    def plugin_class(self) -> type[RolePlugin]:
        return _PLUGINS[self.role]


#: this process's role, decided once (see role_of)
ROLE = pytest.StashKey[ProcessRole]()
#: a rank's platform, decided before any conftest or test module is imported
PLATFORM = pytest.StashKey[PlatformChoice]()


def decide(config: pytest.Config, environ: Mapping[str, str] | None = None) -> ProcessRole:
    """Which role this process plays: torchrun's variables make it a rank, the parent's internal
    options a launched one; a task of a multi-task srun step is a torchrun-mode rank, its Slurm
    variables read as torchrun's (:func:`.harness.slurm.step_of`)."""
    environ = dict(os.environ if environ is None else environ)
    try:
        step = slurm.step_of(environ)
    except slurm.SlurmError as exc:
        raise pytest.UsageError(f"megatron-fsdp: an srun task's Slurm variables: {exc}") from None
    if step is not None:
        environ.update(step.torchrun_variables())
    torchrun = TorchrunEnv.from_environ(environ)
    if torchrun is None:
        return ProcessRole(Role.PARENT, None)
    if step is not None:
        torchrun = dataclasses.replace(torchrun, launched_by=slurm.rendezvous_hint(step))
        return ProcessRole(Role.TORCHRUN_RANK, torchrun, step)
    if protocol.launched_by_parent(config):
        return ProcessRole(Role.LAUNCHED_RANK, torchrun)
    return ProcessRole(Role.TORCHRUN_RANK, torchrun)


def asks_for_plugin(item: pytest.Item) -> bool:
    """Whether a collected test uses the plugin: its markers, or a fixture of it (every one
    builds on ``dist_env``)."""
    if item.get_closest_marker(protocol.MARKER) is not None or item.get_closest_marker("mfsdp_config"):
        return True
    return "dist_env" in getattr(item, "fixturenames", ())


def role_of(config: pytest.Config) -> ProcessRole:
    """The role decided for this process (decided now if no hook did yet)."""
    if ROLE not in config.stash:
        config.stash[ROLE] = decide(config)
    return config.stash[ROLE]


class RolePlugin:
    """What every role's plugin class offers the entry module."""

    #: the name the plugin object is registered under
    NAME: ClassVar[str]

    @classmethod
    def prepare(cls, config: pytest.Config, role: ProcessRole) -> None:
        """At ``pytest_load_initial_conftests``: before any conftest or test module is imported."""

    @classmethod
    def before_configure(cls, config: pytest.Config, role: ProcessRole) -> None:
        """At ``pytest_cmdline_main``: command-line settings pytest reads at configure."""

    @classmethod
    def create(cls, config: pytest.Config, role: ProcessRole, values: options.SessionValues) -> RolePlugin:
        """The plugin object registered for this role; every role class defines its own."""
        raise NotImplementedError

    def registered(self) -> None:
        """Called once the plugin object is registered."""


def _show_summary(terminalreporter: Any, config: pytest.Config, mode: str) -> None:
    from .reporting import report  # plain Python, no torch

    values = options.session_values(config)
    reports = [r for category in terminalreporter.stats.values() for r in category]
    json_path, plot_path = (_in_invocation_dir(config, path) for path in (values.report_json, values.plot))
    report.terminal_summary(
        terminalreporter, metrics.records_from_reports(reports), mode, json_path, plot_path
    )


def _in_invocation_dir(config: pytest.Config, raw: str | None) -> Path | None:
    if not raw:
        return None
    path = Path(raw)
    return path if path.is_absolute() else Path(config.invocation_params.dir) / path


# -- the plain-mode parent ------------------------------------------------------------------------


class ParentPlugin(Controller, RolePlugin):
    """The plain-mode parent's plugin: the controller, and the session's plan around it."""

    NAME = "mfsdp-controller"

    @classmethod
    def create(cls, config: pytest.Config, role: ProcessRole, values: options.SessionValues) -> ParentPlugin:
        return cls(config, options.forwarded_args(config), values.log_dir)

    def registered(self) -> None:
        self._restore_signals: Callable[[], None] | None = None

    def _launch(self, world_size: int) -> Any:
        # Inert until asked: SIGTERM/SIGINT handlers only once a rank set exists to clean up after.
        in_main_thread = threading.current_thread() is threading.main_thread()
        if getattr(self, "_restore_signals", None) is None and in_main_thread:
            self._restore_signals = install_signal_handlers(self)
        return super()._launch(world_size)

    def pytest_itemcollected(self, item: pytest.Item) -> None:
        # The first distributed test collected starts its rank set, whose ranks import torch while
        # this session collects the rest (its batch follows when the session reaches it).
        if item.get_closest_marker(protocol.MARKER) is None:
            return
        try:
            spec = marker.parse(item)
        except pytest.UsageError:
            return  # reported with every other marker at the end of collection
        self.prestart(spec.world_size)

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        config = session.config
        remember_items(config, session.items)
        distributed = [i for i in session.items if protocol.spec_of(i) is not None]
        if not distributed:
            self.close_all()  # a prestarted rank set, deselected
            return
        lines = plan_platforms(self, options.session_values(config).platform, distributed)
        try:
            gpu_slice = self.plan_gpu_slice()  # pytest-xdist workers on a GPU node: their own GPUs
        except GpuSliceError as exc:
            # Raised in a pytest-xdist worker, a usage error would end the worker unseen. As a failed
            # collection it reaches the controller, which shows it once (identical ones from the
            # other workers are dropped), and no worker runs anything.
            config.hook.pytest_collectreport(report=pytest.CollectReport("", "failed", str(exc), []))
            session.items.clear()
            return
        if gpu_slice is not None:
            lines.append(f"this worker's rank sets: CUDA_VISIBLE_DEVICES={gpu_slice}")
        self.plan_first_batch(distributed)
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                "megatron-fsdp: distributed tests run in rank sets launched with torchrun; "
                + "; ".join(lines)
                + f"; {versions.stack_description()}"
            )
            if missing := versions.missing_features_line():
                reporter.write_line(missing)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.close_all()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.close_all()  # also after an interrupted session: no rank set outlives pytest
        restore = getattr(self, "_restore_signals", None)
        if restore is not None:
            restore()

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        super().pytest_terminal_summary(terminalreporter)  # the reruns
        if self._in_xdist_worker():
            return  # a pytest-xdist worker: its reports go to the controller, which shows them
        _show_summary(terminalreporter, config, "plain")


# -- ranks ----------------------------------------------------------------------------------------

#: a torchrun-mode rank's private temp tree (pytest's basetemp, torch's inductor cache), removed at exit
_RANK_TEMP = pytest.StashKey[Path]()


class _RankRolePlugin(RankPlugin, RolePlugin):
    """What both kinds of rank do beyond :class:`RankPlugin`: the platform and the rank session."""

    NAME = "mfsdp-rank"
    LAUNCHED: ClassVar[bool]

    @classmethod
    def prepare(cls, config: pytest.Config, role: ProcessRole) -> None:
        # The platform is decided before any conftest or test module is imported: a CPU rank needs
        # the CUDA emulation in place before anything imports megatron. First what can refuse to
        # start (a bad value, no GPU): a usage error here ends the rank without pytest_unconfigure,
        # which would leave a private temp tree behind.
        assert role.torchrun is not None
        debug_collectives = options.value_of(config, "debug-collectives").value
        choice = select_platform(options.value_of(config, "platform").value, role.torchrun.local_world_size)
        cls._prepare_temp(config, role.torchrun)
        if debug_collectives:
            # before any conftest or test module can create a process group or read the setting
            check_collectives(os.environ)
        if choice.platform == "cpu":
            try:
                cpu_mode.enable()
            except cpu_mode.EmulationTooLate as exc:
                private = config.stash.get(_RANK_TEMP, None)
                if private is not None:  # no unconfigure will remove it: the rank ends here
                    shutil.rmtree(private, ignore_errors=True)
                raise pytest.UsageError(f"megatron-fsdp: {exc}{cls._too_late_hint(config)}") from None
        config.stash[PLATFORM] = choice

    @classmethod
    def _too_late_hint(cls, config: pytest.Config) -> str:
        return ""

    @classmethod
    def _prepare_temp(cls, config: pytest.Config, torchrun: TorchrunEnv) -> None:
        """A temp tree of the rank's own; none by default: a launched rank's pytest temp dir is in the
        batch directory its parent removes (:meth:`_set_basetemp`)."""

    @classmethod
    def before_configure(cls, config: pytest.Config, role: ProcessRole) -> None:
        assert role.torchrun is not None
        if role.torchrun.rank != 0:
            # One JUnit file per run: rank 0's (it carries every rank's outcome); two ranks writing
            # the same path could interleave.
            config.option.xmlpath = None
        cls._set_basetemp(config, role.torchrun)
        if not cls.LAUNCHED:
            # before pytest-randomly's configure: every rank shuffles and reseeds alike (a launched
            # rank set gets the parent's seed on its command line)
            coexist.agree_randomly_seed(config, role.torchrun)

    @classmethod
    def _set_basetemp(cls, config: pytest.Config, torchrun: TorchrunEnv) -> None:
        """Where this rank's pytest basetemp goes (launched and torchrun ranks differ)."""
        raise NotImplementedError

    @classmethod
    def create(
        cls, config: pytest.Config, role: ProcessRole, values: options.SessionValues
    ) -> _RankRolePlugin:
        assert role.torchrun is not None
        return cls(
            config,
            role.torchrun,
            lambda: protocol.log_dir(config, values.log_dir, "torchrun", chosen_by_parent=cls.LAUNCHED),
            agreement_timeout_s=values.pg_timeout,
            default_timeout_s=values.timeout,
            distributed_logs=values.distributed_logs,
            private_temp=config.stash.get(_RANK_TEMP, None),
            launched=cls.LAUNCHED,
        )

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        for item in items:
            spec = protocol.spec_of(item)
            if spec is not None and self.torchrun.world_size != spec.world_size:
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"needs world_size={spec.world_size}; this torchrun session has "
                        f"{self.torchrun.world_size} ranks"
                    )
                )
        super().pytest_collection_modifyitems(config, items)  # a launched rank set: the parent's batch

    def _shared_root(self, config: pytest.Config) -> str | None:
        return options.session_values(config).shared_dir

    def timeout_for(self, item: pytest.Item) -> float:
        # a test without the marker in a torchrun rank session: by the same precedence, without the
        # distributed marker (pytest-timeout's marker, --mfsdp-timeout, pytest-timeout's options)
        if item.nodeid in self._batch_timeouts or protocol.spec_of(item) is not None:
            return super().timeout_for(item)
        return float(options.value_of(item.config, "timeout", item).value)

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        config = session.config
        if config.option.collectonly or not _needs_rank_session(session):
            return
        if not self.launched:
            # before the ranks connect: every rank refuses alike
            coexist.refuse_rerunfailures_under_torchrun(session.items)
        rank_session = RankSession.start(
            self.torchrun,
            config.stash[PLATFORM],
            pg_timeout_s=options.session_values(config).pg_timeout,
            shared_root=self._shared_root(config),
        )
        config.stash[RANK_SESSION] = rank_session
        self.check_same_collection(session, rank_session)
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None and self.torchrun.rank == 0:
            reporter.write_line(rank_session.header(versions.stack_description()))
            if missing := versions.missing_features_line():
                reporter.write_line(missing)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        rank_session = session.config.stash.get(RANK_SESSION, None)
        if rank_session is not None:
            session.config.stash[RANK_SESSION] = None
            rank_session.close()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        super().pytest_unconfigure(config)  # the rank's log closes first
        private = config.stash.get(_RANK_TEMP, None)
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)
            # and those of ranks that could not remove theirs (killed), here and in the shared root
            owned_temp.sweep([None, self._shared_root(config)])
        if config.stash.get(PLATFORM, None) is not None and config.stash[PLATFORM].platform == "cpu":
            cpu_mode.disable()


def _needs_rank_session(session: pytest.Session) -> bool:
    return any(
        protocol.spec_of(item) is not None and not any(m.name == "skip" for m in item.iter_markers())
        for item in session.items
    )


class LaunchedRankPlugin(_RankRolePlugin):
    """A rank of a set the parent launched: the parent shows and writes everything."""

    LAUNCHED = True

    @classmethod
    def _set_basetemp(cls, config: pytest.Config, torchrun: TorchrunEnv) -> None:
        # Its own pytest temp dir inside the batch's working dir (two ranks must not share one
        # basetemp; the parent removes the batch dir). Set before pytest_configure, where pytest
        # reads it.
        config.option.basetemp = str(protocol.batch_dir(config) / f"tmp-rank{torchrun.rank}")

    def _shared_root(self, config: pytest.Config) -> str | None:
        # Inside the batch's working dir, which the parent removes even if this rank set is killed.
        given = super()._shared_root(config)
        return str(protocol.batch_dir(config)) if given is None else given


#: a torchrun-mode rank whose session has not asked for the plugin yet (see AwaitingUse)
_AWAITING = pytest.StashKey[bool]()


class TorchrunRankPlugin(_RankRolePlugin):
    """A rank of a torchrun session the user started (or of an srun step); rank 0 reports to the
    terminal. Inert until asked: where no option of the plugin is given, it starts only when a test
    that uses it is collected (:class:`AwaitingUse`)."""

    LAUNCHED = False

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
        config.stash[_RANK_TEMP] = private
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
            config.option.basetemp = str(config.stash[_RANK_TEMP] / "basetemp")

    @classmethod
    def create(cls, config: pytest.Config, role: ProcessRole, values: options.SessionValues) -> RolePlugin:
        if config.stash.get(_AWAITING, False):
            return AwaitingUse(config, role)
        options.refuse_plain_mode_only(config)
        return super().create(config, role, values)

    @classmethod
    def start_late(cls, config: pytest.Config, role: ProcessRole, session: pytest.Session) -> None:
        """A session asked for the plugin by a collected test: do now what an early start does
        before the conftests are loaded and at configure (see :class:`AwaitingUse`)."""
        assert role.torchrun is not None
        cls.prepare(config, role)
        if role.torchrun.rank != 0:
            _stop_junit_xml(config)  # rank 0's file carries every rank's outcome
        basetemp = config.option.basetemp
        cls._set_basetemp(config, role.torchrun)
        if config.option.basetemp != basetemp:
            _renew_tmp_path_factory(config)
        plugin = super().create(config, role, options.session_values(config))
        config.pluginmanager.register(plugin, plugin.NAME)  # its pytest_configure runs now
        plugin.registered()
        plugin.pytest_sessionstart(session)

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        if hasattr(config, "workerinput") or self.torchrun.rank != 0:
            return  # other ranks must not overwrite rank 0's report
        _show_summary(terminalreporter, config, "torchrun")

    def registered(self) -> None:
        self._restore_sigterm: Callable[[], None] | None = None
        if self.torchrun.launched_by and threading.current_thread() is threading.main_thread():
            # srun ends a step (scancel, the time limit, a task that failed under --kill-on-bad-exit)
            # with SIGTERM, then SIGKILL after KillWait: SIGTERM ends the session as Ctrl-C does, so
            # that the rank's temp dirs and the session's shared dir go with it
            self._restore_sigterm = _interrupt_on(signal.SIGTERM)

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        super().pytest_unconfigure(config)
        if getattr(self, "_restore_sigterm", None) is not None:
            self._restore_sigterm()


def _interrupt_on(signum: int) -> Callable[[], None]:
    """``signum`` raises KeyboardInterrupt (a second one ends the process at once); returns the
    function that puts the previous handler back."""

    def handle(received: int, frame: Any) -> None:
        signal.signal(received, signal.SIG_DFL)  # a second one is not caught
        raise KeyboardInterrupt(f"signal {signal.Signals(received).name}")

    previous = signal.signal(signum, handle)
    return lambda: signal.signal(signum, previous)


class AwaitingUse(RolePlugin):
    """A torchrun-mode rank's plugin until its session asks for megatron-fsdp (no option given).

    It watches the tests being collected; the first that uses the plugin starts the rank's plugin
    (:meth:`TorchrunRankPlugin.start_late`). A rank other than 0 holds its terminal output until
    then, or until collection ends without one, when everything held goes to the terminal as it
    would without the plugin.
    """

    NAME = "mfsdp-awaiting-use"

    def __init__(self, config: pytest.Config, role: ProcessRole) -> None:
        self.config = config
        self.role = role
        self.started = False

    def registered(self) -> None:
        assert self.role.torchrun is not None
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None or self.role.torchrun.rank == 0:
            return
        from _pytest.terminal import TerminalReporter

        held = self.config.stash[HELD_TERMINAL] = HeldOutput(sys.stdout)
        self.config.pluginmanager.unregister(reporter)
        self.config.pluginmanager.register(TerminalReporter(self.config, held), "terminalreporter")

    @pytest.hookimpl(tryfirst=True)
    def pytest_itemcollected(self, item: pytest.Item) -> None:
        if self.started or not asks_for_plugin(item):
            return
        self.started = True
        TorchrunRankPlugin.start_late(self.config, self.role, item.session)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._release()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self._release()  # a session that ended before collection did (a collection error, -x)

    def _release(self) -> None:
        held = self.config.stash.get(HELD_TERMINAL, None)
        if held is not None and held.held:
            held.release()


def _stop_junit_xml(config: pytest.Config) -> None:
    """No JUnit file from this rank, though ``--junitxml`` was given (pytest's plugin for it is
    already configured: it is unregistered before it writes)."""
    config.option.xmlpath = None
    try:
        from _pytest.junitxml import xml_key
    except ImportError:  # a pytest that moved it: every rank writes, as without the plugin
        return
    xml = config.stash.get(xml_key, None)
    if xml is not None:
        del config.stash[xml_key]
        config.pluginmanager.unregister(xml)


def _renew_tmp_path_factory(config: pytest.Config) -> None:
    """pytest read ``--basetemp`` at configure; a factory nobody used yet is made again from it."""
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None or getattr(factory, "_basetemp", None) is not None:
        return
    from _pytest.tmpdir import TempPathFactory

    config._tmp_path_factory = TempPathFactory.from_config(config, _ispytest=True)  # type: ignore[attr-defined]


_PLUGINS: dict[Role, type[RolePlugin]] = {
    Role.PARENT: ParentPlugin,
    Role.LAUNCHED_RANK: LaunchedRankPlugin,
    Role.TORCHRUN_RANK: TorchrunRankPlugin,
}
