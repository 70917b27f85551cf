"""fsdp_dtensor checkpoints of a Megatron-FSDP run: save, load, resume (issue #3).

Every test runs on 2 ranks and every rank asserts. Exactness: a checkpoint round trip is a
byte copy of the tensors, so states are compared with ``torch.equal`` on any device; losses after
a resume are exact on CPU ranks and compared with a small tolerance on GPUs, where cuBLAS and
attention kernels may reduce in a different order from one process to the next.
"""

from __future__ import annotations

import os
import random
import stat
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from pytest_megatron_fsdp import ConfigError
from pytest_megatron_fsdp.checkpoint import (
    CheckpointError,
    assert_states_differ,
    assert_states_equal,
    checkpoint_problems,
    load_checkpoint,
    save_checkpoint,
    state_snapshot,
)
from pytest_megatron_fsdp.fsdp import checkpoint as ckpt
from pytest_megatron_fsdp.fsdp import versions

pytestmark = pytest.mark.distributed(world_size=2)

#: a failed save or load must be reported within this many seconds, far below the process
#: group's timeout (120 s): nobody waited for a rank that had given up.
PROMPT_S = 30.0


def _other_seed(cfg):
    other = cfg.copy()
    other.train.seed = cfg.train.seed + 1
    return other


def _rngs() -> tuple:
    """This process's global RNG states (torch, Python, NumPy), comparable with ==."""
    return (
        torch.get_rng_state().tolist(),
        random.getstate(),
        np.random.get_state()[1].tolist(),
    )


