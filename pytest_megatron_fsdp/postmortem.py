"""``python -m pytest_megatron_fsdp``: a run's artefacts read after the fact, without torch.

Subcommands (each finds the newest run by itself; give a directory or file to read another):

* ``collectives [DIR]``: the c10d flight-recorder dumps a timed-out test left beside the rank logs,
  per rank the last collectives recorded (completed or not), then who never entered which
  collective and which collectives differ across ranks (the summary the failure report showed);
* ``stacks [DIR]``: every stack dump in each rank's log (a timeout's, a fatal signal's, one the
  parent asked for);
* ``report [PATH]``: the JSON report of ``--mfsdp-report-json`` as the session's table, with a text
  plot of each run's loss per iteration (``--png FILE`` for a PNG, with matplotlib);
* ``show [TEST]``: everything the logs hold about one failed test (the last one by default).

DIR is a rank set's log directory (``rank<R>.log`` inside) or a directory of them (the default:
``--mfsdp-log-dir``'s value from ``MFSDP_LOG_DIR``, else ``.pytest_cache/d/mfsdp-logs`` in the
current directory or above, else ``$TMPDIR/mfsdp-logs``); of several, the newest one that holds what
the subcommand reads. Plain Python: it imports neither torch nor pytest, so it runs on a machine
that has the logs and not the training stack.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, TextIO

from .reporting import report as report_module
from .reporting.record import RunRecord
from .wire import flight_recorder, rank_dir
from .wire.rank_dir import TIMEOUT_BANNER, rank_logs

#: the default log root below pytest's cache dir (``wire.protocol.log_dir``)
CACHE_LOG_DIR = Path(".pytest_cache") / "d" / "mfsdp-logs"
#: how many of each rank's last collectives ``collectives`` lists (``--last``)
DEFAULT_LAST = 5
#: the text plot's size in characters (the plot area, without the axis labels)
PLOT_WIDTH, PLOT_HEIGHT = 60, 12

#: faulthandler's first line for a fatal signal and for its C watchdog (``dump_traceback_later``)
_WHY = ("Fatal Python error", "Timeout (")
_THREAD_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+")


class PostMortemError(Exception):
    """Nothing to read where the command looked: one line saying where and what to do."""


# -- where the artefacts are ----------------------------------------------------------------------


def default_log_root(cwd: Path | None = None) -> Path:
    """Where the plugin puts rank-set log directories by default (see the module docstring)."""
    explicit = os.environ.get("MFSDP_LOG_DIR")
    if explicit:
        return Path(explicit)
    here = (cwd or Path.cwd()).resolve()
    for directory in (here, *here.parents):
        if (directory / CACHE_LOG_DIR).is_dir():
            return directory / CACHE_LOG_DIR
    return Path(tempfile.gettempdir()) / "mfsdp-logs"


def _is_run_dir(path: Path) -> bool:
    return bool(rank_logs(path) or rank_dir.dump_paths(path))


def _newest_file_time(path: Path) -> float:
    """When anything in a rank set's log directory was last written (0 for one that went away)."""
    times = []
    for p in path.iterdir():
        try:
            times.append(p.stat().st_mtime)
        except OSError:
            continue  # removed meanwhile (a session replacing its logs)
    return max(times, default=0.0)


def run_dirs(path: Path) -> list[Path]:
    """The rank-set log directories at ``path`` (itself, or those inside it), newest first."""
    if _is_run_dir(path):
        return [path]
    try:
        children = [p for p in path.iterdir() if p.is_dir() and _is_run_dir(p)]
    except OSError:
        return []
    return sorted(children, key=_newest_file_time, reverse=True)


