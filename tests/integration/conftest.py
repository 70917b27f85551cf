"""The integration tier: real rank sets, pytest sessions in subprocesses (pytester's, or one
``run_scenario`` session that a module-scoped fixture runs once for many tests), torchrun, make and
wheel builds. Every test starts from a plain environment (tests/conftest.py)."""

from pathlib import Path

import pytest

HERE = Path(__file__).parent

#: The tier's longest files, longest first: seconds in one process, 2-core machine otherwise idle,
#: 2026-12-01, newest stack (Python 3.12.1, torch 2.14.1, megatron-core 0.19.2). They run first so that
#: neither pytest-xdist worker of ``make integration`` ends the session alone on one of them.
LONGEST_FIRST = (
    "test_launch_modes.py",  # 277 s: the checkpoint and strategy files under pytest -n 2
    "test_checkpoint_resharding.py",  # 83 s: world sizes 2, 4, 2 and 1 in turn
    "test_faults.py",  # 79 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Only this tier's tests move, among the places they hold: a session of several tiers keeps its order.
    slots = [i for i, item in enumerate(items) if HERE in item.path.parents]
    order = {name: rank for rank, name in enumerate(LONGEST_FIRST)}
    mine = sorted((items[i] for i in slots), key=lambda item: order.get(item.path.name, len(order)))
    for i, item in zip(slots, mine, strict=True):
        items[i] = item


@pytest.fixture(autouse=True)
def _plain(plain_environment: None) -> None:
    pass
