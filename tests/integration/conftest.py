"""The integration tier: real rank sets, pytest sessions in subprocesses (pytester's, or one
``run_scenario`` session that a module-scoped fixture runs once for many tests), torchrun, make and
wheel builds. Every test starts from a plain environment (tests/conftest.py)."""

import pytest


@pytest.fixture(autouse=True)
def _plain(plain_environment: None) -> None:
    pass
