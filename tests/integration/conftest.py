"""The integration tier: real rank sets, pytest sessions in subprocesses (pytester's, or one
``run_scenario`` session that a module-scoped fixture runs once for many tests), torchrun and srun
steps. What re-runs a whole suite or drives the build (the functional files under ``pytest -n 2``,
world-size-4 reshards, the wheel, ``make test``) is the end-to-end tier's (tests/e2e). Its longest
files run first (``LONGEST_FIRST`` in tests/conftest.py). Every test starts from a plain
environment (tests/conftest.py)."""

import pytest


@pytest.fixture(autouse=True)
def _plain(plain_environment: None) -> None:
    pass
