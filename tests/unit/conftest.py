"""Every unit test starts from a plain environment: not a torchrun rank, no MFSDP_* settings.

The tests launch pytest and torchrun themselves; a torchrun variable or an MFSDP_* option
inherited from the caller's shell would change what those sessions do.
"""

import os

import pytest

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def plain_environment(monkeypatch):
    for name in list(os.environ):
        if name in TORCHRUN_VARS or name.startswith("MFSDP_"):
            monkeypatch.delenv(name)
