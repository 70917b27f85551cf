"""pytest entry point (``pytest11``): hooks only; decides which side this process is.

* Under torchrun (``RANK``/``WORLD_SIZE`` set) this process is a rank: ``harness.rank`` runs its
  tests with the other ranks, ``harness.session`` holds the process group.
* Otherwise it is a plain pytest session: ``harness.controller`` runs each distributed test in a
  rank set it launches through torchrun (``harness.launcher``), and reports it here like any other test.

Kept light on purpose: loading the plugin imports neither torch nor megatron. They load only
where a collected test needs them.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from . import marker, options
from .fixtures import (  # noqa: F401  (fixtures)
    checkpoint_dir,
    dist_env,
    fully_shard_run,
    megatron_fsdp_run,
    megatron_parallel,
    run_config,
)
from .fsdp import versions
from .harness import protocol
from .harness.controller import Controller, install_signal_handlers, plan_platforms, remember_items
from .harness.gpu_slices import GpuSliceError
from .harness.platform import PlatformChoice, select_platform
from .harness.rank import RankPlugin
from .harness.session import RANK_SESSION, RankSession, TorchrunEnv, check_collectives
from .reporting import metrics


class _EmulatedDeviceWarning(logging.Filter):
    """Drops one known log line in CPU ranks, the emulation's own doing: Megatron-FSDP is given
    ``device=cpu`` while the emulated ``torch.cuda.current_device()`` answers 0, so every wrapper
    logs "Megatron-FSDP is using device cpu instead of the current device cuda:0 ...". Any other
    record (another device, another message) passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return (
            "Megatron-FSDP is using device cpu instead of the current device cuda:0"
            not in record.getMessage()
        )


EMULATED_DEVICE_WARNING = _EmulatedDeviceWarning()
#: where Megatron-FSDP's wrapper logs it: megatron-core's bundled copy, and the standalone package
MEGATRON_FSDP_LOGGERS = (
    "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp",
    "megatron_fsdp.megatron_fsdp",
)

_RANK_PLUGIN = "mfsdp-rank"
#: a torchrun-mode rank's private temp tree (pytest's basetemp, torch's inductor cache), removed at exit
_RANK_TEMP = pytest.StashKey[Path]()


def _private_temp(config: pytest.Config, torchrun: TorchrunEnv) -> None:
    """Give a torchrun-mode rank a temp tree of its own in ``$TMPDIR``, removed when it ends.

    Importing megatron-core 0.19 makes torch's inductor cache dir (``$TMPDIR/torchinductor_<user>``),
    and pytest's basetemp would be ``$TMPDIR/pytest-of-<user>``: both would stay behind after every
    run. Set before any conftest or test module imports megatron; a cache dir the user chose
    (``TORCHINDUCTOR_CACHE_DIR``) is kept as it is.
    """
    private = Path(tempfile.mkdtemp(prefix=f"mfsdp-rank{torchrun.rank}-"))
    config.stash[_RANK_TEMP] = private
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(private / "torchinductor"))


