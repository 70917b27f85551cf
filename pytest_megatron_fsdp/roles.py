"""The three roles a pytest process plays with this plugin: decided once, one plugin object each.

* :attr:`Role.PARENT`: a plain pytest session (also a pytest-xdist controller or worker). Its
  plugin is the controller (:class:`ParentPlugin`): it runs each distributed test in a rank set it
  launches through torchrun and reports it here like any other test.
* :attr:`Role.LAUNCHED_RANK`: a rank of a set the parent launched (:class:`LaunchedRankPlugin`): it
  runs the parent's batch and streams the agreed reports back.
* :attr:`Role.TORCHRUN_RANK`: a rank of a torchrun session the user started
  (:class:`TorchrunRankPlugin`): it runs its tests with the other ranks and, on rank 0, reports
  them to the terminal.

:func:`decide` is the only place that reads the torchrun environment and the launched-by-parent
flag (``tests/unit/test_layering.py`` holds that). The entry module (:mod:`.plugin`) decides the
role before any conftest is loaded, asks the role's class to prepare the process (a CPU rank's
CUDA emulation, a rank's temp dirs), and registers the role's one plugin object at configure.
"""

from __future__ import annotations

import enum
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from . import cpu_mode, marker, options
from .fsdp import versions
from .harness import coexist, protocol
from .harness.controller import Controller, install_signal_handlers, plan_platforms, remember_items
from .harness.gpu_slices import GpuSliceError
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

    @property
    def plugin_class(self) -> type[RolePlugin]:
        return _PLUGINS[self.role]


#: this process's role, decided once (see role_of)
ROLE = pytest.StashKey[ProcessRole]()
#: a rank's platform, decided before any conftest or test module is imported
PLATFORM = pytest.StashKey[PlatformChoice]()


def decide(config: pytest.Config, environ: Mapping[str, str] | None = None) -> ProcessRole:
    """Which role this process plays: torchrun's variables make it a rank, the parent's internal
    options a launched one."""
    torchrun = TorchrunEnv.from_environ(None if environ is None else dict(environ))
    if torchrun is None:
        return ProcessRole(Role.PARENT, None)
    if protocol.launched_by_parent(config):
        return ProcessRole(Role.LAUNCHED_RANK, torchrun)
    return ProcessRole(Role.TORCHRUN_RANK, torchrun)


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
    def create(cls, config: pytest.Config, role: ProcessRole, values: dict[str, Any]) -> RolePlugin:
        raise NotImplementedError

    def registered(self) -> None:
        """Called once the plugin object is registered."""


def _show_summary(terminalreporter: Any, config: pytest.Config, mode: str) -> None:
    from .reporting import report  # plain Python, no torch

    values = config.stash[options.OPTION_VALUES]
    reports = [r for category in terminalreporter.stats.values() for r in category]
    json_path, plot_path = (_in_invocation_dir(config, values[name]) for name in ("report-json", "plot"))
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
    def create(cls, config: pytest.Config, role: ProcessRole, values: dict[str, Any]) -> ParentPlugin:
        return cls(config, options.forwarded_args(config), values["log-dir"])

    def registered(self) -> None:
        self._restore_signals: Callable[[], None] | None = None
        if threading.current_thread() is threading.main_thread():
            self._restore_signals = install_signal_handlers(self)

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
        lines = plan_platforms(self, config.stash[options.OPTION_VALUES]["platform"], distributed)
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
        debug_collectives = options.resolve(config, "debug-collectives")
        choice = select_platform(options.resolve(config, "platform"), role.torchrun.local_world_size)
        cls._prepare_temp(config, role.torchrun)
        if debug_collectives:
            # before any conftest or test module can create a process group or read the setting
            check_collectives(os.environ)
        if choice.platform == "cpu":
            cpu_mode.enable()
        config.stash[PLATFORM] = choice

    @classmethod
    def _prepare_temp(cls, config: pytest.Config, torchrun: TorchrunEnv) -> None:
        pass

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
        raise NotImplementedError

    @classmethod
    def create(cls, config: pytest.Config, role: ProcessRole, values: dict[str, Any]) -> _RankRolePlugin:
        assert role.torchrun is not None
        return cls(
            config,
            role.torchrun,
            lambda: protocol.log_dir(config, values["log-dir"], "torchrun", chosen_by_parent=cls.LAUNCHED),
            agreement_timeout_s=values["pg-timeout"],
            default_timeout_s=values["timeout"],
            distributed_logs=values["distributed-logs"],
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
        return config.stash[options.OPTION_VALUES]["shared-dir"]

    def timeout_for(self, item: pytest.Item) -> float:
        # a test without the marker in a torchrun rank session: by the same precedence, without the
        # distributed marker (pytest-timeout's marker, --mfsdp-timeout, pytest-timeout's options)
        if item.nodeid in self._batch_timeouts or protocol.spec_of(item) is not None:
            return super().timeout_for(item)
        return marker.resolve_timeout(item)

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
            pg_timeout_s=config.stash[options.OPTION_VALUES]["pg-timeout"],
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


class TorchrunRankPlugin(_RankRolePlugin):
    """A rank of a torchrun session the user started; rank 0 reports to the terminal."""

    LAUNCHED = False

    @classmethod
    def _prepare_temp(cls, config: pytest.Config, torchrun: TorchrunEnv) -> None:
        """A temp tree of this rank's own in ``$TMPDIR``, removed when it ends.

        Importing megatron-core 0.19 makes torch's inductor cache dir (``$TMPDIR/torchinductor_<user>``),
        and pytest's basetemp would be ``$TMPDIR/pytest-of-<user>``: both would stay behind after
        every run. Set before any conftest or test module imports megatron; a cache dir the user
        chose (``TORCHINDUCTOR_CACHE_DIR``) is kept as it is.
        """
        private = Path(tempfile.mkdtemp(prefix=f"mfsdp-rank{torchrun.rank}-"))
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
    def create(cls, config: pytest.Config, role: ProcessRole, values: dict[str, Any]) -> _RankRolePlugin:
        options.refuse_plain_mode_only(config)
        return super().create(config, role, values)

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        if hasattr(config, "workerinput") or self.torchrun.rank != 0:
            return  # other ranks must not overwrite rank 0's report
        _show_summary(terminalreporter, config, "torchrun")


_PLUGINS: dict[Role, type[RolePlugin]] = {
    Role.PARENT: ParentPlugin,
    Role.LAUNCHED_RANK: LaunchedRankPlugin,
    Role.TORCHRUN_RANK: TorchrunRankPlugin,
}
