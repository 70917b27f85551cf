"""The wire between a plain-pytest parent and the rank sets it launches, and what both ends share.

* the parent starts ``torchrun ... -m pytest --mfsdp-report-file=<events> --mfsdp-batch-file=<batch>``;
  the two internal options mark a rank set launched this way (:func:`launched_by_parent`);
* the batch file lists the tests to run, in order, one JSON object per line: the node id and the
  test's :class:`~..environment.DistributedSpec` as the parent resolved it (world size, timeout,
  hang bound, reruns, each with its source); the ranks use it as sent and resolve none of it again;
* rank 0 appends events to the events file, one JSON object per line, each a small type below:
  :class:`Collected` (node ids), :class:`Started` (node id), :class:`Warnings` (node id, every
  rank's warnings of the test, merged: see :mod:`.warnings_relay`), :class:`Report` (a pytest
  report, serialised by pytest's own hook; per-test data such as training-run records rides on it),
  :class:`Finished` (node id);
* a rank ended by its watchdog writes :data:`.rank_dir.TIMEOUT_BANNER` into its log and exits with
  :data:`TIMEOUT_EXIT_CODE`.

Plain data and pytest only: no torch, nothing from the Megatron-FSDP domain.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from ..environment import DistributedSpec

#: exit status of a rank ended by its watchdog (as coreutils' timeout)
TIMEOUT_EXIT_CODE = 124

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
    """Whether this process is a rank of a set that a plain-pytest parent launched (also before
    configure, when only the early parse of the command line holds the flags)."""
    early = getattr(getattr(config, "known_args_namespace", None), REPORT_FILE_DEST, None)
    return config.getoption(REPORT_FILE_DEST, None) is not None or early is not None


def batch_dir(config: pytest.Config) -> Path:
    """A launched rank set's working directory (the parent removes it, even after a kill)."""
    return Path(config.getoption(REPORT_FILE_DEST)).parent


def spec_of(item: pytest.Item) -> DistributedSpec | None:
    """The test's parsed marker, None for a test that is not distributed."""
    return item.stash.get(SPEC, None)


# -- the batch file -------------------------------------------------------------------------------


def write_batch(path: Path, tests: Iterable[tuple[str, DistributedSpec]]) -> None:
    lines = (json.dumps({"nodeid": nodeid, "spec": spec.to_json()}) for nodeid, spec in tests)
    path.write_text("".join(f"{line}\n" for line in lines))


def read_batch(path: Path) -> list[tuple[str, DistributedSpec]]:
    """(node id, the spec the parent resolved) per test, in the parent's order."""
    entries = (json.loads(line) for line in Path(path).read_text().splitlines() if line)
    return [(entry["nodeid"], DistributedSpec.from_json(entry["spec"])) for entry in entries]


# -- events ---------------------------------------------------------------------------------------
# One small type per event; the wire format is one JSON object per line, ``{"event": <kind>, ...fields}``.


@dataclass(frozen=True)
class Collected:
    """The node ids rank 0 collected, in order."""

    nodeids: list[str]
    kind: ClassVar[str] = "collected"


@dataclass(frozen=True)
class Started:
    """The ranks agreed to start this test."""

    nodeid: str
    kind: ClassVar[str] = "start"


@dataclass(frozen=True)
class Warnings:
    """Every rank's warnings of the test, merged (see :mod:`.warnings_relay`)."""

    nodeid: str
    warnings: list[dict[str, Any]]
    kind: ClassVar[str] = "warnings"


@dataclass(frozen=True)
class Report:
    """One agreed pytest report, serialised by pytest's own hook (training-run records ride on it)."""

    report: dict[str, Any]
    kind: ClassVar[str] = "report"


@dataclass(frozen=True)
class Finished:
    """The test is over on every rank (its reports were all sent)."""

    nodeid: str
    kind: ClassVar[str] = "finish"


Event = Collected | Started | Warnings | Report | Finished
EVENT_TYPES: dict[str, type[Event]] = {t.kind: t for t in (Collected, Started, Warnings, Report, Finished)}


def encode_event(event: Event) -> str:
    return json.dumps({"event": event.kind, **asdict(event)}) + "\n"


def decode_event(line: bytes | str) -> Event:
    data = json.loads(line)
    kind = data.pop("event")
    try:
        return EVENT_TYPES[kind](**data)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not an event of the rank-set protocol: {line!r}") from exc


# -- logs -----------------------------------------------------------------------------------------


def log_dir(config: pytest.Config, explicit: str | None, name: str, chosen_by_parent: bool = False) -> Path:
    """Where a rank set's logs go: ``--mfsdp-log-dir`` as the parent gave it to a launched rank set
    (``chosen_by_parent``), else ``<log-dir or .pytest_cache/d/mfsdp-logs>/<name>`` (kept after the
    run, replaced by the next)."""
    if explicit and chosen_by_parent:
        return Path(explicit)  # the parent already chose this rank set's own directory
    if explicit:
        return Path(explicit) / name
    if getattr(config, "cache", None) is not None:
        return config.cache.mkdir("mfsdp-logs") / name
    return Path(tempfile.gettempdir()) / "mfsdp-logs" / name


@dataclass(frozen=True)
class Verdict:
    """Why a test's time ran out: hung (no rank got anywhere for ``quiet_s``) or too slow."""

    hung: bool
    #: seconds from the test's start to the verdict
    elapsed_s: float
    timeout_s: float
    #: seconds since any rank last got somewhere (None: nothing measured it: no beacon)
    quiet_s: float | None
    #: the no-progress bound (0: off)
    hang_after_s: float
    #: whether the no-progress bound, not the timeout, ended the test
    before_timeout: bool

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Verdict:
        return cls(**json.loads(text))
