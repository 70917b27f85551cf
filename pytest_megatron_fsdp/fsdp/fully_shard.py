"""The standalone Megatron-FSDP API, ``megatron_fsdp.fully_shard``, on a model the test brings.

``fully_shard(module, optimizer, ...)`` wraps any torch module (and rebinds the optimizer to the
sharded parameters); :class:`FullyShardRun` trains it on the test's batches and loss function and
returns the same :class:`TrainResult` as a megatron-core run, so the assertions, the metrics and the
reports work unchanged. :func:`train_with_torch_ddp` trains the same model under torch's
``DistributedDataParallel``: the baseline a sharded run must match.

Imports torch at module level and ``megatron_fsdp`` when a run is built (inside a rank only).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ..environment import DistEnv
from . import fully_shard_layout
from .collectives import data_parallel_mean
from .results import RunFacts, TrainResult, memory_in_use_bytes
from .run import CheckpointLayout, RunBase, RunObserver

#: ``loss_fn(model, batch) -> scalar loss tensor``
LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
#: the batches, in order: an iterable, or ``batches(iteration) -> batch`` (iteration counts from 0)
Batches = Iterable[Any] | Callable[[int], Any]


def batch_stream(batches: Batches) -> Callable[[int], Any]:
    if callable(batches):
        return batches
    iterator: Iterator[Any] = iter(batches)
    return lambda iteration: next(iterator)


def _counted_grads(parameters: Iterable[torch.nn.Parameter], env: DistEnv) -> Iterator[torch.Tensor]:
    """The gradient pieces this rank counts, so that over all ranks each element counts once: its
    own shards; a shard replicated along some mesh dimensions (no_shard, HSDP's outer dimension)
    only at coordinate 0 there; a whole tensor on every rank (torch DDP) only on rank 0."""
    from torch.distributed.tensor import DTensor, Replicate

    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            coordinate: Sequence[int] = grad.device_mesh.get_coordinate() or []
            replicated = [i for i, p in enumerate(grad.placements) if isinstance(p, Replicate)]
            if any(coordinate[i] != 0 for i in replicated):
                continue
            grad = grad.to_local()
        elif env.rank != 0:
            continue
        yield grad.detach()


def global_grad_norm(parameters: Iterable[torch.nn.Parameter], env: DistEnv) -> float:
    """The L2 norm of the whole model's gradient, however it is sharded (one all_reduce)."""
    total = torch.zeros((), dtype=torch.float64, device=env.device)
    for grad in _counted_grads(parameters, env):
        total += grad.double().square().sum()
    dist.all_reduce(total)
    return math.sqrt(float(total))


def global_num_zeros(parameters: Iterable[torch.nn.Parameter], env: DistEnv) -> float:
    """Zeros in the whole model's gradient, however it is sharded (one all_reduce): Megatron's
    ``num-zeros`` (``count_zeros_fp32``) for a run without Megatron's optimizer."""
    total = torch.zeros((), dtype=torch.int64, device=env.device)
    for grad in _counted_grads(parameters, env):
        total += grad.numel() - torch.count_nonzero(grad)
    dist.all_reduce(total)
    return float(total)


class StandaloneRun(RunBase):
    """What a run of the standalone API on a model the test brings shares (``fully_shard`` V1 here,
    V2 in :mod:`.fully_shard_v2`): every rank data-parallel, the loop of :func:`train_steps`, each
    result told to the observer, the facts the reports name it by."""

    env: DistEnv
    loss_fn: LossFn
    iteration: int
    #: the sharding strategy, as the reports name Megatron-FSDP's strategies
    strategy: str
    checkpoint_layout: ClassVar[CheckpointLayout]
    _batch: Callable[[int], Any]
    _model_name: str
    _tokens_per_batch: int

    def facts(self) -> RunFacts:
        world = self.env.world_size
        return RunFacts(
            platform=self.env.platform,
            preset=self._model_name,
            strategy=self.strategy,
            world_size=world,
            data_parallel_size=world,
            tokens_per_step=self._tokens_per_batch * world,
        )

    def train(self, iterations: int) -> TrainResult:
        """``iterations`` optimizer steps, one batch each, from :attr:`iteration` on; per-step
        figures as a megatron-core run."""
        if self.model is None or self.optimizer is None:
            raise RuntimeError(f"{type(self).__name__}.train() after close()")
        result = TrainResult(first_iteration=self.iteration + 1)
        train_steps(
            self.model,
            self.optimizer,
            self._batch,
            self.loss_fn,
            self.env,
            self.iteration,
            iterations,
            result,
        )
        self.iteration += iterations
        if self.observer is not None:
            self.observer.on_result(self, result)
        return result


#: ``fully_shard``'s ``zero_dp_strategy`` numbers, as the reports name the strategies
STRATEGY_NAMES = {0: "no_shard", 1: "optim", 2: "optim_grads", 3: "optim_grads_params"}


class FullyShardRun(StandaloneRun):
    """``megatron_fsdp.fully_shard(module, optimizer, **kwargs)``, then a training loop (a
    :class:`~.run.Run`; checkpointed as the wrapper's own state dicts, :mod:`.fully_shard_layout`).

    ``kwargs`` go to ``fully_shard`` unchanged (``zero_dp_strategy``, ``fsdp_unit_modules``,
    ``mixed_precision_policy``, ``device_mesh``, ``dp_shard_dim``, ``dp_outer_dim``,
    ``hybrid_fsdp_group``, ``outer_dp_sharding_strategy``, ...); ``device`` defaults to the rank's.
    """

    checkpoint_layout: ClassVar[CheckpointLayout] = fully_shard_layout

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        batches: Batches,
        loss_fn: LossFn,
        env: DistEnv,
        observer: RunObserver | None = None,
        tokens_per_batch: int = 0,
        **fully_shard_kwargs: Any,
    ) -> None:
        """``tokens_per_batch``: tokens in one rank's batch, for tokens/s (0: not reported)."""
        from megatron_fsdp import fully_shard

        self.env = env
        self.loss_fn = loss_fn
        self._batch = batch_stream(batches)
        #: told of every result (the fully_shard_run fixture records it), as for a TrainingRun
        self.observer = observer
        self.fully_shard_kwargs = dict(fully_shard_kwargs)
        strategy = self.fully_shard_kwargs.get("zero_dp_strategy", 3)
        self.strategy = STRATEGY_NAMES.get(strategy, str(strategy))
        fully_shard_kwargs.setdefault("device", torch.device(env.device))
        self._model_name = type(module).__name__
        self._tokens_per_batch = tokens_per_batch
        self.model, self.optimizer = fully_shard(module, optimizer, **fully_shard_kwargs)
        self.iteration = 0


