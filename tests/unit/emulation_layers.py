"""What the unit tests of the CUDA emulation and of the foreign-suite layer over it share."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import pytest

from pytest_megatron_fsdp.emulation import cuda as cuda_emulation
from pytest_megatron_fsdp.emulation import foreign as foreign_emulation


def forget_megatron_rng(monkeypatch: pytest.MonkeyPatch) -> None:
    """The emulation's ``enable()`` refuses once megatron's RNG module is imported (it binds
    ``torch.cuda._lazy_call`` by name), and an earlier test file in this process may have imported
    it. These tests use no megatron: the module is hidden for the test, restored after."""
    monkeypatch.delitem(sys.modules, "megatron.core.tensor_parallel.random", raising=False)


@contextlib.contextmanager
def foreign_layer(local_world_size: int = 2, local_rank: int = 0) -> Iterator[None]:
    """The emulation and the foreign-suite layer over it, on for the block (process groups capped
    at 60 s), then both undone."""
    cuda_emulation.enable()
    foreign_emulation.enable(local_world_size=local_world_size, local_rank=local_rank, pg_timeout_s=60)
    try:
        yield
    finally:
        foreign_emulation.disable()
        cuda_emulation.disable()
