"""The unit tier's guard (tests/unit/conftest.py): a pytest session, torchrun or make started from a
unit test fails it, naming the tier's rule; a fresh interpreter for its own sake does not."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import RULE, session_in


@pytest.mark.parametrize(
    "start",
    [
        lambda: subprocess.run([sys.executable, "-m", "pytest", "--version"], check=False),
        lambda: subprocess.Popen(f"{sys.executable} -m pytest --version", shell=True),
        lambda: subprocess.run(
            [sys.executable, "-c", "import pytest; pytest.main(['--version'])"], check=False
        ),
        lambda: subprocess.run(["torchrun", "--nproc_per_node=2", "x.py"], check=False),
        lambda: subprocess.run(["make", "test"], check=False),
        lambda: os.system("pytest --version"),
    ],
    ids=["python-m-pytest", "shell", "pytest.main", "torchrun", "make", "os.system"],
)
def test_a_session_in_a_subprocess_fails_the_test(start):
    with pytest.raises(pytest.fail.Exception, match="the unit tier starts no pytest session"):
        start()


def test_pytesters_subprocess_sessions_fail_the_test(pytester):
    with pytest.raises(pytest.fail.Exception) as caught:
        pytester.runpytest_subprocess("--version")
    assert RULE in str(caught.value)


def test_a_fresh_interpreter_is_not_a_session():
    done = subprocess.run(
        [sys.executable, "-c", "import sys; print(sys.version)"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_make_may_only_dry_run_from_the_files_named():
    assert session_in(["make", "-n", "-C", ".", "venv"], "test_make_stack.py") is None
    assert session_in(["make", "-C", ".", "venv"], "test_make_stack.py") is not None
    assert session_in(["make", "-n", "venv"], "test_other.py") is not None
    assert session_in([sys.executable, "-m", "torch.distributed.run", "-m", "x"], "test_x.py") is not None
