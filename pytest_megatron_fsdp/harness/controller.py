"""Session control in plain-pytest mode: distributed tests run in rank sets the plugin launches.

All distributed tests of one world size share one torchrun rank set (imports and process-group
set-up are paid once per batch, not per test). The rank set's rank 0 streams agreed reports back;
they are logged here under the same node ids, so ``-x``, ``--lf``, JUnit XML and the terminal
summary behave as for any test. A rank set that dies or hangs fails the test it was running; the
rest of the batch continues in a fresh rank set.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from . import flight_recorder, warnings_relay
from .agreement import headlined_failure
from .launcher import RankSet, describe_exit
from .protocol import TIMEOUT_BANNER, TIMEOUT_EXIT_CODE, log_dir, spec_of

#: seconds a fresh rank set may spend starting (imports, rendezvous) before its first test counts
STARTUP_ALLOWANCE_S = 120.0
#: seconds past a test's timeout before the parent kills the rank set itself (the ranks' own
#: watchdogs normally end them first, with their stacks in the logs)
KILL_GRACE_S = 15.0
#: seconds to wait for a rank set to exit after its last test
EXIT_WAIT_S = 60.0


class Controller:
    """Registered in a plain (non-torchrun) pytest process, as ``mfsdp-controller``."""

    def __init__(
        self, config: pytest.Config, forwarded_args: list[str], explicit_log_dir: str | None
    ) -> None:
        """``forwarded_args``: the plugin's own options as the user gave them, for the ranks' pytest
        (the platform is added per world size); ``explicit_log_dir``: ``--mfsdp-log-dir``."""
        self.config = config
        self._forwarded_args = list(forwarded_args)
        self._explicit_log_dir = explicit_log_dir
        #: the platform each world size runs on, decided once per session (see plan_platforms)
        self.platforms: dict[int, str] = {}
        self.active: dict[int, RankSet] = {}
        self.remaining: dict[int, list[str]] = {}
        self._batches = 0
        #: whether the session's first rank set was started (or ruled out) before collection ended
        self._prestart_decided = False
        #: a pytest-xdist worker's GPUs (CUDA_VISIBLE_DEVICES for its CUDA rank sets; see gpu_slices)
        self.gpu_slice: str | None = None

    # -- batches ------------------------------------------------------------------------------------

    def prestart(self, world_size: int) -> None:
        """Launch a rank set for ``world_size`` now, its tests to follow when the session reaches
        them: its ranks import torch while this session still collects and decides the platform.

        Once per session, for the first distributed test collected; not for ``--collect-only``, nor
        in a pytest-xdist worker (which learns only later which tests it runs).
        """
        if self._prestart_decided:
            return
        self._prestart_decided = True
        if self.config.option.collectonly or self._in_xdist_worker():
            return
        self.active[world_size] = self._launch(world_size)

    def _in_xdist_worker(self) -> bool:
        return hasattr(self.config, "workerinput")

    def plan_first_batch(self, distributed: list[pytest.Item]) -> None:
        """After collection: have a rank set warming up for the first distributed test to run.

        A prestarted set no test will use (deselected, skipped for want of GPUs, another world size
        first) is closed here, before it costs more than its start. The batch itself is given when
        the session reaches that test, so tests still run one at a time, in order.
        """
        self._prestart_decided = True
        runnable = [i for i in distributed if UNHOSTABLE not in i.stash]
        if self.config.option.collectonly or not runnable:
            self.close_all()
            return
        if self._in_xdist_worker():
            return  # which tests this worker runs comes later, one by one: batches start with them
        world_size = spec_of(runnable[0]).world_size
        for other in [w for w in self.active if w != world_size]:
            self._close(other)
        if world_size not in self.active:
            self._launch(world_size)

    def _launch(self, world_size: int) -> RankSet:
        self._batches += 1
        # pytest-xdist: each worker's rank sets log apart (gw0-batch1-world2, ...), never mixed
        worker = getattr(self.config, "workerinput", {}).get("workerid")
        prefix = f"{worker}-batch" if worker else "batch"
        logs = self.log_dir(f"{prefix}{self._batches}-world{world_size}")
        if self._batches == 1:
            # this process's previous rank-set logs (same worker id): this session's replace them
            for old in logs.parent.glob(f"{prefix}*-world*"):
                if old != logs:
                    shutil.rmtree(old, ignore_errors=True)
        env = {}
        if self.gpu_slice is not None and self.platforms.get(world_size) == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = self.gpu_slice
        rank_set = RankSet(world_size, logs, self.config.invocation_params.dir, env)
        self.active[world_size] = rank_set
        return rank_set

    def _assign(self, item: pytest.Item, world_size: int, rank_set: RankSet) -> RankSet:
        """``rank_set`` runs ``item`` and every later test of its world size this session hosts."""
        batch = [
            i
            for i in self._upcoming(item)
            if (spec := spec_of(i)) is not None
            and UNHOSTABLE not in i.stash
            and spec.world_size == world_size
        ]
        files = list(dict.fromkeys(str(i.path) for i in batch))
        rank_set.assign(
            [(i.nodeid, spec_of(i).timeout_s) for i in batch], files, self._pytest_args(world_size)
        )
        self.active[world_size] = rank_set
        self.remaining[world_size] = [i.nodeid for i in batch]
        return rank_set

    def _rank_set_for(self, item: pytest.Item, world_size: int) -> RankSet:
        current = self.active.get(world_size)
        if current is not None and item.nodeid in self.remaining.get(world_size, []):
            return current
        if current is not None and not current.assigned:
            return self._assign(item, world_size, current)  # launched at collection, warmed up
        if current is not None:
            self._close(world_size)
        return self._assign(item, world_size, self._launch(world_size))

    def plan_gpu_slice(self) -> str | None:
        """In a pytest-xdist worker whose session runs tests on CUDA: this worker's GPUs, a slice
        as large as the biggest CUDA world size (None elsewhere). Too few GPUs is a usage error."""
        cuda = [w for w, p in self.platforms.items() if p == "cuda"]
        if not cuda or not self._in_xdist_worker():
            return None
        from . import gpu_slices

        workers = int(self.config.workerinput["workercount"])
        index = gpu_slices.worker_index(self.config.workerinput["workerid"], workers)
        devices = gpu_slices.worker_slice(gpu_slices.device_ids(), workers, index, max(cuda))
        self.gpu_slice = ",".join(devices)
        return self.gpu_slice

    def _pytest_args(self, world_size: int) -> list[str]:
        """The parent's settings that shape how a test runs, for the ranks' pytest."""
        opt = self.config.option
        args = ["--rootdir", str(self.config.rootpath), "-p", "no:cacheprovider"]
        if self.config.inipath is not None:
            args += ["-c", str(self.config.inipath)]
        args += [f"--capture={opt.capture}", f"--import-mode={opt.importmode}"]
        if getattr(opt, "tbstyle", None):
            args.append(f"--tb={opt.tbstyle}")
        for plugin in getattr(opt, "plugins", None) or []:
            args += ["-p", plugin]
        for override in getattr(opt, "override_ini", None) or []:
            args += ["-o", override]
        for warning in getattr(opt, "pythonwarnings", None) or []:
            args += ["-W", warning]
        args += self._forwarded_args
        # The parent decided the platform once; every rank set uses that decision.
        args.append(f"--mfsdp-platform={self.platforms[world_size]}")
        return args

    def _close(self, world_size: int) -> None:
        rank_set = self.active.pop(world_size, None)
        self.remaining.pop(world_size, None)
        if rank_set is not None:
            rank_set.close()

    def _upcoming(self, item: pytest.Item) -> list[pytest.Item]:
        """``item`` and the tests this process will run after it, in order.

        A plain session runs everything it collected. A pytest-xdist worker runs what its
        controller sends: the current test, the next one and those already queued (later ones
        arrive while it runs; a test not yet sent gets a rank set of its own when it comes).
        """
        items = self.config.stash[_SESSION_ITEMS]
        interactor = next(
            (p for p in self.config.pluginmanager.get_plugins() if type(p).__name__ == "WorkerInteractor"),
            None,
        )
        if interactor is None or not hasattr(self.config, "workerinput"):
            return items[items.index(item) :]
        with interactor.torun.lock() as queued:
            indices = [interactor.nextitem_index, *queued]
        return [item] + [items[i] for i in indices if isinstance(i, int)]

    def close_all(self) -> None:
        for world_size in list(self.active):
            self._close(world_size)

    def log_dir(self, name: str) -> Path:
        return log_dir(self.config, self._explicit_log_dir, name)

    # -- running ------------------------------------------------------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        spec = spec_of(item)
        if spec is None or UNHOSTABLE in item.stash:
            return None  # plain tests, and tests skipped for want of GPUs, run as usual
        world_size = spec.world_size
        rank_set = self._rank_set_for(item, world_size)
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        attempts = spec.reruns + 1
        failures: list[tuple[str, pytest.TestReport]] = []  # (rank set, failing report) per failed attempt
        for attempt in range(1, attempts + 1):
            if attempt > 1:
                rank_set = self._fresh_rank_set(item, world_size)
            try:
                reports = self._collect_reports(item, rank_set)
            except KeyboardInterrupt:
                # SIGINT, or SIGTERM (a CI cancel; see install_signal_handlers): the running test fails
                # with what its ranks had logged, its rank set is killed, and pytest then ends the
                # session as interrupted, writing JUnit XML and the report for every finished test.
                rank_set.kill()
                reason = "interrupted (SIGINT/SIGTERM): the rank set was killed\n" + self._death(
                    rank_set, spec.timeout_s, interrupted=True
                )
                report = self._failure(item, rank_set, [], True, reason)
                item.ihook.pytest_runtest_logreport(report=report)
                item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
                raise
            failed = next((r for r in reports if r.failed), None)
            if failed is None or attempt == attempts:
                break
            failures.append((rank_set.log_dir.name, failed))
            for report in reports[: reports.index(failed) + 1]:
                if report is failed:
                    # as pytest-rerunfailures reports it: "R", counted as "rerun", not as a failure
                    report.outcome = "rerun"  # type: ignore[assignment]
                    report.mfsdp_attempt = attempt
                item.ihook.pytest_runtest_logreport(report=report)
        if failures:
            _note_attempts(reports, failures, attempts)
        reports += self._teardown_local_state(item, nextitem)
        for report in reports:
            item.ihook.pytest_runtest_logreport(report=report)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        remaining = self.remaining.get(world_size)
        if remaining is not None and item.nodeid in remaining:
            del remaining[: remaining.index(item.nodeid) + 1]
            if not remaining:
                self._finish_batch(world_size)
        return True

    def _fresh_rank_set(self, item: pytest.Item, world_size: int) -> RankSet:
        """A new rank set for another attempt at ``item`` (and the rest of its batch after it).

        Never the set whose test just failed: its process group went through the failure (torch's
        own harness once reported failures as passes by rerunning in such a group, pytorch#162978).
        That set is killed, also part-way through a later test it had run ahead to.
        """
        self._close(world_size)
        return self._assign(item, world_size, self._launch(world_size))

    @pytest.hookimpl(tryfirst=True)
    def pytest_report_teststatus(self, report: pytest.TestReport) -> tuple[str, str, Any] | None:
        if report.outcome == "rerun":
            return "rerun", "R", ("RERUN", {"yellow": True})
        return None

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self._in_xdist_worker():
            return  # the xdist controller shows the reports its workers send
        lines = rerun_summary([r for reports in terminalreporter.stats.values() for r in reports])
        if lines:
            terminalreporter.write_sep("=", "megatron-fsdp reruns")
            for line in lines:
                terminalreporter.write_line(line)

    def _teardown_local_state(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> list[pytest.TestReport]:
        """Tear down what earlier local tests set up here (module or class fixtures) and the next
        test does not need, as pytest's runner does in every test's teardown: a distributed test's
        own teardown ran in its ranks, but this process's setup state must still move on, or the
        next local test in another module finds the previous one 'not torn down properly'."""
        call = pytest.CallInfo.from_call(
            lambda: item.session._setupstate.teardown_exact(nextitem), when="teardown"
        )
        if call.excinfo is None:
            return []
        return [item.ihook.pytest_runtest_makereport(item=item, call=call)]

    def _finish_batch(self, world_size: int) -> None:
        rank_set = self.active[world_size]
        code = rank_set.wait(EXIT_WAIT_S)
        if code is None:
            self._warn(
                f"the world_size={world_size} rank set did not exit {EXIT_WAIT_S:g} s after its last "
                "test; killed"
            )
        elif code != 0:
            abnormal = _abnormal_exits(rank_set)
            if abnormal:
                self._warn(
                    f"the world_size={world_size} rank set ended abnormally after its last test "
                    f"({abnormal}); output: {rank_set.output_path}"
                )
        self._close(world_size)

    def _warn(self, text: str) -> None:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None:
            return
        reporter.ensure_newline()
        if reporter._tw.width_of_current_line:  # -q writes progress letters with no path to end
            reporter._tw.line()
        reporter.write_line(f"megatron-fsdp: {text}", yellow=True)

    def _collect_reports(self, item: pytest.Item, rank_set: RankSet) -> list[pytest.TestReport]:
        timeout = spec_of(item).timeout_s
        startup = STARTUP_ALLOWANCE_S if rank_set.tests_finished == 0 else 0.0
        deadline = time.monotonic() + timeout + KILL_GRACE_S + startup
        relay = self.config.option.capture == "no"
        reports: list[pytest.TestReport] = []
        started = False
        while True:
            events = rank_set.poll_events()
            while events:
                event = events.popleft()
                kind = event["event"]
                if kind == "collected":
                    if item.nodeid not in event["nodeids"]:
                        return reports + [
                            self._failure(item, rank_set, reports, started, _not_collected(item, event))
                        ]
                elif kind == "start":
                    if event["nodeid"] != item.nodeid:
                        return reports + [
                            self._failure(
                                item,
                                rank_set,
                                reports,
                                started,
                                f"the rank set ran {event['nodeid']} instead",
                            )
                        ]
                    deadline = time.monotonic() + timeout + KILL_GRACE_S
                    started = True
                elif kind == "warnings":
                    warnings_relay.record(item, event["warnings"])
                elif kind == "report":
                    reports.append(_report_from_event(self.config, event["report"]))
                elif kind == "finish":
                    rank_set.tests_finished += 1
                    if relay:
                        _relay(rank_set)
                    return reports
            if relay:
                _relay(rank_set)
            if rank_set.exited():
                if rank_set.poll_events():
                    continue  # the last words arrived with the exit
                return reports + [
                    self._failure(item, rank_set, reports, started, self._death(rank_set, timeout))
                ]
            if time.monotonic() > deadline:
                rank_set.dump_stacks()
                time.sleep(1.0)
                rank_set.kill()
                reason = self._death(rank_set, timeout, killed_after=timeout)
                return reports + [self._failure(item, rank_set, reports, started, reason)]
            time.sleep(0.05)

    def _death(
        self, rank_set: RankSet, timeout: float, killed_after: float | None = None, interrupted: bool = False
    ) -> str:
        """Why the rank set ended before the test did, with each rank's stacks or log tail."""
        timed_out = [r for r in range(rank_set.world_size) if TIMEOUT_BANNER in rank_set.rank_log(r)]
        exits, root = rank_set.rank_exits()
        lines: list[str] = []
        if timed_out or killed_after is not None:
            lines.append(
                f"timed out: the test exceeded its {timeout:g} s timeout; every rank's stacks were dumped "
                "and the rank set was killed"
            )
            lines += self._collectives(rank_set)
        died = {r: c for r, c in exits.items() if c != TIMEOUT_EXIT_CODE}
        if died and not timed_out:
            order = ([root] if root in died else []) + sorted(r for r in died if r != root)
            first = order[0]
            lines.append(f"rank {first} died ({describe_exit(died[first])})")
            for r in order[1:]:
                lines.append(
                    f"rank {r} then ended ({describe_exit(died[r])}; stopped by torchrun after rank {first})"
                )
        if not lines and not interrupted:
            lines.append(f"the rank set ended unexpectedly ({describe_exit(rank_set.proc.returncode or 0)})")
        for r in range(rank_set.world_size):
            log = rank_set.rank_log(r)
            start = log.find(TIMEOUT_BANNER)
            if start < 0:
                start = log.find("Fatal Python error")  # faulthandler on SIGSEGV, SIGABRT, ...
            if start < 0:
                start = log.find("Thread 0x")  # a dump on SIGUSR1 from the parent's watchdog
            if start < 0:
                start = log.rfind("START ")  # this test's part of the log
            excerpt = log[start:] if start >= 0 else log[-3000:]
            lines.append(f"---------- rank {r} (log: {rank_set.log_dir / f'rank{r}.log'}) ----------")
            lines.append(excerpt.rstrip())
        tail = rank_set.output()[-2500:]
        lines.append(f"---------- torchrun output (tail; whole: {rank_set.output_path}) ----------")
        lines.append(tail.rstrip())
        return "\n".join(lines)

    def _collectives(self, rank_set: RankSet) -> list[str]:
        """Who is stuck where, from the ranks' flight-recorder dumps (written as they timed out)."""
        return flight_recorder.section(rank_set.log_dir, rank_set.world_size, time.time_ns())

    def _failure(
        self,
        item: pytest.Item,
        rank_set: RankSet,
        received: list[pytest.TestReport],
        started: bool,
        reason: str,
    ) -> pytest.TestReport:
        """The test fails in the phase it had reached; this rank set is finished.

        Reports arrive only once the ranks agreed on a test, so a test that started and sent
        nothing is charged to its call phase (that is where ranks die or hang in practice).
        """
        when = "call" if started else "setup"
        if received:
            when = "teardown" if received[-1].when != "setup" or received[-1].outcome != "passed" else "call"
        world_size = rank_set.world_size
        if self.active.get(world_size) is rank_set:
            self._close(world_size)  # the rest of the batch continues in a fresh rank set
        return pytest.TestReport(
            nodeid=item.nodeid,
            location=item.location,
            keywords={k: 1 for k in item.keywords},
            outcome="failed",
            longrepr=headlined_failure(item, reason),
            when=when,
            sections=[],
            duration=0.0,
            user_properties=list(item.user_properties),
        )


#: a rank's pytest exit code that says only "some tests failed": those failures are reported already
_TESTS_FAILED = 1
#: how torchrun stops the other ranks once one has exited non-zero
_STOPPED_BY_TORCHRUN = -int(signal.SIGTERM)


def _abnormal_exits(rank_set: RankSet) -> str:
    """Why a rank set's non-zero exit after its last test is worth a note ("" when it is not).

    A rank's pytest exits 1 when any of its tests failed, and torchrun then stops the other ranks
    (SIGTERM) and exits non-zero itself: the normal end of a batch with failures, which the test
    reports already show. Anything else (an internal error, another signal, a rank set with no
    rank exit codes in torchrun's output) is not.
    """
    # pytest's own exit status where a rank left one (the set may end before torchrun reports
    # anything), else what torchrun's summary says about the rank
    exits = {**rank_set.rank_exits()[0], **rank_set.rank_exit_statuses()}
    described = ", ".join(f"rank {rank}: {describe_exit(code)}" for rank, code in sorted(exits.items()))
    if not exits:
        return f"torchrun {describe_exit(rank_set.proc.returncode or 0)}, no rank exit codes in its output"
    codes = set(exits.values())
    if _TESTS_FAILED in codes and codes <= {_TESTS_FAILED, _STOPPED_BY_TORCHRUN}:
        return ""
    return described


def _note_attempts(
    reports: list[pytest.TestReport], failures: list[tuple[str, pytest.TestReport]], attempts: int
) -> None:
    """The last attempt's reports say how many attempts it took; the earlier failures become
    sections of its failing report (or of its call report when it passed)."""
    final = next((r for r in reports if r.failed), None)
    if final is None:
        final = next((r for r in reports if r.when == "call"), reports[-1])
    for number, (rank_set, failed) in enumerate(failures, 1):
        final.sections.append(
            (
                f"megatron-fsdp: attempt {number} of {attempts} failed ({failed.when}; rank set {rank_set})",
                failed.longreprtext,
            )
        )
    for report in reports:
        report.mfsdp_attempts = len(failures) + 1
        report.mfsdp_max_attempts = attempts


def rerun_summary(reports: list[Any]) -> list[str]:
    """One line per test that was rerun: flaky (passed on a rerun) or failed on every attempt."""
    outcome: dict[str, tuple[bool, int, int]] = {}
    for report in reports:
        attempts = getattr(report, "mfsdp_attempts", None)
        if not isinstance(report, pytest.TestReport) or attempts is None:
            continue
        failed = report.failed or outcome.get(report.nodeid, (False, 0, 0))[0]
        outcome[report.nodeid] = (failed, attempts, report.mfsdp_max_attempts)
    lines = []
    for nodeid, (failed, attempts, max_attempts) in outcome.items():
        if failed:
            lines.append(f"FAILED {nodeid}: failed all {attempts} attempts, each in a fresh rank set")
        else:
            lines.append(
                f"FLAKY {nodeid}: passed on attempt {attempts} of {max_attempts}, in a fresh rank set; "
                "the earlier failures are sections of its report (-rP shows them)"
            )
    return lines


def _report_from_event(config: pytest.Config, data: dict[str, Any]) -> pytest.TestReport:
    report = config.hook.pytest_report_from_serializable(config=config, data=data)
    if report.skipped and isinstance(report.longrepr, list):
        report.longrepr = tuple(report.longrepr)  # JSON has no tuples; pytest wants (path, line, reason)
    return report


def _relay(rank_set: RankSet) -> None:
    text = rank_set.new_output()
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


def _not_collected(item: pytest.Item, event: dict[str, Any]) -> str:
    return (
        f"the launched ranks did not collect {item.nodeid} (they collected {len(event['nodeids'])} tests); "
        "is its node id stable across processes (e.g. no random parametrize ids)?"
    )


_SESSION_ITEMS = pytest.StashKey[list]()
#: set on a distributed test this machine cannot host (too few GPUs): it is skipped, not launched
UNHOSTABLE = pytest.StashKey[str]()


def remember_items(config: pytest.Config, items: list[pytest.Item]) -> None:
    config.stash[_SESSION_ITEMS] = list(items)


def max_cpu_ranks() -> int:
    """CPU ranks this machine hosts in one rank set (oversubscribing cores past this only thrashes)."""
    return max(4, 2 * (os.cpu_count() or 1))


def plan_platforms(controller: Controller, requested: str, items: list[pytest.Item]) -> list[str]:
    """Decide each world size's platform before any rank starts; returns header lines.

    ``cuda`` (asked for or chosen by ``auto``) needs one GPU per rank: a test needing more GPUs than
    are visible is skipped with a reason saying so. ``cpu`` hosts up to :func:`max_cpu_ranks` ranks;
    a bigger world size is a usage error naming the limit.
    """
    from .platform import PlatformError, select_platform, visible_gpu_count

    lines = []
    for world_size in sorted({spec_of(i).world_size for i in items}):
        try:
            choice = select_platform(requested, world_size)
        except PlatformError as exc:
            gpus = visible_gpu_count()
            if gpus == 0:
                raise
            reason = (
                f"needs {world_size} GPUs (world_size={world_size}, --mfsdp-platform=cuda); {gpus} visible"
            )
            for i in items:
                if spec_of(i).world_size == world_size:
                    i.stash[UNHOSTABLE] = reason
                    i.add_marker(pytest.mark.skip(reason=reason))
            lines.append(f"world_size={world_size}: skipped ({exc})")
            continue
        if choice.platform == "cpu" and world_size > max_cpu_ranks():
            raise pytest.UsageError(
                f"world_size={world_size} cannot be hosted here: at most {max_cpu_ranks()} CPU ranks "
                f"(2 per core); use a smaller world_size in @pytest.mark.distributed or run on GPUs"
            )
        controller.platforms[world_size] = choice.platform
        lines.append(
            f"world_size={world_size} -> platform={choice.platform}, backend={choice.backend} "
            f"({choice.reason})"
        )
    return lines


def install_signal_handlers(controller: Controller) -> Callable[[], None]:
    """SIGTERM (what a CI cancel sends) ends a plain session the way Ctrl-C does: pytest's
    KeyboardInterrupt handling reports the running test, writes JUnit XML and the JSON report, and
    unconfigure kills every rank set. A second SIGTERM or SIGINT kills the rank sets and exits at once.
    Returns the function that puts the previous handlers back (at unconfigure).
    """
    import signal

    received: list[int] = []

    def handle(signum: int, frame: Any) -> None:
        received.append(signum)
        if len(received) > 1:
            controller.close_all()
            os._exit(128 + signum)
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT)}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore
