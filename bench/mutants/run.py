"""Run the functional suite against each mutant of Megatron-FSDP, and ``tests/upstream_code`` against each
mutant of Megatron-LM's and Megatron-Bridge's checkpoint code; print and write the kill matrix.

The installed packages are never edited: ``megatron/core``, ``megatron/training``, ``megatron/bridge`` and
``megatron_fsdp`` (those installed) are copied into a
scratch directory placed first on ``PYTHONPATH`` (the ranks inherit it), each
mutant edits that copy and is undone after its run, and the installed ``.py`` files are hashed before
and after (a difference fails the run). Where the standalone ``megatron_fsdp`` is the vendored directory
of an editable Megatron-LM checkout, the copy's ``megatron_fsdp`` is a link to its own vendored copy.

Stack-aware: a mutant whose code does not exist in the installed stack (a file it names is absent, or
its ``needs`` text is not found) is reported as not applicable, with the reason, and the kill rate counts
applicable mutants only; a mutant whose code exists but whose edit (and per-stack variants) does not
match exactly once refuses the whole catalogue (it no longer fits: fix the catalogue).

A control run on the unedited copy comes first, per suite the selected mutants need, and must pass. A
functional-suite run is plain pytest with ``-x``; an upstream-code run is the same under torchrun on 2 ranks
in the foreign-suite mode (as ``make upstream-code``). Both use ``-x``
(the first failing test kills the mutant), the plugin's per-test timeout (``--mfsdp-timeout``: a hang
becomes a bounded failure) and a wall limit per mutant.

A mutant may name a probe: the test expected to fail first, run alone before the suite (most of a
run's time is the tests before the killing one). A probe only orders the work: when it passes, the whole
suite runs and judges the mutant (``--no-probes``: always the whole suite).

    python -m bench.mutants                      # the whole catalogue, the whole functional suite
    python -m bench.mutants --only grad_sum_not_mean --tests tests/functional/test_strategies.py
    python -m bench.mutants --list               # the catalogue, per category

Exit status: 0 when the kill rate reaches ``--min-kill-rate`` (default 0.95), 1 below it, 2 when the
control run fails, the catalogue does not fit or no mutant applies, 3 when an installed file changed.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .catalogue import FUNCTIONAL_SUITE, MUTANTS, STANDALONE, UPSTREAM_CODE_SUITE, VENDORED, Mutant

REPO = Path(__file__).resolve().parents[2]
FUNCTIONAL = REPO / "tests" / "functional"
#: fast, discriminating files first (-x stops at the first failure); every other file of the
#: functional suite follows, so the whole suite is always the judge of a survivor
FIRST = (
    "test_strategies.py",
    "test_fully_shard.py",
    "test_schedule.py",
    "test_megatron_fsdp.py",
    "test_checkpoint.py",
)
PACKAGES = ("megatron/core", "megatron/training", "megatron/bridge", "megatron_fsdp")
#: how a suite's session starts: the functional suite's plugin launches its ranks; upstream's code runs as
#: its own tests do, each rank a pytest session under torchrun in the foreign-suite mode
UPSTREAM_CODE_LAUNCH = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")


@dataclass
class Outcome:
    name: str
    category: str
    status: str  # killed | survived | timeout | error | not applicable
    killed_by: str | None
    message: str | None
    seconds: float
    replays: str | None = None
    cpu_undetectable: str | None = None
    files: list[str] = field(default_factory=list)
    #: killed by its probe alone (True), by the whole suite (False), or no probe was run (None)
    killed_by_probe: bool | None = None


def suite_files(suite: str = FUNCTIONAL_SUITE) -> list[str]:
    """The test paths that judge a mutant of ``suite``: the functional suite's files, fast discriminating
    ones first; upstream's code as one directory."""
    if suite == UPSTREAM_CODE_SUITE:
        return [UPSTREAM_CODE_SUITE]
    names = sorted(p.name for p in FUNCTIONAL.glob("test_*.py"))
    ordered = [n for n in FIRST if n in names] + [n for n in names if n not in FIRST]
    return [str((FUNCTIONAL / n).relative_to(REPO)) for n in ordered]


def site_root() -> Path:
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("mutants: megatron-core is not installed in this Python")
    return Path(next(iter(spec.submodule_search_locations))).parents[1]


