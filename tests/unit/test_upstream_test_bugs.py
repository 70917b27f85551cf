"""Megatron-LM tests written for 8 ranks are strict xfails where their own bug shows, ordinary tests
elsewhere; a bug that shows on some ranks only makes the whole distributed test an xfail."""

from __future__ import annotations

from pytest_megatron_fsdp.foreign import upstream_test_bugs
from pytest_megatron_fsdp.fsdp.versions import UPSTREAM_TEST_BUGS
from pytest_megatron_fsdp.rank.agreement import expected_failure

SWIGLU = (
    "tests/unit_tests/distributed/test_torch_fully_sharded_parallel.py::"
    "test_fsdp2_swiglu_sharded_tensor_factory"
)
FP32 = (
    "tests/unit_tests/distributed/test_reduce_scatter_with_fp32_accumulation.py::"
    "TestReduceScatterWithFP32Accumulation::test_reduce_scatter_with_fp32_accumulation"
)


def _names(nodeid: str, world_size: int) -> list[str]:
    return [name for name, _ in upstream_test_bugs.known_bugs_of(nodeid, world_size)]


def test_each_entry_marks_its_test_where_the_bug_shows_and_nowhere_else():
    assert _names(SWIGLU, 4) == ["swiglu_factory_offsets_for_dp4"]
    assert _names(SWIGLU, 8) == []  # the world size it was written for: an ordinary test
    assert _names(f"{FP32}[False-True]", 2) == ["fp32_accumulation_needs_six_ranks"]
    assert _names(f"{FP32}[True-True]", 2) == []  # the fp32 baseline's cases have no bug
    assert _names(f"{FP32}[False-True]", 8) == []
    replicated = "tests/unit_tests/distributed/test_grad_reduce_for_replicated_embedder.py::test_x"
    assert (_names(replicated, 2), _names(replicated, 4)) == (["replicated_embedder_needs_pp4"], [])
    assert (
        _names("tests/unit_tests/distributed/test_other.py::test_fsdp2_swiglu_sharded_tensor_factory", 4)
        == []
    )


def test_the_reason_names_the_entry_the_world_size_and_the_bug():
    entry = UPSTREAM_TEST_BUGS["replicated_embedder_needs_pp4"]
    line = upstream_test_bugs.reason("replicated_embedder_needs_pp4", entry, 2)
    assert line.startswith(
        "upstream test bug replicated_embedder_needs_pp4 at world size 2: "
        "it initialises pipeline parallel size 4"
    )


def _phase(outcome: str, text: str = "", xfailed: str | None = None) -> dict[str, object]:
    data: dict[str, object] = {"outcome": outcome, "duration": 0.1, "sections": [], "text": text}
    if xfailed is not None:
        data["xfailed"] = xfailed
    return data


def test_a_strict_xfail_failing_on_some_ranks_and_passing_on_the_others_failed_as_expected():
    xpass = "[XPASS(strict)] upstream test bug x"
    phase = {
        0: _phase("failed", xpass),
        1: _phase("skipped", "AssertionError: 2 == 4", xfailed="upstream test bug x"),
        2: _phase("skipped", "AssertionError: 4 == 2", xfailed="upstream test bug x"),
        3: _phase("failed", xpass),
    }
    reason, text = expected_failure(phase) or ("", "")
    assert reason == "upstream test bug x (failed as expected on ranks 1, 2, passed on 0, 3)"
    assert text == "AssertionError: 2 == 4"
    assert expected_failure({r: _phase("skipped", "E", xfailed="bug") for r in (0, 1)}) == ("bug", "E")


def test_a_collective_failing_beside_it_echoes_the_expected_failure():
    # ranks 1 and 2 failed as expected outside the collective rank 0 waited in; their release of
    # the group the test made ended rank 0's wait
    closed = "RuntimeError: Connection closed by peer"
    phase = {
        0: {**_phase("failed", closed), "in_a_collective": True},
        1: _phase("skipped", "AssertionError: nan", xfailed="bug"),
        2: _phase("skipped", "AssertionError: nan", xfailed="bug"),
    }
    assert expected_failure(phase) == (
        "bug (failed as expected on ranks 1, 2, failed in a collective they never entered on 0)",
        "AssertionError: nan",
    )
    # not without the ranks that failed as expected, nor beside a failure outside a collective
    assert expected_failure({0: phase[0], 1: _phase("passed")}) is None
    assert expected_failure({**phase, 3: _phase("failed", "ValueError: boom")}) is None


def test_any_other_failure_beside_it_is_a_failure():
    phase = {0: _phase("failed", "ValueError: boom"), 1: _phase("skipped", "E", xfailed="bug")}
    assert expected_failure(phase) is None
    assert expected_failure({0: _phase("failed", "[XPASS(strict)] bug"), 1: _phase("passed")}) is None
