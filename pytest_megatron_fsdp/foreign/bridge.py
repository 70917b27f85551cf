"""Megatron-Bridge's own tests on CPU ranks: the switches its training code needs beyond the
foreign-suite layer (``--mfsdp-foreign-suite``), each named with why.

Bridge's tests (``tests/functional_tests/test_groups/megatron_fsdp``) configure a model for GPUs:
Transformer Engine layers, TE/Apex fused kernels, pinned host memory, torch.compile'd fusions. None of
those can run on CPU ranks, and the tests run unchanged, so the switches go where Bridge reads its
configuration:

* Bridge's LoRA layers (``megatron.bridge.peft.lora_layers``, on the path of every ``import
  megatron.bridge``) import ``transformer_engine.pytorch`` at their top although Bridge declares
  Transformer Engine optional (its ``te`` extra). Without TE, that one module's own imports of
  ``transformer_engine`` get a stand-in: a call of anything in it raises ``ModuleNotFoundError`` for
  ``transformer_engine`` (a ``GPU-only: Transformer Engine`` skip). No other module sees it:
  megatron-core still finds no TE and takes its non-TE paths.
* Bridge's ``initialize_megatron`` runs ``make`` in megatron-core's ``datasets`` folder to compile
  its C++ dataset helpers, and exits when that fails. megatron-core's wheel ships them compiled
  (``helpers_cpp``) and no Makefile, so ``pretrain()`` on a registry install exits there, on GPUs as
  on CPU ranks. Where the compiled helpers import and no Makefile is beside them, that one call is
  skipped (a checkout with its Makefile still compiles).
* ``ConfigContainer.validate`` (Bridge's check of a training configuration, run by ``pretrain``)
  first switches off in the model what needs a GPU (:data:`MODEL_SWITCHES`; Bridge's default TE layer
  spec becomes its local one), pinned memory in the dataset, and torch.compile for the rest of the
  process (:data:`SWITCHES`).

Applied only once Bridge is imported: :func:`watch` puts an import hook first on ``sys.meta_path``
that acts on the three Bridge modules above and answers no other name, so a suite that never imports
``megatron.bridge`` (Megatron-LM's) runs as without it. :func:`unwatch` undoes all of it. Imports no
pytest.
"""

from __future__ import annotations

import builtins
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ..emulation import import_hooks
from ..emulation.import_hooks import nothing as _nothing

__all__ = [
    "LORA_MODULE",
    "MODEL_SWITCHES",
    "SWITCHES",
    "Switch",
    "bridge_seen",
    "switch_lines",
    "unwatch",
    "watch",
]

#: the Bridge module that imports Transformer Engine at its top; the one whose config check is switched
LORA_MODULE = "megatron.bridge.peft.lora_layers"
CONFIG_MODULE = "megatron.bridge.training.config"
#: the Bridge module whose initialisation compiles megatron-core's dataset helpers
INITIALIZE_MODULE = "megatron.bridge.training.initialize"
#: megatron-core's C++ dataset helpers, compiled
HELPERS_MODULE = "megatron.core.datasets.helpers_cpp"
#: where Bridge's GPT layer specs are (its TE default, its local one)
GPT_PROVIDER_MODULE = "megatron.bridge.models.gpt_provider"


@dataclass(frozen=True)
class Switch:
    #: what is switched, as the session start prints it
    name: str
    #: why a CPU rank needs it
    why: str

    def line(self) -> str:
        return f"megatron-fsdp: Megatron-Bridge on CPU ranks: {self.name} ({self.why})"


TE_STAND_IN = Switch(
    f"{LORA_MODULE} imports a Transformer Engine stand-in",
    "it imports transformer_engine at its top; any use raises ModuleNotFoundError, a GPU-only skip",
)
LOCAL_LAYER_SPEC = Switch(
    "default layer spec -> local_layer_spec",
    "Bridge's default builds Transformer Engine layers",
)
#: model fields switched off: (field, why)
MODEL_SWITCHES: tuple[tuple[str, str], ...] = (
    ("apply_rope_fusion", "fused RoPE needs Transformer Engine"),
    ("persist_layer_norm", "Apex's persistent LayerNorm CUDA kernel; torch's LayerNorm refuses it"),
    ("masked_softmax_fusion", "the scaled_masked_softmax_cuda kernel"),
)
PREBUILT_HELPERS = Switch(
    f"{HELPERS_MODULE} used as installed, not compiled again",
    "megatron-core's wheel ships it compiled and no Makefile; Bridge's initialize_megatron runs make "
    "there and exits",
)
PIN_MEMORY = Switch("dataset.pin_memory=False", "pinning host memory needs a CUDA driver")
EAGER = Switch(
    "torch.compile off (torch._dynamo.config.disable)",
    "Bridge warms up megatron-core's compiled fusions; Inductor asks Triton for a CUDA driver",
)
#: every switch, in the order the session start prints them
SWITCHES: tuple[Switch, ...] = (
    TE_STAND_IN,
    LOCAL_LAYER_SPEC,
    *(Switch(f"{field}=False", why) for field, why in MODEL_SWITCHES),
    PIN_MEMORY,
    EAGER,
    PREBUILT_HELPERS,
)


def _te_missing() -> bool:
    return importlib.util.find_spec("transformer_engine") is None


# -- the Transformer Engine stand-in ----------------------------------------------------------------


