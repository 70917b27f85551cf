"""``@pytest.mark.distributed(world_size=2, tp=1, pp=1, cp=1, timeout=None, reruns=None, only_rerun=None)``,
parsed once.

At collection every marked test gets a :class:`DistributedSpec` in its stash (``protocol.SPEC``),
with its timeout and reruns already resolved by the options' precedence (other plugins' settings
included: pytest-timeout's, pytest-rerunfailures'); everything else reads that spec. A bad marker
is a usage error naming the test, before any rank starts.
"""

from __future__ import annotations

from typing import Any

import pytest

from . import options
from .environment import DEFAULT_WORLD_SIZE, DistributedSpec
from .harness import coexist
from .harness.protocol import MARKER, SPEC

MARKER_HELP = (
    f"{MARKER}(world_size={DEFAULT_WORLD_SIZE}, tp=1, pp=1, cp=1, timeout=None, reruns=None, "
    "only_rerun=None): run the test on world_size ranks (torchrun); tp/pp/cp are Megatron's "
    "model-parallel sizes for the test; timeout in seconds; reruns: attempts after a failure, each in "
    "a fresh rank set (plain mode); only_rerun: the kinds of failure rerun (timeout, rank-death, failure)"
)


def resolve_timeout(item: pytest.Item, marker_timeout: Any = None) -> float:
    """A test's timeout in seconds: the ``distributed`` marker's ``timeout=``, else pytest-timeout's
    ``@pytest.mark.timeout``, else ``--mfsdp-timeout`` (flag > env > ini), else pytest-timeout's
    session setting (``--timeout`` > ``PYTEST_TIMEOUT`` > ini ``timeout``), else the default: per-test
    markers before session settings, this plugin's own before pytest-timeout's at each level.
    pytest-timeout's 0 ("no timeout") imposes none: ``--mfsdp-timeout`` or the default applies, as a
    distributed test always has a timeout."""
    config = item.config
    if marker_timeout is not None:
        return float(options.resolve(config, "timeout", marker_timeout))
    foreign = coexist.pytest_timeout_setting(item)
    if foreign is not None and foreign.seconds is not None:
        if foreign.level == coexist.MARKER or not options.given(config, "timeout"):
            return foreign.seconds
    return float(options.resolve(config, "timeout"))


def resolve_reruns(item: pytest.Item, marker_reruns: Any = None) -> int:
    """A distributed test's reruns: pytest-rerunfailures' ``--force-reruns`` (it overrides every
    marker), else the ``distributed`` marker's ``reruns=``, else ``@pytest.mark.flaky``, else
    ``--mfsdp-reruns`` (flag > env > ini), else pytest-rerunfailures' ``--reruns`` / ini ``reruns``,
    else 0."""
    config = item.config
    foreign = coexist.rerunfailures_count(item)
    if foreign is not None and foreign.level == coexist.FORCED:
        return foreign.count
    if marker_reruns is not None:
        return options.resolve(config, "reruns", marker_reruns)
    if foreign is not None and (foreign.level == coexist.MARKER or not options.given(config, "reruns")):
        return foreign.count
    return options.resolve(config, "reruns")


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
    for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp), ("cp", cp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"distributed marker: {name}={value!r} must be a positive integer")
    timeout_s = resolve_timeout(item, timeout)
    if isinstance(reruns, bool):
        raise ValueError(f"distributed marker: reruns={reruns!r} must be a whole number, 0 or more")
    coexist.refuse_flaky_condition(item)
    kinds = options.resolve(item.config, "only-rerun", only_rerun)
    return DistributedSpec(world_size, tp, pp, cp, timeout_s, resolve_reruns(item, reruns), kinds)


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


def stash_specs(items: list[pytest.Item]) -> None:
    """Parse every collected test's marker once, into its stash."""
    for item in items:
        spec = parse(item)
        if spec is not None:
            item.stash[SPEC] = spec