_CONTROLLER = "mfsdp-controller"
PLATFORM = pytest.StashKey[PlatformChoice]()
_RESTORE_SIGNALS = pytest.StashKey[Callable[[], None]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    options.add_options(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    # In a torchrun rank the platform is decided before any conftest or test module is imported:
    # a CPU rank needs the CUDA emulation in place before anything imports megatron.
    torchrun = TorchrunEnv.from_environ()
    if torchrun is None:
        return
    # First what can refuse to start (a bad value, no GPU): a usage error here ends the rank
    # without pytest_unconfigure, which would leave the private temp tree below behind.
    debug_collectives = options.resolve(early_config, "debug-collectives")
    choice = select_platform(options.resolve(early_config, "platform"), torchrun.local_world_size)
    if not protocol.launched_by_parent(early_config):
        _private_temp(early_config, torchrun)
    if debug_collectives:
        # before any conftest or test module can create a process group or read the setting
        check_collectives(os.environ)
    if choice.platform == "cpu":
        from .harness import cuda_emulation

        cuda_emulation.enable()
        for name in MEGATRON_FSDP_LOGGERS:
            logging.getLogger(name).addFilter(EMULATED_DEVICE_WARNING)
    early_config.stash[PLATFORM] = choice


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    torchrun = TorchrunEnv.from_environ()
    if torchrun is not None and torchrun.rank != 0:
        # One JUnit file per run: rank 0's (it carries every rank's outcome); two ranks writing
        # the same path could interleave.
        config.option.xmlpath = None
    if torchrun is not None and protocol.launched_by_parent(config):
        # A rank of a set this plugin launched: its own pytest temp dir inside the batch's working
        # dir (two ranks must not share one basetemp; the parent removes the batch dir). Set before
        # pytest_configure, where pytest reads it.
        config.option.basetemp = str(protocol.batch_dir(config) / f"tmp-rank{torchrun.rank}")
    elif torchrun is not None:
        # torchrun mode: every rank would number its own pytest-of-<user>/pytest-N in $TMPDIR (racing
        # the others) and leave it. An explicit --basetemp is split per rank and kept; otherwise the
        # rank's private temp tree holds it and goes at the session's end.
        if config.option.basetemp:
            given = Path(config.option.basetemp)
            given.mkdir(parents=True, exist_ok=True)  # pytest makes the rank's dir, not its parents
            config.option.basetemp = str(given / f"rank{torchrun.rank}")
        else:
            config.option.basetemp = str(config.stash[_RANK_TEMP] / "basetemp")


@pytest.hookimpl(trylast=True)  # after the terminal reporter and the cache exist
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", marker.MARKER_HELP)
    config.addinivalue_line(
        "markers",
        "mfsdp_config(use_megatron_fsdp=None, set=(), megatron_fsdp_version=None, hybrid=False): "
        "run_config overrides for one test (wins over --mfsdp-use-megatron-fsdp / --mfsdp-set); "
        "megatron_fsdp_version=2 and hybrid=True skip where megatron-core lacks V2 / HybridModel",
    )
    values = config.stash[options.OPTION_VALUES] = options.check_all(config)
    config.stash[RANK_SESSION] = None
    torchrun = TorchrunEnv.from_environ()
    if torchrun is not None and not protocol.launched_by_parent(config):
        options.refuse_plain_mode_only(config)
    if torchrun is not None:
        rank_plugin = RankPlugin(
            config,
            torchrun,
            lambda: protocol.log_dir(config, values["log-dir"], "torchrun"),
            agreement_timeout_s=values["pg-timeout"],
            default_timeout_s=values["timeout"],
            distributed_logs=values["distributed-logs"],
            private_temp=config.stash.get(_RANK_TEMP, None),
        )
        config.pluginmanager.register(rank_plugin, _RANK_PLUGIN)
    else:
        controller = Controller(config, options.forwarded_args(config), values["log-dir"])
        config.pluginmanager.register(controller, _CONTROLLER)
        if threading.current_thread() is threading.main_thread():
            config.stash[_RESTORE_SIGNALS] = install_signal_handlers(controller)


def pytest_itemcollected(item: pytest.Item) -> None:
    # Plain mode: the first distributed test collected starts its rank set, whose ranks import
    # torch while this session collects the rest (its batch follows when the session reaches it).
    controller = item.config.pluginmanager.get_plugin(_CONTROLLER)
    if controller is None or item.get_closest_marker(protocol.MARKER) is None:
        return
    try:
        spec = marker.parse(item)
    except pytest.UsageError:
        return  # reported with every other marker at the end of collection
    controller.prestart(spec.world_size)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marker.stash_specs(items)  # a bad marker is a usage error, before any rank work
    torchrun = TorchrunEnv.from_environ()
    if torchrun is None:
        return
    for item in items:
        spec = protocol.spec_of(item)
        if spec is not None and torchrun.world_size != spec.world_size:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"needs world_size={spec.world_size}; this torchrun session has "
                    f"{torchrun.world_size} ranks"
                )
            )


