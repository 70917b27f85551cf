"""Aligning the c10d flight recorder's records across ranks: who is missing from which collective."""

from __future__ import annotations

from pytest_megatron_fsdp.wire import flight_recorder

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


def test_a_rank_with_no_record_says_why_and_writes_nothing(tmp_path, monkeypatch):
    """torch without a record (a build without the recorder, or nothing recorded): the dump says why,
    for the rank's log, and leaves no file for the report to take as a record."""
    from torch._C import _distributed_c10d as c10d

    def no_record(*args):
        raise RuntimeError("no flight record")

    monkeypatch.setattr(c10d, "_dump_fr_trace", no_record, raising=False)
    path = tmp_path / "flight_recorder_rank_0"
    why = flight_recorder.dump(path)
    assert why == "no flight record of this rank's collectives (RuntimeError: no flight record)"
    assert list(tmp_path.iterdir()) == []
