"""assert_reproducible: the same run twice gives the same losses and state; a different seed does not."""

from __future__ import annotations

import pytest

from pytest_megatron_fsdp import assert_reproducible

pytestmark = pytest.mark.distributed(world_size=2)


def test_the_same_run_twice_is_bitwise_identical(megatron_fsdp_run, run_config):
    assert_reproducible(lambda: megatron_fsdp_run(run_config), iterations=3)


def test_a_different_seed_is_caught_at_the_first_iteration(megatron_fsdp_run, run_config):
    seeds = iter([run_config.train.seed, run_config.train.seed + 1])

    def build():
        cfg = run_config.copy()
        cfg.train.seed = next(seeds)
        return megatron_fsdp_run(cfg)

    with pytest.raises(AssertionError, match=r"not reproducible: loss differs first at iteration 1: "):
        assert_reproducible(build, iterations=2)


def test_a_state_only_difference_names_the_tensor(megatron_fsdp_run, run_config):
    """Equal losses, different final state: the weight decay of the second run differs, which
    moves the weights in the last step but cannot show in that step's (already computed) loss."""
    decays = iter([run_config.optimizer.weight_decay, 0.5])

    def build():
        cfg = run_config.copy()
        cfg.optimizer.weight_decay = next(decays)
        return megatron_fsdp_run(cfg)

    with pytest.raises(AssertionError, match=r"final state differs .* rank 0: (model|optimizer)\."):
        assert_reproducible(build, iterations=1)