def standalone_dir(root: Path) -> Path | None:
    """The installed standalone ``megatron_fsdp`` package directory (None: not installed). Next to
    ``megatron`` for a wheel; the vendored directory itself for an editable Megatron-LM checkout."""
    spec = importlib.util.find_spec("megatron_fsdp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def installed_dirs(root: Path) -> list[Path]:
    dirs = [root / package for package in PACKAGES if (root / package).is_dir()]
    standalone = standalone_dir(root)
    if standalone is not None and not any(standalone.is_relative_to(d.resolve()) for d in dirs):
        dirs.append(standalone)
    return dirs


def hash_installed(root: Path) -> dict[str, str]:
    digests = {}
    for directory in installed_dirs(root):
        for path in sorted(directory.rglob("*.py")):
            digests[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


@dataclass(frozen=True)
class Resolution:
    """What a mutant does on one stack: ``edit`` (old, new) and the files it changes (each once,
    resolved); or ``not_applicable`` (why); or ``problem`` (the code exists, the edit does not fit)."""

    edit: tuple[str, str] | None = None
    paths: tuple[Path, ...] = ()
    not_applicable: str | None = None
    problem: str | None = None


def resolve(shadow: Path, m: Mutant) -> Resolution:
    """Whether ``m`` applies to the stack copied in ``shadow``, and with which of its edits."""
    if m.needs is not None:  # first: its reason says more than a missing file's
        needed = shadow / m.needs.file
        if not needed.is_file() or m.needs.text not in needed.read_text():
            return Resolution(not_applicable=m.needs.why)
    absent = [rel for rel in m.files if not (shadow / rel).is_file()]
    if absent:
        return Resolution(not_applicable=f"not in this stack: {', '.join(absent)}")
    # a file named twice (both copies, where the standalone package is the vendored directory) is
    # edited once
    paths = tuple(dict.fromkeys((shadow / rel).resolve() for rel in m.files))
    texts = [path.read_text() for path in paths]
    edits = [(m.old, m.new), *m.variants]
    for old, new in edits:
        if old != new and all(text.count(old) == 1 for text in texts):
            return Resolution(edit=(old, new), paths=paths)
    counts = "; ".join(
        f"{'old text' if i == 0 else f'variant {i}'} occurs "
        + ", ".join(f"{text.count(old)} times in {rel}" for text, rel in zip(texts, m.files, strict=False))
        for i, (old, _) in enumerate(edits)
    )
    return Resolution(problem=f"{m.name}: no edit matches exactly once in every file ({counts})")


def check_catalogue(shadow: Path, mutants: list[Mutant]) -> list[str]:
    """Every applicable mutant's edit (or one of its variants) must match exactly once in every file
    it names; not-applicable mutants are not problems."""
    problems = []
    names = Counter(m.name for m in mutants)
    problems += [f"{name}: the name is used {n} times" for name, n in names.items() if n > 1]
    for m in mutants:
        if m.old == m.new or any(old == new for old, new in m.variants):
            problems.append(f"{m.name}: the edit changes nothing")
            continue
        resolution = resolve(shadow, m)
        if resolution.problem:
            problems.append(resolution.problem)
    return problems


def make_shadow(root: Path, scratch: Path) -> Path:
    shadow = scratch / "shadow"
    for package in PACKAGES:
        if (root / package).is_dir():
            # copy2 keeps the mtimes, so the copied __pycache__ stays valid (no recompiling)
            shutil.copytree(root / package, shadow / package, copy_function=shutil.copy2)
    standalone = standalone_dir(root)
    if standalone is not None and not (shadow / STANDALONE).exists():
        vendored = (root / VENDORED).resolve()
        if standalone == vendored and (shadow / VENDORED).is_dir():
            # an editable Megatron-LM checkout: megatron_fsdp *is* the vendored directory; so in the copy
            (shadow / STANDALONE.rstrip("/")).symlink_to(Path(VENDORED), target_is_directory=True)
        else:
            shutil.copytree(standalone, shadow / STANDALONE, copy_function=shutil.copy2)
    return shadow


class Applied:
    """A mutant's edits on the shadow copy, undone (bytes and mtime) on exit."""

    def __init__(self, shadow: Path, mutant: Mutant | None) -> None:
        self.shadow, self.mutant, self.saved = shadow, mutant, []

    def __enter__(self) -> Applied:
        if self.mutant is None:
            return self
        resolution = resolve(self.shadow, self.mutant)
        assert resolution.edit is not None, (self.mutant.name, resolution)
        old, new = resolution.edit
        for path in resolution.paths:
            stat, text = path.stat(), path.read_text()
            assert text.count(old) == 1, (self.mutant.name, path)
            self.saved.append((path, text, stat))
            path.write_text(text.replace(old, new))
        return self

    def __exit__(self, *exc: object) -> None:
        for path, text, stat in self.saved:
            path.write_text(text)
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def environment(shadow: Path, tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(shadow), str(REPO), env.get("PYTHONPATH", "")) if p)
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # a mutant's bytecode never lands in the shadow's caches
    env["TMPDIR"] = str(tmp)
    env.pop("PYTEST_ADDOPTS", None)
    return env


def check_shadowing(python: str, shadow: Path, scratch: Path) -> None:
    """The ranks import megatron-core and megatron_fsdp from the copy, and this checkout's plugin (not
    another checkout an editable install points at)."""
    code = (
        "import importlib.util as u; "
        "print(u.find_spec('pytest_megatron_fsdp').origin); "
        "print(u.find_spec('megatron.core').origin); "
        "s = u.find_spec('megatron_fsdp'); print(s.origin if s else ''); "
        "s = u.find_spec('megatron.training'); print(s.origin if s else ''); "
        "s = u.find_spec('megatron.bridge'); print(s.origin if s else '')"
    )
    out = subprocess.run(
        [python, "-c", code], env=environment(shadow, scratch), capture_output=True, text=True, check=True
    ).stdout.split("\n")
    plugin, *origins = out
    if not Path(plugin).resolve().is_relative_to(REPO):
        raise SystemExit(f"mutants: the plugin is imported from {plugin}, not from this checkout {REPO}")
    for origin in filter(None, origins):
        # not resolved: the standalone package may be a link, inside the copy, to the vendored copy
        if not Path(os.path.abspath(origin)).is_relative_to(shadow):
            raise SystemExit(f"mutants: the copy does not shadow the installed package: {origin}")


def first_failure(junit: Path) -> tuple[str | None, str | None]:
    if not junit.is_file():
        return None, None
    for case in ET.parse(junit).getroot().iter("testcase"):
        for child in case:
            if child.tag in ("failure", "error"):
                test = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
                message = (child.get("message") or child.text or "").strip().splitlines()
                summary = message[0] if message else ""
                # the plugin's summary ("failed on ranks 0, 1 (same error)") names the ranks; the
                # traceback's first "E " line says what failed
                lines = (child.text or "").splitlines()
                detail = next((line[1:].strip() for line in lines if line.startswith("E ")), "")
                if detail and detail not in summary:
                    summary = f"{summary}: {detail}" if summary else detail
                return test, summary[:400]
    return None, None


def stop(proc: subprocess.Popen) -> None:
    """End a run and everything it started (its own session): TERM, then KILL after 15 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_suite(
    python: str,
    shadow: Path,
    scratch: Path,
    tests: list[str],
    args: argparse.Namespace,
    label: str,
    suite: str = FUNCTIONAL_SUITE,
) -> tuple[str, str | None, str | None, float]:
    """(status, first failing test, its message, seconds) of one run of ``suite``'s ``tests``."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=scratch))
    junit = run_dir / "junit.xml"
    launch = UPSTREAM_CODE_LAUNCH if suite == UPSTREAM_CODE_SUITE else ()
    foreign = ["--mfsdp-foreign-suite=true"] if suite == UPSTREAM_CODE_SUITE else []
    command = [
        python, *launch, "-m", "pytest", *foreign, *tests, "-x", "-q", "-p", "no:cacheprovider",
        f"--mfsdp-timeout={args.test_timeout}", f"--mfsdp-log-dir={run_dir / 'logs'}",
        f"--junitxml={junit}", *args.pytest_args,
    ]  # fmt: skip
    tmp = run_dir / "tmp"
    tmp.mkdir()
    start = time.monotonic()
    with open(run_dir / "output.txt", "w") as out:
        proc = subprocess.Popen(
            command, cwd=REPO, env=environment(shadow, tmp), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            rc = proc.wait(timeout=args.mutant_wall)
        except subprocess.TimeoutExpired:
            stop(proc)
            rc = None
        except BaseException:  # interrupted (Ctrl-C, SIGTERM): no run left behind
            stop(proc)
            raise
    seconds = time.monotonic() - start
    test, message = first_failure(junit)
    tail = (run_dir / "output.txt").read_text(errors="replace").strip().splitlines()[-1:] or [""]
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    if rc is None:
        return "timeout", test, f"wall limit {args.mutant_wall:g} s reached", seconds
    if rc == 0:
        return "survived", None, None, seconds
    if test is None:
        return "error", f"session (pytest exit {rc})", tail[0][:300], seconds
    return "killed", test, message, seconds


Verdict = tuple[str, str | None, str | None, float]
NOT_APPLICABLE = "not applicable"


def judge(
    mutant: Mutant, tests: list[str], run: Callable[[list[str]], Verdict], use_probe: bool = True
) -> tuple[str, str | None, str | None, float, bool | None]:
    """(status, killer, message, seconds, killed by the probe) of one mutant: its probe alone first
    when it has one; unless the probe killed it, the whole suite decides."""
    status, test, message, seconds = "survived", None, None, 0.0
    by_probe: bool | None = None
    if mutant.probe and use_probe:
        status, test, message, seconds = run([str(Path(mutant.suite) / mutant.probe)])
        by_probe = status == "killed"
    if status != "killed":  # no probe, or it passed (or could not run): the suite judges
        status, test, message, more = run(tests)
        seconds += more
    return status, test, message, seconds, by_probe


def stack() -> str:
    import platform
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return (
        f"Python {platform.python_version()}, torch {version('torch')}, megatron-core "
        f"{version('megatron-core')}, megatron-fsdp {version('megatron-fsdp')}"
    )


def write_report(
    args: argparse.Namespace,
    tests: list[str],
    control: dict[str, object],
    outcomes: list[Outcome],
    started: float,
    complete: bool,
    changed: list[str] | None = None,
) -> Path:
    """The kill matrix as JSON; rewritten after every mutant (``complete`` false until the end), so an
    interrupted run leaves what it measured."""
    applicable = [o for o in outcomes if o.status != NOT_APPLICABLE]
    killed = [o for o in applicable if o.status != "survived"]
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "stack": stack(),
        "complete": complete,
        "tests": tests,
        "test_timeout_s": args.test_timeout,
        "mutant_wall_s": args.mutant_wall,
        "control": control,
        "kill_rate": len(killed) / len(applicable) if applicable else 0.0,
        "killed": len(killed),
        "applicable": len(applicable),
        "not_applicable": len(outcomes) - len(applicable),
        "total": len(outcomes),
        "seconds": round(time.monotonic() - started, 1),
        "installed_files_unchanged": None if changed is None else not changed,
        "mutants": [asdict(o) for o in outcomes],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return out


def print_matrix(outcomes: list[Outcome]) -> None:
    width = max(len(o.name) for o in outcomes)
    print(f"\n{'mutant':<{width}}  {'result':<14}  {'s':>6}  killed by")
    for o in outcomes:
        killer = o.killed_by or ("-" if not o.cpu_undetectable else "(documented CPU-undetectable)")
        if o.status == NOT_APPLICABLE:
            killer = f"({o.message})"
        print(f"{o.name:<{width}}  {o.status:<14}  {o.seconds:6.1f}  {killer}")


def kill_rate(outcomes: list[Outcome]) -> tuple[int, int, float]:
    """(killed, applicable, rate): mutants not applicable to the stack are not counted."""
    applicable = [o for o in outcomes if o.status != NOT_APPLICABLE]
    killed = [o for o in applicable if o.status != "survived"]
    return len(killed), len(applicable), len(killed) / len(applicable) if applicable else 0.0


def list_catalogue() -> None:
    by_category = Counter(m.category for m in MUTANTS)
    for category, count in by_category.items():
        print(f"{category}: {count}")
        for m in MUTANTS:
            if m.category == category:
                first = " ".join(m.doc.split())
                print(f"  {m.name}{' [replays ' + m.replays + ']' if m.replays else ''}: {first}")
    print(f"{len(MUTANTS)} mutants")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.mutants", description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutants only")
    parser.add_argument("--tests", nargs="+", help="test paths (default: the functional suite, ordered)")
    parser.add_argument("--test-timeout", type=float, default=120.0, help="per test, seconds (plugin)")
    parser.add_argument("--mutant-wall", type=float, default=600.0, help="per run, seconds")
    parser.add_argument("--out", default=str(REPO / ".pytest_cache" / "mutants" / "kill-matrix.json"))
    parser.add_argument("--min-kill-rate", type=float, default=0.95)
    parser.add_argument("--no-control", action="store_true", help="skip the control run (development)")
    parser.add_argument("--no-probes", action="store_true", help="run the whole suite only (no probes)")
    parser.add_argument("--keep", action="store_true", help="keep each run's output and rank logs")
    parser.add_argument("--list", action="store_true", help="print the catalogue and exit")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)  # the scratch copy and the running suite are cleaned up
    if args.list:
        list_catalogue()
        return 0
    mutants = list(MUTANTS)
    if args.only:
        unknown = set(args.only) - {m.name for m in mutants}
        if unknown:
            print(f"mutants: no mutant named {', '.join(sorted(unknown))} (see --list)", file=sys.stderr)
            return 2
        mutants = [m for m in mutants if m.name in args.only]
    python = sys.executable
    root = site_root()
    before = hash_installed(root)
    started = time.monotonic()
    outcomes: list[Outcome] = []
    control: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="mfsdp-mutants-") as scratch_name:
        scratch = Path(scratch_name)
        shadow = make_shadow(root, scratch)
        problems = check_catalogue(shadow, mutants)
        if problems:
            print("mutants: the catalogue does not fit the installed packages:", file=sys.stderr)
            for problem in problems:
                print(f"  {problem}", file=sys.stderr)
            return 2
        check_shadowing(python, shadow, scratch)
        resolutions = {m.name: resolve(shadow, m) for m in mutants}
        for m in mutants:
            if (why := resolutions[m.name].not_applicable) is not None:
                outcomes.append(Outcome(m.name, m.category, NOT_APPLICABLE, None, why, 0.0, m.replays))
                print(f"  {m.name}: not applicable ({why})", flush=True)
        mutants = [m for m in mutants if resolutions[m.name].not_applicable is None]
        if not mutants:
            write_report(args, args.tests or [], control, outcomes, started, complete=True)
            print("mutants: no mutant of the selection applies to the installed packages", file=sys.stderr)
            return 2
        suites = list(dict.fromkeys(m.suite for m in mutants))
        tests_of = {suite: args.tests or suite_files(suite) for suite in suites}
        tests = [path for suite in suites for path in tests_of[suite]]
        print(f"mutants: {len(mutants)} mutants of {root} ({stack()}); tests: {' '.join(tests)}", flush=True)
        if not args.no_control:
            for suite in suites:
                status, test, message, seconds = run_suite(
                    python, shadow, scratch, tests_of[suite], args, "control", suite
                )
                control[suite] = {
                    "status": status, "failed": test, "message": message, "seconds": round(seconds, 1)
                }  # fmt: skip
                passed = "passed" if status == "survived" else status
                print(f"control (no mutant, {suite}): {passed} in {seconds:.1f} s", flush=True)
                if status != "survived":
                    print(f"mutants: the control run of {suite} failed ({test}: {message})", file=sys.stderr)
                    return 2
        for m in mutants:
            use_probe = not args.no_probes and not args.tests

            def run_paths(paths: list[str], name: str = m.name, suite: str = m.suite) -> Verdict:
                return run_suite(python, shadow, scratch, paths, args, name, suite)

            with Applied(shadow, m):
                status, test, message, seconds, by_probe = judge(m, tests_of[m.suite], run_paths, use_probe)
            outcome = Outcome(
                m.name, m.category, status, test, message, round(seconds, 1), m.replays,
                m.cpu_undetectable, list(m.files), by_probe,
            )  # fmt: skip
            outcomes.append(outcome)
            how = " (its probe)" if by_probe else " (the suite)" if by_probe is False and test else ""
            print(f"  {m.name}: {status} in {seconds:.1f} s{' by ' + test + how if test else ''}", flush=True)
            write_report(args, tests, control, outcomes, started, complete=False)
    after = hash_installed(root)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    killed, applicable, rate = kill_rate(outcomes)
    print_matrix(outcomes)
    survivors = [o for o in outcomes if o.status == "survived"]
    print(f"\nkill rate: {killed}/{applicable} applicable = {rate:.1%} "
          f"(required {args.min_kill_rate:.0%}; {len(outcomes) - applicable} not applicable); "
          f"total {time.monotonic() - started:.0f} s")  # fmt: skip
    for o in survivors:
        print(f"survived: {o.name}: {o.cpu_undetectable or 'NOT DOCUMENTED: add a test or a reason'}")
    out = write_report(args, tests, control, outcomes, started, complete=True, changed=changed)
    print(f"kill matrix: {out}")
    if changed:
        print(f"mutants: installed files changed during the run: {', '.join(changed[:5])}", file=sys.stderr)
        return 3
    return 0 if rate >= args.min_kill_rate else 1
