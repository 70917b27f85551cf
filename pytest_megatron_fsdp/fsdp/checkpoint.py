"""fsdp_dtensor checkpoints of a Megatron-FSDP run: save, load, resume (Megatron-Bridge's layout).

Layout (what Bridge's ``verify_checkpoint_files`` checks)::

    <dir>/latest_checkpointed_iteration.txt   the last complete iteration, e.g. "5"
    <dir>/latest_train_state.pt               the train state of that iteration (plain data)
    <dir>/iter_0000005/.metadata              torch.distributed.checkpoint (DCP) metadata
    <dir>/iter_0000005/__<rank>_0.distcp      one shard file per rank
    <dir>/iter_0000005/train_state.pt         the train state, inside the iteration it belongs to

The DCP state dict is Megatron-LM's for ``ckpt_format=fsdp_dtensor``: ``model`` (the wrapped
model's DTensor state dict), ``optimizer`` (``DistributedOptimizer.sharded_state_dict(...,
metadata={"distrib_optim_sharding_type": "fsdp_dtensor"})``), both passed through
``preprocess_state_dict_for_uneven_dtensor``; plus each rank's RNG and data-stream state as tensors
under ``rng_state.rank_<r>`` (tensors only: DCP unpickles non-tensor values with
``weights_only=False``).

Atomic: every rank writes into ``iter_XXXXXXX.tmp-<uuid>``; only when all ranks report success
(a collective every rank reaches) does rank 0 rename it to ``iter_XXXXXXX`` and then replace the
train-state file and the tracker (write-temp + ``os.replace``). A failure anywhere, on any rank,
leaves the previous checkpoint the latest and raises :class:`CheckpointError` on every rank.

Loud: before any collective I/O, every rank checks the checkpoint (directory, tracker, iteration,
``.metadata``, shard sizes against the metadata, train state, tensor shapes against this model)
and the ranks agree on the problems through one collective, so every rank raises the same error
and none waits for another.

Trust: DCP's ``.metadata`` is a pickle. Load only checkpoints you (or your CI) wrote.

megatron is imported where it is used, so the file checks work (and are unit-tested) with torch only.
"""

from __future__ import annotations

import os
import random
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from .collectives import gather_problems
from .config import ConfigError, validate
from .layout import (
    FORMAT,
    LATEST_TRAIN_STATE_FILE,
    METADATA_FILE,
    TRACKER_FILE,
    TRAIN_STATE_FILE,
    checkpoint_size_bytes,
    iteration_dir_name,
    shard_file_name,
)

if TYPE_CHECKING:
    from .training import TrainingRun

OPTIMIZER_METADATA = {"distrib_optim_sharding_type": FORMAT}
#: what a rank catches to report to the others (DCP's CheckpointException is a BaseException)
_FAILURES = (Exception, CheckpointException)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message names the path and the problem."""


@dataclass(frozen=True)
class SavedCheckpoint:
    """Where :func:`save_checkpoint` put a checkpoint."""

    root: Path
    iteration: int

    @property
    def path(self) -> Path:
        return self.root / iteration_dir_name(self.iteration)


# --------------------------------------------------------------------------------------------
# agreement between ranks


def _preprocess(state_dict: dict[str, Any]) -> None:
    """Megatron-FSDP's chunk metadata for unevenly sharded DTensors (a collective per DTensor)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )

    preprocess_state_dict_for_uneven_dtensor(state_dict)


def _describe(exc: BaseException, limit: int = 1500) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[:limit] + " [...]"


def _strip_module(key: str) -> str:
    return key[len("module.") :] if key.startswith("module.") else key


def _raise_if_any(problems: list[str], what: str) -> None:
    if problems:
        raise CheckpointError(f"{what}: " + "; ".join(problems))


# --------------------------------------------------------------------------------------------
# the state dicts


def model_state_dict(run: TrainingRun) -> dict[str, Any]:
    state = run.model.state_dict()
    if getattr(run.model.config, "fp8", False):
        # Transformer Engine's opaque fp8 extra state is not a DTensor (Megatron-LM drops it too).
        state = {k: v for k, v in state.items() if not k.endswith("._extra_state")}
    return state


