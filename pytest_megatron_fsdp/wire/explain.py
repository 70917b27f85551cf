"""Why a rank set ended, in words: the post-mortem data (:class:`PostMortem`, read once from a rank
set's logs and torchrun's output by :meth:`..parent.launcher.RankSet.post_mortem`) and every text
made from it or about a test's attempts: deaths and timeouts, exits, abnormal ends of a batch,
reruns, log excerpts. Kept apart from control (launching, watching: :mod:`..parent.launcher`,
:mod:`..parent.controller`), so that each failure wording has one home; many tests assert on it
byte for byte.
"""

from __future__ import annotations

import itertools
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from . import flight_recorder, rank_dir
from .protocol import TIMEOUT_EXIT_CODE, Verdict
from .pytest_compat import ExceptionChainRepr, ReprEntryNative, ReprFileLocation, ReprTraceback
from .rank_dir import TIMEOUT_BANNER

#: how much of torchrun's output a post-mortem keeps (its end)
OUTPUT_TAIL_CHARS = 2500
#: how much of a rank's log a post-mortem keeps when the log has no landmark to start from
LOG_TAIL_CHARS = 3000


#: how pytest prefixes each line of an internal error's traceback
INTERNAL_ERROR_PREFIX = "INTERNALERROR> "
#: how many of an internal error's last traceback lines a post-mortem keeps: the frames above them
#: are pytest's and pluggy's hook calls, the same every time (the whole traceback stays in the log)
INTERNAL_ERROR_LINES = 16


def failure_before_the_timeout(log: str) -> str:
    """The failure a rank logged in its last test before its watchdog's banner ("" when none): a
    rank that failed on its own (an exception in its backward) leaves its peers waiting in a
    collective it never enters, and the test then hangs; its failure is the cause."""
    starts = rank_dir.test_starts(log)
    end = log.rfind(TIMEOUT_BANNER)
    if not starts or end < starts[-1][0]:
        return ""
    lines = log[starts[-1][0] : end].splitlines()
    first = next((i for i, line in enumerate(lines) if rank_dir.failed_test(line)), None)
    return "\n".join(lines[first:]).rstrip() if first is not None else ""


def exception_line(failure: str) -> str:
    """The exception of a logged failure block: its first ``E`` line (pytest's), else its last line."""
    lines = failure.splitlines()
    raised = next((line[1:].strip() for line in lines if line.startswith("E ")), None)
    return raised or (lines[-1].strip() if lines else "")


def log_excerpt(log: str) -> str:
    """The part of a rank's log that explains its end: from its timeout banner (after the failure it
    logged before it, if any), else from a fatal signal's dump, else from a stack dump the parent
    asked for, else the current test's part, else the log's tail; an internal error's traceback
    shortened to its end."""
    failed = failure_before_the_timeout(log)
    if failed:
        return f"{failed}\n{log[log.rfind(TIMEOUT_BANNER) :].rstrip()}"
    start = log.find(TIMEOUT_BANNER)
    if start < 0:
        start = log.find("Fatal Python error")  # faulthandler on SIGSEGV, SIGABRT, ...
    if start < 0:
        start = log.find("Thread 0x")  # a dump on SIGUSR1 from the parent's watchdog
    if start < 0:
        starts = rank_dir.test_starts(log)  # this test's part of the log
        start = starts[-1][0] if starts else -1
    return _shorten_internal_errors(log[start:] if start >= 0 else log[-LOG_TAIL_CHARS:]).rstrip()


def _shorten_internal_errors(text: str) -> str:
    kept: list[str] = []
    for is_error, group in itertools.groupby(
        text.splitlines(), key=lambda line: line.startswith(INTERNAL_ERROR_PREFIX.rstrip())
    ):
        lines = list(group)
        if is_error and len(lines) > INTERNAL_ERROR_LINES:
            left_out = len(lines) - INTERNAL_ERROR_LINES
            kept.append(f"{INTERNAL_ERROR_PREFIX}[{left_out} lines of hook calls left out: see the log]")
            lines = lines[-INTERNAL_ERROR_LINES:]
        kept += lines
    return "\n".join(kept)


