"""The end-to-end tier: whole scenarios, minutes a file. Faults and bounds waited out (timeouts under
every launcher, a rank stuck in C, hung against slow beside CPU hogs, every fault, a rank failing in
Megatron-FSDP's collectives, a save killed mid-write, srun steps, reruns in fresh rank sets,
pytest-timeout's timeouts); xdist and two-node launches; foreign suites; and what re-runs a whole
suite or drives the build: the functional files under ``pytest -n 2``, checkpoints resharded across
world sizes 2, 4, 2 and 1, the wheel built and installed into a fresh venv, ``make test`` and
``make smoke`` leaving ``$TMPDIR`` as they found it. ``make e2e`` runs it (CI on both stacks;
``make test`` does not). Its longest files run first (``LONGEST_FIRST`` in tests/conftest.py).
Every test starts from a plain environment (tests/conftest.py)."""

import pytest


@pytest.fixture(autouse=True)
def _plain(plain_environment: None) -> None:
    pass
