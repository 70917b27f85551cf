"""The CUDA caching allocator's block reuse, for a storage that is released and grown back.

Megatron-FSDP V2 frees a buffer's memory between uses without replacing its storage object
(``DBuffer.release_storage``: ``untyped_storage().resize_(0)``, views saved by autograd keep the
storage) and grows it back before the next use (``reallocate_storage``: ``resize_(nbytes)``). On a
GPU the caching allocator hands the freed block back: the buffer and every view of it sit at the
address they had, which V2's tests assert (``test_release_and_reallocate_storage_preserves_buffer_views``).
The CPU allocator gives a new address every time. Under the foreign-suite layer, a CPU storage
released this way by a caller in :data:`BLOCK_REUSERS` keeps its block aside (swapped out, not
freed: the storage reads 0 bytes) and gets it back when the same caller grows it to the same size;
any other resize is torch's own. A block whose storage has died is freed at the next such call.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["BLOCK_REUSERS", "apply"]

#: torch's storage class (its private weak-reference and swap methods are unannotated in its hints)
_Storage: Any = torch.UntypedStorage

#: (module, function) whose ``UntypedStorage.resize_`` calls release and grow back a storage's block.
#: ``module`` matches the caller's module name or its tail after a dot (Megatron-FSDP ships as
#: ``megatron_fsdp`` and inside megatron-core).
BLOCK_REUSERS: frozenset[tuple[str, str]] = frozenset(
    {("megatron_fsdp.experimental.dbuffer", "_resize_storage")}
)


def _a_block_reuser(caller: Any) -> bool:
    module = caller.f_globals.get("__name__") or ""
    return any(
        caller.f_code.co_name == function and (module == owner or module.endswith("." + owner))
        for owner, function in BLOCK_REUSERS
    )


class _ReleasedBlocks:
    """The blocks set aside, by their storage (its ``_cdata``, with a weak reference that keeps the
    address from being reused while it is held): a dead storage's block is freed."""

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original
        self.blocks: dict[int, tuple[Any, Any]] = {}

    def _drop_dead(self) -> None:
        for key, (ref, _) in list(self.blocks.items()):
            if _Storage._expired(ref):
                del self.blocks[key]
                _Storage._free_weak_ref(ref)

    def resize_(self, storage: Any, size: int) -> Any:
        self._drop_dead()
        held = self.blocks.get(storage._cdata)
        if size == 0 and held is None and storage.nbytes() > 0:
            block = _Storage(0)
            storage._swap_data_ptr_(block)  # the storage reads 0 bytes; the block keeps its memory
            self.blocks[storage._cdata] = (storage._weak_ref(), block)
            return storage
        if held is not None and storage.nbytes() == 0 and held[1].nbytes() == size:
            del self.blocks[storage._cdata]
            storage._swap_data_ptr_(held[1])  # the very block it had, at its address
            _Storage._free_weak_ref(held[0])
            return storage
        return self.original(storage, size)  # torch's own


def apply(patch: Callable[[Any, str, Any], None]) -> None:
    """Set the block-reusing ``resize_`` with ``patch(owner, name, value)`` (a
    :class:`.cuda.PatchSet`'s, which undoes it)."""
    released = _ReleasedBlocks(torch.UntypedStorage.resize_)

    def resize_(self: Any, size: int) -> Any:
        if self.device.type == "cpu" and _a_block_reuser(sys._getframe(1)):
            return released.resize_(self, size)
        return released.original(self, size)  # torch's own

    resize_.__doc__ = torch.UntypedStorage.resize_.__doc__
    resize_.released = released  # type: ignore[attr-defined]  # what it holds, for its tests
    patch(torch.UntypedStorage, "resize_", resize_)
