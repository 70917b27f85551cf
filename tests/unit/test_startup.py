"""Rank set start-up, in process: a waiting rank gets its command line or gives up when its parent is
gone, and a rank set is done when its ranks are, not when torchrun has shut down (processes played
by hand). The real sessions (a rank set launched while the parent collects, reaped when no test
needs it) are tests/integration/test_startup_sessions.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from pytest_megatron_fsdp.parent.launcher import RankSet
from pytest_megatron_fsdp.rank import entry as rank_entry
from pytest_megatron_fsdp.wire import rank_dir


def test_a_waiting_rank_gets_its_command_line_or_gives_up_when_the_parent_is_gone(tmp_path):
    argv = tmp_path / "argv.json"
    argv.write_text(json.dumps(["test_x.py", "-q"]))
    assert rank_entry.wait_for_argv(argv, os.getpid(), limit_s=5) == ["test_x.py", "-q"]

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    started = time.monotonic()
    assert rank_entry.wait_for_argv(tmp_path / "never.json", gone.pid, limit_s=30) is None
    assert time.monotonic() - started < 5  # noticed the parent is gone, did not wait out the limit

    started = time.monotonic()
    assert rank_entry.wait_for_argv(tmp_path / "never.json", os.getpid(), limit_s=0.3) is None
    assert 0.3 <= time.monotonic() - started < 5


def _rank_set_without_launch(tmp_path, world_size: int = 2) -> RankSet:
    """A RankSet whose 'torchrun' is a sleeping process (a slow shutdown), its ranks played by hand."""
    rank_set = RankSet.__new__(RankSet)
    rank_set.world_size = world_size
    rank_set.log_dir = tmp_path / "logs"
    rank_set.log_dir.mkdir()
    rank_set.work_dir = tmp_path / "work"
    rank_set.work_dir.mkdir()
    rank_set._argv_path = rank_set.work_dir / "argv.json"
    rank_set.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    return rank_set


def test_a_rank_set_is_done_when_its_ranks_are_not_when_torchrun_has_shut_down(tmp_path):
    rank_set = _rank_set_without_launch(tmp_path)
    try:
        # rank 1 still runs (its command line names the batch's argv file): not done
        rank1 = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)", str(rank_set._argv_path)]
        )
        (rank_set.log_dir / "rank1.pid").write_text(str(rank1.pid))
        rank_dir.exit_status_path(rank_set._argv_path, 0).write_text("0")
        assert rank_set.wait(0.3) is None
        rank_dir.exit_status_path(rank_set._argv_path, 1).write_text("1")
        assert rank_set.wait(0.3) is None  # its status is there, but the process is not gone yet
        rank1.kill()
        rank1.wait()
        started = time.monotonic()
        assert rank_set.wait(30) == 1  # pytest's status on rank 1; torchrun still 'shutting down'
        assert time.monotonic() - started < 5
        assert rank_set.proc.poll() is None
    finally:
        rank_set.proc.kill()
        rank_set.proc.wait()


def test_a_rank_that_died_without_a_status_is_waited_for_through_torchrun(tmp_path):
    rank_set = _rank_set_without_launch(tmp_path)
    try:
        rank_dir.exit_status_path(rank_set._argv_path, 0).write_text("0")
        assert rank_set.wait(0.3) is None  # rank 1 left no status: torchrun's summary will say why
        rank_set.proc.kill()
        assert rank_set.wait(5) == rank_set.proc.returncode != 0
    finally:
        rank_set.proc.kill()
        rank_set.proc.wait()
