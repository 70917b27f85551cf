"""Every fixture a distributed test uses. Importing this module imports neither torch nor megatron."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import pytest

from . import options
from .environment import DistEnv, DistributedSpec
from .fsdp.config import RunConfig
from .rank.session import RANK_SESSION, RankSession
from .wire.protocol import spec_of

if TYPE_CHECKING:
    from .fsdp.fully_shard import FullyShardRun
    from .fsdp.fully_shard_v2 import FullyShardV2Run
    from .fsdp.release import RunWatch
    from .fsdp.run import Run, RunObserver
    from .fsdp.training import TrainingRun

P = ParamSpec("P")
R = TypeVar("R", bound="Run")


def _rank_session(request: pytest.FixtureRequest) -> RankSession:
    session = request.config.stash.get(RANK_SESSION, None)
    if session is None:
        pytest.fail(
            "dist_env needs a running rank session: mark the test "
            "@pytest.mark.distributed(world_size=N) and run it under "
            "python -m torch.distributed.run --nproc_per_node=N -m pytest",
            pytrace=False,
        )
    return session


def _spec(request: pytest.FixtureRequest) -> DistributedSpec:
    return spec_of(request.node) or DistributedSpec()


@pytest.fixture
def dist_env(request: pytest.FixtureRequest) -> DistEnv:
    """This rank's view of the running process group (torch.distributed only, no megatron)."""
    return _rank_session(request).env


@pytest.fixture
def megatron_parallel(request: pytest.FixtureRequest, dist_env: DistEnv) -> Iterator[DistEnv]:
    """Megatron's model-parallel state, up for the test with every rank seeded identically.

    Sizes come from the marker (``tp=``, ``pp=``, ``cp=``); seeds (``model_parallel_cuda_manual_seed``
    included) are reset for every test, so tests do not leak into each other. The state itself is
    kept for the next test with the same sizes (building it makes 17 process groups; see
    ``fsdp.parallel.initialize_model_parallel``) and dropped before the process group goes: at the
    session's end, and when a failed test renews the group. Megatron's scratch buffer, which that
    state would keep, is freed after each test.
    """
    from .fsdp import parallel

    spec = _spec(request)
    _rank_session(request).on_release(parallel.destroy_model_parallel)
    parallel.initialize_model_parallel(spec.tp, spec.pp, spec.cp, RunConfig().train.seed)
    yield dist_env
    parallel.release_scratch_memory()


@pytest.fixture
def run_config(request: pytest.FixtureRequest, megatron_parallel: DistEnv) -> RunConfig:
    """A fresh Bridge-shaped config with Megatron-FSDP on (Megatron-Bridge's minimal override).

    The preset is ``--mfsdp-preset`` or the platform's default (tiny on CPU, the Bridge reference
    model on GPUs); tp/pp/cp follow the test's marker. On CPU ranks without native bf16 (the
    session's CPU report, ``--mfsdp-cpu-speed``) a bf16 preset's step is its smaller one.
    """
    cpu = _rank_session(request).cpu
    slow_bf16 = cpu is not None and not cpu.verdict.native
    return build_run_config(request.node, megatron_parallel.platform, _spec(request), slow_bf16)


def build_run_config(
    item: pytest.Item, platform: str, spec: DistributedSpec, slow_bf16: bool = False
) -> RunConfig:
    """``run_config``'s value for ``item`` on ``platform``: the starting config
    (``fsdp.config.starting_config``) as the session's options and the test's own
    ``@pytest.mark.mfsdp_config(use_megatron_fsdp=, set=, megatron_fsdp_version=, hybrid=)`` make it,
    with the marker's tp/pp/cp (``slow_bf16``: ``train.slow_bf16_step``). For a test with no marker
    of its own it equals the config checked at configure time (``options.checked_starting_config``)."""
    from .fsdp.config import ConfigError, starting_config

    config = item.config
    try:
        cfg = starting_config(
            platform,
            preset=options.session_values(config).preset,
            use_megatron_fsdp=options.value_of(config, "use-megatron-fsdp", item).value,
            assignments=options.value_of(config, "set", item).value,
            tp=spec.tp,
            pp=spec.pp,
            cp=spec.cp,
            slow_bf16=slow_bf16,
        )
    except ConfigError as exc:  # only reachable from a marker: CLI/env/ini fail at configure time
        pytest.fail(f"{item.nodeid}: mfsdp_config marker: {exc}", pytrace=False)
    # the marker's choices win over --mfsdp-set, as its set= does; each skips where missing
    config_marker = item.get_closest_marker(options.CONFIG_MARKER)
    kwargs = dict(config_marker.kwargs) if config_marker else {}
    if kwargs.get("megatron_fsdp_version") is not None:
        use_megatron_fsdp_version(cfg, kwargs["megatron_fsdp_version"])
    if kwargs.get("hybrid"):
        use_hybrid_model(cfg)
    return cfg


