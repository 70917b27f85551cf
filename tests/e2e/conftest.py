"""The end-to-end tier: checks that re-run a whole suite or drive the build, minutes each: the
functional files under ``pytest -n 2``, checkpoints resharded across world sizes 2, 4, 2 and 1, the
wheel built and installed into a fresh venv, ``make test`` and ``make smoke`` leaving ``$TMPDIR`` as
they found it. ``make e2e`` runs it (CI on both stacks; ``make test`` does not). Its longest files
run first (``LONGEST_FIRST`` in tests/conftest.py). Every test starts from a plain environment
(tests/conftest.py)."""

import pytest


@pytest.fixture(autouse=True)
def _plain(plain_environment: None) -> None:
    pass
