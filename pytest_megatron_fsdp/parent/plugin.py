"""The plain-mode parent's role: a plain pytest session (also a pytest-xdist controller or worker)
that runs each distributed test in a rank set it launches through torchrun and reports it here like
any other test.

Its plugin holds a :class:`..parent.controller.Controller` (the rank sets) and owns every pytest
hook of the parent: the controller has none of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from typing import Any, cast

import pytest

from .. import marker, options
from ..foreign import gpu_only_skips
from ..fsdp import versions
from ..reporting.summary import show_summary
from ..wire import cpu_probe, protocol
from ..wire.explain import rerun_summary, tests_not_run_heading
from ..wire.reports import not_run_status
from ..wire.role import PLUGINS, ProcessRole, Role, RolePlugin
from .controller import Controller, install_signal_handlers, plan_platforms, remember_items
from .gpu_slices import GpuSliceError


class ParentPlugin(RolePlugin):
    """The plain-mode parent's plugin: the session's plan around its controller, and the hooks
    through which pytest hands it the distributed tests."""

    NAME = "mfsdp-controller"

    def __init__(
        self, config: pytest.Config, forwarded_args: list[str], explicit_log_dir: str | None
    ) -> None:
        self.config = config
        self._restore_signals: Callable[[], None] | None = None
        self.controller = Controller(
            config, forwarded_args, explicit_log_dir, before_launch=self._install_signal_handlers
        )

    @classmethod
    def create(cls, config: pytest.Config, role: ProcessRole, values: options.SessionValues) -> ParentPlugin:
        return cls(config, options.forwarded_args(config), values.log_dir)

    def prestart(self, world_size: int) -> None:
        """Launch the session's first rank set early (see :meth:`Controller.prestart`)."""
        self.controller.prestart(world_size)

    def close_all(self) -> None:
        self.controller.close_all()

    def _install_signal_handlers(self) -> None:
        # Inert until asked: SIGTERM/SIGINT handlers only once a rank set exists to clean up after.
        in_main_thread = threading.current_thread() is threading.main_thread()
        if self._restore_signals is None and in_main_thread:
            self._restore_signals = install_signal_handlers(self.controller)

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        # pytest-xdist's controller launches no rank set, so its handlers would never be armed, and
        # SIGTERM (a CI cancel) would end it at once with no JUnit file. It takes SIGTERM as Ctrl-C,
        # which pytest-xdist handles: its workers end (each killing its rank sets), the finished
        # tests' results are written.
        if session.config.pluginmanager.hasplugin("dsession"):
            self._install_signal_handlers()

    # -- collection ---------------------------------------------------------------------------------

    def pytest_itemcollected(self, item: pytest.Item) -> None:
        # The first distributed test collected starts its rank set, whose ranks import torch while
        # this session collects the rest (its batch follows when the session reaches it).
        if item.get_closest_marker(protocol.MARKER) is None:
            return
        try:
            spec = marker.parse(item)
        except pytest.UsageError:
            return  # reported with every other marker at the end of collection
        assert spec is not None  # the marker is there
        self.prestart(spec.world_size)

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector: pytest.Collector) -> Generator[None, Any, Any]:
        report = yield
        return gpu_only_skips.skip_collect_report(collector, report)

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        config = session.config
        controller = self.controller
        remember_items(config, session.items)
        distributed = [i for i in session.items if protocol.spec_of(i) is not None]
        if not distributed:
            controller.close_all()  # a prestarted rank set, deselected
            return
        lines = plan_platforms(controller, options.session_values(config).platform, distributed)
        try:
            gpu_slice = controller.plan_gpu_slice()  # pytest-xdist workers on a GPU node: their own GPUs
        except GpuSliceError as exc:
            # Raised in a pytest-xdist worker, a usage error would end the worker unseen. As a failed
            # collection it reaches the controller, which shows it once (identical ones from the
            # other workers are dropped), and no worker runs anything.
            config.hook.pytest_collectreport(report=pytest.CollectReport("", "failed", str(exc), []))
            session.items.clear()
            return
        if gpu_slice is not None:
            lines.append(f"this worker's rank sets: CUDA_VISIBLE_DEVICES={gpu_slice}")
        controller.plan_first_batch(distributed)
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                "megatron-fsdp: distributed tests run in rank sets launched with torchrun; "
                + "; ".join(lines)
                + f"; {versions.stack_description()}"
                + _cpu_line(config, controller)
            )
            if missing := versions.missing_features_line():
                reporter.write_line(missing)

    # -- running ------------------------------------------------------------------------------------

    @pytest.hookimpl(optionalhook=True)
    def pytest_timeout_set_timer(self, item: pytest.Item, settings: Any) -> bool | None:
        """pytest-timeout: no timer of its own around a distributed test here. The controller owns
        that test's deadline (its timeout, pytest-timeout's settings among the sources: see
        ``options.value_of``); a SIGALRM in its wait would end the session, a timer thread's
        ``os._exit`` would leave the rank set running."""
        return True if self.controller.hosts(item) else None

    @pytest.hookimpl(optionalhook=True)
    def pytest_timeout_cancel_timer(self, item: pytest.Item) -> bool | None:
        return True if isinstance(item, pytest.Item) and self.controller.hosts(item) else None

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        if not self.controller.hosts(item):
            return None  # plain tests, and tests skipped for want of GPUs, run as usual
        self.controller.run(item, nextitem)
        return True

    @pytest.hookimpl(tryfirst=True)
    def pytest_report_teststatus(self, report: pytest.TestReport) -> tuple[str, str, Any] | None:
        if cast(str, report.outcome) == "rerun":  # set by the controller, outside pytest's three
            return "rerun", "R", ("RERUN", {"yellow": True})
        return not_run_status(report)

    # -- the end ------------------------------------------------------------------------------------

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.controller.close_all()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.controller.close_all()  # also after an interrupted session: no rank set outlives pytest
        if self._restore_signals is not None:
            self._restore_signals()

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        if self.controller.in_xdist_worker():
            # a pytest-xdist worker: its reports go to the controller, which shows them (reruns too)
            return
        lines = rerun_summary([r for reports in terminalreporter.stats.values() for r in reports])
        if lines:
            terminalreporter.write_sep("=", "megatron-fsdp reruns")
            for line in lines:
                terminalreporter.write_line(line)
        show_summary(terminalreporter, config, "plain")
        if self.controller.not_run:
            terminalreporter.write_sep("=", tests_not_run_heading(len(self.controller.not_run)))
            for nodeid in self.controller.not_run:
                terminalreporter.write_line(nodeid)


def _cpu_line(config: pytest.Config, controller: Controller) -> str:
    """Where a rank set runs on CPU: the CPU's flags and the bf16 sizing they make, as its ranks
    decide it (their header, in the rank logs, adds the speeds: this process imports no torch)."""
    if "cpu" not in controller.platforms.values():
        return ""
    values = options.session_values(config)
    facts = cpu_probe.read_cpu_facts()
    verdict = cpu_probe.decide_bf16(values.cpu_speed, values.source_of("cpu-speed"), facts)
    return f"; {cpu_probe.CpuReport(facts, verdict).describe()} (speeds: the rank logs' header)"


PLUGINS[Role.PARENT] = ParentPlugin
