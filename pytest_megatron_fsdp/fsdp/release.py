"""A run's model and optimizer end with their test: release what keeps them alive, then check.

Megatron-FSDP (megatron-core 0.16 to 0.19, and the standalone megatron-fsdp 0.6) registers, for
every parameter, ``param.register_post_accumulate_grad_hook(lambda p: ...)`` whose closure holds
the wrapper, which holds the parameter. torch keeps a tensor's ``_post_accumulate_grad_hooks``
dict where the garbage collector cannot follow it, so that cycle is never collected: every wrapper
would outlive its test with its parameters, gradients and optimizer state (the same cycle through
``register_hook`` is collected; ``tests/unit/test_model_release.py`` shows both with torch alone).
:func:`release_grad_hooks` removes those hooks (:func:`release_method_caches` the method caches
that hold a module, :func:`wait_pending_collectives` the collectives a wrapper left in flight);
:class:`RunWatch` checks, once the test is over, that nothing of it is still reachable and, on GPUs,
that the CUDA memory it allocated is free.

Imports torch at module level: loaded only inside a rank that builds a run.
"""

from __future__ import annotations

import gc
import sys
import types
import warnings
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

#: objects a leftover search visits at most (a leaked model is a few thousand; this bounds the cost)
_WALK_LIMIT = 1_000_000
#: most garbage collections a check runs while watched objects are still alive
_COLLECT_PASSES = 3
_frozen = False


def release_grad_hooks(*modules: torch.nn.Module | None) -> int:
    """Remove the post-accumulate-grad hooks that keep ``modules`` alive; returns how many.

    Two places, as the hooks may sit on parameters the module no longer shows (Megatron-FSDP swaps
    its parameters for DTensors around ``state_dict``): every handle a Megatron-FSDP wrapper keeps
    in ``grad_acc_hooks``, and every post-accumulate hook still on a parameter of the modules.
    Clearing the dict matters: setting ``_post_accumulate_grad_hooks = None`` leaves torch's own
    reference to the old dict, closures and all, in place.
    """
    removed = 0
    for module in modules:
        if module is None:
            continue
        for submodule in module.modules():
            handles = getattr(submodule, "grad_acc_hooks", None)
            if isinstance(handles, dict):
                for handle in handles.values():
                    handle.remove()
                removed += len(handles)
                handles.clear()
        for param in module.parameters():
            hooks = param._post_accumulate_grad_hooks
            if hooks:
                removed += len(hooks)
                hooks.clear()
    return removed


def release_autograd_graphs(*modules: torch.nn.Module | None) -> int:
    """Drop the tensors of the last forward's autograd graph that the modules keep; returns how many.

    A tensor with a ``grad_fn`` holds its graph, down to the ``AccumulateGrad`` nodes of the
    parameters, and those hold the hooks Megatron DDP registers on them (``grad_acc.register_hook``),
    whose closures hold the wrapper: a cycle through autograd's C++ nodes, which the garbage
    collector cannot see. megatron-core's MoE layer keeps such a tensor on its token dispatcher, a
    plain object beside the modules (``MoEAllGatherTokenDispatcher.local_probs``, Megatron-LM main of
    2026-08-22), so a MoE model under DDP outlived its test. Looks at every module's attributes and
    at the attributes of the plain objects among them (one level); the run is closing, so nothing
    reads them again.
    """
    dropped = 0
    for module in modules:
        if module is None:
            continue
        for submodule in module.modules():
            holders: list[Any] = [submodule]
            holders += [
                value
                for value in vars(submodule).values()
                if hasattr(value, "__dict__")
                and not isinstance(value, (torch.nn.Module, type, types.ModuleType))
            ]
            for holder in holders:
                for name, value in list(vars(holder).items()):
                    if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                        setattr(holder, name, None)
                        dropped += 1
    return dropped


def release_method_caches(*modules: torch.nn.Module | None) -> int:
    """Clear the ``functools.lru_cache`` of every method of the modules' classes; returns how many.

    A cache on a method is one per class and keys on ``self``: megatron-core's
    ``RotaryEmbedding.forward`` (``@lru_cache(maxsize=32)``, 0.16.1 and 0.19.2) keeps the last 32
    embeddings that called it, each holding its model config and, through the config's
    ``grad_scale_func``, the optimizer, so a RoPE model outlived its test. (Megatron-LM PR #2229
    clears the same kind of cache on YarnRotaryEmbedding for a memory leak.) Clearing a cache
    costs only a recomputation in other runs of that class.
    """
    cleared = 0
    classes = {type(m) for module in modules if module is not None for m in module.modules()}
    for cls in classes:
        for klass in cls.__mro__:
            for attribute in vars(klass).values():
                cache_info = getattr(attribute, "cache_info", None)  # a functools.lru_cache
                if callable(cache_info) and hasattr(attribute, "cache_clear") and cache_info().currsize:
                    attribute.cache_clear()
                    cleared += 1
    return cleared