def pick_run_dir(given: str | None, wanted: Callable[[Path], bool], what: str) -> Path:
    """The newest rank-set log directory under ``given`` (else the default root) for which
    ``wanted`` holds; ``what`` names what it must hold, for the error."""
    root = Path(given) if given else default_log_root()
    if not root.exists():
        hint = (
            "" if given else " (give the log directory: the run's --mfsdp-log-dir, or a rank set's directory)"
        )
        raise PostMortemError(f"no log directory at {root}{hint}")
    candidates = run_dirs(root)
    for run_dir in candidates:
        if wanted(run_dir):
            return run_dir
    if not candidates:
        raise PostMortemError(f"no rank logs under {root} (rank<R>.log files of a distributed test run)")
    raise PostMortemError(f"no {what} under {root}")


# -- collectives ----------------------------------------------------------------------------------


def _describe_entry(c: flight_recorder.Collective, dumped_ns: int) -> str:
    if c.completed:
        return f"{c.describe()} completed"
    age = max(dumped_ns - c.created_ns, 0) / 1e9
    return f"{c.describe()} {c.state or 'not completed'}, not completed {age:.1f} s after it was issued"


def collectives_lines(run_dir: Path, last: int = DEFAULT_LAST) -> list[str]:
    """The flight-recorder dumps in ``run_dir``, per rank and aligned across ranks."""
    paths = rank_dir.dump_paths(run_dir)
    traces = {}
    for rank, path in paths.items():
        trace = flight_recorder.load(path)
        if trace is not None:
            traces[rank] = trace
    unreadable = sorted(set(paths) - set(traces))
    if not traces:
        raise PostMortemError(f"no readable flight-recorder dump in {run_dir}")
    # "waited for": until the dump was written (the test's timeout), not until now
    dumped_ns = max(paths[r].stat().st_mtime_ns for r in traces)
    dumped = datetime.datetime.fromtimestamp(dumped_ns / 1e9, datetime.timezone.utc)
    lines = [
        f"flight-recorder dumps in {run_dir}: ranks {', '.join(map(str, sorted(traces)))} "
        f"(written {dumped:%Y-%m-%d %H:%M:%S} UTC)"
    ]
    lines += [f"rank {r}: dump {paths[r]} is not a readable pickle" for r in unreadable]
    tests = _timed_out_tests(run_dir)
    if tests:
        lines.append(f"timed-out test: {', '.join(tests)}")
    for rank, trace in sorted(traces.items()):
        recorded = flight_recorder.collectives(rank, trace)
        shown = recorded[-last:] if last > 0 else []
        lines.append(f"rank {rank}: last {len(shown)} of {len(recorded)} collectives recorded")
        lines += [f"  {_describe_entry(c, dumped_ns)}" for c in shown]
    aligned = flight_recorder.align(traces, dumped_ns)
    problems = [line for line in aligned if not line.startswith("rank ") or " never entered " in line]
    lines.append("across ranks:")
    lines += [f"  {line}" for line in aligned]
    if problems:
        lines.append(f"first mismatch: {problems[0]}")
    else:
        lines.append("first mismatch: none (every rank recorded the same collectives)")
    world_size = max(len(rank_logs(run_dir)), max(traces) + 1)
    lines += flight_recorder.commands(run_dir, sorted(traces), world_size)[1:]
    return lines


def _timed_out_tests(run_dir: Path) -> list[str]:
    """The test(s) the ranks' watchdogs ended, from their ``rank<R>.expired`` markers."""
    names = []
    for marker in rank_dir.markers(run_dir, rank_dir.EXPIRED):
        try:
            names.append(marker.read_text().strip())
        except OSError:
            continue
    return sorted(set(filter(None, names)))


# -- stacks ---------------------------------------------------------------------------------------


