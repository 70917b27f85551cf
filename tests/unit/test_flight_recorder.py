"""Aligning the c10d flight recorder's records across ranks: who is missing from which collective."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

from pytest_megatron_fsdp.harness import flight_recorder

SECOND = 1_000_000_000


def _entry(seq, op, sizes, retired, created_s, group=("0", "default_pg")):
    return {
        "collective_seq_id": seq,
        "profiling_name": f"gloo:{op}",
        "input_sizes": sizes,
        "retired": retired,
        "state": "scheduled",
        "is_p2p": False,
        "process_group": group,
        "time_created_ns": created_s * SECOND,
    }


def test_a_rank_that_never_entered_a_broadcast_is_named():
    traces = {
        0: {"entries": [_entry(1, "all_reduce", [[4]], True, 10), _entry(2, "broadcast", [[3]], False, 11)]},
        1: {"entries": [_entry(1, "all_reduce", [[4]], True, 10)]},
    }
    lines = flight_recorder.align(traces, now_ns=36 * SECOND)
    assert lines[0] == (
        "rank 0: last completed #1 (all_reduce, default_pg, sizes [[4]]); "
        "in #2 (broadcast, default_pg, sizes [[3]]) for 25.0 s"
    )
    assert lines[1] == "rank 1: last completed #1 (all_reduce, default_pg, sizes [[4]]); in no collective"
    assert (
        "rank 1 never entered collective #2 (broadcast, default_pg) that rank 0 has waited in for 25.0 s"
        in lines
    )


def test_collectives_that_differ_at_the_same_sequence_number_are_named():
    traces = {
        0: {"entries": [_entry(1, "broadcast", [[3]], False, 10)]},
        1: {"entries": [_entry(1, "all_reduce", [[4]], False, 10)]},
    }
    lines = flight_recorder.align(traces, now_ns=12 * SECOND)
    assert (
        "collective #1 in default_pg differs across ranks: rank 0 broadcast [[3]], rank 1 all_reduce [[4]]"
        in lines
    )
    assert not any("never entered" in line for line in lines)


def test_an_entry_gone_from_the_ring_buffer_is_not_called_missing():
    # rank 1 recorded #5 and #6 only (its #4 left the buffer); rank 0 still holds #4, completed
    traces = {
        0: {"entries": [_entry(4, "all_reduce", [[4]], True, 1), _entry(5, "all_reduce", [[4]], False, 2)]},
        1: {"entries": [_entry(5, "all_reduce", [[4]], True, 2), _entry(6, "all_reduce", [[4]], False, 3)]},
    }
    lines = flight_recorder.align(traces, now_ns=4 * SECOND)
    assert not any("rank 1 never entered collective #4" in line for line in lines)
    assert (
        "rank 0 never entered collective #6 (all_reduce, default_pg) that rank 1 has waited in for 1.0 s"
        in lines
    )


def test_torch_records_are_aligned(tmp_path):
    """Two real gloo ranks: rank 0 starts a broadcast that rank 1 never joins; each dumps torch's
    record, and the alignment names rank 1 and the broadcast."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = textwrap.dedent(
        f"""
        import os, sys, time, torch, torch.distributed as dist
        from pathlib import Path
        from pytest_megatron_fsdp.harness import flight_recorder
        rank = int(sys.argv[1])
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        dist.all_reduce(torch.ones(4))
        if rank == 0:
            work = dist.broadcast(torch.ones(3), src=0, async_op=True)
        time.sleep(0.5)  # rank 1 never joins the broadcast
        assert flight_recorder.dump(flight_recorder.dump_path(Path(sys.argv[2]), rank))
        time.sleep(0.5)
        os._exit(0)
        """
    )
    env = dict(os.environ)
    flight_recorder.enable(env)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(tmp_path)], env=env) for r in range(2)]
    for p in procs:
        assert p.wait(timeout=60) == 0
    assert sorted(flight_recorder.dump_paths(tmp_path)) == [0, 1]
    traces = {r: flight_recorder.load(flight_recorder.dump_path(tmp_path, r)) for r in range(2)}
    lines = flight_recorder.align(
        traces, now_ns=max(e["time_created_ns"] for e in traces[0]["entries"]) + 3 * SECOND
    )
    assert any(
        line.startswith("rank 1 never entered collective #2 (broadcast, default_pg) that rank 0")
        for line in lines
    ), lines
