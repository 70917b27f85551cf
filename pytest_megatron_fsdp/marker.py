"""``@pytest.mark.distributed(...)`` (its arguments: ``options.MARKER_KEYWORDS``), parsed once.

At collection every marked test gets a :class:`DistributedSpec` in its stash (``protocol.SPEC``),
with its timeout and reruns looked up once through their options' chains (``options.value_of``;
other plugins' settings included: pytest-timeout's, pytest-rerunfailures'); everything else reads
that spec. A bad marker is a usage error naming the test, before any rank starts.
"""

from __future__ import annotations

from typing import Any

import pytest

from . import options
from .environment import DistributedSpec
from .wire import coexist
from .wire.protocol import MARKER, SPEC

MARKER_HELP = (
    f"{options.MARKER_SIGNATURE}: run the test on world_size ranks (torchrun); tp/pp/cp are Megatron's "
    "model-parallel sizes for the test; timeout in seconds; reruns: attempts after a failure, each in "
    "a fresh rank set (plain mode); only_rerun: the kinds of failure rerun (timeout, rank-death, failure)"
)


def _spec(item: pytest.Item, *args: Any, **kwargs: Any) -> DistributedSpec:
    """The spec of ``item``, whose marker gave these arguments (:data:`options.MARKER_KEYWORDS`;
    anything else is a TypeError, as a call with a wrong name would be); ``timeout``, ``reruns``
    and ``only_rerun`` are the first sources of their options' chains, which read them from the
    marker."""
    names = list(options.MARKER_KEYWORDS)
    if len(args) > 1:
        raise TypeError(f"takes world_size as its only positional argument, {len(args)} were given")
    unknown = [name for name in kwargs if name not in options.MARKER_KEYWORDS]
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}")
    if args and "world_size" in kwargs:
        raise TypeError("got multiple values for argument 'world_size'")
    given = {**options.MARKER_KEYWORDS, **dict(zip(names, args, strict=False)), **kwargs}
    for name in ("world_size", "tp", "pp", "cp"):
        value = given[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"distributed marker: {name}={value!r} must be a positive integer")
    if isinstance(given["reruns"], bool):
        raise ValueError(f"distributed marker: reruns={given['reruns']!r} must be a whole number, 0 or more")
    coexist.refuse_flaky_condition(item)
    return resolve(item, given["world_size"], given["tp"], given["pp"], given["cp"])


def resolve(item: pytest.Item, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1) -> DistributedSpec:
    """The test's settings, each looked up once through its option's chain and labelled with its
    source: the one place they are resolved (a launched rank takes them from its parent's batch)."""
    config = item.config
    timeout_s = options.value_of(config, "timeout", item)
    hang_after_s = options.value_of(config, "hang-after", item)
    return DistributedSpec(
        world_size,
        tp,
        pp,
        cp,
        float(timeout_s.value),
        options.value_of(config, "reruns", item).value,
        options.value_of(config, "only-rerun", item).value,
        timeout_source=timeout_s.source,
        hang_after_s=float(hang_after_s.value),
        hang_after_source=hang_after_s.source,
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
            f"{item.nodeid}: bad @pytest.mark.{MARKER} arguments ({exc}); use {options.MARKER_SIGNATURE}"
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
