"""How the settings of the plugins users commonly have reach a distributed test, in process (no rank
set): pytest-timeout's as one more source of its timeout, pytest-rerunfailures' as its reruns and
their filters, pytest-randomly's seed, a running coverage measurement. Each collected with the real
plugin installed (the dev extra); the sessions that launch ranks, and the usage errors a pytest
session prints, are tests/integration/test_coexist_*.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pytest_megatron_fsdp.environment import DistributedSpec
from pytest_megatron_fsdp.parent import controller as ctl
from pytest_megatron_fsdp.wire import coexist
from pytest_megatron_fsdp.wire.protocol import SPEC
from pytest_megatron_fsdp.wire.torchrun_env import TorchrunEnv

pytest.importorskip("pytest_timeout", reason="the dev extra's pytest-timeout")
pytest.importorskip("pytest_rerunfailures", reason="the dev extra's pytest-rerunfailures")

TIMEOUTS = """
import pytest

@pytest.mark.distributed(world_size=1, timeout=11)
@pytest.mark.timeout(22)
def test_own_marker(): pass

@pytest.mark.distributed(world_size=1)
@pytest.mark.timeout(22)
def test_their_marker(): pass

@pytest.mark.distributed(world_size=1)
def test_no_marker(): pass

@pytest.mark.distributed(world_size=1)
@pytest.mark.timeout(0)
def test_their_marker_says_none(): pass
"""


def _specs(pytester: pytest.Pytester, source: str, *args: str) -> dict[str, DistributedSpec]:
    """The distributed specs of a collect-only session (no rank set starts), by test name."""
    pytester.makepyfile(test_specs=source)
    items, _ = pytester.inline_genitems("-p", "no:cacheprovider", "--mfsdp-platform=cpu", *args)
    return {item.name.removeprefix("test_"): item.stash[SPEC] for item in items}


def _timeouts(pytester: pytest.Pytester, *args: str) -> dict[str, float]:
    return {name: spec.timeout_s for name, spec in _specs(pytester, TIMEOUTS, *args).items()}


@pytest.mark.parametrize(
    ("args", "ini", "env", "expected"),
    [
        # nothing but markers: pytest-timeout's marker is a source; its 0 imposes none (the default)
        (
            [],
            "",
            None,
            {"own_marker": 11, "their_marker": 22, "no_marker": 300, "their_marker_says_none": 300},
        ),
        # pytest-timeout's session setting, each of its sources
        (["--timeout=44"], "", None, {"their_marker": 22, "no_marker": 44, "their_marker_says_none": 300}),
        ([], "", "55", {"no_marker": 55}),
        ([], "timeout = 66", None, {"no_marker": 66}),
        (["--timeout=44"], "timeout = 66", "55", {"no_marker": 44}),
        # this plugin's session setting wins over pytest-timeout's; the per-test markers over both
        (
            ["--timeout=44", "--mfsdp-timeout=33"],
            "",
            None,
            {"own_marker": 11, "their_marker": 22, "no_marker": 33},
        ),
        (["--timeout=44"], "mfsdp_timeout = 77", None, {"no_marker": 77, "their_marker_says_none": 77}),
        # pytest-timeout's "no timeout" in its session setting: this plugin's default
        (["--timeout=0"], "", None, {"no_marker": 300}),
        # pytest-timeout disabled: its marker and settings mean nothing
        (["-p", "no:timeout", "--timeout=44"], "", None, None),
    ],
)
def test_pytest_timeout_is_one_more_source_of_the_timeout(pytester, monkeypatch, args, ini, env, expected):
    if ini:
        pytester.makeini(f"[pytest]\n{ini}\n")
    if env is not None:
        monkeypatch.setenv("PYTEST_TIMEOUT", env)
    if expected is None:  # -p no:timeout: --timeout is no option at all then
        pytester.makepyfile(test_specs=TIMEOUTS)
        result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:timeout", "--collect-only")
        assert result.ret == pytest.ExitCode.OK  # (without --timeout) collects
        timeouts = _timeouts(pytester, "-p", "no:timeout")
        assert timeouts == {
            "own_marker": 11,
            "their_marker": 300,
            "no_marker": 300,
            "their_marker_says_none": 300,
        }
        return
    timeouts = _timeouts(pytester, *args)
    assert {name: timeouts[name] for name in expected} == expected


RERUNS = """
import pytest

@pytest.mark.distributed(world_size=1, reruns=1)
@pytest.mark.flaky(reruns=2)
def test_own_marker(): pass

