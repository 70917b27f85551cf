"""Measuring a training run inside the ranks, and carrying the figures on the test's reports.

Importing this module imports neither torch nor megatron: the reductions load torch on first use
(only ever inside a rank, after a run trained).

The ``megatron_fsdp_run`` fixture installs a :class:`TestRecorder` as each run's observer; it turns
every ``train()`` result into a :class:`RunRecord` kept on the test item. When pytest makes the
test's report, :func:`attach_to_report` puts the new records on it (``report.mfsdp_runs``), the way
Hypothesis carries its statistics: pytest's report serialisation then brings them to a plain-mode
parent and to an xdist controller, and the summary reads them back from the terminal reporter's
stats (:func:`records_from_reports`). Checkpoint code (any test, or the harness's own) records what
it measured with :func:`record_checkpoint`.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import pytest

from ..fsdp.layout import checkpoint_size_bytes
from .record import RunRecord

__all__ = [
    "TestRecorder",
    "attach_to_report",
    "checkpoint_size_bytes",
    "record_checkpoint",
    "record_result",
    "records_from_reports",
    "run_records",
]

if TYPE_CHECKING:
    from ..fsdp.results import TrainResult
    from ..fsdp.run import Run

#: where a report carries its test's run records (a list of ``dataclasses.asdict(RunRecord)``)
REPORT_ATTRIBUTE = "mfsdp_runs"

#: the test's run records, in the order they were made
_RECORDS = pytest.StashKey[list[RunRecord]]()
#: how many of them are already on a report
_ATTACHED = pytest.StashKey[int]()
#: checkpoint figures recorded before the test's first run record (the next record takes them)
_PENDING_CHECKPOINT = pytest.StashKey[dict[str, Any]]()


class TestRecorder:
    """A run's observer for one test (see ``fsdp.run.RunObserver``)."""

    __test__ = False  # not a test class, whatever its name

    def __init__(self, item: pytest.Item) -> None:
        self.item = item

    def started(self, run: Run) -> None:
        if run.env.platform == "cuda":
            import torch

            # Peak memory per run, not per process: the previous test's peak must not count here.
            torch.cuda.reset_peak_memory_stats(run.env.device)

    def on_result(self, run: Run, result: TrainResult) -> None:
        record_result(self.item, run, result)

    def on_checkpoint(self, run: Run, figures: dict[str, float]) -> None:
        size = figures.get("bytes")  # a count of bytes, carried as a figure
        record_checkpoint(
            self.item, None if size is None else int(size), figures.get("save_s"), figures.get("load_s")
        )


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


def reduce_across_ranks(
    run: Run, result: TrainResult
) -> tuple[list[float], int, str, list[int], list[float]]:
    """Collective (every rank calls it): per-step times, peak memory, per-step memory in use and
    per-step gradient zeros, max over all ranks.

    The slowest rank sets the pace of a synchronous step, and the biggest rank sets the memory a
    machine needs, so max is the reduction for both. The zeros are counted by Megatron over each
    rank's grad-stats group: the same count on every rank, but where that group is not every rank
    (HSDP with the optimizer sharded over its instances: each instance counts its own shards), max
    gives every rank one figure, the one a golden file can hold. One all_reduce for all of them.
    """
    import torch
    import torch.distributed as dist

    peak, kind = peak_memory_bytes(run.env.platform)
    steps = len(result.step_times_s)
    memory = list(result.memory_bytes) if len(result.memory_bytes) == steps else [0] * steps
    zeros = list(result.num_zeros) if len(result.num_zeros) == steps else [0.0] * steps
    values = torch.tensor(
        [float(peak), *result.step_times_s, *map(float, memory), *zeros],
        dtype=torch.float64,
        device=run.env.device,
    )
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    reduced = values.tolist()
    in_use = [int(v) for v in reduced[1 + steps : 1 + 2 * steps]] if result.memory_bytes else []
    num_zeros = reduced[1 + 2 * steps :] if result.num_zeros else []
    return reduced[1 : 1 + steps], int(reduced[0]), kind, in_use, num_zeros


def make_record(
    nodeid: str,
    run: Run,
    result: TrainResult,
    *,
    step_times_s: list[float] | None = None,
    peak_memory_bytes: int | None = None,
    peak_memory_kind: str = "",
    checkpoint: dict[str, Any] | None = None,
    memory_bytes: list[int] | None = None,
    num_zeros: list[float] | None = None,
) -> RunRecord:
    """``step_times_s``, ``memory_bytes``, ``num_zeros``: the per-step figures reduced across ranks
    (default: this rank's)."""
    steps = list(result.step_times_s if step_times_s is None else step_times_s)
    times = steps[1:] or steps  # the first step warms up
    ms_per_step = 1000 * sum(times) / len(times) if times else float("nan")
    facts = run.facts()
    tokens = facts.tokens_per_step
    return RunRecord(
        nodeid=nodeid,
        platform=facts.platform,
        preset=facts.preset,
        strategy=facts.strategy,
        iterations=len(result.losses),
        first_loss=result.losses[0],
        last_loss=result.losses[-1],
        ms_per_step=ms_per_step,
        world_size=facts.world_size,
        data_parallel_size=facts.data_parallel_size,
        tokens_per_step=tokens,
        tokens_per_s=tokens / (ms_per_step / 1000) if ms_per_step > 0 and tokens else float("nan"),
        losses=list(result.losses),
        grad_norms=list(result.grad_norms),
        step_times_s=steps,
        peak_memory_bytes=peak_memory_bytes,
        peak_memory_kind=peak_memory_kind,
        first_iteration=result.first_iteration,
        num_zeros=list(result.num_zeros if num_zeros is None else num_zeros),
        memory_bytes=list(result.memory_bytes if memory_bytes is None else memory_bytes),
        **{f"checkpoint_{k}": v for k, v in (checkpoint or {}).items()},
    )


