"""The one place that reads pytest-xdist's private worker queue.

A pytest-xdist worker runs what its controller sends: the current test, the next one and those
already queued (later ones arrive while it runs). A rank set is given every queued test of its
world size at once, so the worker's queue is read here: ``WorkerInteractor.torun`` (a queue whose
``lock()`` yields the pending indices) and ``WorkerInteractor.nextitem_index``, both private to
pytest-xdist. The layout was read in pytest-xdist 3.8.0's ``xdist/remote.py``; other versions are
not trusted with it: there (or when the layout is not the expected one) only the current test is
given, and the next test gets a rank set of its own when it comes (slower, never wrong).
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

import pytest

#: pytest-xdist versions whose worker queue this module reads: [first, end)
SUPPORTED = ((3, 8), (4, 0))


def xdist_version() -> tuple[int, ...] | None:
    """pytest-xdist's installed version as numbers (major, minor), None when it is not installed."""
    try:
        text = metadata.version("pytest-xdist")
    except metadata.PackageNotFoundError:
        return None
    numbers = []
    for part in text.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers)


def supported(version: tuple[int, ...] | None) -> bool:
    first, end = SUPPORTED
    return version is not None and len(version) == 2 and first <= version < end


def _interactor(config: pytest.Config) -> Any:
    return next(
        (p for p in config.pluginmanager.get_plugins() if type(p).__name__ == "WorkerInteractor"), None
    )


def upcoming(
    config: pytest.Config, items: list[pytest.Item], item: pytest.Item, version: tuple[int, ...] | None = None
) -> list[pytest.Item]:
    """``item`` and the tests this process will run after it, in order.

    A plain session (no pytest-xdist worker) runs everything it collected: ``items`` from ``item`` on.
    A worker: ``item`` and those its controller already queued, read from the queue of a supported
    pytest-xdist (``version``: the installed one unless given); elsewhere ``item`` alone.
    """
    interactor = _interactor(config)
    if interactor is None or not hasattr(config, "workerinput"):
        return items[items.index(item) :]
    torun: Any = getattr(interactor, "torun", None)  # pytest-xdist's private work queue
    if not supported(xdist_version() if version is None else version) or not (
        hasattr(torun, "lock") and hasattr(interactor, "nextitem_index")
    ):
        return [item]
    with torun.lock() as queued:
        indices = [interactor.nextitem_index, *queued]
    return [item] + [items[i] for i in indices if isinstance(i, int)]