@pytest.mark.distributed(world_size=1)
@pytest.mark.flaky(reruns=2)
def test_flaky(): pass

@pytest.mark.distributed(world_size=1)
@pytest.mark.flaky
def test_flaky_bare(): pass

@pytest.mark.distributed(world_size=1)
def test_no_marker(): pass
"""


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ([], {"own_marker": 1, "flaky": 2, "flaky_bare": 1, "no_marker": 0}),
        (["--reruns=4"], {"own_marker": 1, "flaky": 2, "flaky_bare": 1, "no_marker": 4}),
        # this plugin's session setting wins over pytest-rerunfailures'; the markers over both
        (["--reruns=4", "--mfsdp-reruns=3"], {"own_marker": 1, "flaky": 2, "no_marker": 3}),
        # pytest-rerunfailures' own rules: --reruns-mode=append adds, --force-reruns overrides every marker
        (["--reruns=4", "--reruns-mode=append"], {"own_marker": 1, "flaky": 6, "no_marker": 4}),
        (["--force-reruns=5", "--mfsdp-reruns=3"], {"own_marker": 5, "flaky": 5, "no_marker": 5}),
        (["--reruns=4", "--rerun-exclude-path=test_specs.py"], {"own_marker": 1, "flaky": 0, "no_marker": 0}),
        (["-p", "no:rerunfailures", "--mfsdp-reruns=3"], {"own_marker": 1, "flaky": 3, "no_marker": 3}),
    ],
)
def test_pytest_rerunfailures_gives_a_distributed_test_its_reruns(pytester, args, expected):
    specs = _specs(pytester, RERUNS, *args)
    assert {name: specs[name].reruns for name in expected} == expected


def test_the_ini_reruns_count_too(pytester):
    pytester.makeini("[pytest]\nreruns = 2\n")
    assert _specs(pytester, RERUNS)["no_marker"].reruns == 2


def test_only_rerun_kinds_resolve_from_the_marker_over_the_options(pytester, monkeypatch):
    source = (
        "import pytest\n"
        "@pytest.mark.distributed(world_size=1, only_rerun='timeout')\ndef test_marker(): pass\n"
        "@pytest.mark.distributed(world_size=1)\ndef test_plain(): pass\n"
    )
    specs = _specs(pytester, source, "--mfsdp-only-rerun=rank-death", "--mfsdp-only-rerun=timeout")
    assert specs["marker"].only_rerun == ("timeout",)
    assert specs["plain"].only_rerun == ("rank-death", "timeout")
    monkeypatch.setenv("MFSDP_ONLY_RERUN", "failure;rank-death")
    assert _specs(pytester, source)["plain"].only_rerun == ("failure", "rank-death")


def _failed(text: str, kind: str | None = None) -> pytest.TestReport:
    extra = {} if kind is None else {"mfsdp_failure": kind}
    return pytest.TestReport("t.py::t", ("t.py", 1, "t"), {}, "failed", text, "call", **extra)


RANK_FAILURE = """\
---------- rank 1 failed (log: /logs/rank1.log) ----------
    def test_x():
        try:
>           connect()
E           mypkg.net.ConnectionError: refused
E           + where 1 = f()

The above exception was the direct cause of the following exception:

