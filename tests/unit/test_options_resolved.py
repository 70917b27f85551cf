"""The session's option values: a typed, frozen object with one attribute per option, and sources.

In-process: the registry and the object, then one configured session (pytester, no test run).
"""

from __future__ import annotations

import dataclasses

import pytest

from pytest_megatron_fsdp import options
from pytest_megatron_fsdp.options import OPTIONS, SessionValues, Setting


def _defaults() -> dict:
    return {name: Setting(option.default, "default") for name, option in OPTIONS.items()}


def test_one_attribute_per_option():
    """An option added to OPTIONS needs its attribute here (and the other way round)."""
    fields = {f.name for f in dataclasses.fields(SessionValues)} - {"sources"}
    assert fields == {name.replace("-", "_") for name in OPTIONS}


def test_session_values_are_frozen():
    values = SessionValues.from_settings(_defaults())
    with pytest.raises(dataclasses.FrozenInstanceError):
        values.timeout = 1.0  # type: ignore[misc]
    assert (values.platform, values.timeout, values.golden_mode) == ("auto", 300.0, "compare")


def test_every_option_must_have_a_value_and_nothing_else():
    missing = _defaults()
    del missing["plot"]
    with pytest.raises(TypeError, match="plot"):
        SessionValues.from_settings(missing)
    with pytest.raises(TypeError, match="no_such"):
        SessionValues.from_settings({**_defaults(), "no-such": Setting(1, "default")})


def test_a_configured_session_stashes_its_values_and_their_sources(pytester, monkeypatch):
    monkeypatch.setenv("MFSDP_PG_TIMEOUT", "7")
    (pytester.path / "golden").mkdir()
    config = pytester.parseconfigure(
        "--mfsdp-timeout=12.5",
        "--mfsdp-golden=golden",
        "--mfsdp-set=train.train_iters=3",
        "--mfsdp-use-megatron-fsdp=false",
    )
    values = options.session_values(config)
    assert isinstance(values, SessionValues)
    assert values.timeout == 12.5
    assert values.pg_timeout == 7.0  # the environment, below the command line
    assert values.golden == str(pytester.path / "golden")  # made absolute
    assert values.set == ("train.train_iters=3",)
    assert values.use_megatron_fsdp is False
    assert values.reruns == 0  # the default
    sources = {name: values.source_of(name) for name in ("timeout", "pg-timeout", "golden", "reruns")}
    assert sources == {
        "timeout": "--mfsdp-timeout",
        "pg-timeout": "MFSDP_PG_TIMEOUT",
        "golden": "--mfsdp-golden",
        "reruns": "default",
    }


def test_bridges_rules_asked_for_without_bridge_is_one_usage_line(pytester, monkeypatch):
    from pytest_megatron_fsdp.fsdp import versions

    monkeypatch.setattr(versions, "megatron_bridge_problem", lambda: "megatron-bridge is not installed (why)")
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "no:randomly", "--mfsdp-bridge-rules=true")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert [line for line in result.errlines if "bridge-rules" in line] == [
        "ERROR: --mfsdp-bridge-rules=true: megatron-bridge is not installed (why); leave it off on this stack"
    ]


def test_bridges_rules_are_checked_once_in_plain_mode_by_the_parent(pytester, monkeypatch):
    """A rank its parent launched does not check again what its parent checked before starting it
    (its pytest gets the flag too): one fresh interpreter for Bridge per session, not one per rank."""
    from pytest_megatron_fsdp.fsdp import versions

    monkeypatch.setattr(versions, "megatron_bridge_problem", lambda: "megatron-bridge is not installed (why)")
    config = pytester.parseconfig("--mfsdp-bridge-rules=true")
    assert options.check_at_configure(config, parent_checked=True).bridge_rules is True
    with pytest.raises(options.OptionError, match="megatron-bridge is not installed"):
        options.check_at_configure(config)
