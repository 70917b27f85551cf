"""Fixtures a distributed test uses. Importing this module imports neither torch nor megatron."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

from .config import RunConfig
from .environment import DistEnv
from .presets import DEFAULT_PRESET
from .state import SESSION, distributed_marker

if TYPE_CHECKING:
    from .training import TrainingRun, TrainResult


def _rank_session(request: pytest.FixtureRequest):
    session = request.config.stash.get(SESSION, None)
    if session is None:
        pytest.fail(
            "dist_env needs a running rank session: mark the test "
            "@pytest.mark.distributed(world_size=N) and run it under "
            "python -m torch.distributed.run --nproc_per_node=N -m pytest",
            pytrace=False,
        )
    return session


@pytest.fixture
def dist_env(request: pytest.FixtureRequest) -> DistEnv:
    """This rank's view of the running process group (torch.distributed only, no megatron)."""
    return _rank_session(request).env


@pytest.fixture
def megatron_parallel(request: pytest.FixtureRequest, dist_env: DistEnv) -> DistEnv:
    """Megatron's model-parallel state, up for the test with every rank seeded identically.

    Sizes come from the marker (``tp=``, ``pp=``, ``cp=``); seeds (``model_parallel_cuda_manual_seed``
    included) are reset for every test, so tests do not leak into each other. The state itself is
    kept for the next test with the same sizes (building it makes 17 process groups; see
    ``training.initialize_model_parallel``) and torn down with the process group: at the session's
    end, and when a failed test renews the group.
    """
    from . import training

    marker = distributed_marker(request.node)
    cfg = RunConfig()
    cfg.model.tensor_model_parallel_size = marker.tp
    cfg.model.pipeline_model_parallel_size = marker.pp
    cfg.model.context_parallel_size = marker.cp
    training.initialize_model_parallel(cfg)
    return dist_env


@pytest.fixture
def run_config(request: pytest.FixtureRequest, megatron_parallel: DistEnv) -> RunConfig:
    """A fresh Bridge-shaped config with Megatron-FSDP on (the seed's minimal override).

    The preset is ``--mfsdp-preset`` or the platform's default (tiny on CPU, the Bridge reference
    model on GPUs); tp/pp/cp follow the test's marker.
    """
    from .config import ConfigError, disable_megatron_fsdp, enable_megatron_fsdp
    from .options import resolve

    marker = distributed_marker(request.node)
    cfg = enable_megatron_fsdp(RunConfig())
    cfg.model.preset = resolve(request.config, "preset") or DEFAULT_PRESET[megatron_parallel.platform]
    cfg.model.tensor_model_parallel_size = marker.tp
    cfg.model.pipeline_model_parallel_size = marker.pp
    cfg.model.context_parallel_size = marker.cp
    # --mfsdp-use-megatron-fsdp / --mfsdp-set, or @pytest.mark.mfsdp_config(use_megatron_fsdp=, set=)
    config_marker = request.node.get_closest_marker("mfsdp_config")
    kwargs = dict(config_marker.kwargs) if config_marker else {}
    if not resolve(request.config, "use-megatron-fsdp", kwargs.get("use_megatron_fsdp")):
        disable_megatron_fsdp(cfg)
        if megatron_parallel.platform == "cpu":
            # Megatron DDP + DistributedOptimizer fails a torch.cuda type check on CPU ranks.
            cfg.ddp.use_distributed_optimizer = False
    for assignment in resolve(request.config, "set", kwargs.get("set")):
        try:
            cfg.assign(assignment)
        except ConfigError as exc:  # only reachable from a marker: CLI/env/ini fail at configure time
            pytest.fail(f"{request.node.nodeid}: mfsdp_config marker: {exc}", pytrace=False)
    return cfg


@pytest.fixture
def megatron_fsdp_run(
    request: pytest.FixtureRequest, megatron_parallel: DistEnv, run_config: RunConfig
) -> Iterator[Callable[..., TrainingRun]]:
    """Factory: ``megatron_fsdp_run(cfg=None)`` builds the GPT, Megatron-FSDP and its optimizer.

    ``run.train(n)`` returns a :class:`TrainResult`; each result is measured (reduced across ranks)
    and recorded for the session summary, the JSON report and JUnit properties.
    """
    from . import metrics
    from .training import TrainingRun

    runs: list[TrainingRun] = []

    def build(cfg: RunConfig | None = None) -> TrainingRun:
        run = TrainingRun(cfg or run_config, megatron_parallel)
        runs.append(run)
        metrics.register_run(run, request)

        def record(result: TrainResult) -> None:
            # Called on every rank after train(): the cross-rank reductions are collectives, so all
            # ranks take part; only rank 0 keeps the record.
            metrics.record_result(request, run, result)

        run.on_result = record
        return run

    try:
        yield build
    finally:
        for run in runs:
            run.close()
