"""A rank of a set the plain-pytest parent launched before it knew the set's tests.

``python -m pytest_megatron_fsdp.rank.entry <argv file> <log dir> <parent pid>``, under
torchrun. The parent launches the rank set as soon as it collects the first distributed test, while
it still collects the rest and decides the platform; each rank meanwhile imports torch (which
every rank needs, whatever its tests and platform), then waits for the parent to write its pytest
command line to the argv file, and runs pytest with it in this process (``python -m pytest
<argv>`` in effect). A rank whose parent is gone, or that waits past :data:`WAIT_LIMIT_S`, exits.
pytest's exit status is left next to the argv file (:func:`exit_status_path`), so the parent knows
how the set ended as soon as its ranks did, without waiting for torchrun's own shutdown.

Nothing else is imported before pytest starts: the plugin still decides the platform and enables
the CUDA emulation before megatron is first imported.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path

from ..wire import rank_dir
from ..wire.rank_dir import exit_status_path

#: seconds a rank waits for its command line (the parent normally writes it within seconds)
WAIT_LIMIT_S = 600.0
#: exit status of a rank that never received a command line
NO_BATCH_EXIT_CODE = 3
_POLL_S = 0.01


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_for_argv(argv_path: Path, parent_pid: int, limit_s: float = WAIT_LIMIT_S) -> list[str] | None:
    """The parent's pytest arguments for this rank, or None when it is gone or never wrote them."""
    deadline = time.monotonic() + limit_s
    while not argv_path.exists():
        if not _alive(parent_pid) or time.monotonic() > deadline:
            return None
        time.sleep(_POLL_S)
    argv: list[str] = json.loads(argv_path.read_text())  # written by the parent: a list of strings
    return argv


def main(args: list[str]) -> int:
    argv_path, log_dir, parent_pid = Path(args[0]), Path(args[1]), int(args[2])
    rank = os.environ.get("RANK", "0")
    # The parent kills ranks by the pids they leave here (torchrun starts each in its own session).
    log_dir.mkdir(parents=True, exist_ok=True)
    rank_dir.pid_path(log_dir, int(rank)).write_text(str(os.getpid()))
    # A stack dump on request (the parent's watchdog) instead of SIGUSR1's default, which ends the
    # process; the plugin installs its own, into the rank's log, once pytest runs.
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    import torch  # noqa: F401 - the warm-up, while the parent collects

    argv = wait_for_argv(argv_path, parent_pid)
    if argv is None:
        print(f"rank {rank}: no tests came from the parent (pid {parent_pid}); exiting", file=sys.stderr)
        return NO_BATCH_EXIT_CODE
    import pytest

    sys.argv = [sys.argv[0], *argv]
    code = pytest.console_main()
    # pytest is done: the parent need not wait for torchrun's own shutdown to learn how it ended.
    partial = argv_path.with_name(f"exit-rank{rank}.partial")
    partial.write_text(str(code))
    os.replace(partial, exit_status_path(argv_path, int(rank)))
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
