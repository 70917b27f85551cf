"""megatron-core's Adam on CPU ranks (``emulation/fused_adam.py``): torch's Adam with Transformer
Engine FusedAdam's state rule (state for every parameter of its groups after a step), installed as
megatron-core's ``Adam`` when its optimizer module is imported, and undone exactly."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pytest_megatron_fsdp.emulation.fused_adam import FusedAdamOnCpu


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g)) for _ in range(3)] + [
        torch.nn.Parameter(torch.empty(0))
    ]


def test_every_parameter_has_state_after_a_step_and_one_without_a_gradient_is_unchanged():
    params = _params()
    optimizer = FusedAdamOnCpu(params, lr=0.1, weight_decay=0.5)
    before = [p.detach().clone() for p in params]
    for _ in range(2):
        params[0].grad = torch.ones_like(params[0])  # params 1-3 get none (3: an empty local shard)
        optimizer.step()
    assert all(set(optimizer.state[p]) == {"step", "exp_avg", "exp_avg_sq"} for p in params)
    assert not torch.equal(params[0], before[0])
    for p, b in zip(params[1:], before[1:], strict=True):
        assert torch.equal(p, b), "a parameter without a gradient changed (weight decay applied)"
    # FusedAdam's per-group count: the same "step" for every parameter, whichever had gradients
    assert [optimizer.state[p]["step"].item() for p in params] == [2.0] * 4


def test_a_step_without_any_gradient_still_counts():
    params = _params()
    optimizer = FusedAdamOnCpu(params, lr=0.1)
    optimizer.step()
    optimizer.step()
    assert [optimizer.state[p]["step"].item() for p in params] == [2.0] * 4


@pytest.mark.parametrize(
    ("adam_w_mode", "torch_class"), [(True, torch.optim.AdamW), (False, torch.optim.Adam)]
)
def test_steps_are_torchs_own_bit_for_bit(adam_w_mode, torch_class):
    ours, theirs = _params()[:3], _params()[:3]
    settings = {"lr": 0.01, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}
    a = FusedAdamOnCpu(ours, adam_w_mode=adam_w_mode, **settings)
    b = torch_class(theirs, **settings)
    for step in range(3):
        for p, q in zip(ours, theirs, strict=True):
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)


def test_what_only_transformer_engines_fused_adam_has_is_a_missing_transformer_engine():
    with pytest.raises(
        ModuleNotFoundError, match="exp_avg_dtype, master_weights need Transformer Engine"
    ) as caught:
        FusedAdamOnCpu(_params(), lr=0.1, exp_avg_dtype=torch.float32, master_weights=True)
    assert caught.value.name == "transformer_engine"


INSTALL = """
import torch
from pytest_megatron_fsdp.emulation import fused_adam
{first}
fused_adam.install()
import megatron.core.optimizer as optimizer
assert optimizer.Adam is fused_adam.FusedAdamOnCpu, optimizer.Adam
assert optimizer.USING_PYTORCH_OPTIMIZER is False
fused_adam.uninstall()
assert optimizer.Adam is torch.optim.AdamW, optimizer.Adam
assert optimizer.USING_PYTORCH_OPTIMIZER is True
print("megatron-core's Adam patched and restored")
"""


@pytest.mark.parametrize(
    "first", ["", "import megatron.core.optimizer"], ids=["imported-after", "imported-before"]
)
def test_installed_as_megatron_cores_adam_and_restored(first):
    """In a fresh interpreter (megatron imported in this one may be the emulation's)."""
    done = subprocess.run(
        [sys.executable, "-c", INSTALL.format(first=first)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "patched and restored" in done.stdout
