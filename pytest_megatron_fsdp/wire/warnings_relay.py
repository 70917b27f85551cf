"""Warnings raised in the ranks, brought into the plain-pytest parent's "warnings summary".

In a rank, pytest's warnings plugin records a test's warnings only as its whole run protocol ends,
after the ranks have agreed on the test and rank 0 has sent its reports. So each rank records them
itself (:func:`capture`, inside pytest's own capture: its filters, ``-W`` and ``filterwarnings``
marks already apply), hands them back to pytest unchanged (the rank's own summary, torchrun mode's
included, is as before), and sends them as plain data with its outcome. Rank 0 merges every rank's
list (:func:`merge`: a warning raised alike on every rank counts once) and sends it to the parent,
which records each one through pytest's ``pytest_warning_recorded`` hook (:func:`record`), as
pytest does for a local test: the terminal summary, and pytest-xdist's relay from a worker to its
controller, take it from there.

Plain data and pytest only: no torch, nothing from the Megatron-FSDP domain.
"""

from __future__ import annotations

import importlib
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest


class RankWarning(UserWarning):
    """Stands for a rank's warning whose category the parent cannot import (its message names it)."""


def active(config: pytest.Config) -> bool:
    """Whether pytest records warnings in this session (not under ``-p no:warnings``)."""
    return config.pluginmanager.get_plugin("warnings") is not None


@contextmanager
def capture() -> Iterator[list[warnings.WarningMessage]]:
    """Record the warnings raised inside, then issue them again to whoever records around it."""
    with warnings.catch_warnings(record=True) as caught:
        yield caught
    with warnings.catch_warnings():
        # they passed the filters once already; "always" so that "once"/"default" bookkeeping of
        # the first issue does not drop them now
        warnings.simplefilter("always")
        for message in caught:
            warnings.warn_explicit(
                message.message, message.category, message.filename, message.lineno, source=message.source
            )


def to_data(messages: list[warnings.WarningMessage]) -> list[dict[str, Any]]:
    """The warnings as JSON-ready dicts: category (module and name), message, file and line."""
    return [
        {
            "module": message.category.__module__,
            "category": message.category.__qualname__,
            "message": str(message.message),
            "filename": str(message.filename),
            "lineno": int(message.lineno),
        }
        for message in messages
    ]


def _key(data: dict[str, Any]) -> tuple[Any, ...]:
    return (data["module"], data["category"], data["message"], data["filename"], data["lineno"])


def merge(per_rank: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One list from every rank's: a warning (same category, message, file and line) appears as
    many times as on the rank that raised it most often, in order of first appearance."""
    counts: Counter[tuple[Any, ...]] = Counter()
    first: dict[tuple[Any, ...], dict[str, Any]] = {}
    for rank in sorted(per_rank):
        mine = Counter(_key(data) for data in per_rank[rank])
        for data in per_rank[rank]:
            first.setdefault(_key(data), data)
        for key, count in mine.items():
            counts[key] = max(counts[key], count)
    return [first[key] for key in first for _ in range(counts[key])]


def warning_message(data: dict[str, Any]) -> warnings.WarningMessage:
    """A rank's warning as ``warnings`` would have recorded it here."""
    category: type[Warning] = RankWarning
    text = data["message"]
    try:
        found = importlib.import_module(data["module"])
        for part in data["category"].split("."):
            found = getattr(found, part)
        if isinstance(found, type) and issubclass(found, Warning):
            category = found
    except Exception:  # noqa: BLE001 - any failure to find it: the stand-in category below
        pass
    if category is RankWarning:
        text = f"{data['category']}: {text}"
    try:
        message = category(text)
    except Exception:  # noqa: BLE001 - a category whose constructor takes other arguments
        category, message = RankWarning, RankWarning(f"{data['category']}: {text}")
    return warnings.WarningMessage(message, category, data["filename"], data["lineno"])


def record(item: pytest.Item, data: list[dict[str, Any]]) -> None:
    """Record a test's warnings from its ranks in this (the parent's) session."""
    for one in data:
        item.ihook.pytest_warning_recorded.call_historic(
            kwargs={
                "warning_message": warning_message(one),
                "when": "runtest",
                "nodeid": item.nodeid,
                "location": None,
            }
        )