>       raise AssertionError("no AssertionError in this line's source") from exc
E       AssertionError: lost the peer
"""


def test_rerun_patterns_match_the_exception_lines_the_ranks_reported():
    texts = coexist.exception_texts(_failed(RANK_FAILURE))
    assert texts == ["ConnectionError: refused", "+ where 1 = f()", "AssertionError: lost the peer"]
    only_connection = coexist.RerunFilters(only=("ConnectionError",), source={"only": "--only-rerun"})
    assert only_connection.declines(texts) is None
    assert only_connection.declines(["AssertionError: x"]) == "--only-rerun: no pattern matches the failure"
    # as pytest-rerunfailures: re.search, so an anchored pattern matches the type without its module
    assert coexist.RerunFilters(only=("^ConnectionError: ref",), source={"only": "x"}).declines(texts) is None
    # an exception class (flaky(only_rerun=[...])) matches by its name
    assert coexist.RerunFilters(only=(ConnectionError,), source={"only": "x"}).declines(texts) is None
    assert coexist.RerunFilters(only=(KeyError,), source={"only": "x"}).declines(texts) is not None
    excluded = coexist.RerunFilters(exclude=("lost the peer",), source={"exclude": "--rerun-except"})
    assert excluded.declines(texts) == "--rerun-except: a pattern matches the failure"
    assert coexist.RerunFilters(condition=False).declines(texts) == "@pytest.mark.flaky(condition=False)"
    # a native traceback (--tb=native) has no E lines: its whole text is matched
    native = _failed("Traceback...\nValueError: boom\n")
    assert coexist.exception_texts(native) == [native.longreprtext]


def test_a_failure_the_controller_made_is_matched_by_its_headline_and_kind():
    timed_out = _failed(
        "timed out: the test exceeded its 5 s timeout; ...\nmore\nrank 0 ...\nrest", "timeout"
    )
    assert coexist.exception_texts(timed_out)[0].startswith("timed out:")
    assert ctl.failure_kind(timed_out) == "timeout"
    assert ctl.failure_kind(_failed("rank 1 died (exit code 3)", "rank-death")) == "rank-death"
    assert ctl.failure_kind(_failed(RANK_FAILURE)) == "failure"
    item = SimpleNamespace(config=None)  # no pytest-rerunfailures filters: only the kinds decide
    only_deaths = DistributedSpec(reruns=1, only_rerun=("rank-death",))
    nothing = coexist.RerunFilters()
    assert ctl._declines_rerun(item, only_deaths, nothing, _failed("rank 1 died", "rank-death")) is None
    assert ctl._declines_rerun(item, only_deaths, nothing, _failed(RANK_FAILURE)) == (
        "only rank-death is rerun (--mfsdp-only-rerun, the marker's only_rerun=); this is a failure"
    )
    assert ctl._declines_rerun(item, DistributedSpec(reruns=1), nothing, _failed(RANK_FAILURE)) is None
    # pytest-rerunfailures' patterns decide too, on the exception lines of the ranks' report
    only_keys = coexist.RerunFilters(only=("KeyError",), source={"only": "--only-rerun"})
    declined = ctl._declines_rerun(item, DistributedSpec(reruns=1), only_keys, _failed(RANK_FAILURE))
    assert declined == "--only-rerun: no pattern matches the failure"
    only_deaths_text = coexist.RerunFilters(only=("died",), source={"only": "--only-rerun"})
    assert (
        ctl._declines_rerun(
            item, DistributedSpec(reruns=1), only_deaths_text, _failed("rank 1 died", "rank-death")
        )
        is None
    )


def test_the_delay_between_attempts_is_pytest_rerunfailures_formula():
    filters = coexist.RerunFilters(delay_s=2.0, backoff=3.0)
    assert [filters.delay(attempt) for attempt in (1, 2, 3)] == [2.0, 6.0, 18.0]
    assert coexist.RerunFilters(delay_s=-1).delay(1) == 0.0


# -- pytest-randomly, coverage --------------------------------------------------------------------


def _torchrun(rank: int, run_id: str = "run-a", port: int = 29400, agent_store: bool = False) -> TorchrunEnv:
    return TorchrunEnv(
        rank, 2, rank, 2, master_addr="127.0.0.1", master_port=port, agent_store=agent_store, run_id=run_id
    )


@pytest.fixture
def agent_store():
    """A store such as torchrun's agent hosts for its ranks (its port)."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield store.port
    del store


def test_torchrun_ranks_take_one_new_seed_per_run_from_the_agent_store(pytester, agent_store):
    seeds = []
    for rank in (0, 1):
        config = pytester.parseconfig("-p", "randomly")
        torchrun = _torchrun(rank, "none", agent_store, agent_store=True)
        seeds.append(coexist.agree_randomly_seed(config, torchrun))
        assert config.option.randomly_seed == seeds[-1]  # what pytest-randomly's configure then uses
    assert seeds[0] == seeds[1]
    assert isinstance(seeds[0], int)
    # `torchrun --nproc_per_node=2` without --standalone: run id "none" and the same port on every
    # run; each run's agent store is new, and so is its seed (as pytest-randomly's own default)
    from torch.distributed import TCPStore

    next_run = TCPStore("127.0.0.1", agent_store, is_master=False)
    next_run.delete_key("mfsdp/randomly-seed/none")
    again = coexist.agree_randomly_seed(
        pytester.parseconfig("-p", "randomly"), _torchrun(0, "none", agent_store, agent_store=True)
    )
    assert again != seeds[0]


def test_ranks_without_an_agent_store_derive_one_seed_from_their_run(pytester):
    seeds = []
    for rank in (0, 1):
        config = pytester.parseconfig("-p", "randomly")
        seeds.append(coexist.agree_randomly_seed(config, _torchrun(rank)))
        assert config.option.randomly_seed == seeds[-1]
    assert seeds[0] == seeds[1]
    assert isinstance(seeds[0], int)
    other = coexist.agree_randomly_seed(pytester.parseconfig("-p", "randomly"), _torchrun(0, run_id="run-b"))
    assert other != seeds[0]  # a new run, a new order (as pytest-randomly's own default)


