"""An error in the plugin's own code around a test (a bug of the plugin), under torchrun: pytest would
end the session as an INTERNALERROR, with that test's result and every later one's lost. The test fails
with the traceback, each later test is named not run, and every rank ends within the bound."""

from __future__ import annotations

import xml.etree.ElementTree as ET

TESTS = """
import torch
import torch.distributed as dist
import pytest

from pytest_megatron_fsdp.rank.session import RANK_SESSION


@pytest.mark.distributed(world_size=2)
def test_1_passes(dist_env):
    dist.all_reduce(torch.ones(2))


@pytest.mark.distributed(world_size=2)
def test_2_the_plugin_fails_after_it(dist_env, request):
    # the plugin's own after-agreement step raises on rank 0, as a bug of the plugin would
    def fails():
        raise RuntimeError("a bug of the plugin, injected")

    if dist_env.rank == 0:
        request.config.stash[RANK_SESSION].after_agreement(fails)
    dist.all_reduce(torch.ones(2))


@pytest.mark.distributed(world_size=2)
def test_3_not_run(dist_env):
    dist.all_reduce(torch.ones(2))
"""


def test_a_harness_error_fails_the_test_and_names_every_later_one(inner_session):
    session = inner_session(
        {"test_harness_error.py": TESTS},
        "--mfsdp-timeout=60",
        "--mfsdp-log-dir=logs",
        "--junitxml=junit.xml",
        "-p",
        "no:randomly",
        torchrun=True,
        timeout=200,
    )
    out = session.out
    assert "INTERNALERROR" not in out, out
    assert session.result.ret == 1, out
    names = [case.get("name") for case in session.junit.iter("testcase")]
    assert names == ["test_1_passes", "test_2_the_plugin_fails_after_it", "test_3_not_run"], names
    failed = ET.tostring(session.junit_case("test_2_the_plugin_fails_after_it"), encoding="unicode")
    assert "megatron-fsdp's own code failed on rank 0 around" in failed, failed
    assert "RuntimeError: a bug of the plugin, injected" in failed, failed
    not_run = ET.tostring(session.junit_case("test_3_not_run"), encoding="unicode")
    assert "not run: megatron-fsdp's own code failed on rank 0 around" in not_run, not_run
    assert session.leftovers == [], session.leftovers