def _needs_rank_session(session: pytest.Session) -> bool:
    return any(
        protocol.spec_of(item) is not None and not any(m.name == "skip" for m in item.iter_markers())
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
    values = config.stash[options.OPTION_VALUES]
    shared_root = values["shared-dir"]
    if shared_root is None and protocol.launched_by_parent(config):
        # Inside the batch's working dir, which the parent removes even if this rank set is killed.
        shared_root = str(protocol.batch_dir(config))
    rank_session = RankSession.start(
        torchrun, config.stash[PLATFORM], pg_timeout_s=values["pg-timeout"], shared_root=shared_root
    )
    config.stash[RANK_SESSION] = rank_session
    config.pluginmanager.get_plugin(_RANK_PLUGIN).check_same_collection(session, rank_session)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and torchrun.rank == 0:
        reporter.write_line(rank_session.header(versions.stack_description()))
        if missing := versions.missing_features_line():
            reporter.write_line(missing)


def _plan_plain_session(session: pytest.Session) -> None:
    config = session.config
    remember_items(config, session.items)
    distributed = [i for i in session.items if protocol.spec_of(i) is not None]
    if not distributed:
        config.pluginmanager.get_plugin(_CONTROLLER).close_all()  # a prestarted rank set, deselected
        return
    controller = config.pluginmanager.get_plugin(_CONTROLLER)
    lines = plan_platforms(controller, config.stash[options.OPTION_VALUES]["platform"], distributed)
    try:
        gpu_slice = controller.plan_gpu_slice()  # pytest-xdist workers on a GPU node: their own GPUs
    except GpuSliceError as exc:
        # Raised in a pytest-xdist worker, a usage error would end the worker unseen. As a failed
        # collection it reaches the controller, which shows it once (identical ones from the other
        # workers are dropped), and no worker runs anything.
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
        )
        if missing := versions.missing_features_line():
            reporter.write_line(missing)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    metrics.attach_to_report(item, report)  # the test's training-run records ride on its report
    if report.when == "call" and report.passed and not hasattr(report, "wasxfail"):
        _golden_values(item, report)
    return report


def _golden_values(item: pytest.Item, report: pytest.TestReport) -> None:
    """--mfsdp-golden, in the process that ran the test (a rank: its runs are recorded there, the
    same on every rank): record the golden file (rank 0 writes it), or compare with it and fail
    the test's call with one line per difference."""
    values = item.config.stash[options.OPTION_VALUES]
    if values["golden"] is None:
        return
    from .reporting import golden  # numpy: only where golden values are asked for

    torchrun = TorchrunEnv.from_environ()
    failures = golden.record_or_compare(
        Path(values["golden"]),
        versions.golden_stack(),
        item.nodeid,
        metrics.run_records(item),
        values["golden-mode"],
        write=torchrun is None or torchrun.rank == 0,
    )
    if failures:
        report.outcome = "failed"
        report.longrepr = "\n".join(failures)


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    rank_session = config.stash.get(RANK_SESSION, None)
    if rank_session is not None:
        config.stash[RANK_SESSION] = None
        rank_session.close()
    controller = config.pluginmanager.get_plugin(_CONTROLLER)
    if controller is not None:
        controller.close_all()


def pytest_unconfigure(config: pytest.Config) -> None:
    controller = config.pluginmanager.get_plugin(_CONTROLLER)
    if controller is not None:
        controller.close_all()  # also after an interrupted session: no rank set outlives pytest
    private = config.stash.get(_RANK_TEMP, None)
    if private is not None:
        shutil.rmtree(private, ignore_errors=True)
    restore = config.stash.get(_RESTORE_SIGNALS, None)
    if restore is not None:
        restore()
    if config.stash.get(PLATFORM, None) is not None and config.stash[PLATFORM].platform == "cpu":
        from .harness import cuda_emulation

        cuda_emulation.disable()
        for name in MEGATRON_FSDP_LOGGERS:
            logging.getLogger(name).removeFilter(EMULATED_DEVICE_WARNING)


def _shows_the_summary(config: pytest.Config, torchrun: TorchrunEnv | None) -> bool:
    if protocol.launched_by_parent(config):
        return False  # a launched rank set: the parent session shows and writes everything
    if hasattr(config, "workerinput"):
        return False  # a pytest-xdist worker: its reports go to the controller, which shows them
    return torchrun is None or torchrun.rank == 0  # other ranks must not overwrite rank 0's report


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    torchrun = TorchrunEnv.from_environ()
    if not _shows_the_summary(config, torchrun):
        return
    from .reporting import report  # plain Python, no torch

    values = config.stash[options.OPTION_VALUES]
    reports = [r for category in terminalreporter.stats.values() for r in category]
    json_path, plot_path = (_in_invocation_dir(config, values[name]) for name in ("report-json", "plot"))
    report.terminal_summary(
        terminalreporter,
        metrics.records_from_reports(reports),
        "plain" if torchrun is None else "torchrun",
        json_path,
        plot_path,
    )


def _in_invocation_dir(config: pytest.Config, raw: str | None) -> Path | None:
    if not raw:
        return None
    path = Path(raw)
    return path if path.is_absolute() else Path(config.invocation_params.dir) / path