def stack_dumps(log: str) -> list[list[str]]:
    """Every stack dump in a rank's log, each as its lines: the line that says why (the timeout
    banner, ``Fatal Python error: ...``, ``Timeout (0:00:16)!``) where one comes just before, then
    each thread's stack."""
    lines = log.splitlines()
    dumps: list[list[str]] = []
    i = 0
    while i < len(lines):
        if not _THREAD_HEADER.match(lines[i]):
            i += 1
            continue
        start = i
        # faulthandler: a header, "  File ..." lines, a blank line, the next thread's header
        while i < len(lines) and (
            _THREAD_HEADER.match(lines[i])
            or lines[i].startswith("  ")
            or (not lines[i].strip() and i + 1 < len(lines) and _THREAD_HEADER.match(lines[i + 1]))
        ):
            i += 1
        why = []
        for back in range(start - 1, max(start - 4, -1), -1):
            if TIMEOUT_BANNER in lines[back] or lines[back].startswith(_WHY):
                why = [lines[back]]
                break
        dumps.append(why + lines[start:i])
    return dumps


def stacks_lines(run_dir: Path, rank: int | None = None) -> list[str]:
    logs = rank_logs(run_dir)
    if rank is not None:
        if rank not in logs:
            missing = rank_dir.log_path(run_dir, rank).name
            raise PostMortemError(f"--rank {rank}: no {missing} in {run_dir} (ranks: {sorted(logs)})")
        logs = {rank: logs[rank]}
    lines = [f"stacks in {run_dir}"]
    for r, path in logs.items():
        dumps = stack_dumps(path.read_text(errors="replace"))
        if not dumps:
            lines.append(f"rank {r}: no stack dump in {path}")
            continue
        lines.append(f"rank {r}: {len(dumps)} stack dump{'s' if len(dumps) > 1 else ''} in {path}")
        for dump in dumps:
            lines += [f"  {line}" if line else "" for line in dump]
    return lines


def _has_stacks(run_dir: Path) -> bool:
    return any(stack_dumps(p.read_text(errors="replace")) for p in rank_logs(run_dir).values())


# -- the JSON report ------------------------------------------------------------------------------

_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _number(value: Any) -> Any:
    if isinstance(value, str) and value in _NON_FINITE:
        return _NON_FINITE[value]
    if isinstance(value, list):
        return [_number(v) for v in value]
    return value