def internal_error(log: str) -> str | None:
    """The exception of the last pytest internal error in a rank's log (its traceback's last line),
    or None: what a rank that exited with pytest's INTERNAL_ERROR status died of."""
    lines = [
        line[len(INTERNAL_ERROR_PREFIX) :]
        for line in log.splitlines()
        if line.startswith(INTERNAL_ERROR_PREFIX)
    ]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if not starts:
        return None
    # after the last traceback's frames (indented), the exception's first line (not indented)
    return next(
        (line.strip() for line in lines[starts[-1] + 1 :] if line.strip() and not line.startswith(" ")), None
    )


@dataclass(frozen=True)
class PostMortem:
    """How a rank set ended, as plain data: what the controller formats into a failure or a note."""

    world_size: int
    #: torchrun's exit status (None: it had not exited when this was read)
    returncode: int | None
    #: exit code per failed rank, from torchrun's failure summary
    exits: dict[int, int] = field(default_factory=dict)
    #: the rank torchrun's summary names as the root cause
    root: int | None = None
    #: pytest's exit status per rank that left one (rank_entry)
    exit_statuses: dict[int, int] = field(default_factory=dict)
    #: ranks whose watchdog ended them (the timeout banner is in their log)
    timed_out: list[int] = field(default_factory=list)
    #: hung or too slow, as the first timed-out rank's banner says (:func:`verdict_phrase`)
    verdict: str | None = None
    #: per rank, the part of its log that explains its end (see log_excerpt)
    excerpts: dict[int, str] = field(default_factory=dict)
    #: per rank whose log has a pytest internal error, its exception (see internal_error)
    internal_errors: dict[int, str] = field(default_factory=dict)
    #: per rank that failed on its own in the test before the timeout, its exception
    #: (see failure_before_the_timeout)
    failed_first: dict[int, str] = field(default_factory=dict)
    log_dir: Path = Path()
    #: torchrun's output, its end
    output_tail: str = ""
    output_path: Path = Path()

    def died(self) -> list[tuple[int, int]]:
        """(rank, exit code) of the ranks that died, not ended by their watchdog: the first failing
        rank first (the root cause torchrun names, else the lowest rank), then the others."""
        died = {r: c for r, c in self.exits.items() if c != TIMEOUT_EXIT_CODE}
        order = ([self.root] if self.root in died else []) + sorted(r for r in died if r != self.root)
        return [(r, died[r]) for r in order]

    def log_path(self, rank: int) -> Path:
        return rank_dir.log_path(self.log_dir, rank)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def death_text(
    post_mortem: PostMortem,
    timeout: float,
    killed_after: float | None = None,
    interrupted: bool = False,
    timeout_source: str | None = None,
) -> str:
    """:func:`describe_death`, with who is stuck where from the ranks' flight-recorder dumps
    (written as they timed out) when the test timed out."""
    collectives = None
    if post_mortem.timed_out or killed_after is not None:
        collectives = flight_recorder.section(post_mortem.log_dir, post_mortem.world_size, time.time_ns())
    return describe_death(post_mortem, timeout, killed_after, interrupted, collectives, timeout_source)


def describe_death(
    post_mortem: PostMortem,
    timeout: float,
    killed_after: float | None = None,
    interrupted: bool = False,
    collectives: list[str] | None = None,
    timeout_source: str | None = None,
) -> str:
    """Why the rank set ended before the test did, with each rank's stacks or log tail.

    ``killed_after``: the parent killed it after the test's timeout; ``interrupted``: the session
    was interrupted; ``collectives``: the flight-recorder section of a timeout; ``timeout_source``:
    where the timeout came from (a source label of ``--mfsdp-timeout``'s chain), said under the
    headline of a timeout.
    """
    pm = post_mortem
    lines: list[str] = []
    if pm.timed_out or killed_after is not None:
        verdict = pm.verdict or verdict_phrase(None, timeout)
        lines.append(
            f"timed out: the test {verdict}; every rank's stacks were dumped and the rank set was killed"
        )
        if timeout_source is not None:
            lines.append(f"timeout {timeout:g} s (from {timeout_source})")
        for r, raised in sorted(pm.failed_first.items()):
            lines.append(f"rank {r} had failed on its own before (its failure below): {raised}")
        lines += collectives or []
    died = pm.died()
    if died and not pm.timed_out:
        first, code = died[0]
        cause = pm.internal_errors.get(first)
        lines.append(
            f"rank {first} died ({describe_exit(code)}"
            + (f": a pytest internal error in the rank: {cause})" if cause else ")")
        )
        for r, other in died[1:]:
            lines.append(
                f"rank {r} then ended ({describe_exit(other)}; stopped by torchrun after rank {first})"
            )
    if not lines and not interrupted:
        lines.append(f"the rank set ended unexpectedly ({describe_exit(pm.returncode or 0)})")
    for r in range(pm.world_size):
        lines.append(f"---------- rank {r} (log: {pm.log_path(r)}) ----------")
        lines.append(pm.excerpts.get(r, ""))
    lines.append(f"---------- torchrun output (tail; whole: {pm.output_path}) ----------")
    lines.append(pm.output_tail.rstrip())
    return "\n".join(lines)


