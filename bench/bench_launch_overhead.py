"""Per-test cost of a distributed test in plain-pytest mode, against launching torchrun per test.

Measured side by side in one run, on the same ten trivial 2-rank tests (an all_reduce each):

* batched: one plain ``pytest`` session runs all ten (the plugin launches one rank set for them).
  Two figures for the cost of each extra test: the whole-session marginal, (T10 - T1) / 9, where T1
  is the same session with one test (the conservative one, used for the ratio); and the parent's
  own view, start to report of tests 2..10 (a conftest records it), which is smaller because the
  ranks run ahead of the parent;
* per-test torchrun: ``torchrun --nproc_per_node=2 -m pytest <one test>`` ten times.

Usage: python bench/bench_launch_overhead.py [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = 10
TEST_FILE = """
import pytest
import torch
import torch.distributed as dist

@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("i", range({n}))
def test_trivial(dist_env, i):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
"""


def _env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in drop}


# Times each test in the parent session only (the ranks load this conftest too).
TIMING_CONFTEST = """
import json, os, time
_times = []
def pytest_runtest_logstart(nodeid):
    _times.append(time.perf_counter())
def pytest_runtest_logfinish(nodeid):
    _times[-1] = time.perf_counter() - _times[-1]
def pytest_sessionfinish(session):
    if "RANK" not in os.environ:
        with open("times.json", "w") as f:
            json.dump(_times, f)
"""


def _timed(cmd: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="repeat each measurement, report medians")
    args = parser.parse_args()
    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--mfsdp-platform=cpu"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    torchrun_pytest = [*torchrun, "-m", *pytest_cmd[2:]]
    with tempfile.TemporaryDirectory(prefix="mfsdp-bench-") as tmp:
        # torchrun leaves a torchelastic_* dir in $TMPDIR on every launch: keep them in here.
        os.environ["TMPDIR"] = tmp
        root = Path(tmp)
        (root / "ten").mkdir()
        (root / "ten" / "test_ten.py").write_text(TEST_FILE.format(n=TESTS))
        (root / "ten" / "conftest.py").write_text(TIMING_CONFTEST)
        (root / "one").mkdir()
        (root / "one" / "test_one.py").write_text(TEST_FILE.format(n=1))
        batched, batched_one, extra_test, per_test = [], [], [], []
        for _ in range(args.repeat):
            batched.append(_timed(pytest_cmd, root / "ten"))
            batched_one.append(_timed(pytest_cmd, root / "one"))
            times = json.loads((root / "ten" / "times.json").read_text())
            extra_test.append(statistics.mean(times[1:]))
            per_test.append(
                sum(
                    _timed([*torchrun_pytest, f"test_ten.py::test_trivial[{i}]"], root / "ten")
                    for i in range(TESTS)
                )
            )
    t10, t1, seen, tper = (statistics.median(x) for x in (batched, batched_one, extra_test, per_test))
    extra = (t10 - t1) / (TESTS - 1)
    launch_each = tper / TESTS
    print(f"plain pytest, {TESTS} tests in one batched rank set: {t10:.2f} s whole session")
    print(f"  the same session with 1 test: {t1:.2f} s")
    print(f"  cost per extra test after the first, whole-session marginal: {extra:.3f} s")
    print(f"  ... as the parent session sees it (start to report): {seen:.3f} s")
    print(f"torchrun launched once per test, {TESTS} tests: {tper:.2f} s ({launch_each:.2f} s per test)")
    # The marginal can fall inside the sessions' run-to-run noise (even below 0): then the larger of
    # the two per-test figures bounds the cost, and the ratio is a lower bound.
    per_extra = max(extra, seen)
    ratio = launch_each / per_extra
    print(f"ratio (launch-per-test / batched extra test, larger of the two figures): {ratio:.0f}x")
    print(f"medians of {args.repeat} repeat(s)")


if __name__ == "__main__":
    main()
