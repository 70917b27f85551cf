"""The process groups a foreign suite's tests make, each owned by what made it, freed when that ends.

Megatron-LM's unit tests make many process groups and free few (Megatron's model-parallel groups,
one group per ``init_device_mesh``): every gloo group holds threads and sockets of its own until it
is destroyed and nothing references it. In foreign-suite mode the patched ``init_process_group`` and
``new_group`` (:mod:`.foreign`) record each group they make here, and the rank session
destroys those still alive once their owner is over, on every rank alike, after the test's outcome
is agreed:

* a group made while a class-, module-, package- or session-scoped fixture is set up (``setup_class``
  is one) belongs to that fixture: it is freed after the test in whose teardown the fixture ends;
* any other (the test's body, its function-scoped fixtures) belongs to the test: freed after it, and
  at once where the test fails on this rank (:meth:`MadeGroups.release_test_groups`), so that a
  peer waiting in a collective on one of them is brought back;
* none made while :meth:`MadeGroups.unrecorded` is on: the plugin's own fixtures, used by a test in
  that mode, release their groups themselves (Megatron's model-parallel state is kept for the next
  test and destroyed with the rank session's process group).

Only weak references are kept: a group's connections close when its last reference goes, and a
reference held here would keep them open.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

#: what destroys a group (``torch.distributed.destroy_process_group``); raises ValueError for a
#: group already destroyed
Destroy = Callable[[Any], None]


class MadeGroups:
    """The groups made so far and not yet freed, by owner: ``None`` (the current test) or a
    longer-scoped fixture (any hashable token: the fixture's definition)."""

    def __init__(self) -> None:
        self._owners: list[object] = []  # the long-scoped fixtures being set up, innermost last
        self._by_owner: dict[object | None, list[weakref.ref[Any]]] = {}
        self._due: list[weakref.ref[Any]] = []
        self._unrecorded = 0  # how many unrecorded() blocks are open

    def record(self, group: Any) -> None:
        """``group`` was just made (anything that is not a group, e.g. torch's marker for a rank
        outside the group, is ignored)."""
        if self._unrecorded:
            return
        try:
            ref = weakref.ref(group)
        except TypeError:  # not a group object (GroupMember.NON_GROUP_MEMBER, None)
            return
        owner = self._owners[-1] if self._owners else None
        self._by_owner.setdefault(owner, []).append(ref)

    @contextlib.contextmanager
    def owned_by(self, owner: object) -> Iterator[None]:
        """The groups made inside belong to ``owner`` (a long-scoped fixture being set up)."""
        self._owners.append(owner)
        try:
            yield
        finally:
            self._owners.remove(owner)

    @contextlib.contextmanager
    def unrecorded(self) -> Iterator[None]:
        """The groups made inside are not recorded: whoever made them frees them."""
        self._unrecorded += 1
        try:
            yield
        finally:
            self._unrecorded -= 1

    def owner_done(self, owner: object) -> None:
        """``owner`` has ended (its fixture was finalized): its groups are freed after this test."""
        self._due.extend(self._by_owner.pop(owner, []))

    def release_test_groups(self, destroy: Destroy) -> int:
        """The current test failed on this rank: free its own groups now (a peer may wait in a
        collective on one); returns how many were alive."""
        return _free(self._by_owner.pop(None, []), destroy)

    def free_after_test(self, destroy: Destroy) -> int:
        """The test is over on every rank: free its own groups and those of fixtures that ended in
        it; returns how many were alive."""
        due, self._due = self._due, []
        return _free(self._by_owner.pop(None, []) + due, destroy)

    def alive(self) -> int:
        """How many recorded groups are still referenced by someone (destroyed or not)."""
        refs = [*self._due, *(ref for refs in self._by_owner.values() for ref in refs)]
        return sum(ref() is not None for ref in refs)


def _free(refs: list[weakref.ref[Any]], destroy: Destroy) -> int:
    freed = 0
    for ref in refs:
        group = ref()
        if group is None:
            continue
        try:
            destroy(group)
        except Exception:  # noqa: BLE001 - destroyed already (ValueError), or its backend broken: gone
            continue
        finally:
            del group  # no reference of this frame's may keep its connections open
        freed += 1
    return freed
