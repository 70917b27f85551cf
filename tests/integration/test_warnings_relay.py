"""Warnings raised in the ranks reach the plain-mode parent's warnings summary, once."""

import warnings

import pytest

from pytest_megatron_fsdp.harness import warnings_relay

WARNING_TESTS = """
import warnings
import pytest

class TooFewStepsWarning(UserWarning):
    pass

@pytest.mark.distributed(world_size=2, timeout=60)
def test_warns_on_every_rank(dist_env):
    warnings.warn(TooFewStepsWarning("same on every rank"))

@pytest.mark.distributed(world_size=2, timeout=60)
def test_warns_on_rank1_only(dist_env):
    if dist_env.rank == 1:
        warnings.warn("only rank 1 says this", UserWarning)

@pytest.mark.distributed(world_size=2, timeout=60)
def test_quiet(dist_env):
    pass
"""


def _summary(text: str) -> str:
    start = text.index("warnings summary")
    return text[start : text.index("-- Docs:", start)]


@pytest.mark.parametrize("xdist", [False, True], ids=["plain", "xdist"])
def test_rank_warnings_reach_the_parent_summary_once(pytester, xdist):
    pytester.makepyfile(test_warn=WARNING_TESTS)
    args = ["-p", "no:cacheprovider", "--mfsdp-platform=cpu"] + (["-n", "2"] if xdist else [])
    result = pytester.runpytest_subprocess(*args, timeout=240)
    result.assert_outcomes(passed=3, warnings=2)  # one per warning, not one per rank
    summary = _summary(result.stdout.str())
    assert summary.count("TooFewStepsWarning: same on every rank") == 1, summary
    assert summary.count("UserWarning: only rank 1 says this") == 1, summary
    assert "test_warn.py::test_warns_on_every_rank" in summary
    assert "test_warn.py::test_warns_on_rank1_only" in summary
    assert "test_quiet" not in summary


def test_error_filter_and_disabled_warnings_plugin_behave_as_for_local_tests(pytester):
    pytester.makepyfile(test_warn=WARNING_TESTS)
    base = ["-p", "no:cacheprovider", "--mfsdp-platform=cpu"]
    # -W error: the ranks raise the warning, so the tests that warn fail
    result = pytester.runpytest_subprocess(*base, "-W", "error::UserWarning", timeout=240)
    result.assert_outcomes(passed=1, failed=2)
    assert "TooFewStepsWarning: same on every rank" in result.stdout.str()
    # -p no:warnings: pytest records no warning, from the ranks neither
    result = pytester.runpytest_subprocess(*base, "-p", "no:warnings", timeout=240)
    result.assert_outcomes(passed=3)
    assert "warnings summary" not in result.stdout.str()


def test_torchrun_mode_summary_is_rank0s_as_before(pytester, torchrun_pytest):
    pytester.makepyfile(test_warn=WARNING_TESTS)
    result = pytester.run(
        *torchrun_pytest(),
        "-p",
        "no:cacheprovider",
        "--mfsdp-platform=cpu",
        timeout=180,
    )
    text = result.stdout.str()
    assert result.ret == 0, text
    summary = _summary(text)
    assert summary.count("TooFewStepsWarning: same on every rank") == 1, summary
    assert "only rank 1 says this" not in summary  # rank 0 prints its own warnings only
    assert "3 passed, 1 warning" in text


def test_merge_counts_a_warning_raised_alike_on_every_rank_once():
    def one(message, lineno=3):
        return {
            "module": "builtins",
            "category": "UserWarning",
            "message": message,
            "filename": "t.py",
            "lineno": lineno,
        }

    merged = warnings_relay.merge(
        {0: [one("a"), one("b"), one("b")], 1: [one("a"), one("c")], 2: [one("b"), one("a", lineno=4)]}
    )
    assert [(d["message"], d["lineno"]) for d in merged] == [("a", 3), ("b", 3), ("b", 3), ("c", 3), ("a", 4)]


def test_a_category_the_parent_cannot_import_keeps_its_name_in_the_message():
    data = {
        "module": "nowhere_to_be_found",
        "category": "OddWarning",
        "message": "m",
        "filename": "f.py",
        "lineno": 1,
    }
    message = warnings_relay.warning_message(data)
    assert message.category is warnings_relay.RankWarning
    assert str(message.message) == "OddWarning: m"
    known = warnings_relay.warning_message({**data, "module": "builtins", "category": "DeprecationWarning"})
    assert known.category is DeprecationWarning and isinstance(known.message, DeprecationWarning)


def test_capture_hands_the_warnings_back_to_the_enclosing_recorder():
    with warnings.catch_warnings(record=True) as outer:
        warnings.simplefilter("default")
        with warnings_relay.capture() as inner:
            warnings.warn("once here", UserWarning, stacklevel=1)
    assert [str(m.message) for m in inner] == ["once here"]
    assert [str(m.message) for m in outer] == ["once here"]


def test_the_plugins_own_config_warning_reaches_the_parent_summary_once(pytester):
    pytester.makepyfile(
        test_config_warning="""
import pytest

@pytest.mark.distributed(world_size=2, timeout=120)
def test_average_in_collective(megatron_fsdp_run, run_config):
    run_config.ddp.average_in_collective = True  # Megatron-FSDP switches it off, with a ConfigWarning
    megatron_fsdp_run(run_config).train(1)
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--mfsdp-platform=cpu", timeout=240)
    result.assert_outcomes(passed=1)
    summary = _summary(result.stdout.str())
    line = "ConfigWarning: ddp.average_in_collective=True is not supported with Megatron-FSDP"
    assert summary.count(line) == 1, summary