def use_megatron_fsdp_version(cfg: RunConfig, version: int) -> RunConfig:
    """Megatron-FSDP ``version`` (1 or 2) for ``cfg``; skips the test, with the reason in one line,
    where the installed megatron-core has no V2. Also ``@pytest.mark.mfsdp_config(megatron_fsdp_version=2)``.
    """
    from .fsdp import versions

    if version == 2 and (problem := versions.megatron_fsdp_v2_problem()):
        pytest.skip(problem)
    cfg.ddp.megatron_fsdp_version = version
    return cfg


def use_hybrid_model(cfg: RunConfig) -> RunConfig:
    """The small model as a ``HybridModel`` (the ``tiny-hybrid`` preset: pattern ``*-*-``); skips the
    test, with the reason in one line, where megatron-core has no HybridModel. Also
    ``@pytest.mark.mfsdp_config(hybrid=True)``."""
    from .fsdp import versions

    if problem := versions.hybrid_model_problem():
        pytest.skip(problem)
    cfg.model.preset = "tiny-hybrid"
    return cfg


@pytest.fixture
def megatron_fsdp_run(
    request: pytest.FixtureRequest, megatron_parallel: DistEnv, run_config: RunConfig
) -> Iterator[Callable[..., TrainingRun]]:
    """Factory: ``megatron_fsdp_run(cfg=None, pre_wrap_hook=None)`` builds the GPT, Megatron-FSDP and
    its optimizer (``pre_wrap_hook(model)`` runs on the GPT before the wrapper, as Megatron-Bridge's
    pre-wrap hooks do, e.g. to freeze parameters).

    ``run.train(n)`` returns a :class:`TrainResult`; each result is measured (reduced across ranks)
    and recorded for the session summary, the JSON report and JUnit properties.
    """
    from .fsdp.training import TrainingRun

    def build(
        observer: RunObserver,
        cfg: RunConfig | None = None,
        pre_wrap_hook: Callable[[Any], None] | None = None,
    ) -> TrainingRun:
        return TrainingRun(
            cfg or run_config, megatron_parallel, observer=observer, pre_wrap_hook=pre_wrap_hook
        )

    yield from _run_factory(request, megatron_parallel, "run", build)


@pytest.fixture
def fully_shard_run(
    request: pytest.FixtureRequest, dist_env: DistEnv
) -> Iterator[Callable[..., FullyShardRun]]:
    """Factory for the standalone Megatron-FSDP API, on a model and optimizer the test brings:
    ``fully_shard_run(module, optimizer, batches, loss_fn, **fully_shard_kwargs)``.

    ``megatron_fsdp.fully_shard`` wraps them (kwargs passed through: ``zero_dp_strategy``,
    ``fsdp_unit_modules``, ``mixed_precision_policy``, mesh dims ...); ``run.train(n)`` returns the
    same :class:`TrainResult` as ``megatron_fsdp_run``'s runs and is recorded the same way. torch's
    RNG is seeded identically on every rank first, so modules the test builds agree across ranks.
    Skipped, with the reason in one line, where megatron-fsdp is missing or cannot run beside the
    installed megatron-core.
    """
    from .fsdp import versions

    def make(*args: Any, **kwargs: Any) -> FullyShardRun:
        from .fsdp.fully_shard import FullyShardRun

        return FullyShardRun(*args, **kwargs)

    yield from _standalone_run_factory(
        request, dist_env, versions.fully_shard_problem(), "fully_shard run", make
    )


@pytest.fixture
def fully_shard_v2_run(
    request: pytest.FixtureRequest, dist_env: DistEnv
) -> Iterator[Callable[..., FullyShardV2Run]]:
    """Factory for Megatron-FSDP V2's standalone API (``megatron_fsdp.experimental``) on a model the
    test brings: ``fully_shard_v2_run(module, optimizer, batches, loss_fn, units=..., strategy=...,
    mixed_precision_policy=...)``.

    ``optimizer(parameters)`` builds the optimizer on the sharded parameters (V2 shards in place, so
    the optimizer comes after); ``units(module)``: the modules sharded before the root, children
    before parents. ``run.train(n)`` returns the same :class:`TrainResult` as the other run fixtures,
    recorded the same way; the plugin's ``save_checkpoint``/``load_checkpoint`` take the run and
    write V2's own checkpoint format. torch's RNG is seeded identically on every rank first. Skipped,
    with the reason in one line, where megatron-core has no such API.
    """
    from .fsdp import versions

    def make(*args: Any, **kwargs: Any) -> FullyShardV2Run:
        from .fsdp.fully_shard_v2 import FullyShardV2Run

        return FullyShardV2Run(*args, **kwargs)

    yield from _standalone_run_factory(
        request, dist_env, versions.v2_fully_shard_problem(), "fully_shard V2 run", make
    )


