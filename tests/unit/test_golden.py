"""Golden values (``reporting.golden``, ``--mfsdp-golden``): the compare rules in process (the
real 2-rank session that records, compares and fails on a changed loss is
tests/integration/test_golden_sessions.py).

The rules are Megatron-LM's (tests/functional_tests/python_test_utils/common.py): exact on CPU
ranks for lm loss and num-zeros, ``np.isclose(rtol, atol=0)`` on GPUs with up to
``min(max(N // 100, 1), 50)`` failing steps, iteration time on the median of steps 5-20.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pytest_megatron_fsdp.reporting import golden
from pytest_megatron_fsdp.reporting.record import RunRecord


def _record(steps: int = 10, loss: float = 4.0, first_iteration: int = 1, **changes) -> RunRecord:
    fields = dict(
        nodeid="tests/test_x.py::test_y",
        platform="cpu",
        preset="tiny",
        strategy="optim_grads_params",
        iterations=steps,
        first_loss=loss,
        last_loss=loss,
        ms_per_step=50.0,
        losses=[loss - 0.01 * i for i in range(steps)],
        grad_norms=[1.0] * steps,
        step_times_s=[0.05] * steps,
        num_zeros=[float(i % 3) for i in range(steps)],
        memory_bytes=[2**30 + 4096 * i for i in range(steps)],
        first_iteration=first_iteration,
    )
    fields.update(changes)
    return RunRecord(**fields)


def _metric(values: dict[int, float], start: int | None = None) -> dict:
    steps = sorted(values)
    return {
        "start_step": steps[0] if start is None else start,
        "end_step": steps[-1],
        "step_interval": 1,
        "values": {str(s): v for s, v in values.items()},
    }


def _doc(steps: int, metric: str = "lm loss", value: float = 1.0) -> dict:
    """Every metric present (constant series); ``metric``'s values are ``value``."""
    doc = {m: _metric({s: 1.0 for s in range(1, steps + 1)}) for m in golden.METRICS}
    doc[metric] = _metric({s: value for s in range(1, steps + 1)})
    return doc


# -- the file -----------------------------------------------------------------------------------------


def test_a_record_becomes_megatron_lms_format():
    doc = golden.golden_values([_record(steps=3, first_iteration=4)])
    assert list(doc) == ["lm loss", "num-zeros", "mem-allocated-bytes", "iteration-time"]
    assert doc["lm loss"] == {
        "start_step": 4,
        "end_step": 6,
        "step_interval": 1,
        "values": {"4": 4.0, "5": 3.99, "6": 3.98},
    }
    assert doc["mem-allocated-bytes"]["values"]["6"] == float(2**30 + 8192)
    assert golden.check(json.loads(golden.dumps(doc))) == doc  # strict JSON, read back unchanged


def test_later_runs_get_numbered_metrics_and_non_finite_values_strings():
    doc = golden.golden_values([_record(steps=2), _record(steps=2, losses=[math.nan, math.inf])])
    assert doc["run2/lm loss"]["values"] == {"1": "nan", "2": "inf"}
    assert "run2/num-zeros" in doc
    assert "run3/lm loss" not in doc
    json.loads(golden.dumps(doc))  # allow_nan=False would have raised


def test_file_names_come_from_the_node_id():
    assert golden.file_name("tests/functional/test_x.py::TestA::test_b[optim-2]") == (
        "tests_functional_test_x.py__TestA__test_b_optim-2_.json"
    )
    long = "tests/t.py::test_" + "x" * 300
    other = "tests/t.py::test_" + "x" * 299 + "y"
    assert len(golden.file_name(long)) < 150
    assert golden.file_name(long) != golden.file_name(other)  # the hash keeps cut names apart


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ([], "expected an object of metrics"),
        ({"lm loss": {"start_step": 1, "end_step": 1, "step_interval": 1}}, "'lm loss' has no 'values'"),
        ({"lm loss": _metric({1: 1.0}) | {"values": {}}}, "'values' must be a non-empty object"),
        ({"lm loss": _metric({1: 1.0}) | {"values": {"one": 1.0}}}, "step 'one' is not a whole number"),
        ({"lm loss": _metric({1: 1.0}) | {"values": {"1": [1.0]}}}, "step 1: [1.0] is not a number"),
    ],
)
def test_a_malformed_golden_file_is_named_with_its_field(tmp_path, document, message):
    path = tmp_path / "g.json"
    path.write_text(json.dumps(document))
    with pytest.raises(golden.GoldenFileError) as raised:
        golden.load(path)
    assert str(raised.value).startswith(f"{path}: ")
    assert message in str(raised.value)


