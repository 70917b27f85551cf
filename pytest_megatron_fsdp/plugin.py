"""pytest entry point (``pytest11``): options, the ``distributed`` marker, and the choice of side.

* Under torchrun (``RANK``/``WORLD_SIZE`` set) this process is a rank: :mod:`.rank` runs its tests
  with the other ranks, :mod:`.session` holds the process group.
* Otherwise it is a plain pytest session: :mod:`.controller` runs each distributed test in a rank
  set it launches through torchrun (:mod:`.launcher`), and reports it here like any other test.

Kept light on purpose: loading the plugin imports neither torch nor megatron. They load only
where a collected test needs them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from . import options, versions
from .checkpoint_fixtures import checkpoint_dir  # noqa: F401  (fixtures)
from .controller import Controller, log_dir, plan_platforms, remember_items
from .fixtures import dist_env, megatron_fsdp_run, megatron_parallel, run_config  # noqa: F401  (fixtures)
from .platform import select_platform
from .rank import RankPlugin
from .session import RankSession, TorchrunEnv
from .state import MARKER, OPTIONS, PLATFORM, RUN_RECORDS, SESSION, RunRecord, distributed_marker

_RANK_PLUGIN = "mfsdp-rank"
_CONTROLLER = "mfsdp-controller"
_XDIST_RECORDS = "mfsdp_run_records"


def pytest_addoption(parser: pytest.Parser) -> None:
    options.add_options(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    # In a torchrun rank the platform is decided before any conftest or test module is imported:
    # a CPU rank needs the CUDA emulation in place before anything imports megatron.
    torchrun = TorchrunEnv.from_environ()
    if torchrun is None:
        return
    choice = select_platform(options.resolve(early_config, "platform"), torchrun.local_world_size)
    if choice.platform == "cpu":
        from . import cuda_emulation

        cuda_emulation.enable()
    early_config.stash[PLATFORM] = choice


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    torchrun = TorchrunEnv.from_environ()
    if torchrun is not None and torchrun.rank != 0:
        # One JUnit file per run: rank 0's (it carries every rank's outcome); two ranks writing
        # the same path could interleave.
        config.option.xmlpath = None
    report_file = config.getoption("mfsdp_report_file")
    if torchrun is not None and report_file is not None:
        # A rank of a set this plugin launched: its own pytest temp dir inside the batch's working
        # dir (two ranks must not share one basetemp; the parent removes the batch dir). Set before
        # pytest_configure, where pytest reads it.
        config.option.basetemp = str(Path(report_file).parent / f"tmp-rank{torchrun.rank}")


@pytest.hookimpl(trylast=True)  # after the terminal reporter and the cache exist
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(world_size=2, tp=1, pp=1, cp=1, timeout=None): run the test on world_size ranks "
        "(torchrun); tp/pp/cp are Megatron's model-parallel sizes for the test; timeout in seconds",
    )
    config.addinivalue_line(
        "markers",
        "mfsdp_config(use_megatron_fsdp=None, set=()): run_config overrides for one test "
        "(wins over --mfsdp-use-megatron-fsdp / --mfsdp-set)",
    )
    config.stash[OPTIONS] = options.check_all(config)
    config.stash[SESSION] = None
    torchrun = TorchrunEnv.from_environ()
    if torchrun is not None:
        config.pluginmanager.register(
            RankPlugin(config, torchrun, lambda: log_dir(config, "torchrun")), _RANK_PLUGIN
        )
    else:
        config.pluginmanager.register(Controller(config), _CONTROLLER)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    torchrun = TorchrunEnv.from_environ()
    for item in items:
        if item.get_closest_marker(MARKER) is None:
            continue
        marker = distributed_marker(item)  # a bad marker is a usage error, before any rank work
        if torchrun is not None and torchrun.world_size != marker.world_size:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"needs world_size={marker.world_size}; this torchrun session has "
                    f"{torchrun.world_size} ranks"
                )
            )


def _needs_rank_session(session: pytest.Session) -> bool:
    return any(
        item.get_closest_marker(MARKER) is not None and not any(m.name == "skip" for m in item.iter_markers())
        for item in session.items
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    config = session.config
    torchrun = TorchrunEnv.from_environ()
    if torchrun is None:
        _plan_plain_session(session)
        return
    if config.option.collectonly or not _needs_rank_session(session):
        return
    opts = config.stash[OPTIONS]
    shared_root = opts["shared-dir"]
    report_file = config.getoption("mfsdp_report_file")
    if shared_root is None and report_file is not None:
        # Inside the batch's working dir, which the parent removes even if this rank set is killed.
        shared_root = str(Path(report_file).parent)
    rank_session = RankSession.start(
        torchrun, config.stash[PLATFORM], pg_timeout_s=opts["pg-timeout"], shared_root=shared_root
    )
    config.stash[SESSION] = rank_session
    config.pluginmanager.get_plugin(_RANK_PLUGIN).check_same_collection(session, rank_session)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and torchrun.rank == 0:
        reporter.write_line(rank_session.header())


def _plan_plain_session(session: pytest.Session) -> None:
    config = session.config
    remember_items(config, session.items)
    distributed = [i for i in session.items if i.get_closest_marker(MARKER) is not None]
    if not distributed:
        return
    controller = config.pluginmanager.get_plugin(_CONTROLLER)
    lines = plan_platforms(config, controller, distributed)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(
            "megatron-fsdp: distributed tests run in rank sets launched with torchrun; "
            + "; ".join(lines)
            + f"; torch {versions.package_version('torch')}, "
            f"megatron-core {versions.package_version('megatron-core')}"
        )


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    rank_session = config.stash.get(SESSION, None)
    if rank_session is not None:
        config.stash[SESSION] = None
        rank_session.close()
    controller = config.pluginmanager.get_plugin(_CONTROLLER)
    if controller is not None:
        controller.close_all()
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:
        # a pytest-xdist worker: hand the training-run records to the controller's summary
        workeroutput[_XDIST_RECORDS] = [dataclasses.asdict(r) for r in config.stash.get(RUN_RECORDS, [])]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """pytest-xdist controller: collect each worker's training-run records."""
    records = getattr(node, "workeroutput", {}).get(_XDIST_RECORDS, [])
    node.config.stash.setdefault(RUN_RECORDS, []).extend(RunRecord(**data) for data in records)


def pytest_unconfigure(config: pytest.Config) -> None:
    controller = config.pluginmanager.get_plugin(_CONTROLLER)
    if controller is not None:
        controller.close_all()  # also after an interrupted session: no rank set outlives pytest
    if config.stash.get(PLATFORM, None) is not None and config.stash[PLATFORM].platform == "cpu":
        from . import cuda_emulation

        cuda_emulation.disable()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    from . import report  # plain Python, no torch

    report.terminal_summary(
        terminalreporter, config, config.stash.get(RUN_RECORDS, []), report.session_mode()
    )
