"""The session's resolved options: a typed, frozen object with one attribute per option.

In-process: the registry and the object, then one configured session (pytester, no test run).
"""

from __future__ import annotations

import dataclasses

import pytest

from pytest_megatron_fsdp import options
from pytest_megatron_fsdp.options import OPTIONS, ResolvedOptions


def _defaults() -> dict:
    return {name: option.default for name, option in OPTIONS.items()}


def test_one_attribute_per_option():
    """An option added to OPTIONS needs its attribute here (and the other way round)."""
    fields = {f.name for f in dataclasses.fields(ResolvedOptions)}
    assert fields == {name.replace("-", "_") for name in OPTIONS}


def test_resolved_options_are_frozen():
    values = ResolvedOptions.from_values(_defaults())
    with pytest.raises(dataclasses.FrozenInstanceError):
        values.timeout = 1.0  # type: ignore[misc]
    assert (values.platform, values.timeout, values.golden_mode) == ("auto", 300.0, "compare")


def test_every_option_must_be_resolved_and_nothing_else():
    missing = _defaults()
    del missing["plot"]
    with pytest.raises(TypeError, match="plot"):
        ResolvedOptions.from_values(missing)
    with pytest.raises(TypeError, match="no_such"):
        ResolvedOptions.from_values({**_defaults(), "no-such": 1})


def test_a_configured_session_stashes_its_resolved_options(pytester, monkeypatch):
    monkeypatch.setenv("MFSDP_PG_TIMEOUT", "7")
    (pytester.path / "golden").mkdir()
    config = pytester.parseconfigure(
        "--mfsdp-timeout=12.5",
        "--mfsdp-golden=golden",
        "--mfsdp-set=train.train_iters=3",
        "--mfsdp-use-megatron-fsdp=false",
    )
    values = options.resolved(config)
    assert isinstance(values, ResolvedOptions)
    assert values.timeout == 12.5
    assert values.pg_timeout == 7.0  # the environment, below the command line
    assert values.golden == str(pytester.path / "golden")  # made absolute
    assert values.set == ("train.train_iters=3",)
    assert values.use_megatron_fsdp is False
    assert values.reruns == 0  # the default
