"""What the unit, integration and reproduction tiers share: a plain environment, a private ``$TMPDIR``,
the processes a test left running, and the torchrun command line. The functional suite uses none
of it (its ranks load this file too, so it imports nothing heavy).

A plain environment: not a torchrun rank or srun task, no MFSDP_* settings, not CI, pytest-randomly
off (``PYTEST_ADDOPTS``), no pytest-timeout from the environment. The tests launch pytest and
torchrun themselves; a torchrun or Slurm variable (a CI runner that is a Slurm job) or an MFSDP_*
option inherited from the caller's shell would change what those sessions do, and ``CI`` or
``BUILD_NUMBER`` (set by CI services) makes pytest print its short summary untrimmed: the sessions
print the same on a laptop and on CI, and a test that is about CI output sets ``CI``. Each tier's
conftest.py makes ``plain_environment`` autouse.

One way to run a pytest session in a subprocess, plain (the plugin launches the rank sets) or under
torchrun: :func:`run_pytest_session`, with the suite's isolation (a plain environment,
pytest-randomly off, a ``$TMPDIR``, ``HOME`` and basetemp of its own, no colour, a timeout that kills
the whole process group and fails the test) and what the session left behind (:class:`Scenario`).
A test takes it as the ``inner_session`` fixture (a fresh directory under ``tmp_path`` each call);
a module-scoped fixture whose one session many tests read takes ``run_scenario``. Older tests still
call ``pytester.runpytest_subprocess`` or ``subprocess.run`` themselves; new ones use these. (The
unit tier starts none: tests/unit/conftest.py.)
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
PYTEST_CI_VARS = ("CI", "BUILD_NUMBER")


#: pytest-timeout's environment setting; PYTEST_ADDOPTS is set anew (INNER_ADDOPTS)
PYTEST_PLUGIN_VARS = ("PYTEST_TIMEOUT", "PYTEST_ADDOPTS")
#: pytest-randomly (in the dev extra) off in every session a test starts, as in this suite itself
#: (pyproject's addopts): their expected output follows file order. The test_coexist_* tests turn it
#: on where they test it (``-p randomly``).
INNER_ADDOPTS = "-p no:randomly"


def is_plain(name: str) -> bool:
    """Whether the environment variable ``name`` stays in a plain environment."""
    return not (
        name in TORCHRUN_VARS
        or name in PYTEST_CI_VARS
        or name in PYTEST_PLUGIN_VARS
        or name.startswith(("MFSDP_", "SLURM_"))
    )


def plain_environ(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """A copy of ``environ`` without torchrun or Slurm variables, MFSDP_* settings, CI markers and
    pytest-timeout's setting, with pytest-randomly off (:data:`INNER_ADDOPTS`)."""
    plain = {name: value for name, value in environ.items() if is_plain(name)}
    plain["PYTEST_ADDOPTS"] = INNER_ADDOPTS
    return plain


