"""The optimizer megatron-core builds on a CPU rank, made to keep state as it does on a GPU.

On a GPU runner megatron-core's Adam is Transformer Engine's ``FusedAdam``; without TE (and Apex)
it falls back to torch's ``Adam``/``AdamW`` (``megatron.core.optimizer.USING_PYTORCH_OPTIMIZER``).
The two differ in one thing Megatron-FSDP's checkpoints depend on: ``FusedAdam.step`` makes the
state of every parameter of its groups before it skips those without a gradient, torch's makes
state only for parameters with one. Megatron-FSDP gives a parameter whose local shard is empty no
gradient, so with torch's optimizer each rank holds state for other parameters: the fsdp_dtensor
optimizer state dict (``DistributedOptimizer.sharded_param_state_fsdp_dtensor``) then names
different DTensors on each rank, and Megatron-LM's and Megatron-Bridge's saves, which run one
collective per DTensor, pair different collectives and hang until the process-group timeout (a
tiny GPT on 2 ranks: state for 7 and for 24 of 28 parameters). No GPU run does that.

:class:`FusedAdamOnCpu` is torch's Adam (``adam_w_mode``: AdamW) with FusedAdam's state rule; the
emulation installs it as megatron-core's ``Adam`` when megatron-core's optimizer module is imported
(:func:`install`), as if TE's were importable. What only TE's has (its precision-aware options:
``exp_avg_dtype``, ``master_weights``, ...) raises ``ModuleNotFoundError`` for
``transformer_engine``, as megatron-core's other Transformer Engine stand-ins do on CPU ranks.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch

from . import import_hooks

#: the megatron-core module that picks the Adam class
OPTIMIZER_MODULE = "megatron.core.optimizer"
#: the keywords of TE's FusedAdam that torch's Adam has no counterpart for
_TE_ONLY = (
    "exp_avg_dtype",
    "exp_avg_sq_dtype",
    "master_weights",
    "master_weight_dtype",
    "use_decoupled_grad",
    "store_param_remainders",
)


class FusedAdamOnCpu(torch.optim.Adam):
    """torch's Adam with Transformer Engine FusedAdam's signature (``adam_w_mode``) and state rule:
    every parameter of its groups has state after a step, also one without a gradient, which the
    step leaves unchanged (no weight decay either) but counts, as FusedAdam's per-group step does.
    A parameter with a gradient at every step steps as with torch's, bit for bit."""

    #: read by the checkpoint code, which gives such an optimizer state for every parameter it loads
    keeps_state_for_every_parameter = True

    def __init__(self, params: Any, *, adam_w_mode: bool = True, **kwargs: Any) -> None:
        te_only = sorted(set(kwargs) & set(_TE_ONLY))
        if te_only:
            raise ModuleNotFoundError(
                f"No module named 'transformer_engine': FusedAdam's {', '.join(te_only)} "
                "need Transformer Engine (the CPU rank's Adam is torch's)",
                name="transformer_engine",
            )
        super().__init__(params, decoupled_weight_decay=adam_w_mode, **kwargs)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        without_grad = [
            (group, param) for group in self.param_groups for param in group["params"] if param.grad is None
        ]
        for group, param in without_grad:
            state = self.state[param]
            if not state:  # torch's own first-step state
                state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        stepped = len(without_grad) < sum(len(group["params"]) for group in self.param_groups)
        loss: float | None = super().step(closure)
        # FusedAdam counts steps per group, a parameter without a gradient included; torch per
        # parameter. Skipped parameters take the count, so every parameter's "step" is the same
        # on every rank, as a checkpoint writes it once for all ranks (a plain tensor is saved
        # from one rank).
        count = max((float(state["step"]) for state in self.state.values() if "step" in state), default=0.0)
        count += 0.0 if stepped else 1.0
        for _, param in without_grad:
            self.state[param]["step"].fill_(count)
        return loss


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class _Installed:
    """megatron-core's optimizer module with FusedAdamOnCpu as its Adam, and how to undo it."""

    def __init__(self) -> None:
        self.finder: _PatchAfterImport | None = None
        self.previous: dict[str, Any] = {}

    def patch(self, module: ModuleType) -> None:
        if not getattr(module, "USING_PYTORCH_OPTIMIZER", False):
            return  # Transformer Engine or Apex is there: its FusedAdam
        self.previous = {"Adam": module.Adam, "USING_PYTORCH_OPTIMIZER": True}
        module.Adam = FusedAdamOnCpu  # type: ignore[attr-defined]
        module.USING_PYTORCH_OPTIMIZER = False  # type: ignore[attr-defined]

    def restore(self) -> None:
        if self.finder is not None and self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)
        self.finder = None
        module = sys.modules.get(OPTIMIZER_MODULE)
        if module is not None and getattr(module, "Adam", None) is FusedAdamOnCpu:
            for name, value in self.previous.items():
                setattr(module, name, value)
        self.previous = {}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Patches megatron-core's optimizer module once its code has run (the other finders find it)."""

    def __init__(self, installed: _Installed) -> None:
        self.installed = installed

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != OPTIMIZER_MODULE:
            return None
        after = self.installed.patch
        return import_hooks.wrapped_spec(self, fullname, path, target, import_hooks.nothing, after)


_installed: _Installed | None = None


def install() -> None:
    """megatron-core's Adam on this CPU rank is :class:`FusedAdamOnCpu` (now, or once its optimizer
    module is imported). Idempotent."""
    global _installed
    if _installed is not None:
        return
    _installed = _Installed()
    module = sys.modules.get(OPTIMIZER_MODULE)
    if module is not None:
        _installed.patch(module)
    else:
        _installed.finder = _PatchAfterImport(_installed)
        sys.meta_path.insert(0, _installed.finder)


def uninstall() -> None:
    """Undo :func:`install` (megatron-core's own Adam back); a no-op when not installed."""
    global _installed
    if _installed is not None:
        _installed.restore()
        _installed = None
