"""``make upstream``: Megatron-LM's own Megatron-FSDP tests, unchanged, on CPU ranks, one run per world size.

Each run is ``python -m torch.distributed.run --standalone --nproc_per_node=<ws> -m pytest
--mfsdp-platform=cpu --mfsdp-foreign-suite=true --junitxml=<results>/<run>.xml <tests>`` from the
checkout's root (its tests import ``tests.…``), its output in ``<results>/<run>.log``. The runs go
one after the other, each under a wall limit: on overrun the torchrun agent gets SIGINT (it passes it
on to its ranks, whose pytest ends the session as interrupted and writes the JUnit file of the tests
finished so far), and whatever is left after a grace period is SIGKILLed, the ranks' own sessions
included (torchrun starts each rank in a session of its own). A run that did not finish is reported
as such, with whatever JUnit it wrote.

Then a table per run (file | passed | GPU-only skips | other skips | xfailed | failed | errors |
time) and totals, and ``<results>/summary.json``: per run, per file and per test id its outcome and
skip reason, and the stack (the checkout's commit where git can tell, the installed versions, the
CPU). ``docs/generate_gpu_only_causes.py --record`` turns that summary into the data of
docs/gpu-only-causes.md.

A run is one entry of data (:class:`Run`): the world sizes of the Megatron-LM suites give one each,
selected by upstream's own markers (``--markers``, default Megatron-LM's dev CI's ``not flaky_in_dev``,
passed as ``-m``; the count pytest deselected is read from the run's log); Megatron-Bridge's
(``--megatron-bridge``, run ``bridge``) is one more, after them: ``make bridge-test`` (the Makefile
states its command) with its JUnit file, its rank logs into ``<results>/bridge-logs`` and its
last-loss line (bench/bridge_loss.py) read from its log into the table.

Bad input (a missing or wrong checkout, a test path not in it, a world size that is no number) stops
in one line naming the variable, the value and the fix, exit status 2, before anything starts; the
Makefile runs that check (``--check``) with the stack's base Python before it builds the venv. The
parsing and the tables are plain functions of JUnit files (stdlib ``xml.etree``).

    python -m bench.upstream --megatron-lm /path/to/Megatron-LM [--tests "..."] [--world-sizes "2 4 8"]

Exit status: 0 when every run finished with no failure or error, 1 otherwise, 2 on bad input.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import bridge_loss

REPO = Path(__file__).resolve().parents[1]
#: what ``make upstream`` runs when UPSTREAM_TESTS is not given (paths in the Megatron-LM checkout)
DEFAULT_TESTS = (
    "tests/unit_tests/distributed",
    "tests/unit_tests/transformer/test_fsdp_dtensor_checkpoint.py",
)
#: 8 is upstream's own (tests/unit_tests/run_ci_test.sh: torchrun --nproc_per_node 8)
DEFAULT_WORLD_SIZES = (2, 4, 8)
#: What a rank needs above what it holds once torch and megatron-core are imported: the most a
#: rank's anonymous memory grew above that over the default tests at world size 8 (0.6 GiB, in
#: mfsdp_v2/test_memory.py; measured 2026-12-05 on a 2-core Xeon with avx512_bf16, torch 2.14.1,
#: megatron-core of Megatron-LM main), rounded up.
TEST_HEADROOM_GIB = 1.0
#: Memory kept free beside the ranks: the parent, the torchrun agent, the shared libraries' pages.
RESERVE_GIB = 1.5
#: The runs have no network (tests never download): a request through ``requests``/``urllib``
#: goes to this proxy, a closed port on this machine, and fails at once. Megatron-LM's session
#: fixture ``ensure_test_data`` tries to download its test data into /opt/data (60 s a try against
#: a silent server); its failure is said in one line after the run.
NO_NETWORK = {"HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}
#: what that fixture logs when it could not get the data
NO_TEST_DATA = "Error downloading/extracting"
#: Directories Megatron-LM's tests make outside the checkout and leave behind: the test-data
#: fixture's /opt/data, the shared temp dir of mfsdp_v1's checkpoint tests. Removed after the runs
#: where the runs made them and left them empty.
MADE_OUTSIDE = (Path("/opt/data"), Path("/tmp/pytest-shared-tmp"))
#: what a rank imports before any test (the probe measures a process that imported it)
RANK_IMPORTS = "import torch, megatron.core"
GIB = 1 << 30
#: what a checkout's root holds (its tests import ``tests.…`` from there)
MEGATRON_LM_LAYOUT = ("megatron/core", "tests/unit_tests")
BRIDGE_LAYOUT = ("src/megatron/bridge", "tests")
DEFAULT_RESULTS = "upstream-results"
#: seconds one run may take before it is interrupted (UPSTREAM_WALL)
DEFAULT_WALL_S = 3600.0
#: seconds an interrupted run has to write its JUnit file before everything left is killed; the
#: torchrun agent itself waits 30 s for its ranks before it SIGKILLs them
DEFAULT_GRACE_S = 60.0
#: upstream's own selection of the Megatron-LM runs (UPSTREAM_MARKERS), passed as ``-m``: what
#: Megatron-LM's tests/unit_tests/run_ci_test.sh selects in its dev environment ("not flaky" in LTS)
DEFAULT_MARKERS = "not flaky_in_dev"
#: the world size of the run named ``bridge`` (``make bridge-test``'s NPROC; its last rank logs the loss)
BRIDGE_WORLD_SIZE = 2
BRIDGE_EXAMPLE = "tests/functional_tests/test_groups/megatron_fsdp"
#: the pytest arguments of every run: CPU ranks, the foreign-suite mode, nothing written into the
#: checkout (no .pytest_cache), JUnit with each test's file (xunit1's ``file`` attribute), the tests
#: in upstream's own order (its CI does not shuffle them; pytest-randomly, which this project's dev
#: tools bring into the venv, would, and a test's outcome may depend on the ones before it)
PYTEST_ARGS = (
    "-p", "no:cacheprovider", "-p", "no:randomly", "--mfsdp-platform=cpu", "--mfsdp-foreign-suite=true",
    "-o", "junit_family=xunit1",
)  # fmt: skip
#: the columns of the per-file table, each an outcome of :func:`outcome_of` (time comes last)
COLUMNS = (
    ("passed", "passed"),
    ("GPU-only skips", "gpu-only"),
    ("other skips", "skipped"),
    ("xfailed", "xfailed"),
    ("failed", "failed"),
    ("errors", "error"),
    ("not run", "not-run"),
)


#: what the message of a test the session never ran says (its setup error; see the plugin's
#: ``wire/explain.not_run``, ``not_run_after_interrupt``)
NOT_RUN_MESSAGE = "not run: the session "


class BadInput(Exception):
    """One line naming the variable, its value and the fix."""


# -- what runs --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One named run: a checkout's tests on ``world_size`` CPU ranks, JUnit into ``<name>.xml``."""

    name: str
    checkout: Path
    tests: tuple[str, ...]
    world_size: int
    #: the variable that named the checkout, for messages
    variable: str = "MEGATRON_LM"
    #: pytest's ``-m`` expression; empty: every test
    markers: str = ""
    #: a run of ``make <make_args>`` in this repository instead of torchrun (the target states its
    #: command): the run's JUnit file, world size and rank-log directory are added as JUNIT, NPROC
    #: and BRIDGE_LOGS
    make_args: tuple[str, ...] = ()

    def command(self, python: str, junit: Path, make: str = "make") -> list[str]:
        if self.make_args:
            return [
                make, "--no-print-directory", "-C", str(REPO), *self.make_args, f"NPROC={self.world_size}",
                f"JUNIT={junit}", f"BRIDGE_LOGS={self.log_dir(junit.parent)}",
            ]  # fmt: skip
        selection = ["-m", self.markers] if self.markers else []
        return [
            python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.world_size}",
            "-m", "pytest", *PYTEST_ARGS, *selection, f"--junitxml={junit}",
            f"--mfsdp-log-dir={self.log_dir(junit.parent)}", *self.tests,
        ]  # fmt: skip

    def log_dir(self, results: Path) -> Path:
        """Where a run's rank logs go: next to its JUnit file, so the paths its failures name outlive
        the run's scratch directory."""
        return results.resolve() / f"{self.name}-logs"


