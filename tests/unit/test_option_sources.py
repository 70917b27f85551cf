"""One lookup, ``options.value_of``: each option's value comes from the first source of the chain
declared beside it, labelled with that source; the timeout's and the reruns' chains hold
pytest-timeout's and pytest-rerunfailures' settings (with the real plugins installed). In process:
configured sessions and collected items (pytester), no rank set, no subprocess.
"""

from __future__ import annotations

import itertools

import pytest

from pytest_megatron_fsdp import marker, options
from pytest_megatron_fsdp.options import OPTIONS, Setting, value_of
from pytest_megatron_fsdp.wire import explain
from pytest_megatron_fsdp.wire.explain import PostMortem

pytest.importorskip("pytest_timeout", reason="the dev extra's pytest-timeout")
pytest.importorskip("pytest_rerunfailures", reason="the dev extra's pytest-rerunfailures")


def test_each_session_source_gives_its_value_and_its_label(pytester, monkeypatch):
    assert value_of(pytester.parseconfig(), "pg-timeout") == Setting(120.0, "default")
    pytester.makeini("[pytest]\nmfsdp_pg_timeout = 11\nmfsdp_set =\n    train.seed=1\n")
    assert value_of(pytester.parseconfig(), "pg-timeout") == Setting(11.0, "ini mfsdp_pg_timeout")
    assert value_of(pytester.parseconfig(), "set") == Setting(("train.seed=1",), "ini mfsdp_set")
    monkeypatch.setenv("MFSDP_PG_TIMEOUT", "22")
    monkeypatch.setenv("MFSDP_SET", "train.seed=2; ;train.train_iters=4")
    assert value_of(pytester.parseconfig(), "pg-timeout") == Setting(22.0, "MFSDP_PG_TIMEOUT")
    assert value_of(pytester.parseconfig(), "set") == Setting(
        ("train.seed=2", "train.train_iters=4"), "MFSDP_SET"
    )
    config = pytester.parseconfig("--mfsdp-pg-timeout=33", "--mfsdp-set=train.seed=3")
    assert value_of(config, "pg-timeout") == Setting(33.0, "--mfsdp-pg-timeout")
    assert value_of(config, "set") == Setting(("train.seed=3",), "--mfsdp-set")


def test_what_the_user_gave_is_listed_by_label(pytester, monkeypatch):
    assert options.options_given(pytester.parseconfig()) == []
    pytester.makeini("[pytest]\nmfsdp_golden_mode = record\n")
    monkeypatch.setenv("MFSDP_TIMEOUT", "7")
    given = options.options_given(pytester.parseconfig("--mfsdp-platform=cpu"))
    assert given == ["--mfsdp-platform", "MFSDP_TIMEOUT", "ini mfsdp_golden_mode"]


_MODULES = itertools.count()


def _item(pytester: pytest.Pytester, source: str, args: list[str]) -> pytest.Item:
    """The one test of ``source``, collected in a configured session (its marker not parsed yet);
    a module of its own each time (an imported module's markers would stay)."""
    path = pytester.makepyfile(**{f"test_sources_{next(_MODULES)}": source})
    config = pytester.parseconfigure(path, "-p", "no:cacheprovider", *args)
    module = pytester.getnode(config, path)
    (item,) = pytester.genitems([module])
    return item


#: every source of the timeout's chain, highest first: (a piece of the test file, ini line, env
#: variable, command-line argument) and the seconds it gives
TIMEOUT_SOURCES = [
    ("distributed", "timeout=11", 11.0),
    ("timeout marker", "@pytest.mark.timeout(22)", 22.0),
    ("arg", "--mfsdp-timeout=33", 33.0),
    ("env", ("MFSDP_TIMEOUT", "44"), 44.0),
    ("ini", "mfsdp_timeout = 55", 55.0),
    ("arg", "--timeout=66", 66.0),
    ("env", ("PYTEST_TIMEOUT", "77"), 77.0),
    ("ini", "timeout = 88", 88.0),
]

RERUNS_SOURCES = [
    ("arg", "--force-reruns=1", 1),
    ("distributed", "reruns=2", 2),
    ("flaky marker", "@pytest.mark.flaky(reruns=3)", 3),
    ("arg", "--mfsdp-reruns=4", 4),
    ("env", ("MFSDP_RERUNS", "5"), 5),
    ("ini", "mfsdp_reruns = 6", 6),
    ("arg", "--reruns=7", 7),
    ("ini", "reruns = 8", 8),
]


