"""The optimizer as Bridge runs it: Megatron's OptimizerParamScheduler in the training loop (and in
checkpoints), and Megatron's gradient clipping applied on every platform, CPU ranks included.

Each expectation is computed here by hand from the documented formulas, not read back from Megatron.
"""

import math

import pytest
import torch

from pytest_megatron_fsdp.checkpoint import load_checkpoint, save_checkpoint, state_snapshot

pytestmark = pytest.mark.distributed(world_size=2)


def cosine_with_warmup(iteration: int, lr: float, min_lr: float, warmup: int, decay: int) -> float:
    """The learning rate iteration ``iteration`` (1-based) trains with: linear warm-up from 0 over
    ``warmup`` iterations, then cosine decay to ``min_lr`` at iteration ``decay``."""
    done = iteration - 1  # optimizer steps taken before this one
    if done <= warmup:
        return lr * done / warmup
    ratio = (done - warmup) / (decay - warmup)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (lr - min_lr)


def _cosine(run_config, iters=6):
    run_config.train.train_iters = iters
    run_config.optimizer.lr = 1e-3
    run_config.optimizer.min_lr = 1e-5
    run_config.scheduler.lr_decay_style = "cosine"
    run_config.scheduler.lr_warmup_iters = 2
    run_config.scheduler.override_opt_param_scheduler = True
    return run_config


def test_the_learning_rate_follows_the_warmup_and_cosine_schedule(megatron_fsdp_run, run_config):
    result = megatron_fsdp_run(_cosine(run_config)).train()
    expected = [cosine_with_warmup(i, 1e-3, 1e-5, warmup=2, decay=6) for i in range(1, 7)]
    assert len(result.learning_rates) == 6
    for i, (actual, wanted) in enumerate(zip(result.learning_rates, expected, strict=True), start=1):
        assert math.isclose(actual, wanted, rel_tol=1e-12, abs_tol=1e-15), (
            i,
            result.learning_rates,
            expected,
        )
    assert result.learning_rates[0] == 0.0  # Bridge warms up from lr_warmup_init=0


def test_the_schedule_is_checkpointed_with_the_run(megatron_fsdp_run, run_config, checkpoint_dir):
    cfg = _cosine(run_config)
    run = megatron_fsdp_run(cfg)
    first = run.train(3)
    save_checkpoint(run, checkpoint_dir)
    rest = run.train(3)

    fresh = megatron_fsdp_run(cfg.copy())
    assert fresh.learning_rate() == 0.0
    assert load_checkpoint(fresh, checkpoint_dir) == 3
    resumed = fresh.train(3)
    assert resumed.learning_rates == rest.learning_rates  # continues at iteration 4's rate
    assert resumed.first_iteration == rest.first_iteration == 4

    # loading into a run that trained already puts its schedule where the checkpoint's was
    trained = megatron_fsdp_run(cfg.copy())
    trained.train(5)
    load_checkpoint(trained, checkpoint_dir)
    assert trained.learning_rate() == rest.learning_rates[0] != first.learning_rates[0]


def _one_adam_step(megatron_fsdp_run, cfg, clip_grad):
    """(parameter change of one optimizer step on this rank, the grad norm Megatron measured)."""
    cfg = cfg.copy()
    cfg.optimizer.clip_grad = clip_grad
    run = megatron_fsdp_run(cfg)
    before = state_snapshot(run)
    result = run.train(1)
    after = state_snapshot(run)
    run.close()
    delta = {k: after[k] - before[k] for k in before if k.startswith("model.")}
    return delta, result.grad_norms[0]


def test_megatrons_gradient_clipping_applies_on_every_platform(megatron_fsdp_run, run_config):
    """Megatron's clip, on CPU ranks too, against a clip computed by hand.

    Adam's first step moves a weight by -lr * g / (|g| + eps) (bias-corrected moments g and g²; no
    weight decay). With an eps far above |g| that is nearly linear in g, so clipping shows: from the
    unclipped step each g is recovered exactly, scaled by Megatron's coefficient
    max_norm / (norm + 1e-6), and the clipped step predicted from it.
    """
    # large steps, so that fp32 rounding of weight + step (a few ulps of the weight) stays small
    lr, eps = 1000.0, 100.0
    run_config.optimizer.lr = lr
    run_config.optimizer.adam_eps = eps
    run_config.optimizer.weight_decay = 0.0
    free, norm = _one_adam_step(megatron_fsdp_run, run_config, clip_grad=0.0)
    clipped, clipped_norm = _one_adam_step(megatron_fsdp_run, run_config, clip_grad=norm / 4)
    assert clipped_norm == pytest.approx(norm, rel=1e-6)  # the norm is measured before clipping
    coefficient = (norm / 4) / (norm + 1e-6)
    moved = [k for k in free if free[k].numel() and free[k].abs().max() > 0]
    assert moved, "the unclipped step moved no weight: the comparison would prove nothing"
    for key in moved:
        u = (-free[key] / lr).double()
        grad = eps * u / (1 - u.abs())  # inverts u = g / (|g| + eps)
        expected = -lr * coefficient * grad / ((coefficient * grad).abs() + eps)
        assert torch.allclose(clipped[key].double(), expected, rtol=1e-3, atol=1e-5), key
        assert not torch.allclose(clipped[key], free[key], rtol=0.1), f"{key}: clipping changed nothing"
