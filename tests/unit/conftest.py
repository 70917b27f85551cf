"""The unit tier: in-process tests (no rank set, no pytest session in a subprocess; a fresh
interpreter only where that is the point, e.g. what an import pulls in). Every test starts from a
plain environment (tests/conftest.py).

The tier holds its promise itself: while a unit test runs, starting a pytest session in a
subprocess (``python -m pytest``, pytester's ``runpytest_subprocess``/``spawn_pytest``, ``python -c
"...pytest.main(...)"``), torchrun or an srun step fails the test, and so does ``make``, whose
targets run such sessions, except the dry runs :data:`MAKE_DRY_RUNS` names. Such a test belongs in
tests/integration (or runs its session in process: ``pytester.runpytest_inprocess``).

Nor does an in-process session start a rank set early: a configured session that collects a
distributed test would launch its first rank set while it collects (``Controller.prestart``), which
no unit test waits for (the integration tier tests the prestart: test_startup_sessions.py,
test_inert_sessions.py). A unit test whose session runs a distributed test still starts one, and
the guard above fails it.
"""

from __future__ import annotations

import itertools
import os
import shlex
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from pytest_megatron_fsdp.parent.controller import Controller

#: the unit test files that may start ``make``, only as ``make -n`` (prints the recipes, runs none),
#: and why each needs it
MAKE_DRY_RUNS = {
    "test_make_stack.py": "reads the requirement lines `make venv` would install from `make -n venv`",
}

#: programs that are a pytest session, or start one per rank
_SESSION_PROGRAMS = {"pytest", "py.test", "torchrun", "srun"}
#: ``python -m <module>`` that is one
_SESSION_MODULES = {"pytest", "torch.distributed.run", "torch.distributed.launch"}
#: what in ``python -c <code>`` starts one
_SESSION_CODE = ("pytest.main(", "torch.distributed.run")

RULE = (
    "the unit tier starts no pytest session in a subprocess (tests/unit/conftest.py): move this test "
    "to tests/integration, or run the session in process (pytester.runpytest_inprocess)"
)


def _argv(args: Any, shell: bool = False) -> list[str]:
    if isinstance(args, (str, bytes, os.PathLike)):
        text = os.fsdecode(args)
        return shlex.split(text) if shell else [text]
    return [os.fsdecode(a) for a in args]


def session_in(argv: Sequence[str], test_file: str) -> str | None:
    """Why ``argv``, started by a test in ``test_file``, breaks the unit tier's rule; None if it does not."""
    if not argv:
        return None
    program = Path(argv[0]).name
    if program in _SESSION_PROGRAMS:
        return f"{program} is a pytest session or starts some"
    if program == "make":
        if test_file in MAKE_DRY_RUNS and "-n" in argv:
            return None
        return "make's targets run pytest sessions (a dry run `make -n` from a file in MAKE_DRY_RUNS may)"
    for flag, value in itertools.pairwise(argv):
        if flag == "-m" and value in _SESSION_MODULES:
            return f"python -m {value} is a pytest session or starts some"
        if flag == "-c" and any(code in value for code in _SESSION_CODE):
            return "python -c runs a pytest session"
    return None


@pytest.fixture(autouse=True)
def _no_session_in_a_subprocess(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    test_file = request.node.path.name

    def check(argv: list[str]) -> None:
        reason = session_in(argv, test_file)
        if reason is not None:
            pytest.fail(f"{RULE}; it started {shlex.join(argv)!r}: {reason}", pytrace=True)

    popen_init = subprocess.Popen.__init__

    def guarded_popen(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        check(_argv(args, kwargs.get("shell", False)))
        popen_init(self, args, *rest, **kwargs)

    def guarded(original: Callable[..., Any], argv_of: Callable[..., list[str]]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            check(argv_of(*args, **kwargs))
            return original(*args, **kwargs)

        return call

    def refuse(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            pytest.fail(f"{RULE}; it called pytester.{name}")

        return call

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded_popen)
    monkeypatch.setattr(os, "system", guarded(os.system, lambda command: shlex.split(command)))
    for name in ("posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, guarded(getattr(os, name), lambda path, argv, *a, **k: _argv(argv)))
    for name in ("spawnv", "spawnve", "spawnvp", "spawnvpe"):
        monkeypatch.setattr(os, name, guarded(getattr(os, name), lambda mode, file, args, *a: _argv(args)))
    for name in ("runpytest_subprocess", "spawn_pytest"):
        monkeypatch.setattr(pytest.Pytester, name, refuse(name))


@pytest.fixture(autouse=True)
def _no_prestarted_rank_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Controller, "prestart", lambda self, world_size: None)


@pytest.fixture(autouse=True)
def _plain(plain_environment: None) -> None:
    pass
