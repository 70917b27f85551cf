"""fsdp_dtensor checkpoints of a Megatron-FSDP run: save, verify, load, resume (issues #3, #11).

Every test runs on 2 ranks and every rank asserts (loading at other world sizes:
tests/e2e/test_checkpoint_resharding.py, which launches the rank sets itself). Exactness: a
checkpoint round trip is a byte copy of the tensors, so states are compared with ``torch.equal``
on any device; losses after a resume are exact on CPU ranks and compared with a small tolerance on
GPUs, where cuBLAS and attention kernels may reduce in a different order from one process to the
next.
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
    CheckpointWarning,
    assert_states_differ,
    assert_states_equal,
    checkpoint_problems,
    fingerprint_differences,
    load_checkpoint,
    save_checkpoint,
    state_fingerprint,
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


def test_no_shard_trains_without_param_gather_overlap(known_bug, megatron_fsdp_run, run_config):
    known_bug(versions.NO_SHARD_PARAM_SYNC, raises=AttributeError)
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
    assert train_state["iteration"] == 5
    assert train_state["ckpt_format"] == "fsdp_dtensor"
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
    elif kind in ("shard bytes flipped", "metadata bytes flipped"):
        target = iter_dir / ("__1_0.distcp" if kind == "shard bytes flipped" else ".metadata")
        _on_rank0(dist_env, lambda: _flip_bytes(target))
    elif kind == "digests unreadable":
        _on_rank0(dist_env, lambda: (iter_dir / "digests.json").write_text("{"))


def _flip_bytes(path: Path, count: int = 64) -> None:
    """Invert ``count`` bytes in the middle of ``path``: the same size, other content."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("directory missing", r"checkpoint directory \S*does-not-exist does not exist"),
        ("metadata missing", r"iter_0000001/\.metadata is missing"),
        ("shard truncated", r"iter_0000001/__1_0\.distcp is truncated: \d+ bytes, \S+ needs at least \d+"),
        (
            "tracker points at a missing iteration",
            r"latest_checkpointed_iteration\.txt names iteration 7 but \S+/iter_0000007 does not exist",
        ),
        ("different model shape", r"iter_0000001 does not match this model: .*has shape \[64, 256\] in the"),
        (
            "shard bytes flipped",
            r"iter_0000001/__1_0\.distcp does not match its sha256 digest in \S+/iter_0000001/digests\.json",
        ),
        ("metadata bytes flipped", r"iter_0000001/\.metadata does not match its sha256 digest"),
        ("digests unreadable", r"iter_0000001/digests\.json is not a valid digest manifest"),
    ],
)
def test_bad_checkpoint_is_refused_on_every_rank(
    megatron_fsdp_run, run_config, checkpoint_dir, dist_env, monkeypatch, kind, expected
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
    reads = []
    monkeypatch.setattr(ckpt.state_dict_loader, "load", lambda *args, **kwargs: reads.append(args))

    start = time.monotonic()
    with pytest.raises(CheckpointError, match=expected) as refused:
        load_checkpoint(target, source)
    elapsed = time.monotonic() - start
    assert reads == [], "DCP read the checkpoint before it was refused"
    monkeypatch.undo()

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
        partial = checkpoint_dir / "iter_0000002.tmp-0dead0"
        partial.mkdir(mode=0o700)
        (partial / "__0_0.distcp").write_bytes(b"\0" * 100)

    _on_rank0(dist_env, leave_partial_save)
    run.train(1)
    assert load_checkpoint(run, checkpoint_dir) == 1
    assert_states_equal(expected, state_snapshot(run))
    run.train(1)
    save_checkpoint(run, checkpoint_dir)  # a completed save removes what the killed one left
    assert sorted(p.name for p in checkpoint_dir.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000001",
        "iter_0000002",
    ]


# ---------------------------------------------------------------------------------------------
# 8 (issue #11): content integrity


def test_a_checkpoint_saved_before_digests_existed_loads_with_a_warning(
    megatron_fsdp_run, run_config, checkpoint_dir, dist_env
):
    run = megatron_fsdp_run(run_config)
    run.train(2)
    save_checkpoint(run, checkpoint_dir)
    expected = state_snapshot(run)
    _on_rank0(dist_env, lambda: (checkpoint_dir / "iter_0000002" / "digests.json").unlink())

    fresh = megatron_fsdp_run(_other_seed(run_config))
    with pytest.warns(CheckpointWarning, match=r"iter_0000002 has no digests\.json .* not verified"):
        assert load_checkpoint(fresh, checkpoint_dir) == 2
    assert_states_equal(expected, state_snapshot(fresh))


# ---------------------------------------------------------------------------------------------
# 9 (issue #11): into another sharding strategy; the full state compared whole


@pytest.mark.parametrize(
    ("saved_with", "loaded_into"),
    [
        ("optim_grads_params", "optim_grads"),
        ("optim_grads_params", "optim"),
        ("optim_grads_params", "no_shard"),
        ("no_shard", "optim_grads_params"),
    ],
)
def test_loads_into_another_sharding_strategy(
    megatron_fsdp_run, run_config, checkpoint_dir, saved_with, loaded_into
):
    source_cfg = run_config.copy()
    source_cfg.ddp.data_parallel_sharding_strategy = saved_with
    run = megatron_fsdp_run(source_cfg)
    run.train(3)
    save_checkpoint(run, checkpoint_dir)
    expected = state_fingerprint(run)
    continued = run.train(2).losses

    target_cfg = _other_seed(run_config)
    target_cfg.ddp.data_parallel_sharding_strategy = loaded_into
    fresh = megatron_fsdp_run(target_cfg)
    assert fingerprint_differences(expected, state_fingerprint(fresh)) != []  # it starts elsewhere
    assert load_checkpoint(fresh, checkpoint_dir) == 3
    assert fingerprint_differences(expected, state_fingerprint(fresh)) == []
    # ... and trains on from there, on the same batches. Not bit for bit: the strategies reduce
    # gradients differently ('optim' trains ~3e-4 apart from the others after one step even from
    # scratch, measured on CPU ranks); the state itself was compared exactly above.
    assert fresh.train(2).losses == pytest.approx(continued, rel=1e-3)


def test_the_fingerprint_sees_one_changed_element(megatron_fsdp_run, run_config, dist_env):
    """The comparison above can fail: one weight changed on one rank changes the fingerprint."""
    run = megatron_fsdp_run(run_config)
    run.train(1)
    before = state_fingerprint(run)
    if dist_env.rank == 1:
        shard = next(v for v in ckpt.model_state_dict(run).values() if v.to_local().numel())
        shard.to_local().view(-1)[0] += 1e-3
    after = state_fingerprint(run)
    changed = fingerprint_differences(before, after)
    assert len(changed) == 1, changed
    assert changed[0].startswith("model."), changed


# ---------------------------------------------------------------------------------------------
# 10 (issue #11): RNG states that differ between data-parallel ranks


def test_rng_states_that_differ_between_ranks_are_restored_per_rank(
    megatron_fsdp_run, run_config, checkpoint_dir, dist_env
):
    run = megatron_fsdp_run(run_config)
    run.train(1)
    for _ in range(dist_env.rank + 1):  # rank-dependent draws: the ranks' RNGs now differ
        torch.rand(1), random.random(), np.random.rand()
    save_checkpoint(run, checkpoint_dir)
    expected = _rngs()
    assert len(set(map(str, _same_everywhere(expected)))) == dist_env.world_size

    keys = dcp.FileSystemReader(checkpoint_dir / "iter_0000001").read_metadata().state_dict_metadata
    saved = sorted({k.split(".")[2] for k in keys if k.startswith("rng_state.(0, 0).")})
    assert saved == [str(r) for r in range(dist_env.world_size)]  # one entry per data-parallel rank

    fresh = megatron_fsdp_run(_other_seed(run_config))
    load_checkpoint(fresh, checkpoint_dir)
    assert _rngs() == expected


# ---------------------------------------------------------------------------------------------
# 11 (issue #11): Megatron-LM's key layout


def _expected_megatron_lm_keys(num_layers: int, te: bool, wrappers: str) -> set[str]:
    """The model and optimizer keys Megatron-LM's fsdp_dtensor save writes for the bridge-reference
    GPT (RMSNorm, no biases, RoPE, SwiGLU, untied embeddings): SwiGLU's linear_fc1 as _w and _v,
    no Transformer Engine _extra_state. ``wrappers``: the optimizer's parameter-name prefix."""
    params = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"]
    for layer in range(num_layers):
        prefix = f"decoder.layers.{layer}."
        if te:  # Transformer Engine fuses the norms into the following linear layers
            norms = ["self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"]
        else:
            norms = ["input_layernorm.weight", "pre_mlp_layernorm.weight"]
        params += [prefix + n for n in norms]
        params += [
            prefix + "self_attention.linear_qkv.weight",
            prefix + "self_attention.linear_proj.weight",
            prefix + "mlp.linear_fc1.weight_w",
            prefix + "mlp.linear_fc1.weight_v",
            prefix + "mlp.linear_fc2.weight",
        ]
    keys = {f"model.module.{p}" for p in params}
    keys |= {f"optimizer.state.{wrappers}{p}.{s}" for p in params for s in ("exp_avg", "exp_avg_sq", "step")}
    return keys


def _optimizer_parameter_names(num_layers: int, te: bool, wrappers: str) -> set[str]:
    """The optimizer's names of the parameters (SwiGLU's linear_fc1 whole, as the optimizer has it)."""
    keys = _expected_megatron_lm_keys(num_layers, te, wrappers)
    prefix = f"optimizer.state.{wrappers}"
    return {
        wrappers + k[len(prefix) :].rsplit(".", 1)[0].removesuffix("_w").removesuffix("_v")
        for k in keys
        if k.startswith(prefix)
    }


def test_megatron_lm_key_layout_for_the_bridge_reference_preset(
    megatron_fsdp_run, run_config, checkpoint_dir, dist_env
):
    from pytest_megatron_fsdp.fsdp.model import uses_transformer_engine  # megatron: not at collection

    run_config.model.preset = "bridge-reference"
    # The key layout and the exact reload depend on the model, not on how many tokens a step sees:
    # on a CPU without native bf16 the preset's step is its slow_bf16_step, as run_config sizes it
    # for every test.
    run = megatron_fsdp_run(run_config)
    run.train(1)
    save_checkpoint(run, checkpoint_dir)
    saved = dcp.FileSystemReader(checkpoint_dir / "iter_0000001").read_metadata().state_dict_metadata

    # FullyShardedDataParallel -> MegatronFSDP -> Float16Module (bf16) -> GPTModel
    te, wrappers = uses_transformer_engine(dist_env), "module.module.module."
    expected = _expected_megatron_lm_keys(2, te, wrappers)
    params = _optimizer_parameter_names(2, te, wrappers)
    # param_to_group_meta: one pickled entry per parameter and group setting (lr, betas, ...)
    group_meta = "optimizer.param_to_group_meta."
    tensors = {k for k in saved if k.startswith(("model.", "optimizer.")) and not k.startswith(group_meta)}
    assert sorted(tensors - expected) == []
    assert sorted(expected - tensors) == []
    with_group_meta = {p for p in params if any(k.startswith(f"{group_meta}{p}.") for k in saved)}
    assert with_group_meta == params
    assert [
        k for k in saved if k.startswith(group_meta) and k.rsplit(".", 1)[0][len(group_meta) :] not in params
    ] == []
    fc1 = "model.module.decoder.layers.0.mlp.linear_fc1.weight"
    assert list(saved[fc1 + "_w"].size) == list(saved[fc1 + "_v"].size) == [2688, 768]  # ffn 2688, hidden 768

    rng = f"rng_state.({0}, {0}).0."
    others = {k for k in saved if not k.startswith(("model.", "optimizer.", rng + "rng_tracker_states."))}
    scheduler = {f"opt_param_scheduler.{k}" for k in run.scheduler.state_dict()}
    assert len(scheduler) == 10, scheduler  # Megatron's OptimizerParamScheduler, as Megatron-LM saves it
    assert others == {
        "checkpoint_version",
        "iteration",
        # what Megatron-LM's loader reads besides the state (its run arguments: the model's shape)
        "args",
        "num_floating_point_operations_so_far",
        *scheduler,
        rng + "random_rng_state",
        rng + "np_rng_state",
        rng + "torch_rng_state",
        rng + "cuda_rng_state",
        *(f"data_stream.dp_rank_{r}" for r in range(dist_env.world_size)),
    }
    assert rng + "rng_tracker_states.model-parallel-rng" in saved

    # ... and it loads back exactly (the handlers' _w/_v halves are views of the weights).
    expected_state, before = state_snapshot(run), run.forward_loss()
    fresh = megatron_fsdp_run(_other_seed(run_config))
    load_checkpoint(fresh, checkpoint_dir)
    assert_states_equal(expected_state, state_snapshot(fresh))
    assert fresh.forward_loss() == pytest.approx(before, rel=0 if dist_env.platform == "cpu" else 1e-3)


def test_bf16_round_trip_without_swiglu_is_exact(megatron_fsdp_run, run_config, checkpoint_dir):
    """A bf16 run (a Float16Module between Megatron-FSDP and the GPT) that megatron-core's wrapper loads
    strictly (no SwiGLU, no FP8): every weight and the next loss as saved."""
    run_config.model.bf16 = True
    straight = megatron_fsdp_run(run_config)
    straight.train(2)
    save_checkpoint(straight, checkpoint_dir)
    expected, before = state_snapshot(straight), straight.forward_loss()

    fresh = megatron_fsdp_run(_other_seed(run_config))
    assert load_checkpoint(fresh, checkpoint_dir) == 2
    assert_states_equal(expected, state_snapshot(fresh))
    assert fresh.forward_loss() == before


def test_swiglu_round_trip_and_resume_are_exact(megatron_fsdp_run, run_config, checkpoint_dir):
    run_config.model.overrides["swiglu"] = True  # the tiny GPT with SwiGLU: fp32, no Float16Module
    straight = megatron_fsdp_run(run_config)
    straight.train(3)
    save_checkpoint(straight, checkpoint_dir)
    expected, fingerprint = state_snapshot(straight), state_fingerprint(straight)
    rest = straight.train(3).losses

    resumed = megatron_fsdp_run(_other_seed(run_config))
    load_checkpoint(resumed, checkpoint_dir)
    assert_states_equal(expected, state_snapshot(resumed))
    assert fingerprint_differences(fingerprint, state_fingerprint(resumed)) == []
    second = resumed.train(3).losses
    if resumed.env.platform == "cpu":
        assert second == rest
    else:
        assert second == pytest.approx(rest, rel=1e-4)


# ---------------------------------------------------------------------------------------------
# 12 (issue #11): a checkpoint from before digests, saved on the floor stack


#: tests/data/make_pre_digest_checkpoint.py saved it with the pre-digest code (commit 35cd11d) on
#: Python 3.11, torch 2.13.0, megatron-core 0.16.1: 2 ranks, this smaller tiny GPT, 3 iterations.
PRE_DIGEST_ARCHIVE = Path(__file__).parents[1] / "data" / "pre-digest-checkpoint.tar.xz"
PRE_DIGEST_MODEL = {
    "num_layers": 1,
    "hidden_size": 32,
    "ffn_hidden_size": 64,
    "num_attention_heads": 2,
    "num_query_groups": 2,
}


def _whole_state_on_disk(iter_dir: Path) -> dict:
    """Every tensor of a DCP checkpoint, whole, read in this process alone (DCP's own converter)."""
    import io

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    buffer = io.BytesIO()
    dcp_to_torch_save(iter_dir, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)  # our own test data: pickles allowed


def _same_tensors(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_pre_digest_checkpoint_from_the_floor_stack_loads_exactly(
    megatron_fsdp_run, run_config, checkpoint_dir, dist_env
):
    import tarfile

    from megatron.core import tensor_parallel

    from pytest_megatron_fsdp.fsdp.megatron_layout import strip_wrappers
    from pytest_megatron_fsdp.fsdp.snapshots import tensor_digest

    def extract() -> None:
        with tarfile.open(PRE_DIGEST_ARCHIVE) as archive:
            archive.extractall(checkpoint_dir, filter="data")

    _on_rank0(dist_env, extract)
    root = checkpoint_dir / "pre-digest-checkpoint"
    on_disk = _whole_state_on_disk(root / "iter_0000003")
    expected = {
        f"model.{strip_wrappers(k)}": tensor_digest(v)
        for k, v in on_disk["model"].items()
        if "_extra" not in k
    }
    for name, entry in on_disk["optimizer"]["state"].items():
        expected |= {f"optimizer.{strip_wrappers(name)}.{s}": tensor_digest(entry[s]) for s in entry}

    run_config.model.overrides.update(PRE_DIGEST_MODEL)
    run = megatron_fsdp_run(_other_seed(run_config))  # other weights, RNGs and data stream
    mine = on_disk["rng_state"][f"rank_{dist_env.rank}"]
    assert fingerprint_differences(expected, state_fingerprint(run)) != []
    assert not torch.equal(torch.get_rng_state(), mine["torch_cpu"])
    assert not torch.equal(run.data_stream_state(), mine["data_stream"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    # Megatron's RNG tracker, saved flat as "tracker.<name>"
    saved_tracker = {k.removeprefix("tracker."): v for k, v in mine.items() if k.startswith("tracker.")}
    assert saved_tracker
    assert not _same_tensors(tracker.get_states(), saved_tracker)
    with pytest.warns(CheckpointWarning, match=r"iter_0000003 has no digests\.json .* not verified"):
        assert load_checkpoint(run, root) == 3
    assert fingerprint_differences(expected, state_fingerprint(run)) == []
    # this rank's RNG and data stream, as that rank saved them
    assert torch.equal(torch.get_rng_state(), mine["torch_cpu"])
    assert torch.equal(run.data_stream_state(), mine["data_stream"])
    assert _same_tensors(tracker.get_states(), saved_tracker)
    losses = run.train(2).losses
    assert losses[1] < losses[0]


@pytest.mark.skipif(
    not versions.megatron_lm_training_installed(),
    reason="megatron.training.checkpointing (Megatron-LM's) is not importable with this megatron-core "
    "(0.16.1's wheel does not ship it; 0.19.2's and a Megatron-LM checkout, MEGATRON_CORE='-e PATH', do)",
)
def test_megatron_lms_own_preprocessing_gives_the_same_keys(known_bug, megatron_fsdp_run, run_config):
    """Megatron-LM's ``preprocess_fsdp_dtensor_state_dict`` on this run, against the harness's layout
    (it raises AttributeError on 0.19.2: versions.SWIGLU_HANDLER_LOOKUP)."""
    known_bug(versions.SWIGLU_HANDLER_LOOKUP, raises=AttributeError)
    from types import SimpleNamespace

    from megatron.training.checkpointing import preprocess_fsdp_dtensor_state_dict

    from pytest_megatron_fsdp.fsdp import megatron_layout

    run_config.model.overrides["swiglu"] = True
    run = megatron_fsdp_run(run_config)
    run.train(1)

    def raw():
        model = megatron_layout.model_state_dict(run)
        return {"model": dict(model), "optimizer": megatron_layout.optimizer_state_dict(run, model)[1]}

    ours = raw()
    megatron_layout.apply_megatron_lm_handlers(run, ours)
    megatron_layout.preprocess_uneven(ours)
    args = SimpleNamespace(swiglu=True, num_experts=None)
    theirs = preprocess_fsdp_dtensor_state_dict(args, raw(), run.model)
    assert sorted(k for k, _ in ckpt.flatten_state(theirs)) == sorted(k for k, _ in ckpt.flatten_state(ours))
