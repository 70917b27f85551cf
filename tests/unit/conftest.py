"""The unit tier: in-process tests (no rank set, no pytest session in a subprocess; a fresh
interpreter only where that is the point, e.g. what an import pulls in). Every test starts from a
plain environment (tests/conftest.py)."""

import pytest


@pytest.fixture(autouse=True)
def _plain(plain_environment: None) -> None:
    pass
