"""pytest entry point (``pytest11``): options, the ``distributed`` marker, session control.

Kept light on purpose: loading the plugin imports neither torch nor megatron. They load inside a
rank, when a collected test actually needs the process group.
"""

from __future__ import annotations

import pytest

from . import options
from .checkpoint_fixtures import checkpoint_dir  # noqa: F401  (fixtures)
from .fixtures import dist_env, megatron_fsdp_run, run_config  # noqa: F401  (fixtures)
from .platform import select_platform
from .session import RankSession, TorchrunEnv
from .state import MARKER, OPTIONS, PLATFORM, RUN_RECORDS, SESSION, distributed_marker


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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(world_size=2, tp=1, pp=1, cp=1, timeout=None): run the test on world_size ranks "
        "(torchrun); tp/pp/cp are Megatron's model-parallel sizes for the test",
    )
    config.stash[OPTIONS] = options.check_all(config)
    config.stash[SESSION] = None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    torchrun = TorchrunEnv.from_environ()
    for item in items:
        if item.get_closest_marker(MARKER) is None:
            continue
        marker = distributed_marker(item)  # a bad marker is a usage error, before any rank work
        if torchrun is None:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"needs {marker.world_size} ranks: run under "
                    f"python -m torch.distributed.run --nproc_per_node={marker.world_size} -m pytest"
                )
            )
        elif torchrun.world_size != marker.world_size:
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


def pytest_collection_finish(session: pytest.Session) -> None:
    config = session.config
    torchrun = TorchrunEnv.from_environ()
    if torchrun is None or config.option.collectonly or not _needs_rank_session(session):
        return
    opts = config.stash[OPTIONS]
    rank_session = RankSession.start(torchrun, config.stash[PLATFORM], pg_timeout_s=opts["pg-timeout"])
    config.stash[SESSION] = rank_session
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and torchrun.rank == 0:
        reporter.write_line(rank_session.header())


def pytest_sessionfinish(session: pytest.Session) -> None:
    rank_session = session.config.stash.get(SESSION, None)
    if rank_session is not None:
        session.config.stash[SESSION] = None
        rank_session.close()


def pytest_unconfigure(config: pytest.Config) -> None:
    if config.stash.get(PLATFORM, None) is not None and config.stash[PLATFORM].platform == "cpu":
        from . import cuda_emulation

        cuda_emulation.disable()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    records = config.stash.get(RUN_RECORDS, [])
    if not records:
        return
    terminalreporter.section("megatron-fsdp training runs")
    for r in records:
        terminalreporter.write_line(
            f"{r.nodeid}: {r.platform}/{r.preset}/{r.strategy}, {r.iterations} iterations, "
            f"loss {r.first_loss:.4f} -> {r.last_loss:.4f}, {r.ms_per_step:.1f} ms/step"
        )