@pytest.fixture
def plain_environment(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if "pytester" in request.fixturenames:
        request.getfixturevalue("pytester")  # first: it empties PYTEST_ADDOPTS as it starts
    for name in list(os.environ):
        if not is_plain(name):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PYTEST_ADDOPTS", INNER_ADDOPTS)
    # an in-process session may set variables for its process (a rank's TORCHINDUCTOR_CACHE_DIR):
    # gone after the test, so no later session inherits them
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def isolated_tmp(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ``$TMPDIR`` of the test's own for the sessions it launches: what they leave there is seen."""
    tmp = pytester.path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    return tmp


#: how long a check of what a finished session left waits for processes that are ending and
#: files their exit removes: a process that exits in the moment the check looks is not a leftover,
#: one still there after this is
SETTLE_S = 10.0


def settled(look: Callable[[], list[str]], settle_s: float = SETTLE_S) -> list[str]:
    """What ``look`` finds once it finds nothing, or after ``settle_s``: a check that waits for the
    state it asserts instead of sampling one instant."""
    deadline = time.monotonic() + settle_s
    found = look()
    while found and time.monotonic() < deadline:
        time.sleep(0.2)
        found = look()
    return found


def running_under(path: Path) -> list[str]:
    """The processes still running whose command line names ``path`` (a test's directory): the
    torchrun agents and ranks of the sessions it launched (``pid: command line`` each), waited
    for up to :data:`SETTLE_S`."""
    return settled(lambda: _running_under_now(path))


def left_in(directory: Path, ignore: tuple[str, ...] = ()) -> list[str]:
    """The names left in ``directory`` (those starting with an ``ignore`` prefix aside), waited for
    up to :data:`SETTLE_S` to be gone."""
    return settled(
        lambda: sorted(p.name for p in directory.iterdir() if not (ignore and p.name.startswith(ignore)))
    )


def _running_under_now(path: Path) -> list[str]:
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


@pytest.fixture
def leftover_processes() -> Callable[[Path], list[str]]:
    """:func:`running_under` as a fixture."""
    return running_under


@pytest.fixture
def leftover_files() -> Callable[..., list[str]]:
    """:func:`left_in` as a fixture."""
    return left_in


def torchrun_pytest_command(*pytest_args: str, nproc: int = 2) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc_per_node=N -m pytest <args>``: a
    torchrun-mode session on one node, with this interpreter (the harness's own command builder)."""
    from pytest_megatron_fsdp.parent.launcher import torchrun_command

    return torchrun_command(nproc, "-m", "pytest", *pytest_args)


def free_srun_job_id(nodes: int) -> int:
    """A job id for tests/srun_sim.py whose derived port (20000 + id mod 10000) is free
    on every loopback "node"."""
    for _ in range(200):
        job = random.randrange(10**6, 10**7)
        port = 20000 + job % 10000
        try:
            for node in range(nodes):
                with socket.socket() as s:
                    s.bind((f"127.0.0.{node + 1}", port))
        except OSError:
            continue
        return job
    raise AssertionError("no free port in 20000-29999")


@pytest.fixture
def srun_job_id() -> Callable[[int], int]:
    """``srun_job_id(nodes)``: a job id for tests/srun_sim.py (see :func:`free_srun_job_id`)."""
    return free_srun_job_id


@pytest.fixture
def free_port() -> int:
    """A loopback port no one listens on now (for a rendezvous a test addresses itself)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def torchrun_pytest() -> Callable[..., list[str]]:
    """The command line of a torchrun-mode pytest session (see :func:`torchrun_pytest_command`)."""
    return torchrun_pytest_command


@dataclass
class Scenario:
    """One pytest session run for many assertions (a module-scoped fixture runs it once): its
    directory, its result (``stdout``, ``assert_outcomes``, ``ret``), and what it left behind."""

    path: Path
    result: pytest.RunResult
    #: processes still running after the session whose command line names ``path``
    leftovers: list[str] = field(default_factory=list)
    #: what the session left in its own ``$TMPDIR`` (``path / "tmp"``)
    tmp_left: list[str] = field(default_factory=list)
    #: when the session's process ended (wall clock, ``time.time()``), before the checks for what it
    #: left behind, which wait for stragglers
    ended: float = 0.0

    @property
    def out(self) -> str:
        return self.result.stdout.str()

    @property
    def junit(self) -> ET.Element:
        """The ``<testsuite>`` of ``junit.xml`` (the session must be run with ``--junitxml=junit.xml``)."""
        root = ET.parse(self.path / "junit.xml").getroot()
        return root if root.tag == "testsuite" else root[0]

    def junit_case(self, name: str) -> ET.Element:
        """The JUnit ``<testcase>`` named ``name``."""
        cases = [case for case in self.junit.iter("testcase") if case.get("name") == name]
        # the session's own words (an INTERNALERROR, a rank that ended) say why a case is missing
        internal = [
            ET.tostring(case, encoding="unicode")
            for case in self.junit.iter("testcase")
            if case.get("name") == "internal"
        ]
        assert len(cases) == 1, (
            f"{[case.get('name') for case in self.junit.iter('testcase')]}\n{''.join(internal)}\n"
            f"the session's output, its end:\n{self.out[-6000:]}"
        )
        return cases[0]

    def json_report(self, name: str = "report.json") -> Any:
        return json.loads((self.path / name).read_text())

    @property
    def logs(self) -> Path:
        """The rank logs (the session must be run with ``--mfsdp-log-dir=logs``)."""
        return self.path / "logs"


def run_pytest_session(
    path: Path,
    files: Mapping[str, str],
    *args: str,
    torchrun: bool = False,
    nproc: int = 2,
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
    launch: Callable[[list[str]], list[str]] | None = None,
) -> Scenario:
    """Writes ``files`` (name -> text) into ``path`` and runs pytest there once: plain (the plugin
    launches the rank sets), under torchrun (``nproc`` ranks) or under ``launch`` (pytest's
    arguments -> the command line: srun, two torchrun agents), as pytester's
    ``runpytest_subprocess`` would (a plain environment, ``path`` on ``PYTHONPATH``, a basetemp and a
    ``$TMPDIR`` of its own, no colour). A session still running after ``timeout`` seconds is killed
    with all its processes and fails the test."""
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name).write_text(text)
    tmp = path / "tmp"
    tmp.mkdir(exist_ok=True)
    environ = plain_environ()
    environ.update(PY_COLORS="0", TMPDIR=str(tmp), HOME=str(path))
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), os.environ.get("PYTHONPATH", "")]))
    environ.update(env or {})
    pytest_args = ["-p", "no:cacheprovider", f"--basetemp={path / 'basetemp'}", *args]
    if launch is not None:
        command = launch(pytest_args)
    elif torchrun:
        command = torchrun_pytest_command(*pytest_args, nproc=nproc)
    else:
        command = [sys.executable, "-m", "pytest", *pytest_args]
    started = time.monotonic()
    with subprocess.Popen(
        command,
        cwd=path,
        env=environ,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            for line in running_under(path):
                os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
            pytest.fail(f"the session in {path} ran past {timeout} s:\n{out[-3000:]}\n{err[-3000:]}")
    ended = time.time()
    result = pytest.RunResult(proc.returncode, out.splitlines(), err.splitlines(), time.monotonic() - started)
    return Scenario(
        path=path,
        result=result,
        leftovers=running_under(path),
        tmp_left=sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*")),
        ended=ended,
    )


@pytest.fixture
def inner_session(tmp_path: Path) -> Callable[..., Scenario]:
    """``inner_session(files, *args, torchrun=False, nproc=2, env=None, timeout=300)``: one pytest
    session in a subprocess, in a fresh directory under the test's ``tmp_path`` (``session0``,
    ``session1``, ...; see :func:`run_pytest_session`)."""
    count = itertools.count()

    def run(files: Mapping[str, str], *args: str, **options: Any) -> Scenario:
        return run_pytest_session(tmp_path / f"session{next(count)}", files, *args, **options)

    return run


@pytest.fixture(scope="session")
def run_scenario(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Scenario]:
    """``run_scenario(name, files, *args, torchrun=False, nproc=2, env=None, timeout=300)``: one
    session in a fresh directory named after ``name`` (see :func:`run_pytest_session`), for a
    module-scoped fixture whose result many tests read. ``files`` may be a function of that
    directory (for tests that write there by absolute path)."""

    def run(
        name: str, files: Mapping[str, str] | Callable[[Path], Mapping[str, str]], *args: str, **options: Any
    ) -> Scenario:
        path = tmp_path_factory.mktemp(name, numbered=True)
        return run_pytest_session(path, files(path) if callable(files) else files, *args, **options)

    return run


#: Each xdist-run tier's longest files, longest first. They run first so that neither pytest-xdist
#: worker (``--dist loadfile --no-loadscope-reorder``: whole files, handed out in collection order) ends
#: the session alone on one of them. Seconds per file, summed over its tests under 2 workers, newest
#: stack (Python 3.12.1, torch 2.14.1, megatron-core 0.19.2), 2-core Intel Xeon with avx512_bf16/AMX,
#: another job beside it (load average 4-7), 2026-12-04; the e2e tier's last four: one process, idle,
#: 2026-12-01.
LONGEST_FIRST = {
    "integration": (
        "test_inert_sessions.py",  # 138 s (22 s of it one late-start check, 90 s under that load)
        "test_warnings_relay.py",  # 54 s; then test_startup_sessions.py and the others, 2-48 s
    ),
    "e2e": (
        "test_torchrun_timeouts.py",  # 253 s: the timeout scenario under four launchers, stuck ranks
        "test_functional_under_xdist.py",  # 245 s: the checkpoint and strategy files under pytest -n 2
        "test_hang_or_slow.py",  # 139 s: hang bounds waited out beside CPU hogs
        "test_foreign_suite.py",  # 116 s
        "test_reruns.py",  # 99 s
        "test_faults.py",  # 93 s
        "test_checkpoint_resharding.py",  # 83 s: world sizes 2, 4, 2 and 1 in turn
        "test_make_upstream.py",  # 150 s: a fresh floor venv, a checkout-like tree at 2, 4 and 8 ranks
        "test_wheel.py",  # 70-80 s: build, fresh venv, a 2-rank example
        "test_srun_steps.py",  # 70 s
        "test_leftovers.py",  # make test and make smoke on a small file
    ),
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Puts each tier's :data:`LONGEST_FIRST` files at the head of its tests. Only a tier's tests move,
    among the places they hold: a session of several tiers keeps its order."""
    here = Path(__file__).parent
    for tier, longest_first in LONGEST_FIRST.items():
        root = here / tier
        slots = [i for i, item in enumerate(items) if root in item.path.parents]
        order = {name: rank for rank, name in enumerate(longest_first)}
        mine = sorted((items[i] for i in slots), key=lambda item: order.get(item.path.name, len(order)))
        for i, item in zip(slots, mine, strict=True):
            items[i] = item
