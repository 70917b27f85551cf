"""Measuring a training run inside the ranks, and the public API to record checkpoint figures.

Importing this module imports neither torch nor megatron: the reductions load torch on first use
(only ever inside a rank, after a run trained).

Checkpoint code (any test, or the harness's own checkpoint module) records what it measured with
:func:`record_checkpoint`; the figures join the test's run record in the summary, the JSON report
and the JUnit properties.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from .state import PENDING_CHECKPOINTS, RUN_RECORDS, SESSION, RunRecord

if TYPE_CHECKING:
    from .training import TrainingRun, TrainResult

#: run -> (config, item) of the test that built it, so record_checkpoint(run, ...) finds its test
_RUN_OWNERS: weakref.WeakKeyDictionary[Any, tuple[pytest.Config, pytest.Item]] = weakref.WeakKeyDictionary()

#: how many runs of a test were recorded so far (names the JUnit properties of its later runs)
_RUNS_IN_TEST = pytest.StashKey[int]()


def register_run(run: TrainingRun, request: pytest.FixtureRequest) -> None:
    """Called by the ``megatron_fsdp_run`` fixture for every run it builds (on every rank)."""
    _RUN_OWNERS[run] = (request.config, request.node)
    if run.env.platform == "cuda":
        import torch

        # Peak memory per run, not per process: the previous test's peak must not count here.
        torch.cuda.reset_peak_memory_stats(run.env.device)


def peak_memory_bytes(platform: str) -> tuple[int, str]:
    """This rank's peak memory: CUDA's max allocated bytes, or on CPU the process's max RSS.

    Max RSS cannot be reset, so on CPU ranks it is the process's peak since it started (imports and
    earlier tests included); the kind says which was measured.
    """
    if platform == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated()), "cuda_max_allocated"
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(rss if sys.platform == "darwin" else rss * 1024), "max_rss"


def reduce_across_ranks(run: TrainingRun, result: TrainResult) -> tuple[list[float], int, str]:
    """Collective (every rank calls it): per-step times and peak memory, max over all ranks.

    The slowest rank sets the pace of a synchronous step, and the biggest rank sets the memory a
    machine needs, so max is the reduction for both. One all_reduce for all of them.
    """
    import torch
    import torch.distributed as dist

    peak, kind = peak_memory_bytes(run.env.platform)
    values = torch.tensor([float(peak), *result.step_times_s], dtype=torch.float64, device=run.env.device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    reduced = values.tolist()
    return reduced[1:], int(reduced[0]), kind


def record_result(request: pytest.FixtureRequest, run: TrainingRun, result: TrainResult) -> RunRecord:
    """Every rank calls this after ``run.train()`` returned (it reduces); rank 0 stores the record.

    After the reductions the figures are the same on every rank, so every rank's item gets the
    JUnit properties: whichever rank's ``--junitxml`` file is written last under torchrun, and the
    rank-0 reports a launched rank set sends to the plain-pytest parent, carry them.
    """
    step_times, peak, kind = reduce_across_ranks(run, result)
    config, item = request.config, request.node
    pending = config.stash.setdefault(PENDING_CHECKPOINTS, {}).pop(item.nodeid, None)
    record = RunRecord.from_result(
        item.nodeid,
        run,
        result,
        step_times_s=step_times,
        peak_memory_bytes=peak,
        peak_memory_kind=kind,
        checkpoint=pending,
    )
    index = item.stash.get(_RUNS_IN_TEST, 0)
    item.stash[_RUNS_IN_TEST] = index + 1
    from .report import junit_properties

    # Before the test's reports are made, so the properties travel inside them.
    item.user_properties.extend(junit_properties(record, index))
    if run.env.rank == 0:
        config.stash.setdefault(RUN_RECORDS, []).append(record)
    return record


def is_recorded_run(run: Any) -> bool:
    """Whether ``run`` was built by the ``megatron_fsdp_run`` fixture (so figures have a test to go to)."""
    return run in _RUN_OWNERS


def _owner(target: Any) -> tuple[pytest.Config, pytest.Item]:
    if isinstance(target, pytest.FixtureRequest):
        return target.config, target.node
    if isinstance(target, pytest.Item):
        return target.config, target
    owner = _RUN_OWNERS.get(target)
    if owner is None:
        raise TypeError(
            f"record_checkpoint: {target!r} is neither a pytest request/item nor a run built by the "
            "megatron_fsdp_run fixture"
        )
    return owner


def _rank(config: pytest.Config) -> int:
    session = config.stash.get(SESSION, None)
    if session is not None:
        return session.env.rank
    return int(os.environ.get("RANK", "0"))


def record_checkpoint(
    target: Any,
    bytes: int | None = None,  # noqa: A002 (the figure's name in the report)
    save_s: float | None = None,
    load_s: float | None = None,
) -> None:
    """Record a checkpoint's size and save/load times for the current test.

    ``target``: the test's ``request`` (or item), or a run from ``megatron_fsdp_run``. ``bytes`` is
    the whole checkpoint (all ranks' files, e.g. :func:`checkpoint_size_bytes` of its directory).
    Call it after saving, after loading, or once with all three; figures given later replace earlier
    ones, figures not given are kept. No collective: call it on any ranks (best: all, with the same
    figures, so every rank's JUnit file has them); only rank 0 keeps the record.
    """
    config, item = _owner(target)
    given = {k: v for k, v in (("bytes", bytes), ("save_s", save_s), ("load_s", load_s)) if v is not None}
    if "bytes" in given:
        given["bytes"] = int(given["bytes"])
    for key in ("save_s", "load_s"):
        if key in given:
            given[key] = float(given[key])
    item.user_properties.extend((f"mfsdp.checkpoint_{k}", _text(v)) for k, v in given.items())
    if _rank(config) != 0:
        return
    records = config.stash.setdefault(RUN_RECORDS, [])
    for i in range(len(records) - 1, -1, -1):
        if records[i].nodeid == item.nodeid:
            records[i] = dataclasses.replace(records[i], **{f"checkpoint_{k}": v for k, v in given.items()})
            break
    else:
        # No run recorded yet in this test: the next run record of this test takes the figures.
        pending = config.stash.setdefault(PENDING_CHECKPOINTS, {})
        pending.setdefault(item.nodeid, {}).update(given)


def checkpoint_size_bytes(path: str | os.PathLike[str]) -> int:
    """Total size of the files under ``path`` (a checkpoint directory, or one file)."""
    root = Path(path)
    if root.is_file():
        return root.stat().st_size
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _text(value: Any) -> str:
    from .report import fmt_number

    return fmt_number(value)