def wait_pending_collectives(*modules: torch.nn.Module | None) -> int:
    """Wait for the parameter all-gathers a Megatron-FSDP wrapper left in flight; returns how many.

    megatron-core's ``DistributedOptimizer.step()`` calls the wrapper's ``start_param_sync()``,
    which starts the next forward's all-gathers (3 with the tiny preset and ``optim_grads_params``,
    1 with ``optim_grads``, none with ``no_shard``): the last step of a run leaves them in flight,
    never waited. torch's
    ProcessGroupNCCL keeps the tensors of an async collective (``TORCH_NCCL_AVOID_RECORD_STREAMS``'s
    stash: the all-gather's input is a view of the whole sharded weight buffer) until ``wait()``,
    or, when nobody waits, until the next collective on that process group, which is the next
    test's: the first test of a process kept its model's weight buffer allocated after it. The
    wrapper's own ``synchronize_param_gather()`` waits them and frees the unsharded buckets; its
    warning that there were pending all-gathers is expected here and not shown. Only while the
    ranks still run collectives together: after a failure that released them, a wait could block.
    """
    waited = 0
    for wrapper, pending in _all_gathers_in_flight(modules):
        waited += pending
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="There are still pending all-gather tasks")
            wrapper.synchronize_param_gather()
    return waited


def pending_all_gathers(*modules: torch.nn.Module | None) -> int:
    """How many parameter all-gathers the Megatron-FSDP wrappers in ``modules`` have in flight."""
    return sum(pending for _, pending in _all_gathers_in_flight(modules))


def _all_gathers_in_flight(modules: Iterable[torch.nn.Module | None]) -> list[tuple[Any, int]]:
    """(wrapper, all-gathers in flight) for every Megatron-FSDP wrapper with some in ``modules``.

    The wrapper's all-gather pipeline keeps each async all-gather until a bucket's user waits it
    (``param_gather_event_map``, megatron-core 0.16 to 0.19 and megatron-fsdp 0.6 alike).
    """
    found: list[tuple[Any, int]] = []  # Any: a Megatron-FSDP wrapper (megatron ships no type hints)
    for module in modules:
        if module is None:
            continue
        for submodule in module.modules():
            pipeline = getattr(submodule, "all_gather_pipeline", None)
            pending = getattr(pipeline, "param_gather_event_map", None)
            if pending and hasattr(submodule, "synchronize_param_gather"):
                found.append((submodule, len(pending)))
    return found


def freeze_existing_objects() -> None:
    """Once per process: exclude what is alive now (imports, collected tests) from later collections.

    After each test :meth:`RunWatch.leftovers` runs a full ``gc.collect()``; over the ~400,000
    objects torch and megatron create at import that takes 0.2-0.6 s per test on a 2-core machine,
    over the objects created since ~3 ms. Frozen objects are never collected, so call this before
    the first run is built: what exists then lives as long as the process anyway.
    """
    global _frozen
    if not _frozen:
        _frozen = True
        gc.freeze()


@dataclass(frozen=True)
class Leftovers:
    """What of a test is still alive after it ended."""

    #: "FullyShardedDataParallel (run 1's model)", ... for every watched object still reachable
    alive: list[str]
    #: bytes of tensor storage reachable from them (each storage counted once)
    tensor_bytes: int
    #: CUDA bytes allocated now minus before the test (GPU ranks; None on CPU ranks)
    cuda_bytes: int | None
    #: module globals that hold them (a hint for the user; other holders are not searched)
    holders: list[str]

    def describe(self, what: str = "the test's runs") -> str:
        lines = []
        if self.alive:
            lines.append(
                f"{what} outlived the test: {', '.join(self.alive)} still reachable after the test, "
                f"its fixtures' teardown and gc.collect(), holding {_size(self.tensor_bytes)} of tensors"
            )
            if self.holders:
                lines.append("held by the module global(s): " + ", ".join(self.holders))
            lines.append(
                "something outside the test keeps them: a module global, a class attribute, a fixture of "
                "wider scope, a hook registered elsewhere (see README, 'A wrapped model outlives its test')"
            )
        if self.cuda_bytes:
            lines.append(
                f"{_size(self.cuda_bytes)} of CUDA memory allocated during the test are still allocated "
                "after it (torch.cuda.memory_allocated(), cuBLAS workspaces cleared)"
            )
        return "; ".join(lines[:1]) + "".join(f"\n{line}" for line in lines[1:])