def load_report(path: Path) -> tuple[dict[str, Any], list[RunRecord]]:
    """The JSON report's document and its runs as records (non-finite strings back to floats)."""
    try:
        document = json.loads(path.read_text())
    except OSError as exc:
        raise PostMortemError(f"cannot read the JSON report {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise PostMortemError(f"{path} is not JSON ({exc.msg}, line {exc.lineno})") from None
    version = document.get("schema_version") if isinstance(document, dict) else None
    if version != report_module.SCHEMA_VERSION:
        raise PostMortemError(
            f"{path}: schema_version {version!r}, expected {report_module.SCHEMA_VERSION} "
            "(not a report of --mfsdp-report-json, or of another version of this plugin)"
        )
    known = {f.name for f in fields(RunRecord)}
    records = []
    for index, run in enumerate(document.get("runs", [])):
        data = {k: _number(v) for k, v in run.items() if k in known}
        for key, value in (run.get("checkpoint") or {}).items():
            data[f"checkpoint_{key}"] = value
        try:
            records.append(RunRecord(**data))
        except TypeError as exc:
            raise PostMortemError(
                f"{path}: runs[{index}] is not a run of this plugin's report ({exc})"
            ) from None
    return document, records


def text_plot(values: Sequence[float], width: int = PLOT_WIDTH, height: int = PLOT_HEIGHT) -> list[str]:
    """A text plot of ``values`` against their index (1-based), y from the smallest to the largest
    finite value; a non-finite value is an ``x`` on the bottom row (never left out)."""
    if not values:
        return []
    finite = [v for v in values if math.isfinite(v)]
    low, high = (min(finite), max(finite)) if finite else (0.0, 0.0)
    span = high - low or 1.0
    columns = min(width, len(values))
    grid = [[" "] * columns for _ in range(height)]
    for column in range(columns):
        bucket = values[column * len(values) // columns : (column + 1) * len(values) // columns]
        if any(not math.isfinite(v) for v in bucket):
            grid[height - 1][column] = "x"
            continue
        mean = sum(bucket) / len(bucket)
        row = height - 1 - round((mean - low) / span * (height - 1))
        grid[row][column] = "*"
    labels = [report_module.fmt_number(high, ".4f"), report_module.fmt_number(low, ".4f")]
    pad = max(len(label) for label in labels)
    lines = []
    for i, cells in enumerate(grid):
        label = labels[0] if i == 0 else labels[1] if i == height - 1 else ""
        lines.append(f"{label.rjust(pad)} |{''.join(cells)}".rstrip())
    axis = f"{' ' * pad} +{'-' * columns}"
    last = str(len(values))
    lines += [axis, f"{' ' * pad}  1{last.rjust(columns - 1)}  (iteration)"]
    return lines


def report_lines(path: Path, plot: bool = True) -> list[str]:
    document, records = load_report(path)
    lines = [
        f"{path}: {len(records)} run{'s' if len(records) != 1 else ''}, {document.get('mode', '?')} mode, "
        f"written {document.get('generated_at', '?')}"
    ]
    if not records:
        return [*lines, "no training runs recorded"]
    lines += report_module.table_lines(records, details=True)
    if plot:
        for record in records:
            lines += ["", f"lm loss per iteration: {record.nodeid} ({record.strategy}, {record.preset})"]
            lines += [f"  {line}" for line in text_plot(record.losses)]
    return lines


def _report_path(given: str | None) -> Path:
    raw = given or os.environ.get("MFSDP_REPORT_JSON")
    if not raw:
        raise PostMortemError(
            "no JSON report given: pass the file that --mfsdp-report-json wrote (or set MFSDP_REPORT_JSON)"
        )
    return Path(raw)


# -- one failed test ------------------------------------------------------------------------------


def parts_by_test(log: str) -> dict[str, str]:
    """nodeid -> its part of a rank's log (from its START line to the next test's)."""
    starts = rank_dir.test_starts(log)
    parts: dict[str, str] = {}
    for i, (offset, nodeid) in enumerate(starts):
        line_start = log.rfind("\n", 0, offset) + 1
        end = starts[i + 1][0] if i + 1 < len(starts) else len(log)
        end = log.rfind("\n", 0, end) + 1 if i + 1 < len(starts) else end
        parts[nodeid] = log[line_start:end]
    return parts


def failed_tests(run_dir: Path) -> list[str]:
    """The tests that failed or timed out in a rank set, in the order they ran."""
    failed: dict[str, None] = {}
    for path in rank_logs(run_dir).values():
        for nodeid, part in parts_by_test(path.read_text(errors="replace")).items():
            failing = any(rank_dir.failed_test(line) for line in part.splitlines())
            if failing or f"{TIMEOUT_BANNER}: {nodeid} " in part or "Fatal Python error" in part:
                failed[nodeid] = None
    for nodeid in _timed_out_tests(run_dir):
        failed[nodeid] = None
    order = {
        nodeid: i
        for path in rank_logs(run_dir).values()
        for i, nodeid in enumerate(parts_by_test(path.read_text(errors="replace")))
    }
    return sorted(failed, key=lambda n: order.get(n, len(order)))


def _tests_matching(run_dir: Path, text: str) -> list[str]:
    """The tests whose node id contains ``text`` in a rank set's logs, in the order they ran."""
    found: dict[str, None] = {}
    for path in rank_logs(run_dir).values():
        found.update((n, None) for n in parts_by_test(path.read_text(errors="replace")) if text in n)
    return list(found)


def show_lines(run_dir: Path, test: str | None) -> list[str]:
    failed = failed_tests(run_dir)
    if test is None:
        if not failed:
            raise PostMortemError(f"no failed test in the rank logs of {run_dir}")
        nodeid = failed[-1]
    else:
        matches = [n for n in failed if test in n] or _tests_matching(run_dir, test)
        if not matches:
            raise PostMortemError(f"no test matching {test!r} in the rank logs of {run_dir}")
        if len(matches) > 1 and test not in matches:
            raise PostMortemError(f"{test!r} matches {len(matches)} tests: {', '.join(matches)}")
        nodeid = test if test in matches else matches[0]
    lines = [f"{nodeid} in {run_dir}" + ("" if nodeid in failed else " (no failure recorded)")]
    for rank, path in rank_logs(run_dir).items():
        part = parts_by_test(path.read_text(errors="replace")).get(nodeid)
        lines.append(f"---------- rank {rank} ({path})")
        lines += part.rstrip("\n").splitlines() if part else ["(this rank's log has no part for this test)"]
    if nodeid in _timed_out_tests(run_dir) and rank_dir.dump_paths(run_dir):
        lines.append("---------- collectives")
        lines += collectives_lines(run_dir)
    torchrun_log = run_dir / rank_dir.TORCHRUN_LOG
    if torchrun_log.is_file():
        lines.append(f"torchrun's output: {torchrun_log}")
    return lines


# -- the command line -----------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="python -m pytest_megatron_fsdp",
        description="Read a pytest-megatron-fsdp run's artefacts (rank logs, flight-recorder dumps, "
        "the JSON report) after the fact; needs no torch.",
    )
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    dir_help = (
        "a rank set's log directory, or a directory of them (default: the newest under "
        "$MFSDP_LOG_DIR, else .pytest_cache/d/mfsdp-logs here or above)"
    )
    c = sub.add_parser(
        "collectives", help="the flight-recorder dumps of a timed-out test, aligned across ranks"
    )
    c.add_argument("dir", nargs="?", help=dir_help)
    c.add_argument("--last", type=int, default=DEFAULT_LAST, metavar="N", help="collectives listed per rank")
    s = sub.add_parser("stacks", help="the stack dumps in each rank's log")
    s.add_argument("dir", nargs="?", help=dir_help)
    s.add_argument("--rank", type=int, default=None, help="one rank only")
    r = sub.add_parser("report", help="the JSON report (--mfsdp-report-json) as a table and a text plot")
    r.add_argument("path", nargs="?", help="the report (default: $MFSDP_REPORT_JSON)")
    r.add_argument("--no-plot", action="store_true", help="the table only")
    r.add_argument("--png", metavar="FILE", help="also write the loss plot as a PNG (needs matplotlib)")
    w = sub.add_parser("show", help="everything the rank logs hold about one failed test")
    w.add_argument("test", nargs="?", help="the test's node id or part of it (default: the last failed test)")
    w.add_argument("--log-dir", help=dir_help)
    return top


def run(args: argparse.Namespace) -> list[str]:
    if args.command == "collectives":
        run_dir = pick_run_dir(args.dir, lambda d: bool(rank_dir.dump_paths(d)), "flight-recorder dumps")
        return collectives_lines(run_dir, args.last)
    if args.command == "stacks":
        run_dir = pick_run_dir(args.dir, _has_stacks, "stack dump in a rank log")
        return stacks_lines(run_dir, args.rank)
    if args.command == "report":
        path = _report_path(args.path)
        lines = report_lines(path, plot=not args.no_plot)
        if args.png:
            _, records = load_report(path)
            lines.append(report_module.write_plot(Path(args.png), records) if records else "no runs to plot")
        return lines
    if args.test is None:
        run_dir = pick_run_dir(args.log_dir, lambda d: bool(failed_tests(d)), "failed test in the rank logs")
    else:
        run_dir = pick_run_dir(
            args.log_dir, lambda d: bool(_tests_matching(d, args.test)), f"test matching {args.test!r}"
        )
    return show_lines(run_dir, args.test)


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """The command line; returns the exit status (0, or 1 with one line on stderr when there is
    nothing to read where it looked)."""
    args = parser().parse_args(argv)
    stream = out or sys.stdout
    try:
        lines = run(args)
    except PostMortemError as exc:
        print(f"python -m pytest_megatron_fsdp {args.command}: {exc}", file=sys.stderr)
        return 1
    stream.write("".join(f"{line}\n" for line in lines))
    return 0