def test_a_given_seed_or_no_pytest_randomly_is_left_alone(pytester):
    given = pytester.parseconfig("-p", "randomly", "--randomly-seed=7")
    assert coexist.agree_randomly_seed(given, _torchrun(0)) is None
    assert given.option.randomly_seed == 7
    assert coexist.agree_randomly_seed(pytester.parseconfig("-p", "no:randomly"), _torchrun(0)) is None


def test_the_parents_seed_goes_to_its_rank_sets(pytester):
    config = pytester.parseconfig("-p", "randomly", "--randomly-seed=1234", "--randomly-dont-reset-seed")
    config.option.randomly_seed = 1234  # as pytest-randomly's configure leaves it
    assert coexist.randomly_args(config) == ["--randomly-seed=1234", "--randomly-dont-reset-seed"]
    assert coexist.randomly_args(pytester.parseconfig("-p", "no:randomly")) == []


def test_pytest_covs_measurement_is_handed_to_the_rank_sets(monkeypatch, tmp_path):
    coverage = pytest.importorskip("coverage")
    for name in ("COVERAGE_PROCESS_CONFIG", "COVERAGE_PROCESS_START"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    measurement = coverage.Coverage(source=["mypkg"], branch=True)
    plugins = {}
    config = SimpleNamespace(pluginmanager=SimpleNamespace(get_plugin=plugins.get))
    assert coexist.coverage_env(config) == {}  # no pytest-cov
    plugins["_cov"] = SimpleNamespace(cov_controller=None)
    assert coexist.coverage_env(config) == {}  # pytest-cov, not measuring (no --cov)
    plugins["_cov"] = SimpleNamespace(cov_controller=SimpleNamespace(cov=measurement))
    env = coexist.coverage_env(config)
    from coverage.config import CoverageConfig

    handed = CoverageConfig.deserialize(env["COVERAGE_PROCESS_CONFIG"])
    assert handed.parallel is True
    assert measurement.config.parallel is False  # the parent's untouched
    assert handed.branch is True
    assert handed.source == ["mypkg"]
    assert handed.data_file == str(tmp_path / ".coverage")
    # coverage's own subprocess patch already hands it on: nothing to add
    monkeypatch.setenv("COVERAGE_PROCESS_CONFIG", "x")
    assert coexist.coverage_env(config) == {}


def test_only_rerun_given_for_a_torchrun_run_is_refused_in_one_line(pytester, monkeypatch):
    from pytest_megatron_fsdp import options

    config = pytester.parseconfig("--mfsdp-only-rerun=timeout")
    with pytest.raises(options.OptionError) as refused:
        options.refuse_plain_mode_only(config)
    assert str(refused.value).startswith(
        "--mfsdp-only-rerun=timeout: not under torchrun: it chooses which failures are rerun"
    )
    monkeypatch.setenv("MFSDP_ONLY_RERUN", "rank-death;timeout")
    given = "^environment variable MFSDP_ONLY_RERUN=rank-death;timeout: not under torchrun"
    with pytest.raises(options.OptionError, match=given):
        options.refuse_plain_mode_only(pytester.parseconfig())
    pytester.makeini("[pytest]\nmfsdp_only_rerun = timeout\n")  # a standing setting: not used there
    monkeypatch.delenv("MFSDP_ONLY_RERUN")
    options.refuse_plain_mode_only(pytester.parseconfig())


def test_the_foreign_world_size_is_refused_under_torchrun_only_where_given(pytester, monkeypatch):
    from pytest_megatron_fsdp import options

    options.refuse_plain_mode_only(pytester.parseconfig())  # its default (2) acts in plain mode only
    with pytest.raises(options.OptionError) as refused:
        options.refuse_plain_mode_only(pytester.parseconfig("--mfsdp-foreign-world-size=4"))
    assert str(refused.value) == (
        "--mfsdp-foreign-world-size=4: not under torchrun: under torchrun a foreign suite's tests run on "
        "the session's own ranks (--nproc_per_node)"
    )
    monkeypatch.setenv("MFSDP_FOREIGN_WORLD_SIZE", "3")
    given = r"^environment variable MFSDP_FOREIGN_WORLD_SIZE=3: not under torchrun"
    with pytest.raises(options.OptionError, match=given):
        options.refuse_plain_mode_only(pytester.parseconfig())
