"""The checkpoint file checks and atomic writes, in one process (torch only, no process group)."""

from __future__ import annotations

import os
import stat

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pytest_megatron_fsdp.checkpoint import CheckpointError, checkpoint_problems, read_tracker
from pytest_megatron_fsdp.fsdp import checkpoint as ckpt


@pytest.fixture
def saved(tmp_path):
    """A real single-process DCP checkpoint at iteration 5, in Bridge's layout."""
    iter_dir = tmp_path / "iter_0000005"
    dcp.save({"w": torch.arange(4096, dtype=torch.float32)}, checkpoint_id=iter_dir, no_dist=True)
    torch.save({"iteration": 5, "ckpt_format": "fsdp_dtensor"}, iter_dir / ckpt.TRAIN_STATE_FILE)
    (tmp_path / ckpt.TRACKER_FILE).write_text("5\n")
    return tmp_path


def test_iteration_dir_name_is_megatrons():
    assert ckpt.iteration_dir_name(5) == "iter_0000005"
    assert ckpt.iteration_dir_name(1234567) == "iter_1234567"


def test_a_complete_checkpoint_has_no_problems(saved):
    assert checkpoint_problems(saved, world_size=1) == (5, [])


def test_missing_directory(tmp_path):
    missing = tmp_path / "nope"
    assert checkpoint_problems(missing) == (None, [f"checkpoint directory {missing} does not exist"])


@pytest.mark.parametrize("content", ["", "five", "5.0"])
def test_tracker_that_is_not_a_number(saved, content):
    (saved / ckpt.TRACKER_FILE).write_text(content)
    with pytest.raises(CheckpointError, match=rf"{saved / ckpt.TRACKER_FILE} holds .* not an iteration"):
        read_tracker(saved)


def test_missing_tracker(saved):
    (saved / ckpt.TRACKER_FILE).unlink()
    iteration, problems = checkpoint_problems(saved)
    assert iteration is None and problems == [
        f"{saved / ckpt.TRACKER_FILE} does not exist: {saved} holds no completed checkpoint"
    ]


def test_tracker_naming_a_missing_iteration(saved):
    (saved / ckpt.TRACKER_FILE).write_text("9")
    _, problems = checkpoint_problems(saved)
    assert problems == [
        f"{saved / ckpt.TRACKER_FILE} names iteration 9 but {saved / 'iter_0000009'} does not exist"
    ]


def test_missing_metadata(saved):
    (saved / "iter_0000005" / ".metadata").unlink()
    _, problems = checkpoint_problems(saved)
    assert len(problems) == 1 and ".metadata is missing" in problems[0]


def test_truncated_shard_names_file_and_sizes(saved):
    shard = saved / "iter_0000005" / "__0_0.distcp"
    full = shard.stat().st_size
    os.truncate(shard, full - 1)
    _, problems = checkpoint_problems(saved)
    metadata = saved / "iter_0000005" / ".metadata"
    assert problems == [f"{shard} is truncated: {full - 1} bytes, {metadata} needs at least {full}"]


def test_shard_missing_for_a_rank(saved):
    _, problems = checkpoint_problems(saved, world_size=2)
    assert problems == [
        f"{saved / 'iter_0000005' / '__1_0.distcp'} is not in {saved / 'iter_0000005' / '.metadata'}: "
        "saved by another world size?"
    ]


def test_train_state_of_another_iteration(saved):
    torch.save(
        {"iteration": 4, "ckpt_format": "fsdp_dtensor"}, saved / "iter_0000005" / ckpt.TRAIN_STATE_FILE
    )
    _, problems = checkpoint_problems(saved)
    assert len(problems) == 1 and "says iteration 4" in problems[0]


class Payload:
    """Anything a weights_only load refuses to unpickle."""


def test_train_state_is_read_weights_only(saved):
    torch.save({"iteration": 5, "x": Payload()}, saved / "iter_0000005" / ckpt.TRAIN_STATE_FILE)
    _, problems = checkpoint_problems(saved)
    assert len(problems) == 1 and "cannot be read" in problems[0] and "weights_only" in problems[0].lower()


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    target = tmp_path / ckpt.TRACKER_FILE
    target.write_text("5\n")

    def fail(f):
        f.write(b"1")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ckpt._write_atomically(target, fail)
    assert target.read_text() == "5\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [ckpt.TRACKER_FILE]  # no temp file left


def test_atomic_write_replaces(tmp_path):
    target = tmp_path / ckpt.TRACKER_FILE
    target.write_text("5\n")
    ckpt._write_atomically(target, lambda f: f.write(b"7\n"))
    assert read_tracker(tmp_path) == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == [ckpt.TRACKER_FILE]


def test_publish_is_private_and_tracker_last(tmp_path, monkeypatch):
    """The iteration directory appears before the pointers, and the tracker is written last."""
    tmp_dir = tmp_path / "iter_0000003.tmp-x"
    tmp_dir.mkdir(mode=0o700)
    order = []
    original = ckpt._write_atomically
    monkeypatch.setattr(
        ckpt, "_write_atomically", lambda path, write: (order.append(path.name), original(path, write))
    )
    ckpt._publish(tmp_path, tmp_dir, 3, {"iteration": 3, "ckpt_format": "fsdp_dtensor"})
    assert order == [ckpt.TRAIN_STATE_FILE, ckpt.LATEST_TRAIN_STATE_FILE, ckpt.TRACKER_FILE]
    assert not tmp_dir.exists() and (tmp_path / "iter_0000003" / ckpt.TRAIN_STATE_FILE).is_file()
    assert stat.S_IMODE((tmp_path / "iter_0000003").stat().st_mode) == 0o700
    assert read_tracker(tmp_path) == 3
