"""The integration tier: real rank sets, one plugin behaviour per pytest session in a subprocess
(pytester's, or one ``run_scenario`` session that a module-scoped fixture runs once for many tests).
Whole scenarios are the end-to-end tier's (tests/e2e): a fault or a bound waited out, a launch
repeated across launchers, a whole suite run again, make or a build. Its longest
files run first (``LONGEST_FIRST`` in tests/conftest.py). Every test starts from a plain
environment (tests/conftest.py)."""

import pytest


@pytest.fixture(autouse=True)
def _plain(plain_environment: None) -> None:
    pass
