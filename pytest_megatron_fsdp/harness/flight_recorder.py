"""Who is stuck where: torch's c10d flight recorder, aligned across ranks.

Each rank records its collectives when ``TORCH_FR_BUFFER_SIZE`` (gloo, and NCCL on current torch)
or ``TORCH_NCCL_TRACE_BUFFER_SIZE`` (NCCL) is set; ``torch._C._distributed_c10d._dump_fr_trace``
returns the record as a pickle (torch's own dump and format). This module only aligns the ranks'
records by process group and sequence number and says, in a few lines, which collective each rank
completed last, which one it is in, and who never entered a collective that others wait in, e.g.
``rank 1 never entered collective #4 (broadcast, default_pg) that rank 0 has waited in for 25.1 s``.
Collectives that differ across ranks at the same sequence number (op or sizes) are named the same way.

Plain Python over the decoded records (unit-tested with made-up ones); torch only to dump.
"""

from __future__ import annotations

import ast
import os
import pickle
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: entries each rank keeps (a ring buffer): enough for the last steps of a small training run
BUFFER_ENTRIES = 2000


def enable(environ: MutableMapping[str, str]) -> None:
    """Turn the flight recorder on for processes started with ``environ`` (unless set already)."""
    environ.setdefault("TORCH_FR_BUFFER_SIZE", str(BUFFER_ENTRIES))
    environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(BUFFER_ENTRIES))


def dump(path: Path) -> bool:
    """This rank's record, pickled as torch writes it, into ``path``; False if torch has none."""
    try:
        from torch._C import _distributed_c10d as c10d

        raw = c10d._dump_fr_trace(True, True, False)
    except Exception:  # noqa: BLE001 - no recorder in this torch build, or nothing recorded
        return False
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(raw)
    os.replace(tmp, path)
    return True


def load(path: Path) -> dict[str, Any] | None:
    try:
        return pickle.loads(path.read_bytes())  # written by this session's own ranks
    except (OSError, pickle.UnpicklingError, EOFError):
        return None


@dataclass(frozen=True)
class Collective:
    rank: int
    group: str
    seq: int
    op: str
    sizes: str
    completed: bool
    created_ns: int

    def describe(self) -> str:
        return f"#{self.seq} ({self.op}, {self.group}, sizes {self.sizes})"


def _collectives(rank: int, trace: Mapping[str, Any]) -> list[Collective]:
    found = []
    for entry in trace.get("entries", []):
        if entry.get("is_p2p"):
            continue
        name, desc = (tuple(entry.get("process_group") or ("?", "?")) + ("", ""))[:2]
        op = str(entry.get("profiling_name", "?")).split(":", 1)[-1]
        completed = bool(entry.get("retired")) or entry.get("state") == "completed"
        found.append(
            Collective(
                rank=rank,
                group=desc or name,
                seq=int(entry.get("collective_seq_id", -1)),
                op=op,
                sizes=str(entry.get("input_sizes")),
                completed=completed,
                created_ns=int(entry.get("time_created_ns") or 0),
            )
        )
    return found


def _group_ranks(traces: Mapping[int, Mapping[str, Any]], group: str, seen: set[int]) -> set[int]:
    """The ranks of ``group``: from the records' pg_config where it names them, else every rank
    for the default group, else the ranks that recorded anything in it."""
    for trace in traces.values():
        for config in (trace.get("pg_config") or {}).values():
            if group in (config.get("desc"), config.get("name")):
                try:
                    return set(ast.literal_eval(str(config.get("ranks"))))
                except (ValueError, SyntaxError):
                    break
    if group == "default_pg":
        return set(traces)
    return seen


def align(traces: Mapping[int, Mapping[str, Any]], now_ns: int) -> list[str]:
    """A short "collectives" section from every rank's record (rank -> decoded dump)."""
    if not traces:
        return []
    per_rank = {rank: _collectives(rank, trace) for rank, trace in traces.items()}
    lines: list[str] = []
    for rank in sorted(per_rank):
        done = [c for c in per_rank[rank] if c.completed]
        pending = [c for c in per_rank[rank] if not c.completed]
        last = max(done, key=lambda c: c.created_ns).describe() if done else "none"
        if pending:
            current = min(pending, key=lambda c: c.created_ns)
            waited = max(now_ns - current.created_ns, 0) / 1e9
            lines.append(f"rank {rank}: last completed {last}; in {current.describe()} for {waited:.1f} s")
        else:
            lines.append(f"rank {rank}: last completed {last}; in no collective")
    by_group: dict[str, dict[int, dict[int, Collective]]] = {}
    for rank, collectives in per_rank.items():
        for c in collectives:
            by_group.setdefault(c.group, {}).setdefault(c.seq, {})[rank] = c
    for group in sorted(by_group):
        sequences = by_group[group]
        members = _group_ranks(traces, group, {r for seq in sequences.values() for r in seq})
        for seq in sorted(sequences):
            entered = sequences[seq]
            kinds = {(c.op, c.sizes) for c in entered.values()}
            if len(kinds) > 1:
                detail = ", ".join(f"rank {r} {c.op} {c.sizes}" for r, c in sorted(entered.items()))
                lines.append(f"collective #{seq} in {group} differs across ranks: {detail}")
            waiting = {r: c for r, c in entered.items() if not c.completed}
            if not waiting:
                continue
            first_rank, first = min(waiting.items(), key=lambda item: item[1].created_ns)
            waited = max(now_ns - first.created_ns, 0) / 1e9
            for missing in sorted(members - set(entered)):
                later = [s for s, ranks in sequences.items() if missing in ranks and s > seq]
                if later:
                    continue  # its entry for #seq left the ring buffer: it did enter

                lines.append(
                    f"rank {missing} never entered collective #{seq} ({first.op}, {group}) that rank "
                    f"{first_rank} has waited in for {waited:.1f} s"
                )
    return lines


def section(log_dir: Path, world_size: int, now_ns: int) -> list[str]:
    """The "collectives" section of a timeout report, from the ``rank<R>.fr`` dumps in ``log_dir``
    (a rank with no dump there is left out); [] when there is none."""
    traces = {}
    for rank in range(world_size):
        trace = load(log_dir / f"rank{rank}.fr")
        if trace is not None:
            traces[rank] = trace
    aligned = align(traces, now_ns)
    if not aligned:
        return []
    return ["collectives (c10d flight recorder; raw records: rank<R>.fr beside the logs):"] + [
        f"  {line}" for line in aligned
    ]
