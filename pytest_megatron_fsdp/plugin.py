"""pytest entry point (``pytest11``): the hooks every role shares, and the role's one plugin.

The role this process plays (plain-mode parent, launched rank, torchrun-mode rank: see
:mod:`.wire.role`) is decided once, before any conftest is loaded; the role's class prepares the
process then (the parent's is :mod:`.parent.plugin`'s, a rank's :mod:`.rank.plugin`'s), and its
one plugin object is registered at configure. No hook here asks which side it is on, but where a
launched rank takes its tests' settings from its parent's batch.

Kept light on purpose: loading the plugin imports neither torch nor megatron. They load only
where a collected test needs them.
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path

import pytest

from . import marker, options
from .fixtures import (  # noqa: F401  (fixtures)
    checkpoint_dir,
    dist_env,
    fully_shard_run,
    fully_shard_v2_run,
    megatron_fsdp_run,
    megatron_parallel,
    run_config,
)
from .parent import plugin as _parent_plugin  # noqa: F401  (registers the parent's plugin class)
from .rank import launched as _launched_rank  # noqa: F401  (registers its rank kind)
from .rank import torchrun as _torchrun_rank  # noqa: F401  (registers its rank kind)
from .rank.session import RANK_SESSION
from .reporting import metrics
from .wire.role import Role, role_of


def pytest_addoption(parser: pytest.Parser) -> None:
    options.add_options(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    role = role_of(early_config)
    role.plugin_class.prepare(early_config, role)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    role = role_of(config)
    role.plugin_class.before_configure(config, role)


@pytest.hookimpl(trylast=True)  # after the terminal reporter and the cache exist
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", marker.MARKER_HELP)
    config.addinivalue_line(
        "markers",
        "mfsdp_config(use_megatron_fsdp=None, set=(), megatron_fsdp_version=None, hybrid=False): "
        "run_config overrides for one test (wins over --mfsdp-use-megatron-fsdp / --mfsdp-set); "
        "megatron_fsdp_version=2 and hybrid=True skip where megatron-core lacks V2 / HybridModel",
    )
    role = role_of(config)
    values = config.stash[options.SESSION_VALUES] = options.check_at_configure(
        config, parent_checked=role.role is Role.LAUNCHED_RANK
    )
    config.stash[RANK_SESSION] = None
    plugin = role.plugin_class.create(config, role, values)
    config.pluginmanager.register(plugin, plugin.NAME)
    plugin.registered()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    values = options.session_values(config)
    role = role_of(config).role
    if role is Role.LAUNCHED_RANK:
        return  # its tests' settings come resolved in its parent's batch (RankRunner.select_batch)
    # plain mode: a foreign suite's tests run in rank sets, as marked tests do (under torchrun they
    # run on the session's own ranks)
    foreign = values.foreign_suite and role is Role.PARENT
    # a bad marker is a usage error, before any rank work
    marker.stash_specs(items, values.foreign_world_size if foreign else None)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    metrics.attach_to_report(item, report)  # the test's training-run records ride on its report
    if report.when == "call" and report.passed and not hasattr(report, "wasxfail"):
        _golden_values(item, report)
    return report


def _golden_values(item: pytest.Item, report: pytest.TestReport) -> None:
    """--mfsdp-golden, in the process that ran the test (a rank: its runs are recorded there, the
    same on every rank): record the golden file (rank 0 writes it), or compare with it and fail
    the test's call with one line per difference."""
    values = options.session_values(item.config)
    if values.golden is None:
        return
    from .fsdp import versions
    from .reporting import golden  # numpy: only where golden values are asked for

    torchrun = role_of(item.config).torchrun
    failures = golden.record_or_compare(
        Path(values.golden),
        versions.golden_stack(),
        item.nodeid,
        metrics.run_records(item),
        values.golden_mode,
        write=torchrun is None or torchrun.rank == 0,
    )
    if failures:
        report.outcome = "failed"
        report.longrepr = "\n".join(failures)
