"""The baseline comparison the parity tests share, and the DDP baseline's config (no torch, no ranks)."""

from __future__ import annotations

import pytest

from pytest_megatron_fsdp import (
    RunConfig,
    assert_matches_baseline,
    ddp_baseline,
    enable_megatron_fsdp,
    validate,
)


def test_exact_means_bit_for_bit_and_the_message_names_the_first_differing_iteration():
    assert_matches_baseline([4.5, 4.25], [4.5, 4.25], rel_tol=0.0, what="w")
    with pytest.raises(AssertionError) as failure:
        assert_matches_baseline([4.5, 4.25 + 1e-12, 3.0], [4.5, 4.25, 3.5], rel_tol=0.0, what="optim")
    message = str(failure.value)
    assert message.startswith("optim: iteration 2 loss 4.250000000001 != DDP baseline 4.25 (rel_tol 0.0)")


def test_a_tolerance_is_relative_and_the_metric_is_named():
    assert_matches_baseline([1.0 + 1e-7], [1.0], rel_tol=1e-6, what="w", metric="grad norm")
    with pytest.raises(AssertionError, match=r"^w: iteration 1 grad norm 2\.0 != DDP baseline 1\.0"):
        assert_matches_baseline([2.0], [1.0], rel_tol=1e-5, what="w", metric="grad norm")


def test_series_of_different_lengths_never_compare_equal():
    with pytest.raises(AssertionError, match="2 loss values vs the DDP baseline's 3"):
        assert_matches_baseline([1.0, 2.0], [1.0, 2.0, 3.0], rel_tol=0.0, what="w")


def test_the_ddp_baseline_is_a_valid_megatron_ddp_copy_of_the_config():
    cfg = enable_megatron_fsdp(RunConfig())
    cfg.ddp.overlap_param_gather = True
    base = ddp_baseline(cfg)
    assert cfg.uses_megatron_fsdp
    assert cfg.ddp.overlap_param_gather  # the original is untouched
    assert not base.uses_megatron_fsdp
    assert not base.ddp.use_megatron_fsdp
    assert not base.ddp.use_distributed_optimizer
    assert not base.ddp.overlap_param_gather
    validate(base, world_size=2)
