"""What every training run is, whichever API built it: the :class:`Run` protocol.

Three kinds of run exist: :class:`~.training.TrainingRun` (megatron-core's GPT, wrapped as
Megatron-Bridge wraps it), :class:`~.fully_shard.FullyShardRun` (the standalone
``megatron_fsdp.fully_shard`` on a model the test brings) and :class:`~.fully_shard_v2.FullyShardV2Run`
(V2's standalone API, likewise). The fixtures, the reports and the checkpoints work on any of them
through this protocol alone: a run names the checkpoint layout its state goes in and out of
(:class:`CheckpointLayout`), so checkpointing never asks what kind of run it was given.
:class:`RunBase` holds what all share (releasing the run, telling the observer).

Plain Python at import (no torch, no megatron, no pytest): the layouts and the reports type their
arguments with these protocols without importing a run's module.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from ..environment import DistEnv
    from .config import RunConfig
    from .presets import ModelPreset
    from .results import RunFacts, TrainResult

#: what a checkpoint is saved or loaded for (``validate(purpose=...)``)
SAVE = "save"
LOAD = "load"


class RunObserver(Protocol):
    """Told what a run measured (every rank calls both, at the same points)."""

    def on_result(self, run: Run, result: TrainResult) -> None:
        """After every ``train()``: may run collectives (every rank reaches it)."""

    def on_checkpoint(self, run: Run, figures: dict[str, float]) -> None:
        """After a save (``bytes``, ``save_s``) or a load (``load_s``); no collectives."""


class LoadedState(Protocol):
    """What a layout loads into: ``state_dict`` is the dict DCP fills in place."""

    state_dict: dict[str, Any]


class CheckpointLayout(Protocol):
    """How a run's state goes into and out of an fsdp_dtensor checkpoint (``fsdp.checkpoint``).

    A layout is a module (``megatron_layout``, ``fully_shard_layout``) whose functions take the run;
    ``fsdp.checkpoint`` does the files, the atomic publication and the verification around them.
    """

    def checkpoint_dir(self, run: Any, purpose: str) -> str | os.PathLike[str] | None:
        """Where ``purpose`` (:data:`SAVE` / :data:`LOAD`) goes when the caller names no directory."""

    def check(self, run: Any, purpose: str) -> None:
        """Raise ``ConfigError`` (before the disk is touched) for a run that cannot be checkpointed."""

    def local_save_state(self, run: Any) -> Any:
        """This rank's state for the save: no collectives, no changes to the run."""

    def save_state_dict(self, run: Any, local: Any) -> dict[str, Any]:
        """The state dict DCP saves (collective)."""

    def train_state(self, run: Any) -> dict[str, Any]:
        """The train state rank 0 writes beside the shards: plain data only (``weights_only`` loads)."""

    def train_state_without_file(self, iter_dir: Path, metadata: Metadata) -> dict[str, Any] | None:
        """The train state of a checkpoint another program wrote without a ``train_state.pt``, from
        its DCP entries (no collectives); None where the layout knows no such writer."""

    def load_state_dict(self, run: Any, metadata: Metadata) -> LoadedState:
        """What DCP loads into, built without changing the run (collective)."""

    def apply_loaded(self, run: Any, loaded: Any, metadata: Metadata, train_state: dict[str, Any]) -> None:
        """After DCP filled ``loaded``: make it the run's state, iteration included."""


class Run(Protocol):
    """A wrapped model, its optimizer and a training loop, on this rank's process group."""

    env: DistEnv
    #: optimizer steps taken (a loaded checkpoint sets it)
    iteration: int
    #: the wrapped model (None once closed)
    model: Any
    #: the optimizer that steps it (None once closed)
    optimizer: Any
    #: told of every result and checkpoint (the fixtures install a recorder)
    observer: RunObserver | None
    #: how its state is checkpointed
    checkpoint_layout: ClassVar[CheckpointLayout]

    def train(self, iterations: int) -> TrainResult: ...

    def facts(self) -> RunFacts: ...

    def parts(self) -> dict[str, object]:
        """What the run owns that must be gone after its test, by name (the fixtures watch them)."""
        ...

    def notify_checkpoint(self, **figures: float) -> None: ...

    def close(self, wait_collectives: bool = True) -> None: ...


class MegatronCoreRun(Run, Protocol):
    """A run of megatron-core's own stack (``TrainingRun``): what ``megatron_layout`` needs of it
    beyond :class:`Run`."""

    cfg: RunConfig
    #: the model's shape and training sizes, the config's changes applied
    preset: ModelPreset
    #: Megatron's OptimizerParamScheduler (None once closed)
    scheduler: Any
    #: samples per optimizer step over all data-parallel ranks
    global_batch_size: int

    def data_stream_state(self) -> Any: ...

    def load_data_stream_state(self, state: Any) -> None: ...


class RunBase:
    """What every run shares: its observer, and one way to release it."""

    env: DistEnv
    model: Any
    optimizer: Any
    observer: RunObserver | None = None
    #: the attributes :meth:`close` drops (a subclass adds what else holds the model or optimizer)
    released: ClassVar[tuple[str, ...]] = ("model", "optimizer")

    def parts(self) -> dict[str, object]:
        return {"model": self.model, "optimizer": self.optimizer}

    def notify_checkpoint(self, **figures: float) -> None:
        """Checkpoint figures (``bytes``, ``save_s``, ``load_s``) for the observer."""
        if self.observer is not None:
            self.observer.on_checkpoint(self, figures)  # type: ignore[arg-type]

    def close(self, wait_collectives: bool = True) -> None:
        """Release this run's model and optimizer (again: a no-op).

        First the collectives the wrapper left in flight (waited: ``wait_collectives=False`` after
        a failure that released the ranks from running collectives together) and the hooks that
        would keep the wrapper alive forever, and the tensors of the last forward's graph a module
        kept (``fsdp.release``), then the references
        (:attr:`released`): once the caller's are gone too, the garbage collector frees the model,
        its gradients and the optimizer state. Megatron's model-parallel state stays up for the
        next run or test with the same sizes; the rank session tears it down with the process group.
        """
        from .release import (
            release_autograd_graphs,
            release_grad_hooks,
            release_method_caches,
            wait_pending_collectives,
        )

        if wait_collectives:
            wait_pending_collectives(self.model)
        release_grad_hooks(self.model)
        release_method_caches(self.model)
        release_autograd_graphs(self.model)
        for name in self.released:
            setattr(self, name, None)