def _words(text: str) -> list[str]:
    return text.replace(",", " ").split()


def world_sizes(text: str) -> tuple[int, ...]:
    """UPSTREAM_WORLD_SIZES (``"2 4"``) as numbers."""
    sizes = []
    for word in _words(text):
        if not word.isdigit() or int(word) < 1:
            raise BadInput(
                f"UPSTREAM_WORLD_SIZES={text!r}: {word!r} is not a world size (a whole number of ranks, "
                f'at least 1); e.g. UPSTREAM_WORLD_SIZES="2 4"'
            )
        sizes.append(int(word))
    if not sizes:
        raise BadInput(f'UPSTREAM_WORLD_SIZES={text!r} names no world size; e.g. UPSTREAM_WORLD_SIZES="2 4"')
    return tuple(dict.fromkeys(sizes))


def checkout(variable: str, value: str, name: str, markers: tuple[str, ...]) -> Path:
    """The checkout ``variable`` names: an existing directory holding each of ``markers``."""
    example = f"make upstream {variable}=/path/to/{name}"
    if not value.strip():
        raise BadInput(f"{variable} is not set: give the {name} checkout whose tests to run, e.g. {example}")
    path = Path(value).expanduser()
    if not path.is_dir():
        raise BadInput(
            f"{variable}={value}: no such directory; give the {name} checkout's root, e.g. {example}"
        )
    missing = [marker for marker in markers if not (path / marker).exists()]
    if missing:
        raise BadInput(
            f"{variable}={value} is not a {name} checkout's root (no {' or '.join(missing)} in it); give "
            f"the directory that holds {' and '.join(markers)}, e.g. {example}"
        )
    return path.resolve()


