"""A rank's own output: its log file (``rank<R>.log``, with its report, failures written the moment
they happen, and stack dumps), the event stream rank 0 of a launched rank set sends its parent, and
the terminal, which only a rank that reports to the user keeps."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TextIO, cast

import pytest

from ..wire import flight_recorder, protocol, pytest_compat, rank_dir
from ..wire.protocol import REPORT_FILE_DEST, encode_event
from ..wire.torchrun_env import TorchrunEnv
from .held_terminal import HELD_TERMINAL


class RankLog:
    """One rank's log file, event stream and terminal: opened at configure, closed at unconfigure."""

    #: the log file (set by :meth:`open`; it lives as long as the rank)
    file: IO[str]
    #: ``rank<R>.log`` in the log dir
    path: Path

    def __init__(
        self,
        config: pytest.Config,
        torchrun: TorchrunEnv,
        log_dir: Callable[[], Path],
        distributed_logs: bool = False,
    ) -> None:
        self.config = config
        self.rank = torchrun.rank
        self._torchrun = torchrun
        self._log_dir = log_dir
        self._report_file = config.getoption(REPORT_FILE_DEST)
        self.events: IO[str] | None = None
        #: --mfsdp-distributed-logs: keep torch.distributed's DEBUG/INFO records in captured logs
        self._distributed_logs = distributed_logs
        #: a duplicate of the terminal's stderr, where the rank's own stdout and stderr go to the log
        self._terminal_fd: int | None = None

    @property
    def dir(self) -> Path:
        return self.path.parent

    def open(self, config: pytest.Config, quiet_terminal: bool) -> None:
        """The rank's log, fault handlers and event stream; its terminal report to the log where
        ``quiet_terminal`` (another process reports). Called from the role plugin's
        ``pytest_configure``, as it is registered from the main plugin's trylast pytest_configure:
        the cache dir (the default log dir) and the terminal reporter exist by then."""
        log_dir = self._log_dir()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = rank_dir.log_path(log_dir, self.rank)
        self.file = open(self.path, "w", buffering=1)  # noqa: SIM115 (lives as long as the rank)
        rank_dir.pid_path(log_dir, self.rank).write_text(str(os.getpid()))
        # An earlier session's timeout markers and flight records (torchrun mode reuses its log dir;
        # a launched rank set's is emptied by the parent): a marker naming the same test would end
        # the wait for this session's peers early, an old record would be aligned as theirs.
        for suffix in (rank_dir.EXPIRED, rank_dir.ALIGNED):
            rank_dir.marker_path(log_dir, self.rank, suffix).unlink(missing_ok=True)
        flight_recorder.remove_dumps(log_dir, self.rank)
        # `kill -USR1 <pid>` (the plain-mode parent's backup watchdog does) dumps every thread's stack.
        faulthandler.register(signal.SIGUSR1, file=self.file, all_threads=True)
        # A fatal signal (SIGSEGV, SIGABRT, ...) dumps them into this rank's log too, which failure
        # reports quote per rank; pytest's own handler would write them to the shared torchrun output.
        faulthandler.enable(file=self.file, all_threads=True)
        if self._report_file and self.rank == 0:
            self.events = open(self._report_file, "a", buffering=1)  # noqa: SIM115
        self.line(
            f"rank {self.rank} of {self._torchrun.world_size} (local rank {self._torchrun.local_rank}), "
            f"pid {os.getpid()}"
        )
        if quiet_terminal:
            self.quiet_terminal(config)

    def quiet_distributed_logs(self) -> None:
        """Filter torch.distributed's DEBUG/INFO records out of pytest's log handlers (unless
        ``--mfsdp-distributed-logs``)."""
        if self._distributed_logs:
            return
        # pytest's handlers for captured logs (and live/file logging): records reach them from any
        # logger, so filtering here quiets the reports without touching anyone's logging setup.
        logging_plugin = self.config.pluginmanager.get_plugin("logging-plugin")
        for name in ("caplog_handler", "report_handler", "log_cli_handler", "log_file_handler"):
            handler = getattr(logging_plugin, name, None)
            if isinstance(handler, logging.Handler):
                handler.addFilter(_WarningsAndAbove())

    def line(self, text: str) -> None:
        """``text`` as a timestamped line of the log."""
        self.file.write(f"[{time.strftime('%H:%M:%S')}] {text}\n")

    def event(self, event: protocol.Event) -> None:
        """``event`` to the parent (rank 0 of a launched rank set; nowhere else)."""
        if self.events is not None:
            self.events.write(encode_event(event))

    def quiet_terminal(self, config: pytest.Config) -> None:
        """This rank's terminal report goes to its log file (rank 0's reaches the user)."""
        old = config.pluginmanager.get_plugin("terminalreporter")
        if old is None:
            return
        held = config.stash.get(HELD_TERMINAL, None)
        if held is not None and held.held:
            # a session that turned out to use the plugin: what its reporter wrote so far, and the
            # rest, go to the log (its reporter keeps its state: collection counts, errors)
            held.divert(self.file)
            old._tw.hasmarkup = False
        else:
            config.pluginmanager.unregister(old)
            quiet = pytest_compat.TerminalReporter(config, cast(TextIO, self.file))
            config.pluginmanager.register(quiet, "terminalreporter")
        if config.getoption("capture") == "no":
            # Nothing captures this rank's output, so point its stdout/stderr at the log too.
            sys.stdout.flush()
            sys.stderr.flush()
            self._terminal_fd = os.dup(2)  # for the one line that must reach the user (tell_terminal)
            os.dup2(self.file.fileno(), 1)
            os.dup2(self.file.fileno(), 2)

    def tell_terminal(self, line: str) -> None:
        """One line to the terminal from a rank whose report goes to its log."""
        if self._terminal_fd is not None:
            os.write(self._terminal_fd, (line + "\n").encode())
            return
        self.release_terminal()
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def release_terminal(self) -> None:
        """Stop pytest's capture (this process ends without a report), so what the watchdog writes
        to stderr reaches the terminal, or torchrun's output, instead of the test's captured output."""
        capman = self.config.pluginmanager.get_plugin("capturemanager")
        if capman is None:
            return
        with contextlib.suppress(Exception):  # the capture in another state: stderr stays as it is
            capman.suspend_global_capture(in_=False)

    def close(self) -> None:
        """The fault handlers go, then the event stream and the log (a log never opened: nothing)."""
        if not hasattr(self, "file"):
            return
        faulthandler.unregister(signal.SIGUSR1)
        # Before the log closes; pytest's faulthandler plugin, unconfigured after this one, then
        # restores its own.
        faulthandler.disable()
        if self.events is not None:
            self.events.close()
        self.file.close()


class _WarningsAndAbove(logging.Filter):
    """Drops torch.distributed's own DEBUG/INFO records (DCP's event log, c10d's): about 20 per
    checkpoint save or load, none of which says anything about a failure."""

    PREFIXES = ("c10d-", "torch.distributed")

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.name.startswith(self.PREFIXES)
