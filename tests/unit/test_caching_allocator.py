"""The caching allocator's block reuse under the foreign-suite layer: a storage Megatron-FSDP V2's
DBuffer releases and grows back sits at its address again, views and contents included; any other
resize is torch's own, and everything is undone."""

import gc

import pytest
import torch
from emulation_layers import foreign_layer, forget_megatron_rng

from pytest_megatron_fsdp.emulation import caching_allocator
from pytest_megatron_fsdp.emulation import cuda as cuda_emulation
from pytest_megatron_fsdp.emulation import foreign as foreign_emulation

DBUFFER = "megatron.core.distributed.fsdp.src.megatron_fsdp.experimental.dbuffer"


@pytest.fixture(autouse=True)
def _megatron_rng_not_bound(monkeypatch):
    forget_megatron_rng(monkeypatch)


@pytest.fixture
def foreign():
    with foreign_layer():
        yield


def _resize_storage_of(module):
    """DBuffer._resize_storage as V2 writes it, defined in ``module``."""
    namespace = {"__name__": module}
    exec(
        "def _resize_storage(buffer, numel):\n"
        "    buffer.untyped_storage().resize_(numel * buffer.element_size())\n",
        namespace,
    )
    return namespace["_resize_storage"]


@pytest.mark.parametrize("module", [DBUFFER, "megatron_fsdp.experimental.dbuffer"])
def test_a_released_buffer_grows_back_at_its_address(foreign, module):
    assert ("megatron_fsdp.experimental.dbuffer", "_resize_storage") in caching_allocator.BLOCK_REUSERS
    resize = _resize_storage_of(module)
    buffer = torch.arange(16, dtype=torch.float32)
    view = buffer[4:8]  # autograd keeps views of the storage across the release
    address, view_address = buffer.data_ptr(), view.data_ptr()
    for _ in range(3):
        resize(buffer, 0)
        assert buffer.untyped_storage().nbytes() == 0  # released: reads 0 bytes
        resize(buffer, buffer.numel())
        assert buffer.untyped_storage().nbytes() == 64
        assert (buffer.data_ptr(), view.data_ptr()) == (address, view_address)
    assert buffer.tolist() == [float(i) for i in range(16)]  # the block's contents, as a GPU's
    view.fill_(7.0)
    assert buffer[4:8].tolist() == [7.0] * 4


def test_every_other_resize_is_torchs_own(foreign):
    other = _resize_storage_of("tests.some_test_module")
    buffer = torch.zeros(16)
    other(buffer, 0)
    other(buffer, 16)
    assert buffer.untyped_storage().nbytes() == 64
    # grown to another size, or grown without a release: torch's resize (a new block, contents kept)
    resize = _resize_storage_of(DBUFFER)
    buffer = torch.ones(16)
    resize(buffer, 0)
    resize(buffer, 32)
    assert buffer.untyped_storage().nbytes() == 128
    resize(buffer, 8)
    assert buffer.untyped_storage().nbytes() == 32


def test_a_dead_storages_block_is_freed_and_the_layer_undone():
    original = torch.UntypedStorage.resize_
    cuda_emulation.enable()
    foreign_emulation.enable(2, 0, 60)
    try:
        resize = _resize_storage_of(DBUFFER)
        buffer = torch.ones(16)
        resize(buffer, 0)
        blocks = torch.UntypedStorage.resize_.released.blocks
        assert len(blocks) == 1
        del buffer
        gc.collect()
        resize(torch.ones(4), 0)  # the next call frees the dead storage's block, holds the new one's
        assert len(blocks) == 1
    finally:
        foreign_emulation.disable()
        cuda_emulation.disable()
    assert torch.UntypedStorage.resize_ is original