def _rank_state(run: TrainingRun) -> dict[str, torch.Tensor]:
    """This rank's RNGs and data-stream position, as tensors."""
    py_version, py_internal, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "torch_cpu": torch.get_rng_state(),
        "python": torch.tensor(list(py_internal), dtype=torch.int64),
        "python_meta": torch.tensor(
            [py_version, 0 if py_gauss is None else 1, 0.0 if py_gauss is None else py_gauss],
            dtype=torch.float64,
        ),
        "numpy_keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
        "numpy_meta": torch.tensor([np_pos, np_has_gauss, np_gauss], dtype=torch.float64),
        "data_stream": run.data_stream_state(),
    }
    if np_name != "MT19937":  # the only bit generator np.random's legacy state API has
        raise CheckpointError(f"numpy's global RNG is {np_name!r}, not MT19937: cannot save its state")
    if run.env.platform == "cuda":
        state["torch_cuda"] = torch.cuda.get_rng_state()
    from megatron.core import tensor_parallel

    for name, tracker_state in tensor_parallel.get_cuda_rng_tracker().get_states().items():
        state[f"tracker.{name}"] = tracker_state.cpu()
    return state


def _set_rank_state(run: TrainingRun, state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    version, has_gauss, gauss = state["python_meta"].tolist()
    random.setstate(
        (int(version), tuple(int(x) for x in state["python"].tolist()), gauss if has_gauss else None)
    )
    pos, np_has_gauss, np_gauss = state["numpy_meta"].tolist()
    np.random.set_state(
        ("MT19937", state["numpy_keys"].numpy().astype(np.uint32), int(pos), int(np_has_gauss), np_gauss)
    )
    if "torch_cuda" in state:
        torch.cuda.set_rng_state(state["torch_cuda"])
    tracker = {k[len("tracker.") :]: v for k, v in state.items() if k.startswith("tracker.")}
    if tracker:
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(tracker)
    run.load_data_stream_state(state["data_stream"])


def _rank_state_template(run: TrainingRun) -> dict[str, torch.Tensor]:
    # DCP loads tensors in place, so the template only needs the right shapes and dtypes.
    return {k: v.clone() for k, v in _rank_state(run).items()}


def _optimizer_state_dict(
    run: TrainingRun, model: dict[str, Any], *, is_loading: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The optimizer's fsdp_dtensor state dict, and the same with one key space on every rank.

    megatron-core 0.16's DistributedOptimizer only has state for parameters whose local shard
    is non-empty, so each rank's ``state`` names different parameters. DCP and
    ``preprocess_state_dict_for_uneven_dtensor`` need every rank to present the same DTensor keys
    in the same order (they run collectives per key); ranks that hold no shard of a parameter add
    an empty-shard placeholder for it (newer Megatron-FSDP does the same). Returns
    (the optimizer's own dict, the dict to hand to DCP); their per-parameter entries are shared.
    """
    own = run.optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=OPTIMIZER_METADATA)
    state = own["state"]
    template = next((v for v in state.values() if isinstance(v, dict) and "exp_avg" in v), None)
    uniform: dict[str, Any] = {}
    for name, param in run.model.named_parameters():
        if not param.requires_grad:
            continue
        if name in state:
            uniform[name] = state[name]
            continue
        shard = model.get(name[len("module.") :])  # the optimizer's names carry one more "module."
        if not isinstance(shard, DTensor):
            raise CheckpointError(f"parameter {name} has no DTensor in the model state dict")
        step = template["step"].clone() if template is not None else torch.zeros((), dtype=torch.float32)
        dtype = template["exp_avg"].dtype if template is not None else torch.float32
        uniform[name] = {
            "step": step,
            "exp_avg": torch.zeros_like(shard, dtype=dtype),
            "exp_avg_sq": torch.zeros_like(shard, dtype=dtype),
        }
    for name in state.keys() - uniform.keys():
        uniform[name] = state[name]
    return own, {"state": uniform, "param_to_group_meta": own["param_to_group_meta"]}


def _dcp_state_dict(run: TrainingRun, *, is_loading: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the state dict DCP saves or loads into, the optimizer's own state dict)."""
    model = model_state_dict(run)
    own, optimizer = _optimizer_state_dict(run, model, is_loading=is_loading)
    rank_state = _rank_state_template(run) if is_loading else _rank_state(run)
    state_dict = {
        "model": model,
        "optimizer": optimizer,
        "rng_state": {f"rank_{run.env.rank}": rank_state},
    }
    return state_dict, own


def _train_state(run: TrainingRun) -> dict[str, Any]:
    """Plain data only, so that it loads with ``torch.load(weights_only=True)``."""
    scheduler = getattr(run, "scheduler", None)
    return {
        "iteration": int(run.iteration),
        "ckpt_format": FORMAT,
        "world_size": int(run.env.world_size),
        "sharding_strategy": run.cfg.ddp.data_parallel_sharding_strategy,
        "seed": int(run.cfg.train.seed),
        # TrainingRun keeps a constant learning rate; a run with a scheduler saves its state here.
        "scheduler": None if scheduler is None else scheduler.state_dict(),
    }


def flatten_state(state: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    # DCP's own key scheme: nested dict keys joined with ".".
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from flatten_state(value, f"{name}.")
        else:
            yield name, value


# --------------------------------------------------------------------------------------------
# files


def _write_atomically(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_tracker(root: str | os.PathLike[str]) -> int:
    """The iteration ``latest_checkpointed_iteration.txt`` names; CheckpointError when unusable."""
    tracker = Path(root) / TRACKER_FILE
    try:
        text = tracker.read_text().strip()
    except FileNotFoundError:
        raise CheckpointError(f"{tracker} does not exist: {root} holds no completed checkpoint") from None
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{tracker} holds {text[:40]!r}, not an iteration number") from None


def _publish(root: Path, tmp_dir: Path, iteration: int, train_state: dict[str, Any]) -> None:
    """Rank 0, after every rank wrote its shard: make the checkpoint visible, tracker last."""
    _write_atomically(tmp_dir / TRAIN_STATE_FILE, lambda f: torch.save(train_state, f))
    final = root / iteration_dir_name(iteration)
    old = None
    if final.exists():  # saving the same iteration again: swap, then drop the old one
        old = root / f"{final.name}.old-{uuid.uuid4().hex}"
        os.rename(final, old)
    os.rename(tmp_dir, final)
    _fsync_dir(root)
    _write_atomically(root / LATEST_TRAIN_STATE_FILE, lambda f: torch.save(train_state, f))
    _write_atomically(root / TRACKER_FILE, lambda f: f.write(f"{iteration}\n".encode()))
    _fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# save


def save_checkpoint(run: TrainingRun, save_dir: str | os.PathLike[str] | None = None) -> SavedCheckpoint:
    """Save ``run`` at its current iteration into ``save_dir`` (default ``run.cfg.checkpoint.save``).

    Every rank calls it. Returns where the checkpoint is; raises :class:`ConfigError` (before
    touching the disk) for a config upstream rejects, and :class:`CheckpointError` on every rank
    when any rank failed, in which case the previous checkpoint stays the latest.
    """
    target = save_dir if save_dir is not None else run.cfg.checkpoint.save
    if target is None:
        raise ConfigError("no checkpoint directory: pass save_dir or set checkpoint.save")
    validate(run.cfg, run.env.world_size, purpose="save")
    started = time.perf_counter()
    root = Path(target)
    iteration = int(run.iteration)
    rank0 = run.env.rank == 0

    # Phase 1, local: the directories and the state dict (no collectives yet, so a failure here
    # cannot leave another rank waiting inside DCP).
    tmp_name = f"{iteration_dir_name(iteration)}.tmp-{uuid.uuid4().hex}"
    names: list[str] = [tmp_name]
    dist.broadcast_object_list(names, src=0)  # one temp dir for all ranks: rank 0's name
    tmp_dir = root / names[0]
    problem = None
    state_dict: dict[str, Any] = {}
    try:
        if rank0:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp_dir.mkdir(mode=0o700)
        state_dict, _ = _dcp_state_dict(run, is_loading=False)
    except _FAILURES as exc:
        problem = f"rank {run.env.rank}: preparing the save failed: {_describe(exc)}"
    problems = gather_problems(problem)

    # Phase 2, collective: DCP writes the shards and (rank 0) the metadata. DCP gathers every
    # rank's write result, so a failure on one rank raises on all of them.
    if not problems:
        try:
            _preprocess(state_dict)
            dcp.save(state_dict, checkpoint_id=tmp_dir)
        except _FAILURES as exc:
            problem = f"rank {run.env.rank}: writing the shards failed: {_describe(exc)}"
        problems = gather_problems(problem)

    # Phase 3, rank 0: publish (rename, train state, tracker last); the others learn the outcome.
    if not problems and rank0:
        try:
            _publish(root, tmp_dir, iteration, _train_state(run))
        except _FAILURES as exc:
            problem = f"rank 0: publishing the checkpoint failed: {_describe(exc)}"
    if not problems:
        problems = gather_problems(problem)
    if problems:
        if rank0:
            shutil.rmtree(tmp_dir, ignore_errors=True)  # never visible; nothing a load would accept
        _raise_if_any(problems, f"saving iteration {iteration} to {root} failed (previous checkpoint kept)")
    saved = SavedCheckpoint(root, iteration)
    run.notify_checkpoint(
        bytes=checkpoint_size_bytes(root / iteration_dir_name(iteration)),
        save_s=time.perf_counter() - started,
    )
    return saved


# --------------------------------------------------------------------------------------------
# checks and load


def checkpoint_problems(
    root: str | os.PathLike[str], iteration: int | None = None, world_size: int | None = None
) -> tuple[int | None, list[str]]:
    """What is wrong with the checkpoint in ``root`` (at ``iteration``, default: the tracker's).

    Local (no collectives), reads only. Returns the iteration and a list of problems, each naming
    the path: Bridge's ``verify_checkpoint_files`` and more (shard sizes against the metadata).
    """
    root = Path(root)
    if not root.is_dir():
        return iteration, [f"checkpoint directory {root} does not exist"]
    if iteration is None:
        try:
            iteration = read_tracker(root)
        except CheckpointError as exc:
            return None, [str(exc)]
    iter_dir = root / iteration_dir_name(iteration)
    if not iter_dir.is_dir():
        return iteration, [f"{root / TRACKER_FILE} names iteration {iteration} but {iter_dir} does not exist"]
    problems: list[str] = []
    metadata_path = iter_dir / METADATA_FILE
    if not metadata_path.is_file():
        return iteration, [f"{metadata_path} is missing: {iter_dir} is not a complete DCP checkpoint"]
    try:
        metadata = dcp.FileSystemReader(iter_dir).read_metadata()
    except _FAILURES as exc:
        return iteration, [f"{metadata_path} cannot be read ({_describe(exc)})"]
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    expected = {shard_file_name(r) for r in range(world_size)} if world_size else set()
    for name in sorted(expected - set(needed)):
        problems.append(f"{iter_dir / name} is not in {metadata_path}: saved by another world size?")
    for name, end in sorted(needed.items()):
        shard = iter_dir / name
        if not shard.is_file():
            problems.append(f"{shard} is missing (named in {metadata_path})")
        elif shard.stat().st_size < end:
            problems.append(
                f"{shard} is truncated: {shard.stat().st_size} bytes, {metadata_path} needs at least {end}"
            )
    train_state_path = iter_dir / TRAIN_STATE_FILE
    try:
        train_state = torch.load(train_state_path, weights_only=True)
        if train_state.get("iteration") != iteration or train_state.get("ckpt_format") != FORMAT:
            problems.append(
                f"{train_state_path} says iteration {train_state.get('iteration')!r}, "
                f"format {train_state.get('ckpt_format')!r}; expected {iteration}, {FORMAT!r}"
            )
    except _FAILURES as exc:
        problems.append(f"{train_state_path} cannot be read ({_describe(exc)})")
    return iteration, problems


def _shape_problems(iter_dir: Path, state_dict: dict[str, Any]) -> list[str]:
    """Keys and global shapes this run expects that the checkpoint's metadata lacks or differs in."""
    metadata = dcp.FileSystemReader(iter_dir).read_metadata()
    saved = metadata.state_dict_metadata
    problems: list[str] = []
    for key, value in flatten_state(state_dict):
        if not isinstance(value, torch.Tensor):
            continue
        if key not in saved:
            problems.append(f"{key} is not in the checkpoint")
            continue
        have = tuple(getattr(saved[key], "size", ()))
        want = tuple(value.shape)  # a DTensor's shape is the global one
        if have != want:
            problems.append(f"{key} has shape {list(have)} in the checkpoint, this model has {list(want)}")
    if problems:
        shown = problems[:5] + ([f"... {len(problems) - 5} more"] if len(problems) > 5 else [])
        return [f"{iter_dir} does not match this model: " + "; ".join(shown)]
    return []


def load_checkpoint(
    run: TrainingRun, load_dir: str | os.PathLike[str] | None = None, iteration: int | None = None
) -> int:
    """Load the checkpoint in ``load_dir`` (default ``run.cfg.checkpoint.load``) into ``run``.

    Every rank calls it. Loads the model weights (made live at once, not at the next step), the
    optimizer state, every rank's RNGs and data-stream position, and the iteration; returns the
    iteration. Raises :class:`ConfigError` (before touching the disk) or :class:`CheckpointError`
    on every rank, with the path and the problem; a bad checkpoint leaves ``run`` unchanged.
    """
    source = load_dir if load_dir is not None else run.cfg.checkpoint.load
    if source is None:
        raise ConfigError("no checkpoint directory: pass load_dir or set checkpoint.load")
    validate(run.cfg, run.env.world_size, purpose="load")
    started = time.perf_counter()
    root = Path(source)

    # Every rank checks (reads only), then one collective: the same verdict everywhere.
    problem = None
    found = iteration
    try:
        found, problems = checkpoint_problems(root, iteration, run.env.world_size)
        if not problems:
            problems = _shape_problems(root / iteration_dir_name(found), {"model": model_state_dict(run)})
        problem = "; ".join(problems) or None
    except _FAILURES as exc:
        problem = f"checking {root} failed: {_describe(exc)}"
    _raise_if_any(gather_problems(problem), f"cannot load a checkpoint from {root}")
    assert found is not None
    iter_dir = root / iteration_dir_name(found)

    # The collective load. The optimizer's is_loading state dict allocates Adam's state (a zero
    # step) so DCP has tensors to load into, as Megatron-LM does.
    problem = None
    state_dict: dict[str, Any] = {}
    optimizer_state: dict[str, Any] = {}
    try:
        state_dict, optimizer_state = _dcp_state_dict(run, is_loading=True)
        _preprocess(state_dict)
    except _FAILURES as exc:
        problem = f"rank {run.env.rank}: preparing the load failed: {_describe(exc)}"
    _raise_if_any(gather_problems(problem), f"loading {iter_dir} failed")
    try:
        dcp.load(state_dict, checkpoint_id=iter_dir)
        # DCP wrote into the DTensors in place; load_state_dict runs Megatron-FSDP's post-load
        # hook, which copies the loaded main weights into the weights the forward pass uses
        # (without it they stay inactive until the first optimizer step: Bridge bug #3397).
        # (FullyShardedDataParallel.load_state_dict adds back the "module." its state_dict adds.)
        run.model.load_state_dict({_strip_module(k): v for k, v in state_dict["model"].items()})
        if run.cfg.ddp.data_parallel_sharding_strategy != "no_shard":
            # Drop parameter buckets all-gathered before the load (the optimizer step prefetches
            # the next forward's): else a run that trained before loading computes its next
            # forward with the old weights. no_shard gathers nothing (it has no weight buffer).
            run.model.module.synchronize_param_gather()
        run.optimizer.load_state_dict(optimizer_state)
        _set_rank_state(run, state_dict["rng_state"][f"rank_{run.env.rank}"])
        train_state = torch.load(iter_dir / TRAIN_STATE_FILE, weights_only=True)
        run.iteration = int(train_state["iteration"])
        scheduler = getattr(run, "scheduler", None)
        if scheduler is not None and train_state.get("scheduler") is not None:
            scheduler.load_state_dict(train_state["scheduler"])
    except _FAILURES as exc:
        problem = f"rank {run.env.rank}: {_describe(exc)}"
    _raise_if_any(gather_problems(problem), f"loading {iter_dir} failed")
    run.notify_checkpoint(load_s=time.perf_counter() - started)
    return found
