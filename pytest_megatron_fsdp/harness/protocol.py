"""The wire between a plain-pytest parent and the rank sets it launches, and what both ends share.

* the parent starts ``torchrun ... -m pytest --mfsdp-report-file=<events> --mfsdp-batch-file=<batch>``;
  the two internal options mark a rank set launched this way (:func:`launched_by_parent`);
* the batch file lists the tests to run, in order, one ``<timeout seconds>\\t<node id>`` per line:
  the parent resolved each test's timeout once, and the ranks use that figure;
* rank 0 appends events to the events file, one JSON object per line: ``collected`` (node ids),
  ``start`` (node id), ``warnings`` (node id, every rank's warnings of the test, merged: see
  :mod:`.warnings_relay`), ``report`` (a pytest report, serialised by pytest's own hook; per-test
  data such as training-run records rides on it), ``finish`` (node id);
* a rank ended by its watchdog writes :data:`TIMEOUT_BANNER` into its log and exits with
  :data:`TIMEOUT_EXIT_CODE`.

Plain data and pytest only: no torch, nothing from the Megatron-FSDP domain.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from ..environment import DistributedSpec

#: exit status of a rank ended by its watchdog (as coreutils' timeout)
TIMEOUT_EXIT_CODE = 124
TIMEOUT_BANNER = "MFSDP-TIMEOUT"

#: the marker this plugin runs distributed tests for
MARKER = "distributed"

#: the test's ``@pytest.mark.distributed(...)``, parsed once at collection (absent: not distributed)
SPEC = pytest.StashKey[DistributedSpec]()

#: internal command-line options of a launched rank set (hidden from --help): flag, dest
REPORT_FILE_FLAG, REPORT_FILE_DEST = "--mfsdp-report-file", "mfsdp_report_file"
BATCH_FILE_FLAG, BATCH_FILE_DEST = "--mfsdp-batch-file", "mfsdp_batch_file"


def add_internal_options(group: Any) -> None:
    import argparse

    group.addoption(REPORT_FILE_FLAG, dest=REPORT_FILE_DEST, default=None, help=argparse.SUPPRESS)
    group.addoption(BATCH_FILE_FLAG, dest=BATCH_FILE_DEST, default=None, help=argparse.SUPPRESS)


def launched_by_parent(config: pytest.Config) -> bool:
    """Whether this process is a rank of a set that a plain-pytest parent launched."""
    return config.getoption(REPORT_FILE_DEST, None) is not None


def batch_dir(config: pytest.Config) -> Path:
    """A launched rank set's working directory (the parent removes it, even after a kill)."""
    return Path(config.getoption(REPORT_FILE_DEST)).parent


def spec_of(item: pytest.Item) -> DistributedSpec | None:
    """The test's parsed marker, None for a test that is not distributed."""
    return item.stash.get(SPEC, None)


# -- the batch file -------------------------------------------------------------------------------


def write_batch(path: Path, tests: Iterable[tuple[str, float]]) -> None:
    path.write_text("".join(f"{timeout!r}\t{nodeid}\n" for nodeid, timeout in tests))


def read_batch(path: Path) -> list[tuple[str, float]]:
    """(node id, timeout seconds) per test, in the parent's order."""
    tests = []
    for line in Path(path).read_text().splitlines():
        if line:
            timeout, _, nodeid = line.partition("\t")
            tests.append((nodeid, float(timeout)))
    return tests


# -- events ---------------------------------------------------------------------------------------


def encode_event(kind: str, **data: Any) -> str:
    return json.dumps({"event": kind, **data}) + "\n"


def decode_event(line: bytes) -> dict[str, Any]:
    return json.loads(line)


# -- logs -----------------------------------------------------------------------------------------


def log_dir(config: pytest.Config, explicit: str | None, name: str) -> Path:
    """Where a rank set's logs go: ``--mfsdp-log-dir`` as given to a launched rank set, else
    ``<log-dir or .pytest_cache/d/mfsdp-logs>/<name>`` (kept after the run, replaced by the next)."""
    if explicit and launched_by_parent(config):
        return Path(explicit)  # the parent already chose this rank set's own directory
    if explicit:
        return Path(explicit) / name
    if getattr(config, "cache", None) is not None:
        return config.cache.mkdir("mfsdp-logs") / name
    return Path(tempfile.gettempdir()) / "mfsdp-logs" / name
