"""Activation recompute, observed: which modules' forwards ran again inside the backward.

Megatron recomputes activations inside the backward: ``recompute_granularity='full'`` re-runs the
checkpointed transformer layers (``CheckpointFunction.backward``), ``'selective'`` the modules named
by ``recompute_modules`` (by default ``core_attn``: each layer's ``core_attention``). A run that
recomputes has to show both halves: the same numbers as without recompute (its parity test), and
each recomputed module's forward run once more while the autograd engine runs the backward (here).
Without the second, a recompute that is silently off passes any parity test.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

#: what each granularity recomputes, by module name (megatron-core 0.16.1 to main): every
#: transformer layer (``decoder.layers.<i>``; the harness's full recompute checkpoints them one at a
#: time) or every layer's core attention (``recompute_modules``' default, ``core_attn``)
RECOMPUTED_MODULES = {"full": re.compile(r"\.layers\.\d+$"), "selective": re.compile(r"\.core_attention$")}


@dataclass
class ForwardCalls:
    """How often one module's forward ran, outside a backward and inside one (recomputed)."""

    forward: int = 0
    in_backward: int = 0


def recomputed_module_names(model: Any, granularity: str) -> list[str]:
    """The names of the modules of ``model`` that ``granularity`` ('full', 'selective') recomputes."""
    pattern = RECOMPUTED_MODULES[granularity]
    return [name for name, _ in model.named_modules() if pattern.search(name)]


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread (its graph task)."""
    return bool(torch._C._current_graph_task_id() != -1)


@contextlib.contextmanager
def forward_calls(model: Any, names: list[str]) -> Iterator[dict[str, ForwardCalls]]:
    """Counts, per module named, the forwards run outside and inside a backward while in the block."""
    modules = dict(model.named_modules())
    counts = {name: ForwardCalls() for name in names}
    handles = []

    def counter(calls: ForwardCalls) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            if _in_backward():
                calls.in_backward += 1
            else:
                calls.forward += 1

        return hook

    for name in names:
        handles.append(modules[name].register_forward_hook(counter(counts[name])))
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


def recompute_problem(counts: dict[str, ForwardCalls], granularity: str) -> str | None:
    """One line saying how the counted forwards fall short of recomputing (None: every module
    counted ran forward, and ran again inside the backward exactly as often)."""
    if not counts:
        return f"recompute {granularity}: the model has no module that {granularity} recompute re-runs"
    short = {
        name: calls
        for name, calls in counts.items()
        if calls.forward == 0 or calls.in_backward != calls.forward
    }
    if not short:
        return None
    return f"recompute {granularity}: forwards outside / inside the backward: " + ", ".join(
        f"{name} {calls.forward}/{calls.in_backward}" for name, calls in short.items()
    )
