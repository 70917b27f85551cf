"""The CPU probe in real sessions: a torchrun session's header shows the CPU, its measured speeds
and the bf16 sizing with its source, every rank holds rank 0's report and ``run_config`` takes its
sizing; a plain session's parent header names the flags and the sizing, its rank log the speeds.
"""

from __future__ import annotations

import re

#: the ranks' CPU report, checked in the ranks: the sizing forced (``{verdict}`` from ``{source}``),
#: rank 1's report equal to rank 0's, and run_config sized by it
RANK_SIDE = """
import pytest
import torch.distributed as dist
from pytest_megatron_fsdp.rank.session import RANK_SESSION

@pytest.mark.distributed(world_size=2)
def test_every_rank_holds_rank_0s_report(request, dist_env):
    report = request.config.stash[RANK_SESSION].cpu
    assert report is not None
    assert report.speed is not None
    assert (report.verdict.name, report.verdict.source) == ("{verdict}", "{source}")
    reports = [None] * dist_env.world_size
    dist.all_gather_object(reports, report.to_json())
    assert reports[0] == reports[1]

@pytest.mark.distributed(world_size=2)
def test_run_config_takes_the_sizing(run_config):
    assert run_config.train.slow_bf16_step is ("{verdict}" == "slow-bf16")
"""

#: the measured figures and the sizing at the end of a rank's header line
SPEEDS = re.compile(
    r"^megatron-fsdp: platform=cpu .*; cpu: .+, torch \w+, fp32 [0-9.]+ GFLOP/s, bf16 [0-9.]+ GFLOP/s; "
    r"bf16 steps sized for (\S+) \((.+)\)$",
    re.MULTILINE,
)


def test_a_torchrun_sessions_header_shows_the_measured_speeds_and_the_forced_sizing(inner_session):
    session = inner_session(
        {"test_probe.py": RANK_SIDE.format(verdict="native-bf16", source="MFSDP_CPU_SPEED")},
        "-rA",
        torchrun=True,
        env={"MFSDP_CPU_SPEED": "native-bf16"},
    )
    assert session.result.ret == 0, session.out
    session.result.assert_outcomes(passed=2)
    headers = SPEEDS.findall(session.out)
    assert headers == [("native-bf16", "MFSDP_CPU_SPEED")], session.out  # rank 0's line, once


def test_a_plain_sessions_parent_names_the_sizing_and_its_rank_log_the_speeds(inner_session):
    session = inner_session(
        {"test_probe.py": RANK_SIDE.format(verdict="slow-bf16", source="--mfsdp-cpu-speed")},
        "-rA",
        "--mfsdp-log-dir=logs",
        "--mfsdp-cpu-speed=slow-bf16",
    )
    assert session.result.ret == 0, session.out
    session.result.assert_outcomes(passed=2)
    parent = [
        line for line in session.out.splitlines() if line.startswith("megatron-fsdp: distributed tests")
    ]
    assert len(parent) == 1, session.out
    assert parent[0].endswith(
        "; bf16 steps sized for slow-bf16 (--mfsdp-cpu-speed) (speeds: the rank logs' header)"
    ), parent[0]
    (rank0,) = session.logs.rglob("rank0.log")
    assert SPEEDS.findall(rank0.read_text()) == [("slow-bf16", "--mfsdp-cpu-speed")], rank0.read_text()
