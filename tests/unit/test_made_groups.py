"""The ledger of a foreign suite's process groups: each owned by the test or the long-scoped fixture
that made it, freed when that is over, and never kept alive by the ledger itself."""

from __future__ import annotations

import gc
from typing import Any

from pytest_megatron_fsdp.emulation.made_groups import MadeGroups


class Group:
    """Stands in for a ProcessGroup: weakly referenceable, destroyed once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.destroyed = False


def destroy(group: Any) -> None:
    if group.destroyed:
        raise ValueError("Invalid process group specified")  # torch's, for a group destroyed already
    group.destroyed = True


def test_the_tests_groups_are_freed_after_it_a_fixtures_when_the_fixture_ends():
    made = MadeGroups()
    class_fixture = object()
    with made.owned_by(class_fixture):
        kept = Group("setup_class's")
        made.record(kept)
    first = Group("the first test's")
    made.record(first)
    assert made.free_after_test(destroy) == 1
    assert first.destroyed
    assert not kept.destroyed
    second = Group("the last test's")
    made.record(second)
    made.owner_done(class_fixture)  # finalized in the last test's teardown
    assert made.free_after_test(destroy) == 2
    assert second.destroyed
    assert kept.destroyed
    assert made.free_after_test(destroy) == 0


def test_a_failure_releases_the_tests_own_groups_only():
    made = MadeGroups()
    module_fixture = object()
    with made.owned_by(module_fixture):
        kept = Group("module fixture's")
        made.record(kept)
    own = Group("the test's")
    made.record(own)
    assert made.release_test_groups(destroy) == 1
    assert own.destroyed
    assert not kept.destroyed
    assert made.free_after_test(destroy) == 0  # released already, not freed twice


def test_groups_made_unrecorded_are_left_to_their_maker():
    """The plugin's own fixtures in a foreign suite's session: Megatron's model-parallel groups, kept
    for the next test, are destroyed with the rank session's process group, not after the test."""
    made = MadeGroups()
    with made.unrecorded():
        kept = Group("megatron_parallel's")
        made.record(kept)
    own = Group("the test's")
    made.record(own)
    assert made.release_test_groups(destroy) == 1
    assert made.free_after_test(destroy) == 0
    assert own.destroyed
    assert not kept.destroyed
    assert made.alive() == 0


def test_nested_fixtures_own_what_each_makes():
    made = MadeGroups()
    outer, inner = object(), object()
    with made.owned_by(outer):
        a = Group("outer's")
        made.record(a)
        with made.owned_by(inner):
            b = Group("inner's")
            made.record(b)
        c = Group("outer's again")
        made.record(c)
    made.owner_done(inner)
    assert made.free_after_test(destroy) == 1
    assert b.destroyed
    made.owner_done(outer)
    assert made.free_after_test(destroy) == 2
    assert a.destroyed
    assert c.destroyed


def test_groups_destroyed_by_someone_else_are_not_counted():
    made = MadeGroups()
    group = Group("destroyed by the test")
    made.record(group)
    destroy(group)
    assert made.free_after_test(destroy) == 0


def test_the_ledger_holds_no_group_alive():
    made = MadeGroups()
    group = Group("referenced by the test only")
    made.record(group)
    assert made.alive() == 1
    del group
    gc.collect()
    assert made.alive() == 0  # its connections could close: nothing here referenced it
    assert made.free_after_test(destroy) == 0


def test_what_is_not_a_group_is_ignored():
    made = MadeGroups()
    made.record(-100)  # torch's GroupMember.NON_GROUP_MEMBER: a rank outside the group
    made.record(None)
    assert made.alive() == 0
