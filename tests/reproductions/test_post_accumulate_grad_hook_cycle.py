"""torch alone: its garbage collector cannot collect a cycle through a tensor's post-accumulate-grad hook
(torch 2.13 and 2.14), which is why ``pytest_megatron_fsdp.fsdp.release.release_grad_hooks`` exists.

Megatron-FSDP registers one such hook per parameter, referring back to its wrapper; without the
release a wrapper, its optimizer and every parameter outlive the test. Should a torch release
collect the cycle, the first test here fails, and the release is no longer needed there.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import torch


class _Owner:
    """Holds a parameter whose hook refers back to the owner: the cycle Megatron-FSDP makes."""

    def __init__(self, register: str) -> None:
        self.param = torch.nn.Parameter(torch.zeros(1024))
        if register == "register_post_accumulate_grad_hook":
            self.handle = self.param.register_post_accumulate_grad_hook(lambda p: self.on_grad(p))
        else:
            self.handle = self.param.register_hook(lambda grad: self.on_grad(grad))

    def on_grad(self, tensor: torch.Tensor) -> None:
        pass


def _survives_gc(register: str, then: Callable[[_Owner], None] | None = None) -> bool:
    """Whether an owner built (and then changed by ``then``) survives ``gc.collect()`` once dropped.

    Built here, not by the caller: pytest's assertion rewriting would keep an argument alive."""
    owner = _Owner(register)
    if then is not None:
        then(owner)
    ref = weakref.ref(owner)
    del owner
    gc.collect()
    return ref() is not None


def test_torch_gc_cannot_collect_a_cycle_through_a_post_accumulate_grad_hook():
    """The upstream behaviour the release works around (torch 2.13 and 2.14): should a torch
    release collect this cycle, this test fails, and ``release_grad_hooks`` is no longer needed there."""
    assert _survives_gc("register_post_accumulate_grad_hook")
    assert not _survives_gc("register_hook")  # the same cycle through a tensor hook: collected


def _unset(owner: _Owner) -> None:
    owner.param._post_accumulate_grad_hooks = None  # torch still holds the old dict


def test_removing_or_clearing_the_hooks_frees_the_cycle_and_setting_none_does_not():
    post = "register_post_accumulate_grad_hook"
    assert not _survives_gc(post, lambda owner: owner.handle.remove())
    assert not _survives_gc(post, lambda owner: owner.param._post_accumulate_grad_hooks.clear())
    assert _survives_gc(post, _unset)
