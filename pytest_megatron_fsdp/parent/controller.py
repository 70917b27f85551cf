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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest

from ..environment import DistributedSpec
from ..wire import coexist, protocol, pytest_compat, warnings_relay
from ..wire.explain import (
    abnormal_exits,
    death_text,
    headlined_failure,
    not_run_after_interrupt,
    note_attempts,
)
from ..wire.protocol import log_dir, spec_of
from ..wire.reports import build_report, log_not_run
from . import xdist_queue
from .launcher import RankSet

#: seconds a fresh rank set may spend starting (imports, rendezvous) before its first test counts
STARTUP_ALLOWANCE_S = 120.0
#: seconds past a test's timeout before the parent kills the rank set itself (the ranks' own
#: watchdogs normally end them first, with their stacks in the logs)
KILL_GRACE_S = 15.0
#: seconds to wait for a rank set to exit after its last test
EXIT_WAIT_S = 60.0


class Controller:
    """The plain-mode parent's controller: rank sets started, given their batches, watched and
    closed. A plain object with no pytest hooks: the parent's role plugin (``parent.plugin``) holds
    one and calls it from its hooks (:meth:`prestart`, :meth:`plan_first_batch`, :meth:`hosts`,
    :meth:`run`, :meth:`close_all`)."""

    def __init__(
        self,
        config: pytest.Config,
        forwarded_args: list[str],
        explicit_log_dir: str | None,
        before_launch: Callable[[], None] | None = None,
    ) -> None:
        """``forwarded_args``: the plugin's own options as the user gave them, for the ranks' pytest
        (the platform is added per world size); ``explicit_log_dir``: ``--mfsdp-log-dir``;
        ``before_launch``: called before each rank set is launched (the parent installs its signal
        handlers with the first)."""
        self.config = config
        self._before_launch = before_launch
        self._forwarded_args = list(forwarded_args)
        self._explicit_log_dir = explicit_log_dir
        #: the platform each world size runs on, decided once per session (see plan_platforms)
        self.platforms: dict[int, str] = {}
        self.active: dict[int, RankSet] = {}
        #: the tests an interruption left unrun, named in the terminal summary
        self.not_run: list[str] = []
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
        if self.config.option.collectonly or self.in_xdist_worker():
            return
        self.active[world_size] = self._new_rank_set(world_size)

    def in_xdist_worker(self) -> bool:
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
        if self.in_xdist_worker():
            return  # which tests this worker runs comes later, one by one: batches start with them
        world_size = _hosted_spec(runnable[0]).world_size
        for other in [w for w in self.active if w != world_size]:
            self._close(other)
        if world_size not in self.active:
            self._new_rank_set(world_size)

    def _new_rank_set(self, world_size: int) -> RankSet:
        if self._before_launch is not None:
            self._before_launch()
        return self._launch(world_size)

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
        env = coexist.coverage_env(self.config)  # `pytest --cov`: the ranks measure themselves into it
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
        rank_set.assign([(i.nodeid, _hosted_spec(i)) for i in batch], files, self._pytest_args(world_size))
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
        return self._assign(item, world_size, self._new_rank_set(world_size))

    def plan_gpu_slice(self) -> str | None:
        """In a pytest-xdist worker whose session runs tests on CUDA: this worker's GPUs, a slice
        as large as the biggest CUDA world size (None elsewhere). Too few GPUs is a usage error."""
        cuda = [w for w, p in self.platforms.items() if p == "cuda"]
        if not cuda or not self.in_xdist_worker():
            return None
        from . import gpu_slices

        workerinput = cast(Any, self.config).workerinput  # pytest-xdist's, set on a worker's config
        workers = int(workerinput["workercount"])
        index = gpu_slices.worker_index(workerinput["workerid"], workers)
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
        args += coexist.randomly_args(self.config)  # every rank reseeds each test as this process would
        # The parent decided the platform once; every rank set uses that decision.
        args.append(f"--mfsdp-platform={self.platforms[world_size]}")
        return args

    def _close(self, world_size: int) -> None:
        rank_set = self.active.pop(world_size, None)
        self.remaining.pop(world_size, None)
        if rank_set is not None:
            rank_set.close()

    def _upcoming(self, item: pytest.Item) -> list[pytest.Item]:
        """``item`` and the tests this process will run after it, in order (see :mod:`.xdist_queue`)."""
        return xdist_queue.upcoming(self.config, self.config.stash[_SESSION_ITEMS], item)

    def close_all(self) -> None:
        for world_size in list(self.active):
            self._close(world_size)

    def log_dir(self, name: str) -> Path:
        return log_dir(self.config, self._explicit_log_dir, name)

    # -- running ------------------------------------------------------------------------------------

    def hosts(self, item: pytest.Item) -> bool:
        """Whether this controller runs ``item`` (a distributed test this machine hosts)."""
        return spec_of(item) is not None and UNHOSTABLE not in item.stash

    def run(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        """Run ``item`` (one it :meth:`hosts`) in its rank set, with its reruns, and log its reports
        here as pytest's runner would (logstart, the reports, logfinish)."""
        spec = _hosted_spec(item)
        world_size = spec.world_size
        rank_set = self._rank_set_for(item, world_size)
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        attempts = spec.reruns + 1
        filters = coexist.rerun_filters(item)
        failures: list[tuple[str, pytest.TestReport]] = []  # (rank set, failing report) per failed attempt
        declined: str | None = None  # why a failure was not rerun although attempts were left
        for attempt in range(1, attempts + 1):
            if attempt > 1:
                _sleep(filters.delay(attempt - 1))
                rank_set = self._fresh_rank_set(item, world_size)
            item.execution_count = attempt  # type: ignore[attr-defined]  # as pytest-rerunfailures counts (its --fail-on-flaky reads it)
            started = _clock()
            try:
                reports = self._collect_reports(item, rank_set)
            except KeyboardInterrupt as exc:
                # SIGINT, or SIGTERM (a CI cancel; see install_signal_handlers): the running test fails
                # with what its ranks had logged, its rank set is killed, each later test is named not
                # run, and pytest then ends the session as interrupted, writing JUnit XML and the
                # report for every test.
                rank_set.kill()
                reason = "interrupted (SIGINT/SIGTERM): the rank set was killed\n" + death_text(
                    rank_set.post_mortem(),
                    spec.timeout_s,
                    interrupted=True,
                    timeout_source=spec.timeout_source,
                )
                report = self._failure(item, rank_set, "call", reason, _clock() - started, "interrupted")
                item.ihook.pytest_runtest_logreport(report=report)
                item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
                why = str(exc) or "KeyboardInterrupt"
                self.not_run = log_not_run(
                    self._upcoming(item)[1:], not_run_after_interrupt(item.nodeid, why)
                )
                raise
            # its ranks could not go on together (a process group not rebuilt after a failure):
            # they end after this test, and the rest of the batch runs in a fresh rank set
            if (
                any(getattr(r, "mfsdp_rank_set_stopped", False) for r in reports)
                and self.active.get(world_size) is rank_set
            ):
                self._close(world_size)
            for report in reports:
                # pytest-rerunfailures' attribute: its summary lists the attempts
                report.rerun = attempt - 1  # type: ignore[attr-defined]
            failed = next((r for r in reports if r.failed), None)
            if failed is None or attempt == attempts:
                break
            declined = _declines_rerun(item, spec, filters, failed)
            if declined is not None:
                break
            failures.append((rank_set.log_dir.name, failed))
            for report in reports[: reports.index(failed) + 1]:
                if report is failed:
                    # as pytest-rerunfailures reports it: "R", counted as "rerun", not as a failure
                    report.outcome = "rerun"  # type: ignore[assignment]
                    report.mfsdp_attempt = attempt  # type: ignore[attr-defined]
                item.ihook.pytest_runtest_logreport(report=report)
        if failures:
            note_attempts(reports, failures, attempts)
        if declined is not None:
            assert failed is not None  # only a failure is declined
            failed.sections.append(("megatron-fsdp: not rerun", declined))
        reports += self._teardown_local_state(item, nextitem)
        for report in reports:
            item.ihook.pytest_runtest_logreport(report=report)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        remaining = self.remaining.get(world_size)
        if remaining is not None and item.nodeid in remaining:
            del remaining[: remaining.index(item.nodeid) + 1]
            if not remaining:
                self._finish_batch(world_size)

    def _fresh_rank_set(self, item: pytest.Item, world_size: int) -> RankSet:
        """A new rank set for another attempt at ``item`` (and the rest of its batch after it).

        Never the set whose test just failed: its process group went through the failure (torch's
        own harness once reported failures as passes by rerunning in such a group, pytorch#162978).
        That set is killed, also part-way through a later test it had run ahead to.
        """
        self._close(world_size)
        return self._assign(item, world_size, self._new_rank_set(world_size))

    def _teardown_local_state(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> list[pytest.TestReport]:
        """Tear down what earlier local tests set up here (module or class fixtures) and the next
        test does not need, as pytest's runner does in every test's teardown: a distributed test's
        own teardown ran in its ranks, but this process's setup state must still move on, or the
        next local test in another module finds the previous one 'not torn down properly'."""
        call = pytest.CallInfo.from_call(
            lambda: pytest_compat.teardown_local_state(item, nextitem), when="teardown"
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
            abnormal = abnormal_exits(rank_set.post_mortem())
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
        """The test's reports as its rank set sends them; a failure of the phase it had reached when
        the rank set went wrong (died, hung, ran or collected something else)."""
        spec = _hosted_spec(item)
        timeout = spec.timeout_s
        startup = STARTUP_ALLOWANCE_S if rank_set.tests_finished == 0 else 0.0
        #: since when the test counts as running (its ranks' start; until then, this wait's)
        since = _clock()
        deadline = since + timeout + KILL_GRACE_S + startup
        relay = self.config.option.capture == "no"
        watch = TestWatch(
            item.nodeid,
            to_report=lambda data: _report_from_event(self.config, data),
            record_warnings=lambda data: warnings_relay.record(item, data),
        )
        while True:
            events = rank_set.poll_events()
            while events:
                started = watch.started
                watch.handle(events.popleft())
                if watch.problem is not None:
                    failure = self._failure(
                        item, rank_set, watch.phase(), watch.problem, watch.elapsed(since), RANK_DEATH
                    )
                    return [*watch.reports, failure]
                if watch.started and not started:
                    since = _clock()
                    deadline = since + timeout + KILL_GRACE_S
                if watch.finished:
                    rank_set.tests_finished += 1
                    if relay:
                        _relay(rank_set)
                    return watch.reports
            if relay:
                _relay(rank_set)
            if rank_set.exited():
                if rank_set.poll_events():
                    continue  # the last words arrived with the exit
                post_mortem = rank_set.post_mortem()
                kind = TIMEOUT if post_mortem.timed_out else RANK_DEATH
                reason = death_text(post_mortem, timeout, timeout_source=spec.timeout_source)
                failure = self._failure(item, rank_set, watch.phase(), reason, watch.elapsed(since), kind)
                return [*watch.reports, failure]
            if _clock() > deadline:
                rank_set.dump_stacks()
                _sleep(1.0)
                rank_set.kill()
                reason = death_text(
                    rank_set.post_mortem(), timeout, killed_after=timeout, timeout_source=spec.timeout_source
                )
                failure = self._failure(item, rank_set, watch.phase(), reason, watch.elapsed(since), TIMEOUT)
                return [*watch.reports, failure]
            _sleep(0.05)

    def _failure(
        self, item: pytest.Item, rank_set: RankSet, when: str, reason: str, duration: float, kind: str
    ) -> pytest.TestReport:
        """The test fails in phase ``when`` (see :meth:`TestWatch.phase`) after ``duration`` seconds of
        that phase (JUnit's ``time``, ``--durations``); this rank set is finished. ``kind``: what
        happened (:data:`TIMEOUT`, :data:`RANK_DEATH`; ``--mfsdp-only-rerun`` chooses by it)."""
        world_size = rank_set.world_size
        if self.active.get(world_size) is rank_set:
            self._close(world_size)  # the rest of the batch continues in a fresh rank set
        return build_report(
            item,
            when,
            "failed",
            headlined_failure(item, reason),
            duration=duration,
            attributes={"mfsdp_failure": kind},
        )


#: the clock and the sleep of the controller's watch loop (a unit test drives them)
_clock = time.monotonic
_sleep = time.sleep


@dataclass
class TestWatch:
    """One test's view of its rank set's events, each event type to its own handler.

    ``to_report`` turns a serialised report back into a pytest report; ``record_warnings`` records
    the ranks' warnings in this session. A test whose rank set sends something else than its own
    events (another test started, the test not collected) gets a ``problem``.
    """

    __test__ = False  # not a pytest test class

    nodeid: str
    to_report: Callable[[dict[str, Any]], pytest.TestReport]
    record_warnings: Callable[[list[dict[str, Any]]], None] = lambda data: None
    reports: list[pytest.TestReport] = field(default_factory=list)
    started: bool = False
    finished: bool = False
    problem: str | None = None

    def handle(self, event: protocol.Event) -> None:
        _HANDLERS[type(event)](self, event)

    def on_collected(self, event: protocol.Collected) -> None:
        if self.nodeid not in event.nodeids:
            self.problem = _not_collected(self.nodeid, event)

    def on_started(self, event: protocol.Started) -> None:
        if event.nodeid != self.nodeid:
            self.problem = f"the rank set ran {event.nodeid} instead"
        else:
            self.started = True

    def on_warnings(self, event: protocol.Warnings) -> None:
        self.record_warnings(event.warnings)

    def on_report(self, event: protocol.Report) -> None:
        self.reports.append(self.to_report(event.report))

    def on_finished(self, event: protocol.Finished) -> None:
        self.finished = True

    def elapsed(self, since: float) -> float:
        """Seconds of the phase a failure now is charged to: since ``since`` (the test's start, or the
        start of the wait for it), less what the phases reported before it took."""
        return _clock() - since - sum(r.duration for r in self.reports)

    def phase(self) -> str:
        """The phase a failure of the rank set (death, hang, a wrong event) is charged to.

        Reports arrive only once the ranks agreed on a test, so a test that started and sent
        nothing is charged to its call phase (that is where ranks die or hang in practice); one
        that never started, to its setup; after a report, to the phase after the last one reported
        (call after a passed setup, else teardown).
        """
        when = "call" if self.started else "setup"
        if self.reports:
            last = self.reports[-1]
            when = "teardown" if last.when != "setup" or last.outcome != "passed" else "call"
        return when


_HANDLERS: dict[type, Callable[[TestWatch, Any], None]] = {
    protocol.Collected: TestWatch.on_collected,
    protocol.Started: TestWatch.on_started,
    protocol.Warnings: TestWatch.on_warnings,
    protocol.Report: TestWatch.on_report,
    protocol.Finished: TestWatch.on_finished,
}


#: the kinds of failure the controller makes itself (``report.mfsdp_failure``); a failure the ranks
#: report has none and counts as FAILURE (``--mfsdp-only-rerun``)
TIMEOUT, RANK_DEATH, FAILURE = "timeout", "rank-death", "failure"


def failure_kind(report: pytest.TestReport) -> str:
    """What kind of failure ``report`` is: a timeout, a rank death, or the test's own failure."""
    return getattr(report, "mfsdp_failure", None) or FAILURE


def _declines_rerun(
    item: pytest.Item, spec: Any, filters: coexist.RerunFilters, failed: pytest.TestReport
) -> str | None:
    """Why ``failed`` is not rerun although attempts are left (None: it is rerun): its kind is not
    one ``--mfsdp-only-rerun`` names, pytest-rerunfailures' filters decline it, or its
    ``--max-suite-reruns`` is spent."""
    kind = failure_kind(failed)
    if spec.only_rerun and kind not in spec.only_rerun:
        chosen = ", ".join(spec.only_rerun)
        return f"only {chosen} is rerun (--mfsdp-only-rerun, the marker's only_rerun=); this is a {kind}"
    why = filters.declines(coexist.exception_texts(failed))
    if why is not None:
        return why
    if filters.max_suite_reruns is not None:
        db = getattr(item.config, "failures_db", None)  # pytest-rerunfailures' suite-wide count
        if db is not None and not db.try_increment_suite_reruns(filters.max_suite_reruns):
            return f"--max-suite-reruns={filters.max_suite_reruns}: the suite's reruns are spent"
    return None


def _report_from_event(config: pytest.Config, data: dict[str, Any]) -> pytest.TestReport:
    report: pytest.TestReport = config.hook.pytest_report_from_serializable(config=config, data=data)
    if report.skipped and isinstance(report.longrepr, list):
        report.longrepr = tuple(report.longrepr)  # JSON has no tuples; pytest wants (path, line, reason)
    return report


def _relay(rank_set: RankSet) -> None:
    text = rank_set.new_output()
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


def _not_collected(nodeid: str, event: protocol.Collected) -> str:
    return (
        f"the launched ranks did not collect {nodeid} (they collected {len(event.nodeids)} tests); "
        "is its node id stable across processes (e.g. no random parametrize ids)?"
    )


def _hosted_spec(item: pytest.Item) -> DistributedSpec:
    """The spec of a distributed test (one the controller was given: it has one)."""
    spec = spec_of(item)
    assert spec is not None, item.nodeid
    return spec


_SESSION_ITEMS = pytest.StashKey[list[pytest.Item]]()
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
    from ..wire.platform import PlatformError, select_platform, visible_gpu_count

    lines = []
    for world_size in sorted({_hosted_spec(i).world_size for i in items}):
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
                if _hosted_spec(i).world_size == world_size:
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
