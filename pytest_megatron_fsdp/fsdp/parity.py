"""Per-iteration figures of a run against a baseline run's (Megatron DDP, torch DDP, a recorded run)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def assert_matches_baseline(
    actual: Sequence[float],
    expected: Sequence[float],
    *,
    rel_tol: float,
    what: str,
    metric: str = "loss",
    baseline: str = "DDP baseline",
) -> None:
    """Every iteration's ``metric`` equals the baseline's: bit for bit when ``rel_tol`` is 0 (fp32 CPU
    ranks add the same numbers in the same order), else within ``rel_tol`` relative. The message names
    the first differing iteration and both whole series."""
    if len(actual) != len(expected):
        raise AssertionError(f"{what}: {len(actual)} {metric} values vs the {baseline}'s {len(expected)}")
    for i, (a, e) in enumerate(zip(actual, expected, strict=True), start=1):
        same = a == e if rel_tol == 0 else math.isclose(a, e, rel_tol=rel_tol)
        if not same:
            raise AssertionError(
                f"{what}: iteration {i} {metric} {a!r} != {baseline} {e!r} (rel_tol {rel_tol}); "
                f"all: {list(actual)} vs {list(expected)}"
            )
