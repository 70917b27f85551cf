"""A checkpoint saved at one world size loads at another: 2 -> 4, 4 -> 2 and 2 -> 1 ranks.

Each world size runs in a plain-pytest session of its own (the plugin launches its rank set), in
order, sharing a directory through an environment variable: a chain of tests across world sizes
that neither pytest-xdist nor the order rank sets run in can break. Every load is compared with
the saving run as a whole (the state fingerprint: every full tensor's SHA-256, independent of how
it is sharded), then trains on.
"""

import json

COMMON = """
import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pytest_megatron_fsdp.checkpoint import (
    CheckpointWarning,
    fingerprint_differences,
    load_checkpoint,
    save_checkpoint,
    state_fingerprint,
)

ROOT = Path(os.environ["RESHARD_ROOT"])


def record(name, dist_env, **values):
    if dist_env.rank == 0:
        (ROOT / f"{name}.json").write_text(json.dumps(values))
    dist.barrier()


def recorded(name):
    return json.loads((ROOT / f"{name}.json").read_text())


def other_seed(cfg):
    other = cfg.copy()
    other.train.seed = cfg.train.seed + 1
    return other


def streams(run):
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, run.data_stream_state().tolist())
    return states


def load_resharded(megatron_fsdp_run, run_config, source, saved_dp, dp):
    run = megatron_fsdp_run(other_seed(run_config))
    assert fingerprint_differences(recorded(source)["fingerprint"], state_fingerprint(run)) != []
    match = f"loaded at data-parallel size {dp}, saved at {saved_dp}: each rank's data stream restarts"
    with pytest.warns(CheckpointWarning, match=match):
        iteration = load_checkpoint(run, ROOT / source)
    assert iteration == recorded(source)["iteration"] == run.iteration
    assert fingerprint_differences(recorded(source)["fingerprint"], state_fingerprint(run)) == []
    # the schedule counts samples: at the same iteration with this run's global batch
    assert run.scheduler.num_steps == iteration * run.global_batch_size
    assert run.scheduler.lr_decay_steps == run_config.train.train_iters * run.global_batch_size
    return run


def trains_on(run):
    losses = run.train(2).losses
    assert all(math.isfinite(x) for x in losses) and len(set(losses)) == 2, losses
    return losses
"""

SAVE_AT_2 = (
    COMMON
    + """

@pytest.mark.distributed(world_size=2)
def test_save_at_2(megatron_fsdp_run, run_config, dist_env):
    run = megatron_fsdp_run(run_config)
    run.train(3)
    save_checkpoint(run, ROOT / "from2")
    record("from2", dist_env, fingerprint=state_fingerprint(run), iteration=3)
"""
)

LOAD_AT_4 = (
    COMMON
    + """

@pytest.mark.distributed(world_size=4)
def test_load_2_at_4_then_save(megatron_fsdp_run, run_config, dist_env):
    run = load_resharded(megatron_fsdp_run, run_config, "from2", saved_dp=2, dp=4)
    # The data stream at another data-parallel size: every rank its own, derived from (seed,
    # iteration, rank), the same for every load of this checkpoint, not a fresh run's start.
    loaded = streams(run)
    assert len({str(s) for s in loaded}) == 4
    assert loaded != streams(megatron_fsdp_run(run_config))
    again = load_resharded(megatron_fsdp_run, run_config, "from2", saved_dp=2, dp=4)
    assert streams(again) == loaded
    assert trains_on(again) == trains_on(run)  # the same samples and steps after either load
    save_checkpoint(run, ROOT / "from4")
    record("from4", dist_env, fingerprint=state_fingerprint(run), iteration=5)
"""
)

LOAD_AT_2_AND_1 = (
    COMMON
    + """

@pytest.mark.distributed(world_size=2)
def test_load_4_at_2(megatron_fsdp_run, run_config):
    trains_on(load_resharded(megatron_fsdp_run, run_config, "from4", saved_dp=4, dp=2))


@pytest.mark.distributed(world_size=1)
def test_load_2_at_1(megatron_fsdp_run, run_config):
    trains_on(load_resharded(megatron_fsdp_run, run_config, "from2", saved_dp=2, dp=1))
"""
)


def test_a_checkpoint_loads_at_any_world_size(
    pytester, monkeypatch, isolated_tmp, leftover_processes, leftover_files
):
    root = pytester.path / "checkpoints"
    root.mkdir()
    monkeypatch.setenv("RESHARD_ROOT", str(root))
    args = ("--mfsdp-platform=cpu", "-rA")
    for name, source, outcomes in [
        ("test_save_at_2", SAVE_AT_2, {"passed": 1}),
        ("test_load_at_4", LOAD_AT_4, {"passed": 1}),
        ("test_load_at_2_and_1", LOAD_AT_2_AND_1, {"passed": 2}),
    ]:
        path = pytester.makepyfile(**{name: source})
        result = pytester.runpytest_subprocess(str(path), *args, timeout=420)
        # the ranks' warnings (megatron-core's deprecations) are counted in the summary line too
        counts = {k: v for k, v in result.parseoutcomes().items() if k not in ("warning", "warnings")}
        assert counts == outcomes, result.stdout.str()[-6000:]
    # What each world size saved: one shard per rank, at any world size.
    for source, ranks in [("from2", 2), ("from4", 4)]:
        iteration = json.loads((root / f"{source}.json").read_text())["iteration"]
        shards = sorted(p.name for p in (root / source / f"iter_{iteration:07d}").glob("*.distcp"))
        assert shards == [f"__{r}_0.distcp" for r in range(ranks)]
    assert leftover_processes(pytester.path) == []
    assert leftover_files(isolated_tmp) == []
