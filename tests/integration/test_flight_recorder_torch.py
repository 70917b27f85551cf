"""The flight recorder's alignment on torch's own records: two real gloo processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

from pytest_megatron_fsdp.wire import flight_recorder, rank_dir

SECOND = 1_000_000_000


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
        from pytest_megatron_fsdp.wire import flight_recorder, rank_dir
        rank = int(sys.argv[1])
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        dist.all_reduce(torch.ones(4))
        if rank == 0:
            work = dist.broadcast(torch.ones(3), src=0, async_op=True)
        time.sleep(0.5)  # rank 1 never joins the broadcast
        assert flight_recorder.dump(rank_dir.dump_path(Path(sys.argv[2]), rank)) is None
        time.sleep(0.5)
        os._exit(0)
        """
    )
    env = dict(os.environ)
    flight_recorder.enable(env)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(tmp_path)], env=env) for r in range(2)]
    for p in procs:
        assert p.wait(timeout=60) == 0
    assert sorted(rank_dir.dump_paths(tmp_path)) == [0, 1]
    traces = {r: flight_recorder.load(rank_dir.dump_path(tmp_path, r)) for r in range(2)}
    lines = flight_recorder.align(
        traces, now_ns=max(e["time_created_ns"] for e in traces[0]["entries"]) + 3 * SECOND
    )
    assert any(
        line.startswith("rank 1 never entered collective #2 (broadcast, default_pg) that rank 0")
        for line in lines
    ), lines
