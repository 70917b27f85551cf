"""How the functional suite tells that activation recompute ran (fsdp/recompute.py), in process."""

import torch
from torch.utils.checkpoint import checkpoint

from pytest_megatron_fsdp.fsdp.recompute import (
    ForwardCalls,
    forward_calls,
    recompute_problem,
    recomputed_module_names,
)


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.core_attention = torch.nn.Linear(2, 2)


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attention = _Attention()

    def forward(self, x):
        return self.self_attention.core_attention(x)


class _Model(torch.nn.Module):
    """Named as megatron's GPT: decoder.layers.<i>.self_attention.core_attention."""

    def __init__(self, recompute):
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([_Layer(), _Layer()])
        self.recompute = recompute

    def forward(self, x):
        for layer in self.decoder.layers:
            x = checkpoint(layer, x, use_reentrant=True) if self.recompute else layer(x)
        return x


def test_each_granularity_names_what_megatron_recomputes():
    model = _Model(recompute=True)
    assert recomputed_module_names(model, "full") == ["decoder.layers.0", "decoder.layers.1"]
    assert recomputed_module_names(model, "selective") == [
        "decoder.layers.0.self_attention.core_attention",
        "decoder.layers.1.self_attention.core_attention",
    ]


def _train_step_calls(recompute):
    model = _Model(recompute)
    names = recomputed_module_names(model, "full")
    with forward_calls(model, names) as calls:
        model(torch.ones(1, 2, requires_grad=True)).sum().backward()
    model(torch.ones(1, 2, requires_grad=True)).sum().backward()  # after the block: not counted
    return calls


def test_a_forward_run_again_inside_the_backward_counts_as_recomputed():
    calls = _train_step_calls(recompute=True)
    assert calls == {name: ForwardCalls(forward=1, in_backward=1) for name in calls}
    assert recompute_problem(calls, "full") is None


def test_without_recompute_each_module_is_named_with_its_counts():
    calls = _train_step_calls(recompute=False)
    assert recompute_problem(calls, "full") == (
        "recompute full: forwards outside / inside the backward: decoder.layers.0 1/0, decoder.layers.1 1/0"
    )


def test_a_module_that_never_ran_or_no_module_at_all_is_a_problem():
    assert "decoder.layers.1 0/0" in recompute_problem({"decoder.layers.1": ForwardCalls()}, "full")
    assert recompute_problem({}, "selective") == (
        "recompute selective: the model has no module that selective recompute re-runs"
    )