class _Absent(type):
    """A name of the missing Transformer Engine: its attributes are more of them
    (``te.ops.Sequential``), so annotations and ``isinstance`` checks work (nothing is an instance);
    a call raises ``ModuleNotFoundError``."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(f"{cls.__name__}.{name}", (), {})

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise ModuleNotFoundError(
            f"No module named 'transformer_engine' ({cls.__name__} is pytest-megatron-fsdp's stand-in in "
            f"{LORA_MODULE} on CPU ranks)",
            name="transformer_engine",
        )


def _stand_in_import(real: Callable[..., Any]) -> Callable[..., Any]:
    def import_(
        name: str,
        globals: dict[str, Any] | None = None,
        locals: dict[str, Any] | None = None,
        fromlist: Sequence[str] | None = (),
        level: int = 0,
    ) -> Any:
        if level == 0 and name.split(".")[0] == "transformer_engine":
            return _Absent("transformer_engine", (), {})
        return real(name, globals, locals, fromlist, level)

    return import_


def _give_te_stand_in(module: ModuleType) -> None:
    """``module``'s own import statements get the stand-in for ``transformer_engine`` (its builtins'
    ``__import__``, set before its code runs; every other module keeps the real one)."""
    own = dict(builtins.__dict__)
    own["__import__"] = _stand_in_import(builtins.__import__)
    module.__dict__["__builtins__"] = own


# -- the prebuilt dataset helpers ------------------------------------------------------------------


def _helpers_prebuilt() -> bool:
    """megatron-core's dataset helpers are installed compiled, with no Makefile to compile them again."""
    spec = importlib.util.find_spec(HELPERS_MODULE)
    if spec is None or spec.origin is None:
        return False
    return not (Path(spec.origin).parent / "Makefile").exists()


def _switch_compile_helpers(module: ModuleType) -> None:
    original = module.compile_helpers

    def compile_helpers() -> None:
        if not _helpers_prebuilt():
            original()

    compile_helpers.__doc__ = original.__doc__
    _state.replace(module, "compile_helpers", compile_helpers)


# -- the config switches ----------------------------------------------------------------------------


def switch_config(config: Any) -> None:
    """A Bridge ``ConfigContainer`` switched for CPU ranks (before Bridge validates it)."""
    model = config.model
    for field, _why in MODEL_SWITCHES:
        if hasattr(model, field):
            setattr(model, field, False)
    gpt_provider = sys.modules.get(GPT_PROVIDER_MODULE)
    if (
        gpt_provider is not None
        and getattr(model, "transformer_layer_spec", None) is gpt_provider.default_layer_spec
    ):
        model.transformer_layer_spec = gpt_provider.local_layer_spec
    if hasattr(config.dataset, "pin_memory"):
        config.dataset.pin_memory = False
    _state.eager()


def _switch_validate(module: ModuleType) -> None:
    container = module.ConfigContainer
    original = container.__dict__["validate"]

    def validate(self: Any) -> Any:
        switch_config(self)
        return original(self)

    validate.__name__ = validate.__qualname__ = original.__name__
    validate.__doc__ = original.__doc__
    _state.replace(container, "validate", validate)


# -- the import hook --------------------------------------------------------------------------------


class _BridgeHook(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: notes that Bridge is imported, wraps the loaders of the watched
    modules, and answers None for every name (the other finders find them)."""

    def __init__(self) -> None:
        self.seen = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == "megatron.bridge" or fullname.startswith("megatron.bridge."):
            self.seen = True
        if fullname == LORA_MODULE and _te_missing():
            return import_hooks.wrapped_spec(self, fullname, path, target, _give_te_stand_in, _nothing)
        if fullname == CONFIG_MODULE:
            return import_hooks.wrapped_spec(self, fullname, path, target, _nothing, _switch_validate)
        if fullname == INITIALIZE_MODULE:
            return import_hooks.wrapped_spec(self, fullname, path, target, _nothing, _switch_compile_helpers)
        return None


class _State:
    def __init__(self) -> None:
        self.hook: _BridgeHook | None = None
        self.restores: list[Callable[[], None]] = []

    def replace(self, owner: Any, name: str, value: Any) -> None:
        """``owner.name = value``, its value before put back by :func:`unwatch`."""
        before = getattr(owner, name)
        setattr(owner, name, value)
        self.restores.append(lambda: setattr(owner, name, before))

    def eager(self) -> None:
        import torch._dynamo

        if not torch._dynamo.config.disable:
            self.replace(torch._dynamo.config, "disable", True)


_state = _State()


def watch() -> None:
    """The hook on: Bridge's modules, when imported, get the switches. Idempotent."""
    if _state.hook is None:
        _state.hook = _BridgeHook()
        sys.meta_path.insert(0, _state.hook)


def unwatch() -> None:
    """Undo :func:`watch` and what the switches changed outside Bridge's configs (``validate`` restored,
    torch.compile on again). A no-op when off."""
    if _state.hook is not None and _state.hook in sys.meta_path:
        sys.meta_path.remove(_state.hook)
    _state.hook = None
    while _state.restores:
        _state.restores.pop()()


def bridge_seen() -> bool:
    """Whether this process has imported (or tried to import) ``megatron.bridge`` while watched."""
    return _state.hook is not None and _state.hook.seen


def switch_lines() -> list[str]:
    """One line per switch this process applies to Bridge (the stand-in only where TE is missing, the
    helpers only where they are prebuilt)."""
    applies = {TE_STAND_IN: _te_missing(), PREBUILT_HELPERS: _helpers_prebuilt()}
    return [s.line() for s in SWITCHES if applies.get(s, True)]