#: a rank's pytest exit code that says only "some tests failed": those failures are reported already
_TESTS_FAILED = 1
#: how torchrun stops the other ranks once one has exited non-zero
_STOPPED_BY_TORCHRUN = -int(signal.SIGTERM)


def abnormal_exits(post_mortem: PostMortem) -> str:
    """Why a rank set's non-zero exit after its last test is worth a note ("" when it is not).

    A rank's pytest exits 1 when any of its tests failed, and torchrun then stops the other ranks
    (SIGTERM) and exits non-zero itself: the normal end of a batch with failures, which the test
    reports already show. Anything else (an internal error, another signal, a rank set with no
    rank exit codes in torchrun's output) is not.
    """
    # pytest's own exit status where a rank left one (the set may end before torchrun reports
    # anything), else what torchrun's summary says about the rank
    exits = {**post_mortem.exits, **post_mortem.exit_statuses}
    described = ", ".join(f"rank {rank}: {describe_exit(code)}" for rank, code in sorted(exits.items()))
    if not exits:
        return f"torchrun {describe_exit(post_mortem.returncode or 0)}, no rank exit codes in its output"
    codes = set(exits.values())
    if _TESTS_FAILED in codes and codes <= {_TESTS_FAILED, _STOPPED_BY_TORCHRUN}:
        return ""
    return described