# -- exact (CPU ranks) --------------------------------------------------------------------------------


def test_the_same_runs_match():
    doc = golden.golden_values([_record(), _record(loss=3.0)])
    assert golden.compare(doc, golden.golden_values([_record(), _record(loss=3.0)]), exact=True) == []
    assert golden.compare(doc, doc, exact=False) == []


def test_a_changed_loss_fails_with_one_line_naming_metric_step_expected_and_actual():
    expected = golden.golden_values([_record()])
    changed = _record(losses=[*_record().losses[:6], math.nextafter(3.94, 0), *_record().losses[7:]])
    assert golden.compare(expected, golden.golden_values([changed]), exact=True) == [
        f"lm loss step 7: expected 3.94, actual {math.nextafter(3.94, 0)!r} (exact)"
    ]


def test_exact_compares_num_zeros_and_lists_every_step_that_differs():
    expected = golden.golden_values([_record(steps=4)])
    actual = golden.golden_values([_record(steps=4, num_zeros=[0.0, 1.0, 5.0, 6.0])])
    assert golden.compare(expected, actual, exact=True) == [
        "num-zeros step 3: expected 2.0, actual 5.0 (exact)",
        "num-zeros step 4: expected 0.0, actual 6.0 (exact)",
    ]


def test_exact_leaves_time_and_memory_alone_but_approximate_compares_them():
    expected = golden.golden_values([_record()])
    actual = golden.golden_values([_record(step_times_s=[0.5] * 10, memory_bytes=[2**31] * 10)])
    assert golden.compare(expected, actual, exact=True) == []
    failures = golden.compare(expected, actual, exact=False)
    assert any(f.startswith("mem-allocated-bytes step ") for f in failures)
    assert [f for f in failures if f.startswith("iteration-time")] == [
        "iteration-time median of steps 5-10: expected 0.05, actual 0.5 (rtol 0.05)"
    ]


@pytest.mark.parametrize("side", ["golden", "run"])
@pytest.mark.parametrize("metric", golden.METRICS)
def test_a_missing_metric_is_an_error_in_both_modes(metric, side):
    full = golden.golden_values([_record()])
    partial = {k: v for k, v in full.items() if k != metric}
    expected, actual = (partial, full) if side == "golden" else (full, partial)
    message = (
        f"{metric}: not in the golden file (the run has it; record it again)"
        if side == "golden"
        else f"{metric}: missing from the run (the golden file has it)"
    )
    for exact in (True, False):
        assert golden.compare(expected, actual, exact=exact) == [message]


def test_a_run_that_measured_nothing_of_a_metric_leaves_it_out_and_fails():
    doc = golden.golden_values([_record(num_zeros=[])])
    assert "num-zeros" not in doc
    assert golden.compare(golden.golden_values([_record()]), doc, exact=True) == [
        "num-zeros: missing from the run (the golden file has it)"
    ]


def test_a_missing_later_run_and_missing_or_extra_steps_are_errors():
    two_runs = golden.golden_values([_record(steps=3), _record(steps=3)])
    one_run = golden.golden_values([_record(steps=3)])
    failures = golden.compare(two_runs, one_run, exact=True)
    assert failures == [f"run2/{m}: missing from the run (the golden file has it)" for m in golden.METRICS]
    shorter = golden.golden_values([_record(steps=2)])
    assert golden.compare(one_run, shorter, exact=True) == [
        "lm loss step 3: expected 3.98, actual missing (exact)",
        "num-zeros step 3: expected 2.0, actual missing (exact)",
    ]
    longer = golden.golden_values([_record(steps=5)])
    assert golden.compare(one_run, longer, exact=True) == [
        "lm loss steps 4-5: expected none (the golden file has steps 1-3), actual 2 more",
        "num-zeros steps 4-5: expected none (the golden file has steps 1-3), actual 2 more",
    ]


