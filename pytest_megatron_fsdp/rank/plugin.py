"""The one plugin of a rank, of either kind: a rank of a set the parent launched
(:mod:`.launched`) or of a torchrun session or srun step the user started
(:mod:`.torchrun`). It holds the rank's harness (a :class:`.runner.RankRunner`) and
its kind (a :class:`RankKind`: what differs between the two, each kind's module defining its own),
and owns every pytest hook of a rank: the platform, the rank session, the hooks around the runner."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any, Protocol

import pytest

from .. import marker, options
from ..emulation import cpu_mode
from ..emulation.made_groups import MadeGroups
from ..environment import DistributedSpec
from ..foreign import bridge_plugin as foreign_bridge
from ..foreign import gpu_only, gpu_only_skips, upstream_test_bugs
from ..fsdp import versions
from ..reporting.summary import show_summary
from ..wire import protocol
from ..wire.platform import select_platform
from ..wire.reports import not_run_status
from ..wire.role import PLATFORM, PLUGINS, ProcessRole, Role, RolePlugin
from ..wire.torchrun_env import TorchrunEnv
from . import collection, owned_temp
from .runner import RankRunner
from .session import RANK_SESSION, RankSession, check_collectives
from .watchdog import TimeoutPolicy

#: the module of the plugin's own fixtures (``megatron_parallel`` keeps Megatron's model-parallel state,
#: its process groups included, for the next test; the rank session destroys it on release)
_OWN_FIXTURES = "pytest_megatron_fsdp.fixtures"

#: a rank's private temp tree (a torchrun-mode rank's: pytest's basetemp, torch's inductor cache), removed
#: at exit (:meth:`RankKind.make_own_temp`)
RANK_TEMP = pytest.StashKey[Path]()
#: the dir a foreign suite's ranks of one launch share, their basetemps in it (see
#: ``TorchrunRank.basetemp``): each rank removes its own at exit, the last one out the dir
RUN_TEMP = pytest.StashKey[Path]()


class RankKind(Protocol):
    """What differs between the kinds of rank: the rank's plugin holds one. Three methods run first
    in a :class:`..wire.role.RolePlugin` stage of the plugin and have their say on the rest of it:
    :meth:`prepare` and :meth:`before_configure` in the stages of those names, :meth:`configure`
    in ``create``."""

    @property
    def reports_itself(self) -> bool:
        """Whether the rank set reports its own session (rank 0 to the user's terminal, a rank whose
        test timed out writing its stacks and the ranks' aligned collectives there), or a parent
        reports everything from the logs."""

    @property
    def relays_warnings(self) -> bool:
        """Whether the tests' warnings go to the parent (unless -p no:warnings)."""

    @property
    def when_it_cannot_go_on(self) -> str:
        """What becomes of the session when a rank cannot go on with its peers (said in the failure)."""

    @property
    def timeouts(self) -> TimeoutPolicy:
        """What the rank does at a test's timeout (:mod:`.timeouts`)."""

    @property
    def log_dir_chosen_by_parent(self) -> bool:
        """Whether the rank's log dir was chosen by a parent and passed on."""

    def prepare(self, config: pytest.Config, role: ProcessRole) -> bool:
        """At ``pytest_load_initial_conftests``, first: whether the rank starts now (else it awaits
        its session's use of the plugin)."""

    def make_own_temp(self, torchrun: TorchrunEnv) -> Path | None:
        """A temp tree of the rank's own, removed when the rank ends (:data:`RANK_TEMP`), or None."""

    def too_late_hint(self, config: pytest.Config) -> str:
        """What the usage error adds where the CUDA emulation came too late (megatron imported)."""

    def before_configure(self, config: pytest.Config, torchrun: TorchrunEnv) -> bool:
        """At ``pytest_cmdline_main``, first: whether the rank makes its settings now."""

    def basetemp(self, config: pytest.Config, torchrun: TorchrunEnv) -> str:
        """Where this rank's pytest basetemp goes (two ranks must not share one)."""

    def configure(self, config: pytest.Config, role: ProcessRole) -> RolePlugin | None:
        """At configure, first: the plugin to register instead of the rank's (its session has not
        asked for megatron-fsdp yet), or None."""

    def shared_root(self, config: pytest.Config, given: str | None) -> str | None:
        """Where the rank session's shared dir goes (``given``: ``--mfsdp-shared-dir``)."""

    def before_ranks_connect(self, items: list[pytest.Item]) -> None:
        """What the rank refuses in its collected tests before it connects to the others (every
        rank alike)."""

    def install_signal_handlers(
        self, torchrun: TorchrunEnv, tests_running: Callable[[], bool], on_signal: Callable[[str], None]
    ) -> Callable[[], None] | None:
        """The kind's own signal handlers, once its plugin is registered (``tests_running``: whether
        the session is in its test loop; ``on_signal``: told from another thread of a signal that
        ends the session); returns what restores the previous ones at unconfigure."""


#: each rank role's kind, filled in by the kind's module (:func:`register`)
KINDS: dict[Role, RankKind] = {}


def register(role: Role, kind: RankKind) -> None:
    """``role`` is a rank of ``kind``: its plugin is a :class:`RankPlugin` holding it."""
    KINDS[role] = kind
    PLUGINS[role] = RankPlugin


class RankPlugin(RolePlugin):
    """A rank's plugin, of either kind: the platform, the rank session, and the pytest hooks around
    the rank's :class:`.runner.RankRunner`, which it holds with its :class:`RankKind`."""

    NAME = "mfsdp-rank"

    def __init__(
        self,
        config: pytest.Config,
        torchrun: TorchrunEnv,
        kind: RankKind,
        runner: RankRunner,
        made_groups: MadeGroups | None = None,
    ) -> None:
        self.config = config
        self.torchrun = torchrun
        self.kind = kind
        self.runner = runner
        #: a foreign suite's process groups, each freed when its test or fixture is over (None:
        #: not in foreign-suite mode on CPU ranks)
        self.made_groups = made_groups
        self._restore_signals: Callable[[], None] | None = None
        #: whether the session is in its test loop (between collection and the session's end)
        self._tests_running = False

    @classmethod
    def prepare(cls, config: pytest.Config, role: ProcessRole) -> None:
        # The platform is decided before any conftest or test module is imported: a CPU rank needs
        # the CUDA emulation in place before anything imports megatron. First what can refuse to
        # start (a bad value, no GPU): a usage error here ends the rank without pytest_unconfigure,
        # which would leave a private temp tree behind.
        assert role.torchrun is not None
        kind = KINDS[role.role]
        if not kind.prepare(config, role):
            return
        debug_collectives = options.value_of(config, "debug-collectives").value
        choice = select_platform(options.value_of(config, "platform").value, role.torchrun.local_world_size)
        private = kind.make_own_temp(role.torchrun)
        if private is not None:
            config.stash[RANK_TEMP] = private
        if debug_collectives:
            # before any conftest or test module can create a process group or read the setting
            check_collectives(os.environ)
        if choice.platform == "cpu":
            try:
                cpu_mode.enable()
            except cpu_mode.EmulationTooLate as exc:
                if private is not None:  # no unconfigure will remove it: the rank ends here
                    shutil.rmtree(private, ignore_errors=True)
                raise pytest.UsageError(f"megatron-fsdp: {exc}{kind.too_late_hint(config)}") from None
            if options.value_of(config, "foreign-suite").value:
                # over the emulation, before any conftest of the suite is imported
                cpu_mode.enable_foreign_suite(
                    role.torchrun.local_world_size,
                    role.torchrun.local_rank,
                    float(options.value_of(config, "pg-timeout").value),
                )
                foreign_bridge.watch(config, role.torchrun.rank)  # acts once megatron.bridge is imported
                upstream_test_bugs.register(config, role.torchrun.world_size)
        config.stash[PLATFORM] = choice

    @classmethod
    def before_configure(cls, config: pytest.Config, role: ProcessRole) -> None:
        assert role.torchrun is not None
        kind = KINDS[role.role]
        if not kind.before_configure(config, role.torchrun):
            return
        if role.torchrun.rank != 0:
            # One JUnit file per run: rank 0's (it carries every rank's outcome); two ranks writing
            # the same path could interleave.
            config.option.xmlpath = None
        # set before pytest_configure, where pytest reads it
        config.option.basetemp = kind.basetemp(config, role.torchrun)

    @classmethod
    def create(cls, config: pytest.Config, role: ProcessRole, values: options.SessionValues) -> RolePlugin:
        instead = KINDS[role.role].configure(config, role)
        return instead if instead is not None else cls.build(config, role, values)

    @classmethod
    def build(cls, config: pytest.Config, role: ProcessRole, values: options.SessionValues) -> RankPlugin:
        """The rank's plugin with its runner (:meth:`create` without the kind's say)."""
        assert role.torchrun is not None
        kind = KINDS[role.role]
        made = _made_groups(config)
        runner = RankRunner(
            config,
            role.torchrun,
            lambda: protocol.log_dir(
                config, values.log_dir, "torchrun", chosen_by_parent=kind.log_dir_chosen_by_parent
            ),
            agreement_timeout_s=values.pg_timeout,
            unmarked_settings=functools.partial(
                _settings_without_the_marker, world_size=role.torchrun.world_size
            ),
            timeouts=kind.timeouts,
            relays_warnings=kind.relays_warnings,
            when_it_cannot_go_on=kind.when_it_cannot_go_on,
            distributed_logs=values.distributed_logs,
            private_temp=config.stash.get(RANK_TEMP, None),
            release_test_groups=None
            if made is None
            else functools.partial(made.release_test_groups, _destroy_group),
        )
        return cls(config, role.torchrun, kind, runner, made)

    def registered(self) -> None:
        self._restore_signals = self.kind.install_signal_handlers(
            self.torchrun, lambda: self._tests_running, self.runner.signal_received
        )

    # -- the rank's log -----------------------------------------------------------------------------

    def pytest_configure(self, config: pytest.Config) -> None:
        # called as this plugin is registered; only rank 0 of a rank set that reports itself keeps
        # the terminal
        self.runner.open_log(config, quiet_terminal=self.torchrun.rank != 0 or not self.kind.reports_itself)

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.runner.log.quiet_distributed_logs()

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
        collection.select_batch(config, items)  # a launched rank set: the parent's batch

    def _shared_root(self, config: pytest.Config) -> str | None:
        return self.kind.shared_root(config, options.session_values(config).shared_dir)

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        config = session.config
        if config.option.collectonly or not _needs_rank_session(session):
            return
        self.kind.before_ranks_connect(session.items)
        values = options.session_values(config)
        rank_session = RankSession.start(
            self.torchrun,
            config.stash[PLATFORM],
            pg_timeout_s=values.pg_timeout,
            shared_root=self._shared_root(config),
            cpu_speed=(values.cpu_speed, values.source_of("cpu-speed")),
        )
        config.stash[RANK_SESSION] = rank_session
        if self.made_groups is not None:  # a foreign suite's groups go when what made them is over
            rank_session.after_agreement(functools.partial(_free_after_test, self.made_groups))
        self.runner.check_same_collection(session, rank_session)
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None and self.torchrun.rank == 0:
            reporter.write_line(rank_session.header(versions.stack_description()))
            if missing := versions.missing_features_line():
                reporter.write_line(missing)

    # -- running ------------------------------------------------------------------------------------

    @pytest.hookimpl(optionalhook=True)
    def pytest_timeout_set_timer(self, item: pytest.Item, settings: Any) -> bool | None:
        """pytest-timeout: no timer of its own around a test the watchdog times (see
        :meth:`..rank.runner.RankRunner.times_its_tests`)."""
        return True if self.runner.times_its_tests() else None

    @pytest.hookimpl(optionalhook=True)
    def pytest_timeout_cancel_timer(self, item: Any) -> bool | None:
        return True if self.runner.times_its_tests() else None

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(
        self, fixturedef: pytest.FixtureDef[Any], request: Any
    ) -> Generator[None, Any, Any]:
        made = self.made_groups
        if made is None:
            return (yield)
        if fixturedef.func.__module__ == _OWN_FIXTURES:  # they release their groups themselves
            with made.unrecorded():
                return (yield)
        if fixturedef.scope == "function":
            return (yield)
        with made.owned_by(fixturedef):  # its groups outlive the test: freed when it ends
            return (yield)

    def pytest_fixture_post_finalizer(self, fixturedef: pytest.FixtureDef[Any], request: Any) -> None:
        if self.made_groups is not None:
            self.made_groups.owner_done(fixturedef)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtestloop(self, session: pytest.Session) -> Generator[None, object, object]:
        self._tests_running = True
        try:
            return (yield)
        finally:
            self._tests_running = False

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        if options.session_values(item.config).foreign_suite:
            cpu_mode.before_foreign_test()
        return self.runner.run(item, nextitem)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        if report.failed and call.excinfo is not None and options.session_values(item.config).foreign_suite:
            cause = gpu_only.cause_of(call.excinfo.value)
            if cause is not None:  # a foreign suite's test that needs what only a GPU has
                report.outcome = "skipped"
                report.longrepr = (str(item.path), (item.location[1] or 0) + 1, cause.reason())
        return self.runner.review_report(item, call, report)

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector: pytest.Collector) -> Generator[None, Any, Any]:
        report = yield
        return gpu_only_skips.skip_collect_report(collector, report)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.runner.log_agreed(report)

    @pytest.hookimpl(tryfirst=True)
    def pytest_report_teststatus(self, report: pytest.TestReport) -> tuple[str, str, str] | None:
        return not_run_status(report)

    # -- the end ------------------------------------------------------------------------------------

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        rank_session = session.config.stash.get(RANK_SESSION, None)
        if rank_session is not None:
            session.config.stash[RANK_SESSION] = None
            rank_session.close()

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        if not self.kind.reports_itself or hasattr(config, "workerinput") or self.torchrun.rank != 0:
            return  # a parent reports a launched rank set; other ranks must not overwrite rank 0's report
        show_summary(terminalreporter, config, "torchrun")
        not_run = self.runner.not_run_lines()
        if not_run:
            terminalreporter.write_sep("=", not_run[0])
            for nodeid in not_run[1:]:
                terminalreporter.write_line(nodeid)

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.runner.close_log()  # the rank's log closes first
        run = config.stash.get(RUN_TEMP, None)
        if run is not None:
            shutil.rmtree(run / f"rank{self.torchrun.rank}", ignore_errors=True)
            with contextlib.suppress(OSError):  # not empty: a later rank's, or swept after the launch
                run.rmdir()
        private = config.stash.get(RANK_TEMP, None)
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)
            # and those of ranks that could not remove theirs (killed), here and in the shared root
            owned_temp.sweep([None, self._shared_root(config)])
        if config.stash.get(PLATFORM, None) is not None and config.stash[PLATFORM].platform == "cpu":
            cpu_mode.disable()
        if self._restore_signals is not None:
            self._restore_signals()