def note_attempts(
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
        report.mfsdp_attempts = len(failures) + 1  # type: ignore[attr-defined]
        report.mfsdp_max_attempts = attempts  # type: ignore[attr-defined]


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


# -- a test's timeout in a rank that reports its own session (torchrun, srun) -------------------------


def verdict_phrase(verdict: Verdict | None, timeout: float, rank: int | None = None) -> str:
    """How a test whose time ran out ended, told from its ranks' progress (None: nothing measured
    it), after the test's name: hung before its timeout, or at its timeout with no progress (hung)
    or still getting somewhere (too slow); ``rank``: the rank that says so (in its banner).
    No semicolon: the banner ends the phrase with one."""
    on_rank = f" on rank {rank}" if rank is not None else ""
    if verdict is None or verdict.quiet_s is None:
        return f"exceeded its {timeout:g} s timeout{on_rank}"
    quiet = f"{verdict.quiet_s:.0f} s"
    if verdict.before_timeout:
        return (
            f"hung{on_rank} (no progress on any rank for {quiet}, the --mfsdp-hang-after bound, "
            f"{verdict.elapsed_s:.0f} s into its {timeout:g} s timeout)"
        )
    if verdict.hung:
        return f"exceeded its {timeout:g} s timeout{on_rank} (hung: no progress on any rank for {quiet})"
    return (
        f"exceeded its {timeout:g} s timeout{on_rank} (too slow: still progressing, last progress "
        f"{quiet} ago)"
    )


def timeout_banner(
    nodeid: str, timeout: float, rank: int, interrupts: bool, verdict: Verdict | None = None
) -> str:
    """The line a rank's watchdog writes before this rank's stacks, in its log (where the post-mortem
    command and a plain-mode parent find it) and, in a rank whose process ends here, on stderr.
    ``interrupts``: the rank interrupts the test and goes on (torchrun, srun), else it ends;
    ``verdict``: hung or too slow (:func:`verdict_phrase`)."""
    then = (
        "the test is interrupted and fails on every rank; the session goes on"
        if interrupts
        else "then the rank is ended (a rank stuck in a collective cannot be unwound)"
    )
    verdict_text = verdict_phrase(verdict, timeout, rank)
    return f"{TIMEOUT_BANNER}: {nodeid} {verdict_text}; stacks of every thread follow, {then}"


def verdict_in(log: str) -> str | None:
    """The verdict of the first timeout banner in a rank's log (:func:`timeout_banner`), as
    :func:`verdict_phrase` words it without the rank."""
    match = rank_dir.BANNER_VERDICT.search(log)
    return f"{match.group(1)}{match.group(2) or ''}" if match else None


def timed_out_in_rank(banner: str, collectives: list[str], stacks: str) -> str:
    """The failure a rank's watchdog raises in its main thread when the test's time is up: the
    banner (its first line, what summaries show), who is stuck in which collective (rank 0, from
    every rank's flight record) and this rank's stacks at that moment."""
    return "\n".join([banner, *collectives, "stacks at the timeout:", stacks.rstrip()])


def main_thread_stuck(nodeid: str, rank: int, grace: float) -> str:
    """Why a rank cannot go on after a timeout: its main thread did not come back to Python (where
    the interruption fails the test) within ``grace`` seconds."""
    return (
        f"rank {rank} did not come back from the timeout of {nodeid} within {grace:g} s (its main "
        "thread is stuck outside Python: a C or C++ call, a collective that never returns); the rank "
        "is ended"
    )


def signal_not_taken(nodeid: str, rank: int, grace: float) -> str:
    """Why a rank reports the session from another thread after a signal that ends it: its main
    thread did not take the signal in Python within ``grace`` seconds."""
    return (
        f"rank {rank} did not take the signal within {grace:g} s during {nodeid} (its main thread is "
        "stuck outside Python: a C or C++ call, a collective whose peer is gone); the rank reports "
        "the session and is ended"
    )


def stuck_failure(banner: str, why: str, stacks: str) -> str:
    """The failure of a test whose rank's main thread never came back (from its timeout, or to take
    a signal), reported by that rank's watchdog as the session ends (rank 0 writes the JUnit file
    and the summary from there)."""
    return "\n".join([banner, f"megatron-fsdp: {why}", "stacks:", stacks.rstrip()])


def not_run(nodeid: str, rank: int) -> str:
    """Why a test after a rank that never came back from a timeout was not run."""
    return f"not run: the session ended after {nodeid} timed out on rank {rank}"


def interrupted(nodeid: str, rank: int, why: str) -> str:
    """The failure of the test a signal ended the session in (a CI cancel: torchrun's agent or srun
    passes SIGTERM on to the ranks)."""
    return f"interrupted ({why}) on rank {rank} during {nodeid}: the session ends here"


def not_run_after_interrupt(nodeid: str, why: str) -> str:
    """Why a test after the one a signal interrupted was not run."""
    return f"not run: the session was interrupted ({why}) during {nodeid}"


def harness_error(nodeid: str, rank: int, trace: str) -> str:
    """The failure of a test around which this plugin's own code failed on a rank (a bug of the
    plugin: the traceback says where)."""
    return (
        f"megatron-fsdp's own code failed on rank {rank} around {nodeid} (a bug of the plugin; "
        f"please report it with this traceback); the session ends here:\n{trace}"
    )


def not_run_after_harness_error(nodeid: str, rank: int) -> str:
    """Why a test after the one around which the plugin's own code failed was not run."""
    return f"not run: megatron-fsdp's own code failed on rank {rank} around {nodeid}"


def tests_not_run_heading(count: int) -> str:
    return f"megatron-fsdp: {count} test{'s' if count != 1 else ''} not run"


def headlined_failure(item: pytest.Item, text: str) -> ExceptionChainRepr:
    """A failure report of several lines whose headline (its first line) is what summaries show.

    pytest's short summary appends a report's crash message; a plain-string report is appended
    whole where pytest runs verbosely (``-vv``, or ``CI`` set, as on every CI service), which would
    print every rank's traceback a second time. ``--tb=line`` and JUnit's ``message`` use the
    headline too. A native-style entry keeps the text as it is, and pytest serialises it (xdist,
    the rank-to-parent events) like any traceback.
    """
    path, lineno, _ = item.location
    headline = ReprFileLocation(str(path), (lineno or 0) + 1, text.split("\n", 1)[0])
    body = ReprTraceback([ReprEntryNative([text.rstrip("\n") + "\n"])], None, "native")
    return ExceptionChainRepr([(body, headline, None)])