def test_non_finite_values_compare_as_megatron_lm_does():
    nan_run = golden.golden_values([_record(steps=2, losses=[1.0, math.nan])])
    assert golden.compare(nan_run, nan_run, exact=True) == []  # "nan" strings: inf == inf
    finite = golden.golden_values([_record(steps=2, losses=[1.0, 2.0])])
    assert golden.compare(nan_run, finite, exact=True) == [
        "lm loss step 2: expected 'nan', actual 2.0 (exact)"
    ]


# -- approximate (GPUs) -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metric", "rtol"), [("lm loss", 0.05), ("num-zeros", 0.20), ("mem-allocated-bytes", 0.05)]
)
def test_approximate_tolerances_are_megatron_lms(metric, rtol):
    # every step off (N=10: one failing step allowed), just inside and just outside rtol
    golden_doc = _doc(10, metric, 100.0)
    inside = _doc(10, metric, 100.0 * (1 + rtol * 0.99))
    outside = _doc(10, metric, 100.0 * (1 + rtol * 1.01))
    assert golden.compare(golden_doc, inside, exact=False) == []
    failures = golden.compare(golden_doc, outside, exact=False)
    assert len(failures) == 10
    assert failures[0] == (
        f"{metric} step 1: expected 100.0, actual {100.0 * (1 + rtol * 1.01)!r} "
        f"(rtol {rtol:g}; 10 of 10 steps off, 1 allowed)"
    )


@pytest.mark.parametrize(
    ("steps", "allowed"), [(1, 1), (99, 1), (100, 1), (199, 1), (200, 2), (4999, 49), (5000, 50), (9000, 50)]
)
def test_allowed_failing_steps(steps, allowed):
    assert golden.allowed_failing_steps(steps) == allowed


@pytest.mark.parametrize(("steps", "allowed"), [(50, 1), (200, 2), (5100, 50)])
def test_the_allowed_failing_steps_rule_at_its_edge(steps, allowed):
    expected = _doc(steps, "lm loss", 2.0)

    def off(count: int) -> dict:
        doc = _doc(steps, "lm loss", 2.0)
        for step in range(1, count + 1):
            doc["lm loss"]["values"][str(step)] = 3.0
        return doc

    assert golden.compare(expected, off(allowed), exact=False) == []
    failures = golden.compare(expected, off(allowed + 1), exact=False)
    assert len(failures) == allowed + 1  # one line per failing step
    assert failures[-1] == (
        f"lm loss step {allowed + 1}: expected 2.0, actual 3.0 "
        f"(rtol 0.05; {allowed + 1} of {steps} steps off, {allowed} allowed)"
    )
    # exact: no allowance at all
    assert len(golden.compare(expected, off(1), exact=True)) == 1


def test_iteration_time_compares_the_medians_of_the_steady_window():
    times = {s: 1.0 for s in range(1, 31)}
    golden_doc = _doc(20) | {"iteration-time": _metric({s: 1.0 for s in range(1, 21)})}
    # outside steps 5-20 anything goes; inside, 7 of 16 steps far off leave the median alone
    noisy = dict(times) | {1: 50.0, 2: 9.0} | {s: 100.0 for s in range(5, 12)}
    actual = _doc(20) | {"iteration-time": _metric({s: noisy[s] for s in range(1, 21)})}
    assert golden.compare(golden_doc, actual, exact=False) == []
    slow = _doc(20) | {"iteration-time": _metric({s: 1.06 for s in range(1, 21)})}
    assert golden.compare(golden_doc, slow, exact=False) == [
        "iteration-time median of steps 5-20: expected 1.0, actual 1.06 (rtol 0.05)"
    ]


@pytest.mark.parametrize(
    ("golden_steps", "chosen"),
    [
        (range(1, 21), list(range(5, 21))),
        (range(1, 51), list(range(30, 46))),  # longer than 25 steps: 30-45
        (range(1, 5), [2, 3, 4]),  # shorter than 5 steps: all but the warm-up step
        (range(1, 2), [1]),
        (range(10, 40, 10), [30]),  # a long run sampled every 10 steps: its steps in 30-45
        (range(50, 100, 10), [50, 60, 70, 80]),  # none in 30-45: the first 4 steps after it
        (range(26, 29), [27, 28]),  # none from 30 on: all but the first step
    ],
)
def test_the_steps_of_the_iteration_time_median(golden_steps, chosen):
    assert golden.median_steps({s: 1.0 for s in golden_steps}) == chosen


