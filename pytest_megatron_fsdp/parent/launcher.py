"""Process management: a torchrun rank set launched for a batch of tests, watched, and always reaped.

torchrun starts each rank in a session of its own, so killing torchrun's process group does not
reach them; the ranks write their pids next to their logs and are killed one by one (SIGKILL: a
rank stuck in a collective ignores gentler signals).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from ..environment import DistributedSpec
from ..wire import rank_dir
from ..wire.explain import (
    OUTPUT_TAIL_CHARS,
    PostMortem,
    exception_line,
    failure_before_the_timeout,
    internal_error,
    log_excerpt,
    verdict_in,
)
from ..wire.protocol import (
    BATCH_FILE_FLAG,
    REPORT_FILE_FLAG,
    Event,
    decode_event,
    write_batch,
)
from ..wire.rank_dir import TIMEOUT_BANNER, exit_status_path

#: torchrun's failure summary: "rank : 1 (local_rank: 1)" then "exitcode : 3 (pid: 123)"
_FAILURE_ENTRY = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
_TORCHRUN_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
)


@dataclass(frozen=True)
class Rendezvous:
    """Where the agents of a multi-node torchrun meet (``--rdzv-backend=c10d``)."""

    nodes: int
    node_rank: int
    endpoint: str
    run_id: str


def torchrun_command(nproc_per_node: int, *args: str, rendezvous: Rendezvous | None = None) -> list[str]:
    """``python -m torch.distributed.run ... <args>`` with this interpreter: one node on a free loopback
    port (``--standalone``, never a fixed 29500), or one agent of ``rendezvous``. The one place a
    torchrun command line is written (the rank sets here; the repository's tests use it too)."""
    if rendezvous is None:
        launch = ["--standalone"]
    else:
        launch = [
            f"--nnodes={rendezvous.nodes}",
            f"--node_rank={rendezvous.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rendezvous.endpoint}",
            f"--rdzv-id={rendezvous.run_id}",
        ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launch,
        f"--nproc_per_node={nproc_per_node}",
        *args,
    ]


class RankSet:
    """``torchrun --standalone --nproc_per_node=N`` ranks that run pytest on a batch, and what they report.

    Launched before its batch is known (:mod:`..rank.entry`: the ranks import torch meanwhile), then
    given the batch with :meth:`assign`; until then nothing runs in it but that import.
    """

    def __init__(self, world_size: int, log_dir: Path, cwd: Path, env: dict[str, str] | None = None) -> None:
        """``env``: variables set for torchrun and its ranks on top of this process's (e.g. a
        pytest-xdist worker's ``CUDA_VISIBLE_DEVICES`` slice)."""
        self.world_size = world_size
        #: (node id, timeout seconds) of each test, in order (set by assign())
        self.tests: list[tuple[str, DistributedSpec]] = []
        self.log_dir = log_dir
        self.work_dir = Path(tempfile.mkdtemp(prefix="mfsdp-batch-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        for stale in rank_dir.rank_files(log_dir):
            stale.unlink()
        self.events_path = self.work_dir / "events.jsonl"
        self.events_path.touch()
        self._batch_path = self.work_dir / "batch.txt"
        self._argv_path = self.work_dir / "argv.json"
        self.output_path = log_dir / rank_dir.TORCHRUN_LOG
        command = torchrun_command(
            world_size,
            "--max-restarts=0",
            "-m",
            "pytest_megatron_fsdp.rank.entry",
            str(self._argv_path),
            str(log_dir),
            str(os.getpid()),
        )
        overrides = env or {}
        env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
        env.update(overrides)
        env["PYTHONUNBUFFERED"] = "1"
        # torchrun's own temp dirs (torchelastic_*) and the ranks' temp files land in the batch's
        # working dir, so a killed rank set leaves nothing behind once close() removes it.
        (self.work_dir / "tmp").mkdir()
        env["TMPDIR"] = str(self.work_dir / "tmp")
        self._output = open(self.output_path, "wb")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=self._output,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
            start_new_session=True,
        )
        self.started = time.monotonic()
        self.tests_finished = 0
        self._events: deque[Event] = deque()
        self._events_offset = 0
        self._output_offset = 0

    @property
    def assigned(self) -> bool:
        return self._argv_path.exists()

    def assign(
        self, tests: list[tuple[str, DistributedSpec]], files: list[str], pytest_args: list[str]
    ) -> None:
        """The batch: ``tests`` in order with their resolved specs, collected from ``files``, with
        ``pytest_args`` (once)."""
        if self.assigned:
            raise RuntimeError("this rank set already has its batch")
        self.tests = list(tests)
        write_batch(self._batch_path, self.tests)
        argv = [
            *files,
            f"{REPORT_FILE_FLAG}={self.events_path}",
            f"{BATCH_FILE_FLAG}={self._batch_path}",
            f"--mfsdp-log-dir={self.log_dir}",
            *pytest_args,
        ]
        # Complete or absent: the ranks poll for this file and read it once it exists.
        partial = self._argv_path.with_suffix(".partial")
        partial.write_text(json.dumps(argv))
        os.replace(partial, self._argv_path)

    # -- watching -----------------------------------------------------------------------------------

    def poll_events(self) -> deque[Event]:
        """Newly completed event lines, appended to the pending queue (which is returned)."""
        with open(self.events_path, "rb") as f:
            f.seek(self._events_offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._events_offset += len(complete)
        for line in complete.splitlines():
            if line.strip():
                self._events.append(decode_event(line))
        return self._events

    def new_output(self) -> str:
        """torchrun's output since the last call (to relay when the user asked for ``-s``)."""
        with open(self.output_path, "rb") as f:
            f.seek(self._output_offset)
            data = f.read()
        self._output_offset += len(data)
        return data.decode(errors="replace")

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def rank_pids(self) -> dict[int, int]:
        """Live ranks of this set (a pid is only trusted while its command line names this batch)."""
        pids = {}
        marker = str(self._argv_path).encode()
        for rank, path in rank_dir.pid_paths(self.log_dir).items():
            try:
                pid = int(path.read_text())
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker not in f.read():
                        continue  # exited, and the pid may already belong to someone else
            except (ValueError, OSError):
                continue
            pids[rank] = pid
        return pids

    def rank_log(self, rank: int) -> str:
        try:
            return rank_dir.log_path(self.log_dir, rank).read_text(errors="replace")
        except OSError:
            return ""

    def output(self) -> str:
        return self.output_path.read_text(errors="replace")

    # -- ending -------------------------------------------------------------------------------------

    def dump_stacks(self) -> None:
        """Each live rank writes every thread's stack into its log (faulthandler on SIGUSR1)."""
        for pid in self.rank_pids().values():
            _signal(pid, signal.SIGUSR1)

    def kill(self) -> None:
        for pid in self.rank_pids().values():
            _signal(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):  # torchrun already gone
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):  # pragma: no cover - SIGKILL is not ignorable
            self.proc.wait(timeout=30)

    def wait(self, timeout: float) -> int | None:
        """The set's exit status once its ranks are done (None: still running after ``timeout``).

        Every rank leaves pytest's exit status before it exits (``rank_entry``); once all did and
        no rank process is left, torchrun has nothing to do but shut itself down (~1 s on a busy
        2-core machine), which :meth:`close` cuts short. A rank that died without a status is
        waited for through torchrun, whose summary names it.
        """
        deadline = time.monotonic() + timeout
        while True:
            if self.exited():
                return self.proc.returncode
            codes = self.pytest_exit_statuses()
            if len(codes) == self.world_size and not self.rank_pids():
                return next((c for c in codes.values() if c != 0), 0)
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)

    def pytest_exit_statuses(self) -> dict[int, int]:
        """pytest's exit status of each rank that left one (rank -> status)."""
        codes = {}
        for rank in range(self.world_size):
            with contextlib.suppress(OSError, ValueError):
                codes[rank] = int(exit_status_path(self._argv_path, rank).read_text())
        return codes

    def close(self) -> None:
        """Kill whatever still runs and remove the batch's working directory."""
        if not self.exited():
            self.kill()
        else:
            # torchrun is gone; a rank it failed to reap must not outlive it.
            for pid in self.rank_pids().values():
                _signal(pid, signal.SIGKILL)
        self._output.close()
        shutil.rmtree(self.work_dir, ignore_errors=True)

    # -- explaining ---------------------------------------------------------------------------------

    def torchrun_failure_summary(self) -> tuple[dict[int, int], int | None]:
        """(exit code per failed rank, the root-cause rank) from torchrun's failure summary."""
        text = self.output()
        exits = {int(r): int(c) for r, c in _FAILURE_ENTRY.findall(text)}
        root = None
        if "Root Cause" in text:
            found = _FAILURE_ENTRY.findall(text.split("Root Cause", 1)[1])
            if found:
                root = int(found[0][0])
        return exits, root

    def post_mortem(self) -> PostMortem:
        """What is known of how this rank set ended (or stands, when it still runs), read once."""
        exits, root = self.torchrun_failure_summary()
        logs = {r: self.rank_log(r) for r in range(self.world_size)}
        return PostMortem(
            world_size=self.world_size,
            returncode=self.proc.returncode,
            exits=exits,
            root=root,
            exit_statuses=self.pytest_exit_statuses(),
            timed_out=[r for r, log in logs.items() if TIMEOUT_BANNER in log],
            verdict=next(filter(None, map(verdict_in, logs.values())), None),
            excerpts={r: log_excerpt(log) for r, log in logs.items()},
            internal_errors={r: cause for r, log in logs.items() if (cause := internal_error(log))},
            failed_first={
                r: exception_line(failed)
                for r, log in logs.items()
                if (failed := failure_before_the_timeout(log))
            },
            log_dir=self.log_dir,
            output_tail=self.output()[-OUTPUT_TAIL_CHARS:],
            output_path=self.output_path,
        )


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the rank already ended
        os.kill(pid, sig)
