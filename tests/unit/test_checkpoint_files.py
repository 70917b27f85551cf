"""The checkpoint file checks, digests and atomic writes, in one process (torch only, no process group).

The checkpoints here are real: DCP writes them through the harness's digesting writer, and rank 0's
sealing and publishing steps run as in a save.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import stat
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pytest_megatron_fsdp.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    checkpoint_problems,
    read_tracker,
)
from pytest_megatron_fsdp.fsdp import checkpoint as ckpt
from pytest_megatron_fsdp.fsdp import integrity
from pytest_megatron_fsdp.fsdp.layout import DIGESTS_FILE, is_partial_save_dir, partial_save_dir_name

TRAIN_STATE = {"iteration": 5, "ckpt_format": "fsdp_dtensor"}


def _save(root, iteration=5, *, seal=True):
    """A single-process DCP checkpoint at ``iteration``, saved and published as a save does."""
    tmp_dir = root / partial_save_dir_name(iteration, "ab12")
    tmp_dir.mkdir(mode=0o700)  # as rank 0 makes it
    writer = ckpt._DigestingWriter(tmp_dir)
    state = {"w": torch.arange(4096, dtype=torch.float32), "meta": {"note": "pickled object"}}
    dcp.save(state, storage_writer=writer, no_dist=True)
    train_state = {**TRAIN_STATE, "iteration": iteration}
    if seal:
        ckpt._seal(tmp_dir, train_state, writer.digests)
    else:  # as a save did before digests existed
        torch.save(train_state, tmp_dir / ckpt.TRAIN_STATE_FILE)
    ckpt._publish(root, tmp_dir, iteration, train_state)
    return writer


@pytest.fixture
def saved(tmp_path):
    """A checkpoint at iteration 5, in Bridge's layout, with digests."""
    _save(tmp_path)
    return tmp_path


@pytest.fixture
def legacy(tmp_path):
    """The same, as saved before digests existed (no digests.json)."""
    _save(tmp_path, seal=False)
    return tmp_path