def _standalone_run_factory(
    request: pytest.FixtureRequest,
    env: DistEnv,
    problem: str | None,
    label: str,
    make: Callable[..., R],
) -> Iterator[Callable[..., R]]:
    """The run factory of a standalone API (V1's or V2's ``fully_shard``): skipped with ``problem``
    where the API is missing; torch's RNG seeded identically on every rank, so the modules the test
    builds agree across ranks; ``make(module, optimizer, batches, loss_fn, env, observer=...,
    **kwargs)`` builds each run."""
    if problem is not None:
        pytest.skip(problem)
    import torch

    torch.manual_seed(RunConfig().train.seed)

    def build(
        observer: RunObserver, /, module: Any, optimizer: Any, batches: Any, loss_fn: Any, **kwargs: Any
    ) -> R:
        return make(module, optimizer, batches, loss_fn, env, observer=observer, **kwargs)

    yield from _run_factory(request, env, label, build)


def _run_factory(
    request: pytest.FixtureRequest,
    env: DistEnv,
    label: str,
    build: Callable[Concatenate[RunObserver, P], R],
) -> Iterator[Callable[P, R]]:
    """The one run factory behind the run fixtures: ``build(observer, *args, **kwargs)`` makes a
    :class:`~.fsdp.run.Run`; the factory yielded takes ``*args, **kwargs``. Each run is recorded
    (its results and checkpoints, for the reports), the parts it owns are watched (they must be
    gone after the test), and every run is closed when the test ends."""
    from .reporting.metrics import TestRecorder

    recorder = TestRecorder(request.node)
    runs: list[Run] = []
    watch = _watch_runs(request, env)

    def factory(*args: P.args, **kwargs: P.kwargs) -> R:
        run = build(recorder, *args, **kwargs)
        name = f"{label} {len(runs) + 1}"
        for part, value in run.parts().items():
            watch.watch(f"{name}'s {part}", value)
        recorder.started(run)
        runs.append(run)
        return run

    try:
        yield factory
    finally:
        _close_all(runs, _rank_session(request))


def _watch_runs(request: pytest.FixtureRequest, env: DistEnv) -> RunWatch:
    """What the test builds must be gone after it (checked once pytest has dropped the test's
    fixture values): a wrapper, module or optimizer still reachable, or on GPUs CUDA memory still
    allocated, is an error of the test naming the bytes."""
    from .fsdp.release import RunWatch, freeze_existing_objects

    freeze_existing_objects()  # before the first run: makes the check's gc.collect() cheap
    watch = RunWatch(env.device)

    def check() -> str | None:
        leftovers = watch.leftovers()
        return None if leftovers is None else f"megatron-fsdp: {leftovers.describe()}"

    _rank_session(request).after_test(check)
    return watch


def _close_all(runs: list[Run], session: RankSession) -> None:
    """Close every run, and forget them: the factory, which the test's fixture values hold until
    pytest drops them, must not keep them. A run waits for the collectives it left in flight only
    while the ranks still run collectives together (a failure may have released them)."""
    wait_collectives = bool(runs) and not session.collectives_released()
    errors = []
    for run in runs:
        try:
            run.close(wait_collectives=wait_collectives)
        except Exception as exc:  # noqa: BLE001 - the other runs are closed all the same
            errors.append(exc)
    runs.clear()
    if errors:
        raise errors[0]


@pytest.fixture
def checkpoint_dir(request: pytest.FixtureRequest, dist_env: DistEnv) -> Iterator[Path]:
    """A fresh private (0700) directory, the same path on every rank, removed after the test.

    It lies in the session's shared directory; its name comes from the test id, so every rank
    computes the same one without a collective. After a failure that released the process group
    the teardown skips its barrier (it could not complete) and leaves the directory to the
    session's end, when the shared directory goes.
    """
    import torch.distributed as dist

    session = _rank_session(request)
    digest = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:12]
    path = dist_env.shared_dir / f"ckpt-{digest}"
    if dist_env.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(mode=0o700)
        os.chmod(path, 0o700)  # whatever the umask: checkpoints are unpickled on load
    dist.barrier()  # bounded by the process-group timeout
    yield path
    if session.collectives_released():
        return
    dist.barrier()  # nobody removes it while another rank still reads it
    if dist_env.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
