"""The reproduction tier: upstream bugs shown with torch alone, outside this package (torch's gloo,
torch's garbage collector). Run by ``make reproductions`` and CI, not by ``make test``: they take
long (the gloo crash needs thousands of iterations) and say nothing about a change to this
repository. Every test starts from a plain environment (tests/conftest.py)."""

import pytest


@pytest.fixture(autouse=True)
def _plain(plain_environment: None) -> None:
    pass
