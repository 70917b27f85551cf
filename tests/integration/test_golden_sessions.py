"""Golden values in a real 2-rank session: recorded, compared, and a changed loss fails; compare mode
without its directory is one usage line."""

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
    pytester.makepyfile(test_golden_runs=TRAINS)
    args = ("-p", "no:cacheprovider", "--mfsdp-platform=cpu", "--mfsdp-golden=golden")
    recorded = pytester.runpytest_subprocess(*args, "--mfsdp-golden-mode=record", timeout=600)
    recorded.assert_outcomes(passed=2)
    files = sorted((pytester.path / "golden").rglob("*.json"))
    assert [f.name for f in files] == ["test_golden_runs.py__test_trains.json"]  # no file: no runs
    assert files[0].parent.name == "cpu"
    document = json.loads(files[0].read_text())
    assert sorted(document) == sorted(golden.METRICS)
    for metric in golden.METRICS:
        assert list(document[metric]["values"]) == ["1", "2", "3"]
    assert all(v > 2**20 for v in document["mem-allocated-bytes"]["values"].values())

    pytester.runpytest_subprocess(*args, timeout=600).assert_outcomes(passed=2)  # compare: the default

    loss = document["lm loss"]["values"]["2"]
    document["lm loss"]["values"]["2"] = math.nextafter(loss, math.inf)
    files[0].write_text(json.dumps(document))
    changed = pytester.runpytest_subprocess(*args, timeout=600)
    changed.assert_outcomes(passed=1, failed=1)
    changed.stdout.fnmatch_lines(
        [
            f"golden values differ from {files[0]} (exact on CPU ranks*",
            f"lm loss step 2: expected {math.nextafter(loss, math.inf)!r}, actual {loss!r} (exact)",
        ]
    )