def record_result(item: pytest.Item, run: Run, result: TrainResult) -> RunRecord:
    """Every rank calls this after ``run.train()`` returned (it reduces); each keeps the record.

    After the reductions the figures are the same on every rank, so every rank's item gets the
    record and the JUnit properties: whichever rank's report reaches the user carries them.
    """
    step_times, peak, kind, in_use, num_zeros = reduce_across_ranks(run, result)
    record = make_record(
        item.nodeid,
        run,
        result,
        step_times_s=step_times,
        peak_memory_bytes=peak,
        peak_memory_kind=kind,
        checkpoint=item.stash.get(_PENDING_CHECKPOINT, None),
        memory_bytes=in_use,
        num_zeros=num_zeros,
    )
    item.stash[_PENDING_CHECKPOINT] = {}
    records = item.stash.setdefault(_RECORDS, [])
    from .report import junit_properties

    # Before the test's reports are made, so the properties travel inside them.
    item.user_properties.extend(junit_properties(record, len(records)))
    records.append(record)
    return record


def run_records(target: pytest.FixtureRequest | pytest.Item) -> list[RunRecord]:
    """The runs the test recorded so far (the same on every rank)."""
    item = target.node if isinstance(target, pytest.FixtureRequest) else target
    return list(item.stash.get(_RECORDS, []))


def _item_of(target: Any) -> pytest.Item:
    if isinstance(target, pytest.FixtureRequest):
        # the test's own request (function scope): its node is the test item
        return cast(pytest.Item, target.node)
    if isinstance(target, pytest.Item):
        return target
    observer = getattr(target, "observer", None)
    if isinstance(observer, TestRecorder):
        return observer.item
    raise TypeError(
        f"record_checkpoint: {target!r} is neither a pytest request/item nor a run built by the "
        "megatron_fsdp_run fixture"
    )


def record_checkpoint(
    target: Any,
    bytes: int | None = None,  # the figure's name in the report
    save_s: float | None = None,
    load_s: float | None = None,
) -> None:
    """Record a checkpoint's size and save/load times for the current test.

    ``target``: the test's ``request`` (or item), or a run from ``megatron_fsdp_run``. ``bytes`` is
    the whole checkpoint (all ranks' files, e.g. :func:`checkpoint_size_bytes` of its directory).
    Call it after saving, after loading, or once with all three; figures given later replace earlier
    ones, figures not given are kept. No collective: call it on any ranks (best: all, with the same
    figures, so every rank's report has them).
    """
    item = _item_of(target)
    given = {k: v for k, v in (("bytes", bytes), ("save_s", save_s), ("load_s", load_s)) if v is not None}
    if "bytes" in given:
        given["bytes"] = int(given["bytes"])
    for key in ("save_s", "load_s"):
        if key in given:
            given[key] = float(given[key])
    from .report import fmt_number

    item.user_properties.extend((f"mfsdp.checkpoint_{k}", fmt_number(v)) for k, v in given.items())
    records = item.stash.get(_RECORDS, [])
    if records:
        changes: dict[str, Any] = {f"checkpoint_{k}": v for k, v in given.items()}
        records[-1] = dataclasses.replace(records[-1], **changes)
    else:
        # No run recorded yet in this test: the next run record of this test takes the figures.
        item.stash.setdefault(_PENDING_CHECKPOINT, {}).update(given)


def attach_to_report(item: pytest.Item, report: pytest.TestReport) -> None:
    """Put the test's records made since its last report on ``report`` (plain data)."""
    records = item.stash.get(_RECORDS, [])
    attached = item.stash.get(_ATTACHED, 0)
    if len(records) > attached:
        setattr(report, REPORT_ATTRIBUTE, [dataclasses.asdict(r) for r in records[attached:]])
        item.stash[_ATTACHED] = len(records)


def records_from_reports(reports: Iterable[Any]) -> list[RunRecord]:
    """Every run record the reports carry, in the order the tests ran."""
    carrying = [r for r in reports if getattr(r, REPORT_ATTRIBUTE, None)]
    carrying.sort(key=lambda r: getattr(r, "start", 0.0))
    return [RunRecord(**data) for r in carrying for data in getattr(r, REPORT_ATTRIBUTE)]