# -- record_or_compare: the files --------------------------------------------------------------------


def test_record_then_compare_through_the_files(tmp_path):
    records = [_record(), _record(loss=3.0, strategy="ddp")]
    assert golden.record_or_compare(tmp_path, "newest", records[0].nodeid, records, "record") == []
    path = tmp_path / "newest" / "cpu" / "tests_test_x.py__test_y.json"
    assert path.is_file()
    assert golden.record_or_compare(tmp_path, "newest", records[0].nodeid, records, "compare") == []
    changed = [records[0], _record(loss=3.5)]
    failures = golden.record_or_compare(tmp_path, "newest", records[0].nodeid, changed, "compare")
    assert failures[0] == (
        f"golden values differ from {path} (exact on CPU ranks: lm loss, num-zeros; iteration-time and "
        "mem-allocated-bytes not compared):"
    )
    assert failures[1] == "run2/lm loss step 1: expected 3.0, actual 3.5 (exact)"
    assert len(failures) == 11  # heading + the run's 10 steps


def test_compare_without_a_file_or_without_runs(tmp_path):
    records = [_record()]
    failures = golden.record_or_compare(tmp_path, "floor", "t.py::t", records, "compare")
    assert failures == [
        f"golden values: no file for this test: {tmp_path / 'floor' / 'cpu' / 't.py__t.json'} (record it "
        "with --mfsdp-golden-mode=record, or make golden)"
    ]
    assert golden.record_or_compare(tmp_path, "floor", "t.py::t", [], "compare") == []  # trains nothing
    golden.record_or_compare(tmp_path, "floor", "t.py::t", records, "record")
    assert golden.record_or_compare(tmp_path, "floor", "t.py::t", [], "compare") == [
        f"golden values: {tmp_path / 'floor' / 'cpu' / 't.py__t.json'} holds this test's runs, but it "
        "recorded none this time"
    ]


def test_only_the_writing_rank_records_and_gpu_runs_go_to_their_own_directory(tmp_path):
    golden.record_or_compare(tmp_path, "s", "t.py::t", [_record()], "record", write=False)
    assert not any(tmp_path.rglob("*.json"))
    golden.record_or_compare(tmp_path, "s", "t.py::t", [_record(platform="cuda")], "record")
    assert [p.relative_to(tmp_path) for p in tmp_path.rglob("*.json")] == [Path("s/cuda/t.py__t.json")]


# -- the plugin's options, in a session run in process (the real 2-rank session that records and
# compares: tests/integration/test_golden_sessions.py) -----------------------------------------------

#: a distributed test file for the session to collect (it never runs: the session stops before)
DISTRIBUTED = """
import pytest

@pytest.mark.distributed(world_size=2)
def test_trains(megatron_fsdp_run, run_config):
    megatron_fsdp_run(run_config).train()
"""


@pytest.mark.parametrize(
    ("how", "source"),
    [("flag", "--mfsdp-golden=nowhere"), ("env", "environment variable MFSDP_GOLDEN=nowhere")],
)
def test_compare_mode_without_the_directory_is_one_usage_line(
    pytester, isolated_tmp, monkeypatch, how, source
):
    pytester.makepyfile(test_golden_runs=DISTRIBUTED)
    args = ["-p", "no:cacheprovider"]
    if how == "flag":
        args.append("--mfsdp-golden=nowhere")
    else:
        monkeypatch.setenv("MFSDP_GOLDEN", "nowhere")
    result = pytester.runpytest_inprocess(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{source}: no such directory; record golden values first*"])
    assert "Traceback" not in result.stderr.str()
    # record mode makes the directory: no refusal (nothing trains here: --co)
    result = pytester.runpytest_inprocess(*args, "--mfsdp-golden-mode=record", "--co", "-q")
    assert result.ret == pytest.ExitCode.OK