def _flip(path, offset=None, count=64):
    """Invert ``count`` bytes in the middle of ``path``: same size, other content."""
    data = bytearray(path.read_bytes())
    start = len(data) // 2 if offset is None else offset
    for i in range(start, min(start + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_iteration_dir_name_is_megatrons():
    assert ckpt.iteration_dir_name(5) == "iter_0000005"
    assert ckpt.iteration_dir_name(1234567) == "iter_1234567"


def test_a_complete_checkpoint_has_no_problems(saved):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # verified: no "not verified" warning
        assert checkpoint_problems(saved) == (5, [])


def test_every_file_of_the_iteration_has_a_digest(saved):
    iter_dir = saved / "iter_0000005"
    manifest = json.loads((iter_dir / DIGESTS_FILE).read_text())
    assert manifest["algorithm"] == "sha256"
    names = sorted(p.name for p in iter_dir.iterdir() if p.name != DIGESTS_FILE)
    assert names == [".metadata", "__0_0.distcp", "train_state.pt"]
    assert sorted(manifest["files"]) == names
    for name in names:
        on_disk = integrity.file_digest(iter_dir / name)
        assert manifest["files"][name] == {"bytes": on_disk.bytes, "digest": on_disk.digest}


def test_digests_taken_while_dcp_writes_match_the_files(tmp_path):
    writer = _save(tmp_path)
    shard = tmp_path / "iter_0000005" / "__0_0.distcp"
    assert writer.digests["__0_0.distcp"] == integrity.file_digest(shard)


def test_hashing_stream_gives_up_on_out_of_order_writes(tmp_path):
    with open(tmp_path / "f", "wb") as f:
        stream = integrity.HashingStream(f)
        stream.write(b"abcd")
        assert stream.result() == integrity.FileDigest(4, hashlib.sha256(b"abcd").hexdigest())
        stream.seek(0)
        stream.write(b"x")
        assert stream.result() is None  # the file is then hashed from disk


def test_a_flipped_byte_in_a_shard_is_named(saved):
    shard = saved / "iter_0000005" / "__0_0.distcp"
    size = shard.stat().st_size
    _flip(shard)
    assert shard.stat().st_size == size
    _, problems = checkpoint_problems(saved)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{shard} does not match its sha256 digest in ")
    assert "its content changed after the save" in problems[0]


def test_a_damaged_metadata_file_is_refused_before_it_is_unpickled(saved, monkeypatch):
    metadata = saved / "iter_0000005" / ".metadata"
    _flip(metadata, offset=metadata.stat().st_size - 80, count=8)

    def unpickle(*args, **kwargs):
        raise AssertionError("the damaged .metadata was unpickled")

    monkeypatch.setattr(dcp.FileSystemReader, "read_metadata", unpickle)
    _, problems = checkpoint_problems(saved)
    assert len(problems) == 1
    assert problems[0].startswith(f"{metadata} does not match its sha256 digest")


def test_a_damaged_train_state_is_named(saved):
    train_state = saved / "iter_0000005" / ckpt.TRAIN_STATE_FILE
    with open(train_state, "ab") as f:
        f.write(b"x")
    _, problems = checkpoint_problems(saved)
    assert problems == [
        f"{train_state} has {train_state.stat().st_size} bytes, "
        f"{saved / 'iter_0000005' / DIGESTS_FILE} recorded {train_state.stat().st_size - 1}"
    ]


def test_a_file_without_a_digest_is_named(saved):
    manifest_path = saved / "iter_0000005" / DIGESTS_FILE
    manifest = json.loads(manifest_path.read_text())
    del manifest["files"]["__0_0.distcp"]
    manifest_path.write_text(json.dumps(manifest))
    _, problems = checkpoint_problems(saved)
    assert problems == [
        f"{saved / 'iter_0000005' / '__0_0.distcp'} has no digest in {manifest_path}: "
        "its content cannot be verified"
    ]


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("{not json", "is not a valid digest manifest (JSONDecodeError"),
        ('{"files": {}}', "is not a valid digest manifest (KeyError"),
        ('{"algorithm": "md5", "files": {}}', "uses digest algorithm 'md5'; this version verifies 'sha256'"),
    ],
)
def test_an_unusable_digest_manifest_is_named(saved, content, expected):
    manifest_path = saved / "iter_0000005" / DIGESTS_FILE
    manifest_path.write_text(content)
    _, problems = checkpoint_problems(saved)
    assert len(problems) == 1
    assert problems[0].startswith(f"{manifest_path} ")
    assert expected in problems[0]


def test_a_checkpoint_without_digests_loads_with_a_warning(legacy):
    assert not (legacy / "iter_0000005" / DIGESTS_FILE).exists()
    with pytest.warns(CheckpointWarning, match=r"iter_0000005 has no digests\.json .*not verified"):
        assert checkpoint_problems(legacy) == (5, [])


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
    assert iteration is None
    assert problems == [f"{saved / ckpt.TRACKER_FILE} does not exist: {saved} holds no completed checkpoint"]


def test_tracker_naming_a_missing_iteration(saved):
    (saved / ckpt.TRACKER_FILE).write_text("9")
    _, problems = checkpoint_problems(saved)
    assert problems == [
        f"{saved / ckpt.TRACKER_FILE} names iteration 9 but {saved / 'iter_0000009'} does not exist"
    ]


def test_missing_metadata(saved):
    (saved / "iter_0000005" / ".metadata").unlink()
    _, problems = checkpoint_problems(saved)
    assert len(problems) == 1
    assert ".metadata is missing" in problems[0]


def test_truncated_shard_names_file_and_sizes(legacy):
    shard = legacy / "iter_0000005" / "__0_0.distcp"
    full = shard.stat().st_size
    os.truncate(shard, full - 1)
    _, problems = checkpoint_problems(legacy)
    metadata = legacy / "iter_0000005" / ".metadata"
    assert problems == [f"{shard} is truncated: {full - 1} bytes, {metadata} needs at least {full}"]


def test_missing_shard_named_in_the_metadata(legacy):
    shard = legacy / "iter_0000005" / "__0_0.distcp"
    shard.unlink()
    _, problems = checkpoint_problems(legacy)
    assert problems == [f"{shard} is missing (named in {legacy / 'iter_0000005' / '.metadata'})"]


