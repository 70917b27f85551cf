"""Test files the integration tests run in their pytest sessions, where more than one test module
runs the same scenario."""

#: rank 1 never enters the broadcast rank 0 waits in (after one all_reduce both completed): the
#: flight recorder's records then name the missing rank and the collective (test_faults.py reads
#: the timeout report, test_postmortem_real_dumps.py the dumps)
RANK1_SKIPS_THE_BROADCAST = """
import time
import pytest
import torch
import torch.distributed as dist

@pytest.mark.distributed(world_size=2, timeout=6)
def test_rank1_skips_the_broadcast(dist_env):
    dist.all_reduce(torch.ones(2))
    if dist_env.rank == 1:
        time.sleep(3600)
    dist.broadcast(torch.ones(3), src=0)
"""
