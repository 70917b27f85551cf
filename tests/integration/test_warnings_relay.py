"""Warnings raised in the ranks reach the plain-mode parent's warnings summary, once."""

import pytest

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