def _session_with(pytester, monkeypatch, sources) -> pytest.Item:
    """A test with every source of ``sources`` given (markers, ini, env, command line)."""
    kwargs = [piece for kind, piece, _ in sources if kind == "distributed"]
    markers = [piece for kind, piece, _ in sources if kind.endswith("marker")]
    ini = [piece for kind, piece, _ in sources if kind == "ini"]
    for name in ("MFSDP_TIMEOUT", "PYTEST_TIMEOUT", "MFSDP_RERUNS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (piece for kind, piece, _ in sources if kind == "env"):
        monkeypatch.setenv(name, value)
    pytester.makeini("[pytest]\n" + "\n".join(ini) + "\n")
    source = (
        "import pytest\n"
        + "".join(f"{m}\n" for m in markers)
        + f"@pytest.mark.distributed(world_size=1{''.join(', ' + k for k in kwargs)})\n"
        + "def test_it(): pass\n"
    )
    return _item(pytester, source, ["--mfsdp-platform=cpu", *(p for k, p, _ in sources if k == "arg")])


@pytest.mark.parametrize(("name", "sources"), [("timeout", TIMEOUT_SOURCES), ("reruns", RERUNS_SOURCES)])
def test_the_chain_runs_as_declared_other_plugins_settings_included(pytester, monkeypatch, name, sources):
    """Give every source of the chain, then take the highest away, one by one: each time the value
    comes from the next source, with its label, in the order the option declares (which
    docs/options.md's precedence table states)."""
    seen = []
    for first in range(len(sources) + 1):
        item = _session_with(pytester, monkeypatch, sources[first:])
        setting = value_of(item.config, name, item)
        expected = sources[first][2] if first < len(sources) else OPTIONS[name].default
        assert setting.value == expected, (name, sources[first:])
        seen.append(setting.source)
        spec = marker.parse(item)
        assert spec is not None
        assert (spec.timeout_s if name == "timeout" else spec.reruns) == expected
        if name == "timeout":
            assert spec.timeout_source == setting.source
    assert seen == OPTIONS[name].chain_labels()


def test_pytest_timeouts_no_timeout_passes_to_this_plugins_next_source(pytester, monkeypatch):
    """Its 0 imposes none: at its marker's place the next source applies, this plugin's own first
    (pytest-timeout's session options stay below its marker, which said 0)."""
    sources = [("timeout marker", "@pytest.mark.timeout(0)", 0), ("arg", "--timeout=66", 66)]
    item = _session_with(pytester, monkeypatch, sources)
    assert value_of(item.config, "timeout", item) == Setting(300.0, "default")
    item = _session_with(pytester, monkeypatch, [*sources, ("ini", "mfsdp_timeout = 55", 55)])
    assert value_of(item.config, "timeout", item) == Setting(55.0, "ini mfsdp_timeout")


def test_reruns_mode_append_says_both_sources(pytester, monkeypatch):
    sources = [("flaky marker", "@pytest.mark.flaky(reruns=3)", 3), ("arg", "--reruns=7", 7)]
    item = _session_with(pytester, monkeypatch, [*sources, ("arg", "--reruns-mode=append", None)])
    assert value_of(item.config, "reruns", item) == Setting(
        10, "@pytest.mark.flaky + pytest-rerunfailures --reruns (--reruns-mode=append)"
    )


def test_without_a_test_the_session_value_skips_the_per_test_sources(pytester, monkeypatch):
    item = _session_with(pytester, monkeypatch, TIMEOUT_SOURCES)
    assert value_of(item.config, "timeout") == Setting(33.0, "--mfsdp-timeout")


def test_a_bad_marker_value_names_the_marker(pytester):
    item = _item(pytester, "import pytest\n@pytest.mark.distributed(timeout=-1)\ndef test_it(): pass\n", [])
    with pytest.raises(pytest.UsageError) as refused:
        marker.parse(item)
    assert str(refused.value) == (
        f"{item.nodeid}: @pytest.mark.distributed(timeout=...): invalid value '-1' for --mfsdp-timeout: "
        "must be a positive number of seconds"
    )


def test_a_timeout_says_where_its_timeout_came_from():
    text = explain.describe_death(PostMortem(2, -9), 5.0, killed_after=5.0, timeout_source="MFSDP_TIMEOUT")
    assert text.splitlines()[:2] == [
        "timed out: the test exceeded its 5 s timeout; every rank's stacks were dumped and the rank set was "
        "killed",
        "timeout 5 s (from MFSDP_TIMEOUT)",
    ]
