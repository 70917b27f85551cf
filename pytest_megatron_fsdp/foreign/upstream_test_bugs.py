"""Megatron-LM's tests that fail for a bug of their own at a world size they were not written for
(:data:`..fsdp.versions.UPSTREAM_TEST_BUGS`) are strict xfails there, in a foreign suite's ranks: the
test runs unchanged and must fail as the registry says (a pass is an XPASS(strict) failure saying
the entry is out of date); at other world sizes it is an ordinary test. A test whose bug shows on
some of its ranks only is an xfail of the whole test (``rank.agreement``)."""

from __future__ import annotations

import pytest

from ..fsdp.versions import UPSTREAM_TEST_BUGS, UpstreamTestBug


def reason(name: str, entry: UpstreamTestBug, world_size: int) -> str:
    """The xfail reason: the registry's name, the world size, and the bug in one line."""
    return f"upstream test bug {name} at world size {world_size}: {entry.bug.reason.split(': ', 1)[-1]}"


def known_bugs_of(nodeid: str, world_size: int) -> list[tuple[str, UpstreamTestBug]]:
    """The registry's entries that show for the test ``nodeid`` at ``world_size`` with the
    installed megatron-core."""
    return [
        (name, entry)
        for name, entry in UPSTREAM_TEST_BUGS.items()
        if nodeid.startswith(entry.test) and entry.shows_at(world_size) and entry.bug.present()
    ]


class UpstreamTestBugs:
    """Marks, at collection, each test of the suite the registry knows a bug of at this world size."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            for name, entry in known_bugs_of(item.nodeid, self.world_size):
                item.add_marker(
                    pytest.mark.xfail(
                        strict=True, raises=entry.raises, reason=reason(name, entry, self.world_size)
                    )
                )


def register(config: pytest.Config, world_size: int) -> None:
    config.pluginmanager.register(UpstreamTestBugs(world_size), "mfsdp-upstream-test-bugs")
