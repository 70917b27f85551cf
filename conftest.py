"""The repository's own tests: pytester for the plugin's self-tests. Users need no conftest."""

import pytest

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def _private_tmpdir(tmp_path_factory, monkeypatch):
    # Processes these tests start (torchrun agents and ranks) make temp dirs of their own, e.g.
    # torchrun's torchelastic_* log dirs, which it never removes: keep them in pytest's own temp
    # tree (retention-managed) instead of the machine's /tmp.
    monkeypatch.setenv("TMPDIR", str(tmp_path_factory.mktemp("tmpdir")))
