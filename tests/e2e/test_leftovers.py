"""Nothing is left in ``$TMPDIR``: not by ``make test`` / ``make smoke`` (pytest's basetemp, torchrun's
torchelastic_* dirs, torch's inductor cache included), not by the seed's torchrun command.

Each check runs the real thing on a small test file with a fresh ``$TMPDIR`` and compares the
directory before and after.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# A distributed test that builds and trains Megatron-FSDP (importing megatron, which on megatron-core
# 0.19 makes torch's inductor cache dir) and uses pytest's tmp_path; and a plain test using tmp_path.
TESTS = """
import pytest


@pytest.mark.distributed(world_size=2)
def test_trains(megatron_fsdp_run, run_config, tmp_path):
    (tmp_path / "scratch.txt").write_text("x")
    megatron_fsdp_run(run_config).train(2)


def test_plain(tmp_path):
    (tmp_path / "scratch.txt").write_text("x")
"""


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def fresh_tmpdir(tmp_path):
    """An empty ``$TMPDIR`` for the command under test, and the test file it runs."""
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "test_small.py").write_text(TESTS)
    return tmpdir, tmp_path / "suite" / "test_small.py"


#: what a calling make passes to a make this test starts: `make integration PYTEST_ARGS=-x` must not
#: hand its PYTEST_ARGS (or -n, -k, ...) to the sessions under test
MAKE_VARS = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")


def _env(tmpdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR" and k not in MAKE_VARS}
    env["TMPDIR"] = str(tmpdir)
    return env


def test_make_test_and_make_smoke_leave_tmpdir_as_they_found_it(fresh_tmpdir):
    """``make test`` is a pytest session per tier (the integration tier's under pytest-xdist), the
    seed's test under torchrun, then upstream's training and checkpoint code under torchrun (on the newest
    stack: Bridge and Megatron-LM save checkpoints there; the floor says in one line that it has neither);
    here the integration and functional tiers and the seed's test are the small file instead of the repo's
    suite (no unit tier), with this venv. ``make smoke`` without upstream's code (run once is enough)."""
    tmpdir, test_file = fresh_tmpdir
    stack = "newest" if sys.version_info[:2] == (3, 12) else "floor"
    tiers = ["UNIT=", f"INTEGRATION={test_file}", f"FUNCTIONAL={test_file}", f"SEED_TEST={test_file}"]
    smoke = [f"FUNCTIONAL={test_file}", "UPSTREAM_CODE="]
    for target, paths, sessions in (("test", tiers, 3), ("smoke", smoke, 1)):
        done = subprocess.run(
            # -o venv: use the running venv as it is (never rebuild it from a test)
            ["make", "-C", str(REPO), "-o", "venv", target, f"STACK={stack}", f"VENV={sys.prefix}", *paths],
            capture_output=True,
            text=True,
            timeout=600,
            env=_env(tmpdir),
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert len(re.findall(r"(?<!\d)2 passed", done.stdout)) == sessions, done.stdout[-3000:]
        if target == "test":
            assert "-n 2 --dist loadfile" in done.stdout  # the integration tier ran under pytest-xdist
            upstream_run = done.stdout.split("make: tests/upstream_code on 2 ranks")[-1]
            if stack == "newest":
                assert re.search(r"\d+ passed.* in [\d.]+s", upstream_run), done.stdout[-3000:]
            else:
                assert "make: tests/upstream_code not run: megatron-bridge is not installed" in done.stdout
        assert _listing(tmpdir) == [], f"make {target} left: {_listing(tmpdir)}"


def test_the_seeds_torchrun_command_leaves_only_torchruns_own_dir(fresh_tmpdir, torchrun_pytest):
    """Under torchrun every rank is a pytest session: its basetemp and the inductor cache go with it.
    torchrun itself makes a torchelastic_* dir before any rank starts and never removes it; the make
    targets give it a $TMPDIR of its own for that reason."""
    tmpdir, test_file = fresh_tmpdir
    done = subprocess.run(
        [
            *torchrun_pytest(),
            str(test_file),
            "-p",
            "no:cacheprovider",
            f"--mfsdp-log-dir={tmpdir.parent / 'logs'}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env=_env(tmpdir),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2 passed" in done.stdout, done.stdout[-3000:]
    left = [name for name in os.listdir(tmpdir) if not name.startswith("torchelastic_")]
    assert left == [], f"left in $TMPDIR: {_listing(tmpdir)}"


def test_an_explicit_basetemp_is_kept_one_per_rank(fresh_tmpdir, torchrun_pytest):
    tmpdir, test_file = fresh_tmpdir
    keep = tmpdir.parent / "keep"
    done = subprocess.run(
        [
            *torchrun_pytest(),
            str(test_file),
            "-k",
            "test_plain",
            "-p",
            "no:cacheprovider",
            f"--basetemp={keep}",
            f"--mfsdp-log-dir={tmpdir.parent / 'logs'}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env=_env(tmpdir),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in (0, 1):  # each rank its own tree: neither removed the other's
        assert (keep / f"rank{rank}" / "test_plain0" / "scratch.txt").read_text() == "x"