def _settings_without_the_marker(item: pytest.Item, world_size: int) -> DistributedSpec:
    """A test without the marker in a torchrun rank session: by the same precedence, without the
    distributed marker (pytest-timeout's marker, --mfsdp-timeout, pytest-timeout's options)."""
    return marker.resolve(item, world_size)


def _needs_rank_session(session: pytest.Session) -> bool:
    """Whether a collected test runs with the other ranks: one with the distributed marker, or in
    foreign-suite mode any test (a test of the session's world size), unless marked skip."""
    foreign = options.session_values(session.config).foreign_suite
    return any(
        (foreign or protocol.spec_of(item) is not None)
        and not any(m.name == "skip" for m in item.iter_markers())
        for item in session.items
    )


def _made_groups(config: pytest.Config) -> MadeGroups | None:
    """The process groups a foreign suite's tests make (None: not in foreign-suite mode on CPU
    ranks, where the layer that records them is off; :meth:`RankPlugin.prepare` turned it on)."""
    choice = config.stash.get(PLATFORM, None)
    if choice is None or choice.platform != "cpu" or not options.value_of(config, "foreign-suite").value:
        return None
    from ..emulation import foreign as foreign_emulation

    return foreign_emulation.made_groups()


def _free_after_test(made: MadeGroups) -> str | None:
    freed = made.free_after_test(_destroy_group)
    return f"freed {freed} process groups made by the test or its ended fixtures" if freed else None


def _destroy_group(group: Any) -> None:
    import torch.distributed as dist

    dist.destroy_process_group(group)
