"""A rank's tests: in a launched rank set exactly the parent's batch; in any rank set the same tests,
in the same order, on every rank (checked through the store), or none runs anything."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from ..wire import coexist
from ..wire.protocol import BATCH_FILE_DEST, SPEC, read_batch
from .session import RankSession


def select_batch(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a rank set the plugin launched: exactly the parent's batch, in the parent's order."""
    batch_file = config.getoption(BATCH_FILE_DEST)
    if batch_file is None:
        return
    batch = read_batch(Path(batch_file))
    by_id = {item.nodeid: item for item in items}
    selected = []
    for nodeid, spec in batch:
        if nodeid in by_id:
            by_id[nodeid].stash[SPEC] = spec  # as the parent resolved it: not resolved again here
            selected.append(by_id[nodeid])
    chosen = set(selected)
    deselected = [item for item in items if item not in chosen]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
    items[:] = selected


def check_same_collection(
    session: pytest.Session, rank_session: RankSession, world_size: int, timeout_s: float
) -> list[str]:
    """All ranks run the same tests in the same order, or none runs anything (a usage error says
    where they differ); returns this rank's. ``timeout_s``: how long the ranks wait for each
    other's collection."""
    mine = [item.nodeid for item in session.items]
    seed = coexist.randomly_seed(session.config)
    collected = rank_session.exchange(
        "collect",
        json.dumps({"nodeids": mine, "randomly_seed": seed}),
        datetime.timedelta(seconds=timeout_s),
    )
    first = json.loads(collected[0])
    reference = first["nodeids"]
    for rank in range(1, world_size):
        data = json.loads(collected[rank])
        theirs = data["nodeids"]
        if theirs == reference:
            continue
        if data["randomly_seed"] != first["randomly_seed"]:
            raise pytest.UsageError(
                f"ranks collected their tests in different orders "
                f"({_first_difference(reference, theirs, rank)}): pytest-randomly shuffled them with "
                f"--randomly-seed={first['randomly_seed']} on rank 0 and "
                f"--randomly-seed={data['randomly_seed']} on rank {rank}; give every rank the same "
                "seed (--randomly-seed=N on the command line) or disable it (-p no:randomly)"
            )
        raise pytest.UsageError(
            f"ranks collected different tests: {_first_difference(reference, theirs, rank)}; "
            "every rank must collect the same tests in the same order (check for rank-dependent "
            "collection, e.g. conftest code reading RANK, or files differing between nodes)"
        )
    return mine


def _first_difference(reference: list[str], theirs: list[str], rank: int) -> str:
    for position, (a, b) in enumerate(zip(reference, theirs, strict=False)):
        if a != b:
            return f"at position {position} rank 0 has {a!r} but rank {rank} has {b!r}"
    if len(reference) != len(theirs):
        longer, who = (reference, 0) if len(reference) > len(theirs) else (theirs, rank)
        extra = longer[min(len(reference), len(theirs))]
        return (
            f"rank 0 collected {len(reference)} tests, rank {rank} {len(theirs)}; "
            f"first extra test on rank {who}: {extra!r}"
        )
    return "identical"