def given_tests(
    text: str,
    root: Path,
    variable: str,
    default: Sequence[str],
    tests_variable: str = "UPSTREAM_TESTS",
    example: str = DEFAULT_TESTS[0],
) -> tuple[str, ...]:
    """``tests_variable``'s paths (default: ``default``), each checked to exist in the checkout
    (a node id's file part: ``path::test``)."""
    paths = tuple(_words(text)) or tuple(default)
    for path in paths:
        file_part = path.split("::", 1)[0]
        if Path(file_part).is_absolute() or not (root / file_part).exists():
            raise BadInput(
                f"{tests_variable}: {path} is not in {variable}={root}; give paths relative to the "
                f"checkout's root, e.g. {tests_variable}={example}"
            )
    return paths


def wall_limit(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise BadInput(f"UPSTREAM_WALL={text!r}: not a positive number of seconds; e.g. UPSTREAM_WALL=3600")
    return value


def results_dir(text: str) -> Path:
    path = Path(text or DEFAULT_RESULTS)
    if path.exists() and not path.is_dir():
        raise BadInput(
            f"UPSTREAM_RESULTS={text}: a file, not a directory; give a directory, e.g. {DEFAULT_RESULTS}"
        )
    return path


def plan(args: argparse.Namespace) -> list[Run]:
    """The runs, every input checked (:class:`BadInput` on the first bad one)."""
    mlm = checkout("MEGATRON_LM", args.megatron_lm, "Megatron-LM", MEGATRON_LM_LAYOUT)
    tests = given_tests(args.tests, mlm, "MEGATRON_LM", DEFAULT_TESTS)
    markers = args.markers.strip()
    runs = [Run(f"ws{size}", mlm, tests, size, markers=markers) for size in world_sizes(args.world_sizes)]
    if args.megatron_bridge:
        bridge = checkout("MEGATRON_BRIDGE", args.megatron_bridge, "Megatron-Bridge", BRIDGE_LAYOUT)
        if len(_words(args.bridge_test)) != 1:
            raise BadInput(
                f"BRIDGE_TEST={args.bridge_test!r}: not one test; give one path or node id in the "
                f"MEGATRON_BRIDGE checkout, e.g. BRIDGE_TEST={BRIDGE_EXAMPLE}"
            )
        (test,) = given_tests(args.bridge_test, bridge, "MEGATRON_BRIDGE", (), "BRIDGE_TEST", BRIDGE_EXAMPLE)
        make_args = (
            "bridge-test", "STACK=bridge", f"MEGATRON_BRIDGE={bridge}", f"BRIDGE_TEST={test}",
            *([f"VENV={args.bridge_venv}"] if args.bridge_venv else []),
            *([f"MEGATRON_CORE={args.bridge_megatron_core}"] if args.bridge_megatron_core else []),
        )  # fmt: skip
        runs.append(Run("bridge", bridge, (test,), BRIDGE_WORLD_SIZE, "MEGATRON_BRIDGE", make_args=make_args))
    wall_limit(args.wall)
    results_dir(args.results)
    return runs


# -- memory, before any run ------------------------------------------------------------------------


def _status_bytes(text: str, field_name: str) -> int:
    """A ``kB`` field of /proc/<pid>/status or /proc/meminfo, in bytes (0 where absent)."""
    match = re.search(rf"^{field_name}:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def rank_baseline(python: str, checkout: Path) -> tuple[int, int]:
    """(private, shared) bytes of a process that imported what a rank imports before its first test,
    from the checkout's root: its anonymous memory (each rank's own) and its file-backed memory
    (the libraries, shared by all ranks)."""
    probe = f"{RANK_IMPORTS}; print(open('/proc/self/status').read())"
    out = subprocess.run(
        [python, "-c", probe], cwd=checkout, capture_output=True, text=True, check=True, timeout=300
    ).stdout
    return _status_bytes(out, "RssAnon"), _status_bytes(out, "RssFile")


def memory_available() -> int:
    """MemAvailable of /proc/meminfo in bytes (0 where there is no /proc)."""
    try:
        return _status_bytes(Path("/proc/meminfo").read_text(), "MemAvailable")
    except OSError:
        return 0


def memory_check(sizes: Sequence[int], baseline: tuple[int, int], available: int, given: str) -> str:
    """The line saying what the largest world size needs of the memory ``available``;
    :class:`BadInput` naming the world sizes that would not fit (a rank set the kernel's OOM killer
    ends leaves no result). ``baseline``: :func:`rank_baseline`'s measure; ``given``:
    UPSTREAM_WORLD_SIZES as the user wrote it (empty: the default)."""
    private, shared = baseline
    per_rank = private / GIB + TEST_HEADROOM_GIB

    def need(size: int) -> float:
        return size * per_rank + shared / GIB + RESERVE_GIB

    have = available / GIB
    how = (
        f"per rank {per_rank:.2f} GiB: {private / GIB:.2f} measured after `{RANK_IMPORTS}` plus "
        f"{TEST_HEADROOM_GIB:g} for the largest test; {shared / GIB:.2f} GiB of libraries shared and "
        f"{RESERVE_GIB:g} GiB kept free"
    )
    too_big = [size for size in sizes if need(size) > have]
    if too_big and available:
        fits = [size for size in sizes if size not in too_big]
        fix = (
            f'UPSTREAM_WORLD_SIZES="{" ".join(map(str, fits))}"' if fits else "a smaller UPSTREAM_WORLD_SIZES"
        )
        worst = max(too_big)
        raise BadInput(
            f"UPSTREAM_WORLD_SIZES={given or ' '.join(map(str, sizes))!r}: world size {worst} needs about "
            f"{need(worst):.1f} GiB ({how}), this machine has {have:.1f} GiB available; run {fix}, or "
            "free memory first"
        )
    largest = max(sizes)
    return f"memory: world size {largest} needs about {need(largest):.1f} GiB of {have:.1f} GiB free ({how})"


# -- JUnit -> outcomes ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TestResult:
    file: str
    outcome: str  # passed | gpu-only | skipped | xfailed | failed | error | not-run
    reason: str | None
    time_s: float


def gpu_only_cause(reason: str | None) -> str | None:
    """The cause a skip reason names when it is a GPU-only skip (``GPU-only: <cause>``), else None."""
    from pytest_megatron_fsdp.foreign import gpu_only

    prefix = gpu_only.GpuOnlyCause("").reason()  # the one place the reason's form is stated
    if reason is None or not reason.startswith(prefix):
        return None
    return reason[len(prefix) :]


def _skip_reason(element: ET.Element) -> str:
    """A skip's reason: the message, or for a whole module skipped at collection (message
    ``collection skipped``) the reason in its text, which is ``(path, line, reason)``."""
    message = element.get("message", "")
    if message != "collection skipped":
        return message
    text = (element.text or "").strip()
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text or message
    if isinstance(value, tuple) and len(value) == 3 and isinstance(value[2], str):
        return value[2].removeprefix("Skipped: ")
    return text


def outcome_of(case: ET.Element) -> tuple[str, str | None]:
    """(outcome, reason) of a JUnit testcase: a failure counts before an error (a failed call with a
    failed teardown is a failed test), a skip of type ``pytest.xfail`` is an xfail."""
    children = {child.tag: child for child in case}
    for tag, outcome in (("failure", "failed"), ("error", "error")):
        if tag in children:
            message = children[tag].get("message")
            if tag == "error" and message is not None and NOT_RUN_MESSAGE in message:
                return "not-run", message  # the session ended before it: never a skip
            return outcome, message
    skipped = children.get("skipped")
    if skipped is None:
        return "passed", None
    reason = _skip_reason(skipped)
    if skipped.get("type") == "pytest.xfail":
        return "xfailed", reason
    return ("gpu-only" if gpu_only_cause(reason) is not None else "skipped"), reason


def _module_file(parts: list[str], root: Path | None) -> tuple[str, list[str]]:
    """(file, the names after it) of a dotted address: the longest prefix that is a ``.py`` file in
    ``root``; without one, the prefix before the first capitalised name (a test class)."""
    if root is not None:
        for end in range(len(parts), 0, -1):
            candidate = "/".join(parts[:end]) + ".py"
            if (root / candidate).is_file():
                return candidate, parts[end:]
    end = next((i for i, part in enumerate(parts) if part[:1].isupper()), len(parts))
    return "/".join(parts[:end]) + ".py", parts[end:]


def node_id(case: ET.Element, root: Path | None = None) -> tuple[str, str]:
    """(file, pytest node id) of a JUnit testcase. The file is xunit1's ``file`` attribute; a JUnit
    file without it (xunit2) is resolved against the checkout ``root``. A module's own entry (a
    collection error or skip) has the file as its id."""
    classname, name = case.get("classname", ""), case.get("name", "")
    if classname == "pytest" and name == "internal":
        return "(pytest internal error)", "pytest::internal"
    given = case.get("file")
    if given:
        module = given.removesuffix(".py").replace("/", ".").replace("\\", ".")
        if not classname and name == module:
            return given, given
        rest = classname[len(module) + 1 :].split(".") if classname.startswith(module + ".") else []
        return given, "::".join([given, *rest, name])
    if not classname:  # a module's own entry: the name is its dotted path
        file, _ = _module_file(name.split("."), root)
        return file, file
    file, rest = _module_file(classname.split("."), root)
    return file, "::".join([file, *rest, name])


@dataclass
class JunitResults:
    tests: dict[str, TestResult] = field(default_factory=dict)
    #: why the file could not be read (absent, cut short by a kill), None when it was
    problem: str | None = None
    #: testcases without a name: an interrupted session writes one for the test it cut short
    unnamed: int = 0


def read_junit(path: Path, root: Path | None = None) -> JunitResults:
    """Every test of a JUnit file by node id (a test reported twice counts once: its last report)."""
    if not path.exists():
        return JunitResults(problem="no JUnit file written")
    try:
        tree = ET.parse(path)
    except ET.ParseError as error:
        return JunitResults(problem=f"JUnit file unreadable ({error})")
    results = JunitResults()
    for case in tree.getroot().iter("testcase"):
        if not case.get("name"):
            results.unnamed += 1
            continue
        file, nodeid = node_id(case, root)
        outcome, reason = outcome_of(case)
        try:
            seconds = float(case.get("time", "0") or 0)
        except ValueError:
            seconds = 0.0
        results.tests[nodeid] = TestResult(file, outcome, reason, seconds)
    return results


def per_file(tests: dict[str, TestResult]) -> dict[str, dict[str, float]]:
    """file -> count per outcome and ``time_s``, files in order of their first test."""
    files: dict[str, dict[str, float]] = {}
    for result in tests.values():
        row = files.setdefault(result.file, {key: 0 for _, key in COLUMNS} | {"time_s": 0.0})
        row[result.outcome] += 1
        row["time_s"] += result.time_s
    return files


def totals(rows: Iterable[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {key: 0 for _, key in COLUMNS} | {"time_s": 0.0}
    for row in rows:
        for key in total:
            total[key] += row[key]
    return total


# -- running ----------------------------------------------------------------------------------------


#: seconds between two looks at a run's processes (its ranks, their memory)
SAMPLE_S = 2.0


@dataclass
class MemoryPeak:
    """The most a run's processes held at one sample: their PSS summed (what the machine gave them,
    shared pages counted once), and one process's resident set (a rank's)."""

    total_pss: int = 0
    process_rss: int = 0

    def sample(self, pids: Iterable[int]) -> None:
        total = 0
        for pid in pids:
            try:
                rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue  # gone between the listing and the look
            total += _status_bytes(rollup, "Pss")
            self.process_rss = max(self.process_rss, _status_bytes(status, "VmRSS"))
        self.total_pss = max(self.total_pss, total)

    def line(self) -> str:
        return (
            f"peak memory {self.total_pss / GIB:.1f} GiB (all processes' PSS), "
            f"{self.process_rss / GIB:.2f} GiB the largest resident rank"
        )


@dataclass
class RunResult:
    run: Run
    junit: Path
    log: Path
    #: the command's exit status; None when it was stopped at the wall limit
    status: int | None
    wall_s: float
    limit_s: float
    #: how an overrun ended, None when the run finished
    stopped: str | None = None
    #: processes still running after the run (or its stop) that were killed
    leftovers: int = 0
    #: what its log says (:func:`read_log`): the tests pytest deselected (None: no count logged), and a
    #: make run's last-loss line (bench/bridge_loss.py; None: none logged)
    deselected: int | None = None
    loss: str | None = None
    #: upstream's test-data fixture logged that it could not download its data
    no_test_data: bool = False
    #: what the run's processes held at most (sampled every :data:`SAMPLE_S`): :class:`MemoryPeak`
    memory: MemoryPeak = field(default_factory=lambda: MemoryPeak())

    @property
    def finished(self) -> bool:
        return self.stopped is None


def _proc_stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time) of a live process from /proc, None if gone (or no /proc)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
    if fields[0] == "Z":
        return None  # a zombie: dead, only not reaped
    return int(fields[1]), fields[19]


def descendants(root: int) -> dict[int, str]:
    """Every live descendant of ``root`` (pid -> its start time, so a reused pid is told apart)."""
    parents: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            stat = _proc_stat(int(entry))
            if stat is not None:
                parents.setdefault(stat[0], []).append((int(entry), stat[1]))
    found: dict[int, str] = {}
    todo = [root]
    while todo:
        for pid, started in parents.get(todo.pop(), []):
            if pid not in found:
                found[pid] = started
                todo.append(pid)
    return found


def kill_all(processes: dict[int, str]) -> int:
    """SIGKILL each process still alive as the one seen (same start time), and reap those that are
    this process's children (orphans it took over as subreaper); how many were alive."""
    killed = []
    for pid, started in processes.items():
        stat = _proc_stat(pid)
        if stat is not None and stat[1] == started:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass  # it ended between the look and the kill: nothing left to stop
    for pid in killed:
        with contextlib.suppress(ChildProcessError):  # not this process's child: its parent reaps it
            os.waitpid(pid, 0)
    return len(killed)


def stop(proc: subprocess.Popen[bytes], grace_s: float) -> str:
    """End a run: SIGINT to its session's process group, as Ctrl-C in a terminal: the torchrun agent
    (it passes it on; pytest writes its JUnit file), or for a make run make, its shell and the agent
    under them (make does not pass SIGINT on); then after ``grace_s`` SIGKILL to that group. The ranks
    are in sessions of their own: the caller kills what is left of them. Says how it ended."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=grace_s)
        return f"interrupted (SIGINT), ended within {grace_s:g} s"
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return f"interrupted (SIGINT), still running after {grace_s:g} s: killed (SIGKILL)"
    except ProcessLookupError:
        proc.wait()
        return "ended as it was interrupted"


def execute(
    run: Run,
    command: Sequence[str],
    results: Path,
    wall_s: float,
    grace_s: float = DEFAULT_GRACE_S,
    env: dict[str, str] | None = None,
) -> RunResult:
    """Run ``command`` for ``run`` from its checkout, output into ``<results>/<name>.log``, bounded by
    ``wall_s``; whatever it left running afterwards is killed (and counted)."""
    junit, log = results / f"{run.name}.xml", results / f"{run.name}.log"
    junit.unlink(missing_ok=True)  # a previous run's file must not pass for this one's
    shutil.rmtree(run.log_dir(results), ignore_errors=True)  # nor its rank logs
    start = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            list(command), cwd=run.checkout, stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip
        seen: dict[int, str] = {}
        status: int | None = None
        stopped = None
        memory = MemoryPeak()
        try:
            while stopped is None:
                remaining = wall_s - (time.monotonic() - start)
                try:
                    status = proc.wait(timeout=min(SAMPLE_S, max(0.0, remaining)))
                    break
                except subprocess.TimeoutExpired:
                    alive = descendants(proc.pid)  # the ranks, while the agent still knows them
                    seen |= alive
                    memory.sample([proc.pid, *alive])
                    if remaining <= 0:
                        stopped = f"wall limit {wall_s:g} s reached: {stop(proc, grace_s)}"
        except BaseException:  # interrupted (Ctrl-C, SIGTERM): no rank left behind
            seen |= descendants(proc.pid)
            stop(proc, grace_s)
            kill_all(seen)
            raise
    leftovers = kill_all(seen)
    return RunResult(
        run, junit, log, status, time.monotonic() - start, wall_s, stopped, leftovers, memory=memory
    )


#: a line of pytest's that holds the deselected count: collection's ``collected N items / M deselected
#: / K selected`` and the summary's ``=== ... M deselected ... in 9.9s ===``
DESELECTED = re.compile(r"^(?:collected \d+ items?\b|=+ ).*?\b(\d+) deselected\b", re.MULTILINE)
COLLECTED = re.compile(r"^collected \d+ items?\b", re.MULTILINE)


def deselected(log: str) -> int | None:
    """The count pytest deselected by ``-m`` in a run's output (its last report), 0 when it reported its
    collection without one, None when it never did."""
    counts = DESELECTED.findall(log)
    if counts:
        return int(counts[-1])
    return 0 if COLLECTED.search(log) else None


def read_log(result: RunResult) -> None:
    """Fill in what the run's log says: the deselected count, and a make run's last-loss line."""
    try:
        text = result.log.read_text(errors="replace")
    except OSError:
        return
    result.deselected = deselected(text)
    result.no_test_data = NO_TEST_DATA in text
    if result.run.make_args:
        result.loss = bridge_loss.reported(text)


def remove_made_outside(existed: set[Path]) -> list[Path]:
    """Remove each of :data:`MADE_OUTSIDE` the runs made (not in ``existed``) and left empty; returns
    those removed."""
    removed = []
    for path in MADE_OUTSIDE:
        if path not in existed and path.is_dir() and not any(path.iterdir()):
            with contextlib.suppress(OSError):
                path.rmdir()
                removed.append(path)
    return removed


# -- stack ------------------------------------------------------------------------------------------


def git_commit(path: Path) -> dict[str, str] | None:
    """The checkout's commit and its date where git can tell (None: no git work tree, no git)."""
    try:
        done = subprocess.run(
            ["git", "-C", str(path), "log", "-1", "--format=%H %cs"],
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    words = done.stdout.split()
    if done.returncode != 0 or len(words) != 2:
        return None
    return {"commit": words[0], "date": words[1]}


def stack(runs: Sequence[Run]) -> dict[str, Any]:
    """What ran: each checkout (its commit where git can tell), the installed versions (with their
    source where not an index release), the CPU."""
    from pytest_megatron_fsdp.fsdp.versions import package_source, package_version
    from pytest_megatron_fsdp.wire.cpu_probe import read_cpu_facts

    checkouts = {}
    for run in runs:
        checkouts[run.variable] = {"path": str(run.checkout), "git": git_commit(run.checkout)}
    packages = {}
    for name in ("torch", "megatron-core", "megatron-fsdp", "pytest"):
        source = package_source(name)
        packages[name] = package_version(name) + (f" ({source})" if source else "")
    facts = read_cpu_facts()
    return {
        "checkouts": checkouts,
        "python": platform.python_version(),
        "packages": packages,
        "cpu": {"model": facts.model, "cores": os.cpu_count(), "flags": facts.flags},
    }


def describe_stack(facts: dict[str, Any], paths: bool = True) -> str:
    """One line: the checkouts (commit and date, or no git; with their paths, or not), the packages,
    the CPU."""
    parts = []
    for variable, checkout_facts in facts["checkouts"].items():
        git = checkout_facts["git"]
        where = f"{git['commit'][:10]} of {git['date']}" if git else "no git commit"
        parts.append(
            f"{variable}={checkout_facts['path']} ({where})"
            if paths
            else f"the {variable} checkout ({where})"
        )
    parts.append(f"Python {facts['python']}")
    parts += [f"{name} {version}" for name, version in facts["packages"].items()]
    cpu = facts["cpu"]
    flags = ", ".join(cpu["flags"]) if cpu["flags"] is not None else "flags unknown"
    parts.append(f"{cpu['cores']}-core {cpu['model']} ({flags})")
    return ", ".join(parts)


# -- report -----------------------------------------------------------------------------------------


def _seconds(value: float) -> str:
    return f"{value:.1f} s"


def table(rows: dict[str, dict[str, float]], first: str = "file") -> list[str]:
    """The per-file (or per-``first``) markdown table with a total row."""
    header = [first, *(title for title, _ in COLUMNS), "time"]
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    for name, row in [*rows.items(), ("**total**", totals(rows.values()))]:
        cells = [str(int(row[key])) for _, key in COLUMNS]
        lines.append(f"| {name} | " + " | ".join([*cells, _seconds(row["time_s"])]) + " |")
    return lines


def selection(markers: str, why: bool = False) -> str:
    """The Megatron-LM runs' selection, in words (``why``: with where the default comes from)."""
    said = f"-m {markers!r}" if markers else "every test (UPSTREAM_MARKERS empty)"
    if why:
        said += (
            f" (UPSTREAM_MARKERS; Megatron-LM's dev CI selects -m {DEFAULT_MARKERS!r} in "
            "tests/unit_tests/run_ci_test.sh; UPSTREAM_MARKERS= runs every test)"
        )
    return said


def heading(result: RunResult, parsed: JunitResults) -> str:
    """The run's line above its table: what ran, finished or not within its wall limit, its exit
    status, what pytest deselected, a make run's last-loss line, and what it wrote."""
    run = result.run
    how = f"make {run.make_args[0]}" if run.make_args else selection(run.markers)
    what = f"{run.name}: world size {run.world_size}, {how}, {' '.join(run.tests)}"
    if result.finished:
        state = (
            f"finished in {_seconds(result.wall_s)} (wall limit {result.limit_s:g} s), "
            f"exit status {result.status}"
        )
    else:
        state = f"DID NOT FINISH after {_seconds(result.wall_s)}: {result.stopped}"
    notes = [parsed.problem] if parsed.problem else []
    if result.no_test_data:
        notes.append(
            "upstream's ensure_test_data fixture could not download its test data (the runs have no network; "
            "NEMO_TEST_DATA_ROOT=<dir holding megatron-lm/release-assets/v2.5> supplies it)"
        )
    notes.append(
        f"{result.deselected} deselected" if result.deselected is not None else "no deselected count logged"
    )
    if run.make_args:
        notes.append(result.loss if result.loss is not None else "no last-loss line logged")
    if parsed.unnamed:
        notes.append(f"{parsed.unnamed} testcase without a name (the test an interrupt cut short) left out")
    failures = any(test.outcome in ("failed", "error", "not-run") for test in parsed.tests.values())
    if result.finished and result.status not in (0, 5) and not failures and not parsed.problem:
        notes.append("rank 0 reported no failure: another rank failed or the session broke (see the log)")
    if result.memory.total_pss:
        notes.append(result.memory.line())
    if result.leftovers:
        notes.append(f"{result.leftovers} processes left running were killed")
    return f"{what}: {state}" + "".join(f"; {note}" for note in notes) + f" (log: {result.log})"


def summary(
    results: Sequence[tuple[RunResult, JunitResults]], facts: dict[str, Any], markers: str
) -> dict[str, Any]:
    """summary.json's content: the stack, and per run its state, per file its counts, per test id
    its outcome (with the skip reason and, for a GPU-only skip, its cause)."""
    runs: dict[str, Any] = {}
    for result, parsed in results:
        files = per_file(parsed.tests)
        tests = {}
        for nodeid, test in parsed.tests.items():
            entry: dict[str, Any] = {
                "file": test.file,
                "outcome": test.outcome,
                "time_s": round(test.time_s, 3),
            }
            if test.reason is not None:
                entry["reason"] = test.reason
            if test.outcome == "gpu-only":
                entry["cause"] = gpu_only_cause(test.reason)
            tests[nodeid] = entry
        runs[result.run.name] = {
            "world_size": result.run.world_size,
            "checkout": str(result.run.checkout),
            "tests_given": list(result.run.tests),
            "command": "make " + " ".join(result.run.make_args) if result.run.make_args else "torchrun",
            "markers": None if result.run.make_args else result.run.markers,
            "deselected": result.deselected,
            "finished": result.finished,
            "stopped": result.stopped,
            "exit_status": result.status,
            "wall_s": round(result.wall_s, 1),
            "wall_limit_s": result.limit_s,
            "junit": str(result.junit),
            "junit_problem": parsed.problem,
            "junit_unnamed": parsed.unnamed,
            "leftovers_killed": result.leftovers,
            "peak_pss_bytes": result.memory.total_pss,
            "peak_process_rss_bytes": result.memory.process_rss,
            **({"last_loss": result.loss} if result.run.make_args else {}),
            "files": files,
            "totals": totals(files.values()),
            "tests": tests,
        }
    return {
        "recorded": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "stack": facts,
        "markers": markers,
        "runs": runs,
    }


def report(results: Sequence[tuple[RunResult, JunitResults]], facts: dict[str, Any], markers: str) -> str:
    """The printed report: the stack and the Megatron-LM runs' selection, then per run its heading and
    table, then the totals of all runs."""
    lines = [f"stack: {describe_stack(facts)}", f"Megatron-LM runs: {selection(markers, why=True)}"]
    for result, parsed in results:
        lines += ["", heading(result, parsed), "", *table(per_file(parsed.tests))]
    if len(results) > 1:
        lines += ["", "all runs:", ""]
        rows = {result.run.name: totals(per_file(parsed.tests).values()) for result, parsed in results}
        lines += table(rows, first="run")
    return "\n".join(lines) + "\n"


def clean(results: Sequence[tuple[RunResult, JunitResults]]) -> bool:
    """Every run finished and no test failed or errored."""
    return all(
        result.finished
        and not parsed.problem
        and not any(test.outcome in ("failed", "error", "not-run") for test in parsed.tests.values())
        and result.status in (0, 5)
        for result, parsed in results
    )


# -- main -------------------------------------------------------------------------------------------


def _become_subreaper() -> None:
    """Ranks orphaned by a killed torchrun agent become this process's children (Linux), so the
    leftover check after each run finds them."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass  # no prctl (not Linux, or no libc): orphans stay unadopted; the /proc scan still finds them


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.upstream", description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", default="", help="the Megatron-LM checkout (MEGATRON_LM)")
    parser.add_argument(
        "--megatron-bridge", default="", help="the Megatron-Bridge checkout (MEGATRON_BRIDGE)"
    )
    parser.add_argument("--tests", default="", help="paths in the checkout (UPSTREAM_TESTS)")
    parser.add_argument(
        "--markers", default=DEFAULT_MARKERS, help="-m of the Megatron-LM runs; empty: all (UPSTREAM_MARKERS)"
    )
    parser.add_argument("--bridge-test", default="", help="the Bridge run's node id (BRIDGE_TEST)")
    parser.add_argument("--bridge-venv", default="", help="the Bridge run's venv (BRIDGE_VENV)")
    parser.add_argument(
        "--bridge-megatron-core", default="", help="the Bridge venv's megatron-core (BRIDGE_MEGATRON_CORE)"
    )
    parser.add_argument("--world-sizes", default=" ".join(map(str, DEFAULT_WORLD_SIZES)))
    parser.add_argument("--results", default=DEFAULT_RESULTS, help="where the files go (UPSTREAM_RESULTS)")
    parser.add_argument("--wall", default=str(DEFAULT_WALL_S), help="seconds per run (UPSTREAM_WALL)")
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE_S, help=argparse.SUPPRESS)
    parser.add_argument("--check", action="store_true", help="check the input only, then exit")
    return parser


def main(argv: list[str] | None = None, python: str = sys.executable) -> int:
    args = parser().parse_args(argv)
    try:
        runs = plan(args)
    except BadInput as problem:
        print(f"make upstream: {problem}", file=sys.stderr)
        return 2
    if args.check:
        return 0
    results = results_dir(args.results)
    results.mkdir(parents=True, exist_ok=True)
    wall_s = wall_limit(args.wall)
    _become_subreaper()
    signal.signal(signal.SIGTERM, _terminate)
    facts = stack(runs)
    print(
        f"stack: {describe_stack(facts)}\nMegatron-LM runs: {selection(args.markers.strip(), why=True)}",
        flush=True,
    )
    megatron_lm_sizes = [run.world_size for run in runs if run.variable == "MEGATRON_LM"]
    try:
        print(
            memory_check(
                megatron_lm_sizes,
                rank_baseline(python, runs[0].checkout),
                memory_available(),
                args.world_sizes,
            ),
            flush=True,
        )
    except BadInput as problem:
        print(f"make upstream: {problem}", file=sys.stderr)
        return 2
    done: list[tuple[RunResult, JunitResults]] = []
    existed = {path for path in MADE_OUTSIDE if path.exists()}
    for run in runs:
        junit = (results / f"{run.name}.xml").resolve()
        print(
            f"{run.name}: {run.world_size} ranks, {' '.join(run.tests)} (wall limit {wall_s:g} s) ...",
            flush=True,
        )
        env = {**os.environ, **NO_NETWORK} if run.variable == "MEGATRON_LM" else None
        result = execute(run, run.command(python, junit), results, wall_s, args.grace, env=env)
        result.leftovers += kill_all(descendants(os.getpid()))  # orphans of a killed agent
        read_log(result)
        done.append((result, read_junit(result.junit, run.checkout)))
        print(heading(*done[-1]), flush=True)
    for path in remove_made_outside(existed):
        print(f"removed {path}: the runs made it outside the checkout and left it empty", flush=True)
    markers = args.markers.strip()
    text = report(done, facts, markers)
    (results / "summary.json").write_text(json.dumps(summary(done, facts, markers), indent=1) + "\n")
    (results / "table.md").write_text(text)
    print("\n" + text + f"\nwritten: {results / 'summary.json'}, {results / 'table.md'}")
    return 0 if clean(done) else 1


if __name__ == "__main__":
    sys.exit(main())