def train_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Callable[[int], Any],
    loss_fn: LossFn,
    env: DistEnv,
    start: int,
    iterations: int,
    result: TrainResult,
) -> None:
    """The training loop every run of a model the test brings shares: ``iterations`` optimizer
    steps on ``batch(start)``, ``batch(start + 1)``, ..., each step's figures appended to ``result``.

    The wrappers sync the gradients by the end of backward (Megatron-FSDP's
    ``sync_model_each_microbatch``, the default; torch DDP's hooks); the grad norm and the zeros are
    counted there, before the optimizer steps (a wrapped optimizer's ``step()`` finishes anything
    still pending)."""
    for iteration in range(start, start + iterations):
        begin = time.perf_counter()
        model.train()
        optimizer.zero_grad()
        loss = loss_fn(model, batch(iteration))
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        grad_norm = global_grad_norm(model.parameters(), env)
        num_zeros = global_num_zeros(model.parameters(), env)
        optimizer.step()
        if env.platform == "cuda":
            torch.cuda.synchronize()
        result.step_times_s.append(time.perf_counter() - begin)
        local = float(loss.detach())
        result.local_losses.append(local)
        result.losses.append(data_parallel_mean(local, env.device))
        result.grad_norms.append(grad_norm)
        result.num_zeros.append(num_zeros)
        result.memory_bytes.append(memory_in_use_bytes(env.platform))


def train_with_torch_ddp(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Batches,
    loss_fn: LossFn,
    env: DistEnv,
    iterations: int,
) -> TrainResult:
    """The baseline: the same loop under ``torch.nn.parallel.DistributedDataParallel``."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(module, device_ids=None if env.platform == "cpu" else [env.local_rank])
    result = TrainResult()
    train_steps(model, optimizer, batch_stream(batches), loss_fn, env, 0, iterations, result)
    return result
