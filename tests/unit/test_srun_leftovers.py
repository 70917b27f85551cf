"""What a killed rank leaves in ``$TMPDIR`` (its private tree, rank 0's session dir) is removed by a
rank that ends after it on the same host: the dir's name says whose it is (``owned_temp``)."""

from __future__ import annotations

import os
import subprocess
import sys

from pytest_megatron_fsdp.rank import owned_temp


def _made_by_a_process_that_ended(root, prefix: str) -> str:
    code = (
        f"from pytest_megatron_fsdp.rank import owned_temp\nprint(owned_temp.make({prefix!r}, {str(root)!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


def test_dead_owners_dirs_go_live_and_foreign_ones_stay(tmp_path):
    dead_rank = _made_by_a_process_that_ended(tmp_path, "mfsdp-rank1-")
    dead_session = _made_by_a_process_that_ended(tmp_path, "mfsdp-session-")
    (tmp_path / os.path.basename(dead_rank) / "basetemp").mkdir()  # not empty
    mine = owned_temp.make("mfsdp-rank0-", tmp_path)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host, namespace, _ = owned_temp.owner_tag().split("_")
        alive = tmp_path / f"mfsdp-rank2-{host}_{namespace}_{live.pid}-abc"
        other_host = tmp_path / f"mfsdp-rank3-elsewhere_{namespace}_999999999-abc"
        other_namespace = tmp_path / f"mfsdp-rank3-{host}_{int(namespace) + 1}_999999999-abc"
        unrelated = tmp_path / f"pytest-of-{host}_{namespace}_999999999-abc"
        for path in (alive, other_host, other_namespace, unrelated):
            path.mkdir()
        removed = owned_temp.sweep([tmp_path])
        assert sorted(removed) == sorted([dead_rank, dead_session])
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            p.name for p in (alive, other_host, other_namespace, unrelated, tmp_path / os.path.basename(mine))
        )
    finally:
        live.kill()
        live.wait()
    assert owned_temp.sweep([tmp_path]) == [str(alive)]  # its owner has ended now


def test_a_zombie_owner_counts_as_ended():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    import time

    deadline = time.monotonic() + 30
    while owned_temp.running(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # not reaped (no wait yet): a zombie once it exits
    assert not owned_temp.running(child.pid)
    assert os.path.exists(f"/proc/{child.pid}")  # still in the process table, as a zombie
    child.wait()
    assert owned_temp.running(os.getpid())