def test_shard_files_are_found_through_the_metadata_not_by_rank(saved):
    """Loading at another world size reads the byte ranges .metadata names, whoever wrote them:
    a shard file under another name is fine as long as the metadata names it."""
    iter_dir = saved / "iter_0000005"
    metadata = dcp.FileSystemReader(iter_dir).read_metadata()
    for info in metadata.storage_data.values():
        info.relative_path = "__3_0.distcp"  # as if rank 3 of a 4-rank job had written it
    (iter_dir / "__0_0.distcp").rename(iter_dir / "__3_0.distcp")
    import pickle

    (iter_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    (iter_dir / DIGESTS_FILE).unlink()
    with pytest.warns(CheckpointWarning):
        assert checkpoint_problems(saved) == (5, [])


def test_train_state_of_another_iteration(legacy):
    torch.save(
        {"iteration": 4, "ckpt_format": "fsdp_dtensor"}, legacy / "iter_0000005" / ckpt.TRAIN_STATE_FILE
    )
    _, problems = checkpoint_problems(legacy)
    assert len(problems) == 1
    assert "says iteration 4" in problems[0]


def test_a_megatron_bridge_checkpoint_without_its_config_is_refused_in_one_line(legacy):
    """Bridge writes ``train_state.pt`` too, with its own TrainState's entries (as tensors); without
    Bridge's ``run_config.yaml`` (its sizes and seed) the loader cannot read it, and says so."""
    bridge_state = {
        "step": torch.tensor(5),
        "consumed_train_samples": torch.tensor(40),
        "skipped_train_samples": torch.tensor(0),
        "consumed_valid_samples": torch.tensor(0),
        "floating_point_operations_so_far": torch.tensor(0.0, dtype=torch.float64),
        "do_train": torch.tensor(True),
        "do_valid": torch.tensor(False),
        "do_test": torch.tensor(False),
    }
    torch.save(bridge_state, legacy / "iter_0000005" / ckpt.TRAIN_STATE_FILE)
    _, problems = checkpoint_problems(legacy)
    assert problems == [
        f"{legacy / 'iter_0000005' / ckpt.TRAIN_STATE_FILE} is Megatron-Bridge's train state (step 5): "
        f"{legacy / 'iter_0000005'} is a Megatron-Bridge checkpoint, which this loader reads only into a "
        "megatron-core run and with Bridge's run_config.yaml beside it; resume it with Megatron-Bridge "
        "(checkpoint.load)"
    ]


def test_the_plugins_train_state_with_bridges_entries_is_not_taken_for_bridges(legacy):
    """The plugin's own train state carries Bridge's entries too: it is still read as the plugin's."""
    from pytest_megatron_fsdp.fsdp.megatron_layout import bridge_train_state

    path = legacy / "iter_0000005" / ckpt.TRAIN_STATE_FILE
    torch.save({**torch.load(path, weights_only=True), **bridge_train_state(5, 40)}, path)
    assert checkpoint_problems(legacy) == (5, [])


BRIDGE_RUN_CONFIG = """\
_target_: megatron.bridge.training.config.ConfigContainer
model:
  tensor_model_parallel_size: 1
  pipeline_model_parallel_size: 1
  context_parallel_size: 1
train:
  global_batch_size: 8
ddp:
  data_parallel_sharding_strategy: optim_grads_params
rng:
  seed: 1234
"""


def _bridge_checkpoint(root, *, step=5, saved_iteration=5):
    """A checkpoint in Megatron-Bridge's layout: its DCP entries (``iteration`` among them), its own
    ``train_state.pt`` (Bridge's TrainState entries only), its ``run_config.yaml``, no digests."""
    from pytest_megatron_fsdp.fsdp.megatron_layout import bridge_train_state

    iter_dir = root / ckpt.iteration_dir_name(5)
    iter_dir.mkdir()
    dcp.save({"iteration": saved_iteration, "w": torch.ones(8)}, checkpoint_id=iter_dir, no_dist=True)
    torch.save(bridge_train_state(step, 40), iter_dir / ckpt.TRAIN_STATE_FILE)
    (iter_dir / "run_config.yaml").write_text(BRIDGE_RUN_CONFIG)
    (root / ckpt.TRACKER_FILE).write_text("5")
    return iter_dir


def _assert_pyyaml_is_asked_for(root):
    """Where PyYAML is missing (the floor stack, which has no Bridge), a Bridge checkpoint's config
    cannot be read: one problem line saying what to install."""
    _, problems = checkpoint_problems(root)
    assert len(problems) == 1, problems
    assert "(Megatron-Bridge's config) needs PyYAML to be read: pip install pyyaml" in problems[0], problems


def test_a_megatron_bridge_checkpoint_is_read_from_its_entries_and_config(tmp_path):
    """Its train state from the ``iteration`` entry and Bridge's ``run_config.yaml`` (PyYAML, which
    Bridge installs; without it, one line saying so); not verified (no digests)."""
    from pytest_megatron_fsdp.fsdp.megatron_layout import train_state_without_file

    iter_dir = _bridge_checkpoint(tmp_path)
    if importlib.util.find_spec("yaml") is None:
        _assert_pyyaml_is_asked_for(tmp_path)
        return
    with pytest.warns(CheckpointWarning, match="written by Megatron-LM or Megatron-Bridge"):
        assert checkpoint_problems(tmp_path) == (5, [])
    state = train_state_without_file(iter_dir, dcp.FileSystemReader(iter_dir).read_metadata())
    assert state is not None
    assert (state["iteration"], state["global_batch_size"], state["seed"]) == (5, 8, 1234)
    assert state["sharding_strategy"] == "optim_grads_params"


def test_a_megatron_bridge_checkpoint_whose_step_and_entries_disagree_is_refused(tmp_path):
    iter_dir = _bridge_checkpoint(tmp_path, step=4)
    if importlib.util.find_spec("yaml") is None:
        _assert_pyyaml_is_asked_for(tmp_path)
        return
    assert checkpoint_problems(tmp_path) == (
        5,
        [f"{iter_dir / ckpt.TRAIN_STATE_FILE} says step 4, {iter_dir}'s entries 5"],
    )


class Payload:
    """Anything a weights_only load refuses to unpickle."""


def test_train_state_is_read_weights_only(legacy):
    torch.save({"iteration": 5, "x": Payload()}, legacy / "iter_0000005" / ckpt.TRAIN_STATE_FILE)
    _, problems = checkpoint_problems(legacy)
    assert len(problems) == 1
    assert "cannot be read" in problems[0]
    assert "weights_only" in problems[0].lower()


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


def test_seal_then_publish_is_private_and_tracker_last(tmp_path, monkeypatch):
    """The iteration is sealed (train state, then digests) before it appears; the pointers follow,
    the tracker last."""
    order = []
    original = ckpt._write_atomically
    monkeypatch.setattr(
        ckpt, "_write_atomically", lambda path, write: (order.append(path.name), original(path, write))
    )
    _save(tmp_path, 3)
    assert order == [ckpt.TRAIN_STATE_FILE, DIGESTS_FILE, ckpt.LATEST_TRAIN_STATE_FILE, ckpt.TRACKER_FILE]
    assert (tmp_path / "iter_0000003" / ckpt.TRAIN_STATE_FILE).is_file()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert stat.S_IMODE((tmp_path / "iter_0000003").stat().st_mode) == 0o700
    assert read_tracker(tmp_path) == 3


def test_publishing_removes_what_killed_saves_left(tmp_path):
    killed = tmp_path / partial_save_dir_name(7, "dead")
    killed.mkdir()
    (killed / "__1_0.distcp").write_bytes(b"\0" * 10)
    unrelated = tmp_path / "iter_0000007.notes"
    unrelated.mkdir()
    _save(tmp_path, 5)
    assert not killed.exists()
    assert unrelated.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000005",
        "iter_0000007.notes",
        ckpt.TRACKER_FILE,
        ckpt.LATEST_TRAIN_STATE_FILE,
    ]


@pytest.mark.parametrize(
    ("name", "partial"),
    [
        ("iter_0000005.tmp-0123abcd", True),
        ("iter_0000005", False),
        ("iter_0000005.old-0123abcd", False),
        ("iter_0000005.tmp-", False),
        ("notes.tmp-0123abcd", False),
    ],
)
def test_partial_save_dir_names(name, partial):
    assert is_partial_save_dir(name) is partial