def _same_everywhere(value) -> list:
    """Every rank's ``value`` (a collective that each rank reaches)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and mtime: what "nothing modified" compares."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
    }


def _on_rank0(dist_env, action) -> None:
    """Change the shared checkpoint on rank 0 only; the others wait until it is done."""
    if dist_env.rank == 0:
        action()
    dist.barrier()


# ---------------------------------------------------------------------------------------------
# 1 + 5: round trip, for every sharding strategy


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads", "optim", "no_shard"])
def test_round_trip_restores_every_tensor_exactly(megatron_fsdp_run, run_config, checkpoint_dir, strategy):
    run_config.ddp.data_parallel_sharding_strategy = strategy
    run = megatron_fsdp_run(run_config)
    run.train(3)
    saved = save_checkpoint(run, checkpoint_dir)
    assert saved.iteration == 3
    expected = state_snapshot(run)
    expected_rngs = _rngs()
    assert any(k.startswith("optimizer.") for k in expected), "no optimizer state to compare"

    fresh = megatron_fsdp_run(_other_seed(run_config))
    fresh.train(1)  # its own Adam state exists, so the load must overwrite it, not create it
    assert_states_differ(expected, state_snapshot(fresh))

    assert _rngs() != expected_rngs  # the fresh run seeded them differently
    assert load_checkpoint(fresh, checkpoint_dir) == 3
    assert _rngs() == expected_rngs
    assert fresh.iteration == 3
    assert_states_equal(expected, state_snapshot(fresh))


@pytest.mark.xfail(
    versions.no_shard_param_sync_bug(),
    strict=True,
    raises=AttributeError,
    reason=versions.NO_SHARD_PARAM_SYNC_BUG,
)
def test_no_shard_trains_without_param_gather_overlap(megatron_fsdp_run, run_config):
    run_config.ddp.data_parallel_sharding_strategy = "no_shard"
    run_config.ddp.overlap_param_gather = False
    megatron_fsdp_run(run_config).train(1)


# ---------------------------------------------------------------------------------------------
# 2 + 3: loaded weights are live; resuming is invisible


# optim_grads_params gathers sharded weights into buckets (reset after a load); no_shard has none.
@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
def test_loaded_weights_are_live_before_the_first_step(
    megatron_fsdp_run, run_config, checkpoint_dir, strategy
):
    run_config.ddp.data_parallel_sharding_strategy = strategy
    run = megatron_fsdp_run(run_config)
    run.train(5)
    save_checkpoint(run, checkpoint_dir)
    # forward_loss draws the next batch; the checkpoint holds the data stream's position, so the
    # loaded run draws the same batch.
    before = run.forward_loss()

    fresh = megatron_fsdp_run(_other_seed(run_config))
    fresh.train(1)
    load_checkpoint(fresh, checkpoint_dir)
    after = fresh.forward_loss()  # no optimizer step in between (Bridge bug #3397)
    if fresh.env.platform == "cpu":
        assert after == before, f"forward loss {after!r} after load, {before!r} before save"
    else:
        assert after == pytest.approx(before, rel=1e-5)


def test_resume_is_invisible(megatron_fsdp_run, run_config, checkpoint_dir):
    straight = megatron_fsdp_run(run_config)
    first = straight.train(5).losses
    save_checkpoint(straight, checkpoint_dir)  # saving must not disturb the run either
    rest = straight.train(5).losses

    resumed = megatron_fsdp_run(_other_seed(run_config))
    load_checkpoint(resumed, checkpoint_dir)
    second = resumed.train(5).losses

    assert resumed.iteration == straight.iteration == 10
    assert len(set(first + rest)) > 1  # the losses move, so equal lists mean equal training
    if resumed.env.platform == "cpu":
        assert second == rest, f"resumed {second} != uninterrupted {rest} (iterations 6-10)"
    else:
        assert second == pytest.approx(rest, rel=1e-4)


# ---------------------------------------------------------------------------------------------
# 4: layout (Bridge's verify_checkpoint_files) and privacy


def test_saved_layout_is_bridges(megatron_fsdp_run, run_config, checkpoint_dir, dist_env):
    run = megatron_fsdp_run(run_config)
    run.train(2)
    save_checkpoint(run, checkpoint_dir)
    run.train(3)
    save_checkpoint(run, checkpoint_dir)

    root = checkpoint_dir
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    train_state = torch.load(root / "latest_train_state.pt", weights_only=True)
    assert train_state["iteration"] == 5 and train_state["ckpt_format"] == "fsdp_dtensor"
    # every save kept, nothing else (no temp directories or files left behind)
    assert sorted(p.name for p in root.iterdir()) == [
        "iter_0000002",
        "iter_0000005",
        "latest_checkpointed_iteration.txt",
        "latest_train_state.pt",
    ]
    shards = [f"__{r}_0.distcp" for r in range(dist_env.world_size)]
    assert sorted(p.name for p in (root / "iter_0000005").iterdir()) == sorted(
        [".metadata", "digests.json", "train_state.pt", *shards]
    )
    assert checkpoint_problems(root) == (5, [])
    # the harness's checkpoint directories are private: DCP metadata is unpickled on load
    for path in (root, root / "iter_0000002", root / "iter_0000005"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, oct(path.stat().st_mode)


# ---------------------------------------------------------------------------------------------
# 6: bad input: a clear error on every rank, nothing modified on disk


def _damage(kind: str, root: Path, dist_env) -> None:
    iter_dir = root / "iter_0000001"
    if kind == "metadata missing":
        _on_rank0(dist_env, lambda: (iter_dir / ".metadata").unlink())
    elif kind == "shard truncated":

        def truncate() -> None:
            shard = iter_dir / "__1_0.distcp"
            os.truncate(shard, shard.stat().st_size // 2)

        _on_rank0(dist_env, truncate)
    elif kind == "tracker points at a missing iteration":
        _on_rank0(dist_env, lambda: (root / "latest_checkpointed_iteration.txt").write_text("7\n"))


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("directory missing", r"checkpoint directory \S*does-not-exist does not exist"),
        ("metadata missing", r"iter_0000001/\.metadata is missing"),
        ("shard truncated", r"iter_0000001/__1_0\.distcp is truncated: \d+ bytes, \S+ needs at least \d+"),
        (
            "tracker points at a missing iteration",
            r"latest_checkpointed_iteration\.txt names iteration 7 but \S+/iter_0000007 does not exist",
        ),
        ("different model shape", r"iter_0000001 does not match this model: .*has shape \[64, 256\] in the"),
    ],
)
def test_bad_checkpoint_is_refused_on_every_rank(
    megatron_fsdp_run, run_config, checkpoint_dir, dist_env, kind, expected
):
    run = megatron_fsdp_run(run_config)
    run.train(1)
    save_checkpoint(run, checkpoint_dir)
    _damage(kind, checkpoint_dir, dist_env)
    source = checkpoint_dir / "does-not-exist" if kind == "directory missing" else checkpoint_dir
    if kind == "different model shape":
        other = _other_seed(run_config)
        other.model.overrides["ffn_hidden_size"] = 128  # the tiny preset's is 256
        target = megatron_fsdp_run(other)
    else:
        target = run  # a refused load must leave even the run it was refused for unchanged
    before_disk, before_state = _tree(checkpoint_dir), state_snapshot(target)

    start = time.monotonic()
    with pytest.raises(CheckpointError, match=expected) as refused:
        load_checkpoint(target, source)
    elapsed = time.monotonic() - start

    assert str(source) in str(refused.value)
    assert _same_everywhere(str(refused.value)) == [str(refused.value)] * dist_env.world_size
    assert elapsed < PROMPT_S
    assert _tree(checkpoint_dir) == before_disk
    assert_states_equal(before_state, state_snapshot(target))  # a refused load changes nothing


def test_ckpt_format_other_than_fsdp_dtensor_is_refused_before_touching_disk(
    megatron_fsdp_run, run_config, checkpoint_dir
):
    run = megatron_fsdp_run(run_config)
    run.cfg.checkpoint.ckpt_format = "torch_dist"  # what Bridge recipes often still default to
    target = checkpoint_dir / "never-created"
    expected = r"ckpt_format='torch_dist'.*set checkpoint\.ckpt_format='fsdp_dtensor'"
    with pytest.raises(ConfigError, match=expected):
        save_checkpoint(run, target)
    with pytest.raises(ConfigError, match=expected):
        load_checkpoint(run, target)
    assert not target.exists()
    assert _tree(checkpoint_dir) == {}


# ---------------------------------------------------------------------------------------------
# 7: a save that fails half-way keeps the previous checkpoint the latest


def _fail_on_rank1(monkeypatch, dist_env, target, name: str) -> None:
    original = getattr(target, name)

    def failing(*args, **kwargs):
        if dist_env.rank == 1:
            raise OSError("injected failure: disk full")
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, failing)


@pytest.mark.parametrize("where", ["preparing on rank 1", "writing shards on rank 1", "after the rename"])
def test_failed_save_keeps_the_previous_checkpoint(
    megatron_fsdp_run, run_config, checkpoint_dir, dist_env, monkeypatch, where
):
    run = megatron_fsdp_run(run_config)
    run.train(2)
    save_checkpoint(run, checkpoint_dir)
    expected = state_snapshot(run)
    run.train(2)

    if where == "preparing on rank 1":  # before any collective: the other rank must not wait in DCP
        _fail_on_rank1(monkeypatch, dist_env, run.optimizer, "sharded_state_dict")
    elif where == "writing shards on rank 1":  # inside DCP's write step, on one rank only
        _fail_on_rank1(monkeypatch, dist_env, dcp.FileSystemWriter, "write_data")
    else:  # rank 0 fails after renaming the iteration directory, before updating the pointers
        original = ckpt._write_atomically

        def crash_at_pointers(path, write):
            if path.name == ckpt.LATEST_TRAIN_STATE_FILE:
                raise OSError("injected failure: killed before the pointers")
            return original(path, write)

        monkeypatch.setattr(ckpt, "_write_atomically", crash_at_pointers)

    start = time.monotonic()
    with pytest.raises(
        CheckpointError, match=r"saving iteration 4 to \S+ failed \(previous checkpoint kept\)"
    ):
        save_checkpoint(run, checkpoint_dir)
    assert time.monotonic() - start < PROMPT_S
    monkeypatch.undo()
    dist.barrier()

    assert (checkpoint_dir / ckpt.TRACKER_FILE).read_text().strip() == "2"
    assert torch.load(checkpoint_dir / ckpt.LATEST_TRAIN_STATE_FILE, weights_only=True)["iteration"] == 2
    assert not [p.name for p in checkpoint_dir.iterdir() if ".tmp-" in p.name]
    if where != "after the rename":
        assert not (checkpoint_dir / "iter_0000004").exists()

    assert load_checkpoint(run, checkpoint_dir) == 2  # back from iteration 4
    assert run.iteration == 2
    assert_states_equal(expected, state_snapshot(run))


def test_leftover_of_a_killed_save_is_ignored(megatron_fsdp_run, run_config, checkpoint_dir, dist_env):
    """What a SIGKILL mid-save leaves (a temp directory with partial shards) is never loaded."""
    run = megatron_fsdp_run(run_config)
    run.train(1)
    save_checkpoint(run, checkpoint_dir)
    expected = state_snapshot(run)

    def leave_partial_save() -> None:
        partial = checkpoint_dir / "iter_0000002.tmp-killed"
        partial.mkdir(mode=0o700)
        (partial / "__0_0.distcp").write_bytes(b"\0" * 100)

    _on_rank0(dist_env, leave_partial_save)
    run.train(1)
    assert load_checkpoint(run, checkpoint_dir) == 1
    assert_states_equal(expected, state_snapshot(run))
