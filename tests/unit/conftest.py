"""Every unit test starts from a plain environment: not a torchrun rank or srun task, no MFSDP_*
settings, not CI, pytest-randomly off (``PYTEST_ADDOPTS``), no pytest-timeout from the environment.

The tests launch pytest and torchrun themselves; a torchrun or Slurm variable (a CI runner that is
a Slurm job) or an MFSDP_* option inherited from the caller's shell would change what those
sessions do, and ``CI`` or ``BUILD_NUMBER`` (set by CI services) makes pytest print its short
summary untrimmed: the sessions print the same on a laptop and on CI, and a test that is about CI
output sets ``CI``.
"""

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
PYTEST_CI_VARS = ("CI", "BUILD_NUMBER")


#: pytest-randomly (in the dev extra) off in every session a test starts, as in this suite itself
#: (pyproject's addopts): their expected output follows file order. The test_coexist_* tests turn it
#: on where they test it (``-p randomly``).
INNER_ADDOPTS = "-p no:randomly"


@pytest.fixture(autouse=True)
def plain_environment(request, monkeypatch):
    if "pytester" in request.fixturenames:
        request.getfixturevalue("pytester")  # first: it empties PYTEST_ADDOPTS as it starts
    for name in list(os.environ):
        if (
            name in TORCHRUN_VARS
            or name in PYTEST_CI_VARS
            or name.startswith(("MFSDP_", "SLURM_"))
            or name in ("PYTEST_TIMEOUT", "PYTEST_ADDOPTS")
        ):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PYTEST_ADDOPTS", INNER_ADDOPTS)


@pytest.fixture
def isolated_tmp(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ``$TMPDIR`` of the test's own for the sessions it launches: what they leave there is seen."""
    tmp = pytester.path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    return tmp


@pytest.fixture
def leftover_processes() -> Callable[[Path], list[str]]:
    """Lists the processes still running whose command line names ``path`` (a test's directory):
    the torchrun agents and ranks of the sessions it launched (``pid: command line`` each)."""

    def running(path: Path) -> list[str]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            if int(pid) == os.getpid():
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue  # it ended meanwhile
            if str(path) in cmdline:
                found.append(f"{pid}: {cmdline}")
        return found

    return running


def torchrun_pytest_command(*pytest_args: str, nproc: int = 2) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc_per_node=N -m pytest <args>``: a
    torchrun-mode session on one node, with this interpreter."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "pytest",
        *pytest_args,
    ]


@pytest.fixture
def torchrun_pytest() -> Callable[..., list[str]]:
    """The command line of a torchrun-mode pytest session (see :func:`torchrun_pytest_command`)."""
    return torchrun_pytest_command