class RunWatch:
    """Weak references to what one test built, and the CUDA memory allocated before it built them.

    ``watch()`` each run's wrapper and optimizer when it is built; ``leftovers()`` after the test
    (and everything pytest keeps of it) is gone collects garbage and says what is still alive.
    """

    def __init__(self, device: str) -> None:
        self.device = device
        self._watched: list[tuple[str, weakref.ref[Any]]] = []
        self._cuda_before = _cuda_allocated(device)

    def watch(self, label: str, obj: Any) -> None:
        """``label`` names ``obj`` in a report (e.g. ``"run 1's model"``); ``None`` is ignored."""
        if obj is not None:
            self._watched.append((f"{type(obj).__name__} ({label})", weakref.ref(obj)))

    def leftovers(self) -> Leftovers | None:
        """None when every watched object is gone and, on GPUs, the test's CUDA memory is free."""
        if not self._watched and self._cuda_before is None:
            return None
        for _ in range(_COLLECT_PASSES):
            # One pass may only run finalizers and weakref callbacks that release the rest (a
            # run whose backward raised, measured with FSDP2): collect again while that helps.
            if not gc.collect() or all(ref() is None for _, ref in self._watched):
                break
        live = [(label, ref) for label, ref in self._watched if ref() is not None]
        cuda = None
        if self._cuda_before is not None:
            after = _cuda_allocated(self.device)
            cuda = max(0, (after or 0) - self._cuda_before)
        if not live and not cuda:
            return None
        refs = [ref for _, ref in live]
        return Leftovers(
            alive=[label for label, _ in live],
            tensor_bytes=reachable_tensor_bytes(obj for ref in refs if (obj := ref()) is not None),
            cuda_bytes=cuda,
            holders=_module_globals_holding(refs),
        )


def reachable_tensor_bytes(roots: Iterable[Any]) -> int:
    """Bytes of tensor storage reachable from ``roots`` (each storage once; module globals not followed)."""
    storages: dict[tuple[str, int], int] = {}
    seen: set[int] = set()
    stack = list(roots)
    while stack and len(seen) < _WALK_LIMIT:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (types.ModuleType, type, types.FrameType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            _add_storage(storages, obj)
            stack.extend(t for t in (obj.grad, getattr(obj, "_local_tensor", None)) if t is not None)
        if isinstance(obj, types.FunctionType):
            # a closure's cells and defaults, not the globals of the module it was defined in
            stack.extend(cell.cell_contents for cell in obj.__closure__ or () if _filled(cell))
            stack.extend(obj.__defaults__ or ())
            continue
        stack.extend(gc.get_referents(obj))
    return sum(storages.values())


def _add_storage(storages: dict[tuple[str, int], int], tensor: torch.Tensor) -> None:
    try:
        storage = tensor.untyped_storage()
        size = storage.nbytes()
        if size:
            storages[(str(storage.device), storage.data_ptr())] = size
    except (RuntimeError, NotImplementedError):  # meta tensors, wrapper subclasses without storage
        pass


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _module_globals_holding(refs: list[weakref.ref[Any]], limit: int = 4) -> list[str]:
    """Module globals that hold a live object, directly or in a list, tuple, set or dict they hold.

    The common way a model outlives its test; other holders (a closure, a registry inside a
    library) are not searched, so this may be empty.
    """
    targets = {id(obj) for ref in refs if (obj := ref()) is not None}
    found: list[str] = []
    for module_name, module in list(sys.modules.items()):
        for name, value in list(getattr(module, "__dict__", {}).items()):
            members = _stored_members(value)
            if id(value) in targets or any(id(m) in targets for m in members):
                found.append(f"{module_name}.{name}")
                if len(found) >= limit:
                    return found
    return found


def _stored_members(value: Any) -> Iterable[Any]:
    """What a container global holds, read through the builtin type's own methods: a subclass's may do
    anything. transformers' auto-class registries (``_LazyAutoMapping``, an ``OrderedDict``) import every
    model on ``values()`` and raise for one a release lacks; Megatron-Bridge imports them in every process
    it runs in."""
    if isinstance(value, dict):
        return list(dict.values(value))
    if isinstance(value, list):
        return list(list.__iter__(value))
    if isinstance(value, tuple):
        return list(tuple.__iter__(value))
    if isinstance(value, set):
        return list(set.__iter__(value))
    if isinstance(value, frozenset):
        return list(frozenset.__iter__(value))
    return ()


def _cuda_allocated(device: str) -> int | None:
    """CUDA bytes allocated on ``device`` now (cuBLAS workspaces, cached per stream, freed first);
    None on CPU ranks."""
    if not device.startswith("cuda"):
        return None
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    return int(torch.cuda.memory_allocated(device))


def _size(n: int) -> str:
    return f"{n / 2**20:.2f} MiB ({n:,} bytes)"
