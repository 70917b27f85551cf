"""Wall time of each test tier's make target, and where it goes: the time budgets' measurement.

Runs ``make <tier>`` for each tier asked for, one after the other, on the stack given, and prints one
table row per tier (wall time, the load average before and after, pytest's summary line), then the
slowest test files of each tier (the sum of their tests' times, from a JUnit report). The load
average matters: on a 2-core machine a second job doubles every figure.

Usage:
    python bench/bench_tiers.py [--stack newest|floor] [--venv PATH] [--top N] [TIER ...]

TIER is one of unit, integration, functional, reproductions, test (default: unit integration
functional reproductions). ``--venv`` uses an existing virtualenv as it is (``make -o venv``: nothing
is built or installed); without it make builds the stack's venv first when it is missing, and that
time counts.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIERS = ("unit", "integration", "functional", "reproductions", "test")
_SUMMARY = re.compile(r"^=+ (.*(?:passed|failed|error|skipped|no tests ran).*) in [\d.]+s")


def file_times(junit: Path) -> list[tuple[float, int, str]]:
    """(seconds, tests, file) per test file of a JUnit report, slowest first."""
    seconds: collections.Counter[str] = collections.Counter()
    tests: collections.Counter[str] = collections.Counter()
    for case in ET.parse(junit).getroot().iter("testcase"):
        # classname: tests.integration.test_faults(.Class)
        parts = (case.get("classname") or "").split(".")
        name = "/".join(parts[:3]) + ".py" if len(parts) >= 3 else ".".join(parts)
        seconds[name] += float(case.get("time") or 0)
        tests[name] += 1
    return sorted(((s, tests[name], name) for name, s in seconds.items()), reverse=True)


def run_tier(tier: str, stack: str, venv: str | None, junit: Path) -> dict:
    command = ["make", "-C", str(REPO), tier, f"STACK={stack}"]
    if tier != "test":  # make test runs pytest twice (the seed under torchrun too): one report would be lost
        command.append(f"PYTEST_ARGS=--junitxml={junit}")
    if venv:
        command[3:3] = ["-o", "venv", f"VENV={venv}"]
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.monotonic() - started
    summary = [m.group(1) for line in done.stdout.splitlines() if (m := _SUMMARY.match(line))]
    return {
        "tier": tier,
        "wall": wall,
        "load": (load_before, os.getloadavg()[0]),
        "status": done.returncode,
        "summary": "; ".join(summary) or done.stdout[-300:],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "tiers", nargs="*", choices=TIERS, default=["unit", "integration", "functional", "reproductions"]
    )
    parser.add_argument("--stack", default="newest", choices=("newest", "floor"))
    parser.add_argument("--venv", help="an existing venv of that stack, used as it is (make -o venv)")
    parser.add_argument("--top", type=int, default=15, help="slowest files shown per tier")
    args = parser.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, STACK={args.stack}, {os.cpu_count()} CPUs")
    print("| tier | wall | load avg before -> after | make status | pytest |")
    print("| --- | --- | --- | --- | --- |")
    slowest = {}
    with tempfile.TemporaryDirectory() as scratch:
        for tier in args.tiers:
            junit = Path(scratch) / f"{tier}.xml"
            row = run_tier(tier, args.stack, args.venv, junit)
            before, after = row["load"]
            cells = [
                tier,
                f"{row['wall']:.0f} s",
                f"{before:.2f} -> {after:.2f}",
                row["status"],
                row["summary"],
            ]
            print("| " + " | ".join(map(str, cells)) + " |", flush=True)
            if junit.exists():
                slowest[tier] = file_times(junit)[: args.top]
    for tier, files in slowest.items():
        print(f"\nslowest files of {tier} (sum of their tests' times):")
        for seconds, count, name in files:
            print(f"  {seconds:7.1f} s  {count:3d} tests  {name}")


if __name__ == "__main__":
    sys.exit(main())
