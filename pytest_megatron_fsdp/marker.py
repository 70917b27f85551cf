"""``@pytest.mark.distributed(world_size=2, tp=1, pp=1, cp=1, timeout=None, reruns=None, only_rerun=None)``,
parsed once.

At collection every marked test gets a :class:`DistributedSpec` in its stash (``protocol.SPEC``),
with its timeout and reruns looked up once through their options' chains (``options.value_of``;
other plugins' settings included: pytest-timeout's, pytest-rerunfailures'); everything else reads
that spec. A bad marker is a usage error naming the test, before any rank starts.
"""

from __future__ import annotations

import pytest

from . import options
from .environment import DEFAULT_WORLD_SIZE, DistributedSpec
from .wire import coexist
from .wire.protocol import MARKER, SPEC

MARKER_HELP = (
    f"{MARKER}(world_size={DEFAULT_WORLD_SIZE}, tp=1, pp=1, cp=1, timeout=None, reruns=None, "
    "only_rerun=None): run the test on world_size ranks (torchrun); tp/pp/cp are Megatron's "
    "model-parallel sizes for the test; timeout in seconds; reruns: attempts after a failure, each in "
    "a fresh rank set (plain mode); only_rerun: the kinds of failure rerun (timeout, rank-death, failure)"
)


def _spec(
    item: pytest.Item,
    world_size: int = DEFAULT_WORLD_SIZE,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    timeout: float | None = None,
    reruns: int | None = None,
    only_rerun: str | list[str] | tuple[str, ...] | None = None,
) -> DistributedSpec:
    """The spec of ``item``, whose marker gave these arguments (a wrong name is pytest's TypeError);
    ``timeout``, ``reruns`` and ``only_rerun`` are the first sources of their options' chains, which
    read them from the marker."""
    for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp), ("cp", cp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"distributed marker: {name}={value!r} must be a positive integer")
    config = item.config
    timeout_s = options.value_of(config, "timeout", item)
    if isinstance(reruns, bool):
        raise ValueError(f"distributed marker: reruns={reruns!r} must be a whole number, 0 or more")
    coexist.refuse_flaky_condition(item)
    kinds = options.value_of(config, "only-rerun", item).value
    return DistributedSpec(
        world_size,
        tp,
        pp,
        cp,
        float(timeout_s.value),
        options.value_of(config, "reruns", item).value,
        kinds,
        timeout_source=timeout_s.source,
    )


def parse(item: pytest.Item) -> DistributedSpec | None:
    """The test's marker as data (None when unmarked); a bad marker is a usage error."""
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return None
    try:
        return _spec(item, *marker.args, **marker.kwargs)
    except TypeError as exc:
        raise pytest.UsageError(
            f"{item.nodeid}: bad @pytest.mark.{MARKER} arguments ({exc}); "
            f"use {MARKER}(world_size=2, tp=1, pp=1, cp=1, timeout=None, reruns=None, only_rerun=None)"
        ) from None
    except (ValueError, options.OptionError) as exc:
        raise pytest.UsageError(f"{item.nodeid}: {exc}") from None


def stash_specs(items: list[pytest.Item], unmarked_world_size: int | None = None) -> None:
    """Parse every collected test's marker once, into its stash. ``unmarked_world_size``: a test
    without the marker runs on that many ranks too (a foreign suite's, in plain mode), its timeout
    and reruns by their options' chains as a marked test's."""
    for item in items:
        spec = parse(item)
        if spec is None and unmarked_world_size is not None:
            try:
                spec = _spec(item, unmarked_world_size)
            except (ValueError, options.OptionError) as exc:
                raise pytest.UsageError(f"{item.nodeid}: {exc}") from None
        if spec is not None:
            item.stash[SPEC] = spec
