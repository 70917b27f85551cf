"""Golden values in real 2-rank sessions: recorded, compared, and a changed loss fails (compare mode
without its directory: tests/unit/test_golden.py)."""

from __future__ import annotations

import json
import math

from pytest_megatron_fsdp.reporting import golden

TRAINS = """
import pytest

pytestmark = pytest.mark.distributed(world_size=2)


def test_trains(megatron_fsdp_run, run_config):
    run_config.train.train_iters = 3
    megatron_fsdp_run(run_config).train()


def test_trains_nothing(dist_env):
    assert dist_env.world_size == 2
"""


def test_a_session_records_compares_and_fails_on_a_changed_loss(pytester, isolated_tmp):
    """Two sessions: one records two files' runs; one compares them after one file's golden loss was
    moved by one ulp: that file's test fails naming metric, step and values, the other's passes."""
    pytester.makepyfile(test_golden_runs=TRAINS, test_golden_changed=TRAINS)
    args = ("-p", "no:cacheprovider", "--mfsdp-platform=cpu", "--mfsdp-golden=golden", "-rA")
    recorded = pytester.runpytest_subprocess(*args, "--mfsdp-golden-mode=record", timeout=600)
    recorded.assert_outcomes(passed=4)
    files = sorted((pytester.path / "golden").rglob("*.json"))
    assert [f.name for f in files] == [  # no file: no runs
        "test_golden_changed.py__test_trains.json",
        "test_golden_runs.py__test_trains.json",
    ]
    assert {f.parent.name for f in files} == {"cpu"}
    for file in files:
        document = json.loads(file.read_text())
        assert sorted(document) == sorted(golden.METRICS)
        for metric in golden.METRICS:
            assert list(document[metric]["values"]) == ["1", "2", "3"]
        assert all(v > 2**20 for v in document["mem-allocated-bytes"]["values"].values())

    changed_file = files[0]
    document = json.loads(changed_file.read_text())
    loss = document["lm loss"]["values"]["2"]
    document["lm loss"]["values"]["2"] = math.nextafter(loss, math.inf)
    changed_file.write_text(json.dumps(document))
    compared = pytester.runpytest_subprocess(*args, timeout=600)  # compare: the default mode
    compared.assert_outcomes(passed=3, failed=1)
    compared.stdout.fnmatch_lines(
        [
            f"golden values differ from {changed_file} (exact on CPU ranks*",
            f"lm loss step 2: expected {math.nextafter(loss, math.inf)!r}, actual {loss!r} (exact)",
        ]
    )
    compared.stdout.fnmatch_lines(
        ["PASSED test_golden_runs.py::test_trains*"]
    )  # unchanged: the same runs match
    compared.stdout.fnmatch_lines(["FAILED test_golden_changed.py::test_trains*"])
