"""Megatron's model-parallel state across the tests of one rank set: kept while sizes match,
replaced when they change, forgotten when a failed test renews the process group.

Building the state makes 17 process groups; a gloo group holds sockets and threads that the
models built on it keep alive after their test, so a state rebuilt per test made a rank's file
descriptors and threads grow by ~70 and ~50 per test.
"""

import json

TESTS = """
import json
import os

import pytest

from pytest_megatron_fsdp.fsdp import versions

two_ranks = pytest.mark.distributed(world_size=2)


@pytest.fixture
def snapshot(request, dist_env):
    yield
    if dist_env.rank == 0:  # after the test and its fixtures: what the next test inherits
        with open("usage.jsonl", "a") as f:
            f.write(json.dumps({
                "test": request.node.name,
                "fds": len(os.listdir("/proc/self/fd")),
                "threads": len(os.listdir("/proc/self/task")),
                "groups": len(versions.live_process_groups()),
            }) + "\\n")


@two_ranks
@pytest.mark.parametrize("i", range(4))
def test_trains(snapshot, megatron_fsdp_run, run_config, i):
    megatron_fsdp_run(run_config).train(2)


@pytest.mark.distributed(world_size=2, tp=2)
def test_other_sizes(snapshot, megatron_parallel):
    from megatron.core import parallel_state

    assert parallel_state.get_tensor_model_parallel_world_size() == 2


@two_ranks
def test_fails_on_rank1_after_training(snapshot, megatron_fsdp_run, run_config, dist_env):
    megatron_fsdp_run(run_config).train(1)
    assert dist_env.rank == 0


@two_ranks
def test_trains_after_the_group_was_renewed(snapshot, megatron_fsdp_run, run_config):
    result = megatron_fsdp_run(run_config).train(2)
    assert result.losses[-1] < result.losses[0]
"""


def test_state_is_reused_replaced_and_renewed_without_growth(pytester):
    pytester.makepyfile(test_state=TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--mfsdp-platform=cpu", timeout=300)
    result.assert_outcomes(passed=6, failed=1)
    result.stdout.fnmatch_lines(
        ["*_ test_fails_on_rank1_after_training _*", "failed on rank 1 (passed on 0)"]
    )
    usage = {u["test"]: u for u in map(json.loads, (pytester.path / "usage.jsonl").read_text().splitlines())}
    first = usage["test_trains[0]"]
    # Same sizes: the first test's state serves the next three; nothing grows.
    for i in (1, 2, 3):
        assert usage[f"test_trains[{i}]"]["groups"] == first["groups"], usage
        assert usage[f"test_trains[{i}]"]["fds"] <= first["fds"] + 2, usage
        assert usage[f"test_trains[{i}]"]["threads"] <= first["threads"] + 2, usage
    # tp=2 replaces the state: the old groups are destroyed, not kept beside the new ones.
    assert usage["test_other_sizes"]["groups"] <= first["groups"], usage
    # After the failure renewed the default group, Megatron's state was rebuilt on the new one
    # (the test trains, rather than failing on destroyed groups), and torch's registry holds one
    # state's groups, not three. (Each rebuild still costs the old groups' sockets and threads:
    # the models built on them are never freed, see README "Known upstream issues".)
    last = usage["test_trains_after_the_group_was_renewed"]
    assert last["groups"] == first["groups"], usage
