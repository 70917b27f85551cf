"""pytest-xdist on a GPU node: the slice of GPUs each worker's rank sets get, planned in process."""

import pytest

from pytest_megatron_fsdp.parent import gpu_slices

EIGHT = [str(i) for i in range(8)]


def test_four_workers_of_world_size_two_split_eight_gpus_in_worker_order():
    slices = [gpu_slices.worker_slice(EIGHT, 4, gpu_slices.worker_index(f"gw{i}", 4), 2) for i in range(4)]
    assert [",".join(s) for s in slices] == ["0,1", "2,3", "4,5", "6,7"]


def test_five_workers_are_one_usage_line_naming_the_numbers_and_the_fix(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(gpu_slices.GpuSliceError) as raised:
        gpu_slices.worker_slice(EIGHT, 5, 0, 2)
    assert str(raised.value) == (
        "-n 5 workers x world_size=2 need 10 GPUs, 8 visible (all devices); use -n 4 or fewer, "
        "or --mfsdp-platform=cpu"
    )


def test_the_callers_visible_devices_are_sliced_in_their_order(monkeypatch):
    monkeypatch.setattr(gpu_slices.platform, "visible_gpu_count", lambda fast=False: 4)
    assert gpu_slices.device_ids({"CUDA_VISIBLE_DEVICES": "7, 5,3,1"}) == ["7", "5", "3", "1"]
    assert gpu_slices.device_ids({}) == ["0", "1", "2", "3"]
    # more ids than CUDA sees: only the first ones exist
    assert gpu_slices.device_ids({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5"}) == ["0", "1", "2", "3"]
    assert gpu_slices.worker_slice(["7", "5", "3", "1"], 2, 1, 2) == ["3", "1"]
