"""The rank directory: every file a rank leaves beside its log, its name and the formats of the lines
that are read back, in one place. The writers (``rank/``) and the readers (``parent/``,
``wire/explain.py``, ``postmortem``) import them from here; nothing else spells a name or parses a
line. Plain Python: no pytest, no torch (the post-mortem command line reads a run without either).

One rank set's directory holds, per rank ``R``:

* ``rank<R>.log``: the rank's log: its header, a ``START`` line per test (:func:`start_line`), a
  ``FAILED`` block per failed phase (:func:`failed_line`), the watchdog's timeout banner
  (:data:`TIMEOUT_BANNER`) and stack dumps;
* ``rank<R>.pid``: its pid, for the parent's backup watchdog;
* ``rank<R>.expired``: the node id of the test its watchdog ended (a stale ``rank<R>.aligned``, an
  earlier release's marker, is removed with it);
* ``flight_recorder_rank_<R>``: its c10d flight record (torch's ``torchfrtrace`` reads the rank from
  the name's end), formerly ``rank<R>.fr`` (still read);

and once per set ``torchrun.log`` (torchrun's own output, in plain mode). A launched rank leaves
pytest's exit status next to its argv file (:func:`exit_status_path`), outside the log directory.
"""

from __future__ import annotations

import re
from pathlib import Path

#: the line a rank's watchdog writes before its stacks (the full banner: ``wire.explain.timeout_banner``)
TIMEOUT_BANNER = "MFSDP-TIMEOUT"
#: torchrun's own output, in a launched rank set's directory
TORCHRUN_LOG = "torchrun.log"
#: a flight record's name is this prefix and the rank: torchfrtrace strips the prefix to get the rank
DUMP_PREFIX = "flight_recorder_rank_"
#: the suffix of the flight records' earlier names, ``rank<R>.fr`` (still read)
LEGACY_DUMP_SUFFIX = ".fr"
#: the marker a rank's watchdog leaves (the test it ended), and an earlier release's, removed with it
EXPIRED, ALIGNED = ".expired", ".aligned"

_RANK_LOG = re.compile(r"rank(\d+)\.log")
_DUMP_NAME = re.compile(rf"{DUMP_PREFIX}(\d+)")
_LEGACY_DUMP_NAME = re.compile(rf"rank(\d+){re.escape(LEGACY_DUMP_SUFFIX)}")
_START = re.compile(r"(?:^|(?<=\] ))START (\S+)", re.MULTILINE)
_FAILED = re.compile(r"^FAILED (\S+) \((setup|call|teardown)\) on rank (\d+):$")
#: the verdict in a timeout banner (:func:`wire.explain.timeout_banner` writes it)
BANNER_VERDICT = re.compile(
    rf"{TIMEOUT_BANNER}: .+? (exceeded its \S+ s timeout|hung) on rank \d+( \([^;\n]*\))?; stacks of every"
)


def log_path(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank{rank}.log"


def pid_path(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank{rank}.pid"


def marker_path(log_dir: Path, rank: int, suffix: str) -> Path:
    """``rank<R>.expired`` or ``rank<R>.aligned`` (:data:`EXPIRED`, :data:`ALIGNED`)."""
    return log_dir / f"rank{rank}{suffix}"


def dump_path(log_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` dumps its flight record: ``<log_dir>/flight_recorder_rank_<rank>``."""
    return log_dir / f"{DUMP_PREFIX}{rank}"


def exit_status_path(argv_path: Path, rank: int) -> Path:
    """Where rank ``rank`` leaves pytest's exit status (next to the argv file)."""
    return argv_path.with_name(f"exit-rank{rank}")


def _by_rank(log_dir: Path, *patterns: re.Pattern[str]) -> dict[int, Path]:
    """rank -> its file matching the patterns (a later pattern's file wins)."""
    found: dict[int, Path] = {}
    try:
        names = sorted(p.name for p in log_dir.iterdir())
    except OSError:
        return found
    for pattern in patterns:
        for name in names:
            match = pattern.fullmatch(name)
            if match:
                found[int(match.group(1))] = log_dir / name
    return dict(sorted(found.items()))


def rank_logs(log_dir: Path) -> dict[int, Path]:
    """rank -> its log in one rank set's log directory."""
    return _by_rank(log_dir, _RANK_LOG)


def dump_paths(log_dir: Path) -> dict[int, Path]:
    """rank -> its flight record (a ``rank<R>.fr`` one only where no newer name exists)."""
    return _by_rank(log_dir, _LEGACY_DUMP_NAME, _DUMP_NAME)


def pid_paths(log_dir: Path) -> dict[int, Path]:
    """rank -> its pid file."""
    return _by_rank(log_dir, re.compile(r"rank(\d+)\.pid"))


def markers(log_dir: Path, suffix: str) -> list[Path]:
    """Every rank's ``.expired`` (or ``.aligned``) marker."""
    return sorted(log_dir.glob(f"rank*{suffix}"))


def rank_files(log_dir: Path) -> list[Path]:
    """Every file a rank set leaves in its directory (what a new set there removes first)."""
    return sorted([*log_dir.glob("rank*.*"), *log_dir.glob(f"{DUMP_PREFIX}*")])


def start_line(nodeid: str, timeout: float) -> str:
    """The log line a rank writes as a test starts (after its timestamp)."""
    return f"START {nodeid} (timeout {timeout:g} s)"


def test_starts(log: str) -> list[tuple[int, str]]:
    """(offset of ``START``, node id) of every :func:`start_line` in a rank's log, in order."""
    return [(match.start(), match.group(1)) for match in _START.finditer(log)]


def failed_line(nodeid: str, when: str, rank: int) -> str:
    """The first line of the block a rank writes for a phase that failed on it."""
    return f"FAILED {nodeid} ({when}) on rank {rank}:"


def failed_test(line: str) -> tuple[str, str, int] | None:
    """(node id, phase, rank) of a :func:`failed_line`, None for any other line."""
    match = _FAILED.match(line)
    return (match.group(1), match.group(2), int(match.group(3))) if match else None


def agreed_failure_line(nodeid: str, when: str) -> str:
    """The first line of the block a rank writes for a failure every rank agreed on."""
    return f"FAILED (agreed) {nodeid} ({when}):"
