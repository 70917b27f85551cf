"""Who is stuck where: torch's c10d flight recorder, aligned across ranks.

Each rank records its collectives when ``TORCH_FR_BUFFER_SIZE`` (gloo, and NCCL on current torch)
or ``TORCH_NCCL_TRACE_BUFFER_SIZE`` (NCCL) is set; ``torch._C._distributed_c10d._dump_fr_trace``
returns the record as a pickle (torch's own dump and format). This module only aligns the ranks'
records by process group and sequence number and says, in a few lines, which collective each rank
completed last, which one it is in, and who never entered a collective that others wait in, e.g.
``rank 1 never entered collective #4 (broadcast, default_pg) that rank 0 has waited in for 25.1 s``.
Collectives that differ across ranks at the same sequence number (op or sizes) are named the same way.

Each rank's dump lies beside its log as ``flight_recorder_rank_<R>`` (:func:`.rank_dir.dump_path`): one
common prefix, the rank number last and no suffix, which is what torch's own analyser needs
(``torchfrtrace <dir> -p flight_recorder_rank_``); ``python -m pytest_megatron_fsdp collectives
<dir>`` prints this module's summary again. Dumps named ``rank<R>.fr`` (earlier versions of this
plugin) are still read.

Plain Python over the decoded records (unit-tested with made-up ones); torch only to dump.
"""

from __future__ import annotations

import ast
import contextlib
import os
import pickle
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import rank_dir
from .rank_dir import DUMP_PREFIX

#: entries each rank keeps (a ring buffer): enough for the last steps of a small training run
BUFFER_ENTRIES = 2000


def remove_dumps(log_dir: Path, rank: int) -> None:
    """An earlier session's dumps of ``rank`` in ``log_dir`` (both names), so none is taken for this one's."""
    rank_dir.dump_path(log_dir, rank).unlink(missing_ok=True)
    rank_dir.marker_path(log_dir, rank, rank_dir.LEGACY_DUMP_SUFFIX).unlink(missing_ok=True)


def enable(environ: MutableMapping[str, str]) -> None:
    """Turn the flight recorder on for processes started with ``environ`` (unless set already)."""
    environ.setdefault("TORCH_FR_BUFFER_SIZE", str(BUFFER_ENTRIES))
    environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(BUFFER_ENTRIES))


def dump(path: Path) -> str | None:
    """This rank's record, pickled as torch writes it (its process groups' config completed, see
    :func:`complete_pg_config`), into ``path``; None when written, else why not (torch has no record,
    or this build no recorder), for the rank's log.

    Without the entries' Python stack traces: symbolising them makes torch import ``torch._dynamo``
    on the first dump, which took 10-17 s per rank with two CPU ranks on two busy cores (0.2 ms
    without; 2026-12-01, torch 2.14.1), longer than the peers wait for this rank's dump. Every
    thread's stack is in the rank's log anyway (faulthandler).
    """
    try:
        from torch._C import _distributed_c10d as c10d

        # private, absent from torch's hints and from some builds: the except below covers that
        raw = c10d._dump_fr_trace(True, False, False)  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001 - no recorder in this torch build, or nothing recorded
        return f"no flight record of this rank's collectives ({type(exc).__name__}: {exc})"
    # a record of another shape: written as torch made it
    with contextlib.suppress(Exception):
        raw = pickle.dumps(complete_pg_config(pickle.loads(raw), _registered_groups()))
    # named apart from the dumps (no prefix, no trailing digits): torchfrtrace reads every file whose
    # name holds the prefix, and a reader never sees half a dump
    tmp = path.with_name(f".partial-{path.name.replace(DUMP_PREFIX, '')}-{os.getpid()}.tmp")
    tmp.write_bytes(raw)
    os.replace(tmp, path)
    return None


def _registered_groups() -> dict[str, dict[str, str]]:
    """name -> ``{"name", "desc", "ranks"}`` (the record's pg_config shape) of every process group
    of this rank, from torch.distributed's own registry."""
    try:
        from torch.distributed import distributed_c10d

        world = distributed_c10d._world
        groups = {}
        for group, name in world.pg_names.items():
            ranks = sorted(world.pg_group_ranks.get(group, {}))
            desc = str(getattr(group, "group_desc", "") or name)
            groups[str(name)] = {"name": str(name), "desc": desc, "ranks": str(ranks)}
        return groups
    except Exception:  # noqa: BLE001 - torch's private registry changed: the record stays as it is
        return {}


def complete_pg_config(trace: dict[str, Any], groups: Mapping[str, Mapping[str, str]]) -> dict[str, Any]:
    """``trace`` with a pg_config entry for every group in ``groups`` that it lacks.

    A gloo group records its config before torch names it, so a gloo rank's record keeps every
    group under the name ``""`` (torch 2.13.0 and 2.14.1: ``{"": {"name": "", "desc": "", "ranks":
    "[0, 1]"}}``, the last group created winning), while its entries name the group (``("0",
    "default_pg")``); torchfrtrace then fails on the first entry (``KeyError: ('0', 0)``). Entries
    torch named stay as they are; the nameless one goes once ``groups`` names any.
    """
    config = {name: info for name, info in (trace.get("pg_config") or {}).items() if name}
    for name, info in groups.items():
        config.setdefault(name, dict(info))
    if not config:
        return trace
    return {**trace, "pg_config": config}


def load(path: Path) -> dict[str, Any] | None:
    try:
        trace: dict[str, Any] = pickle.loads(path.read_bytes())  # written by this session's own ranks
        return trace
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
    #: torch's state of the entry: "scheduled", "started" or "completed"
    state: str = ""

    def describe(self) -> str:
        return f"#{self.seq} ({self.op}, {self.group}, sizes {self.sizes})"


def collectives(rank: int, trace: Mapping[str, Any]) -> list[Collective]:
    """The collectives (no point-to-point operations) in one rank's decoded dump, in its order."""
    found = []
    for entry in trace.get("entries", []):
        if entry.get("is_p2p"):
            continue
        name, desc = ((*tuple(entry.get("process_group") or ("?", "?")), "", ""))[:2]
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
                state=str(entry.get("state", "")),
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
    per_rank = {rank: collectives(rank, trace) for rank, trace in traces.items()}
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
    for rank, recorded in per_rank.items():
        for c in recorded:
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


def section(log_dir: Path, world_size: int, now_ns: int, since_ns: int = 0) -> list[str]:
    """The "collectives" section of a timeout report, from the dumps in ``log_dir`` (a rank with no
    dump there is left out), with the commands that read them again; [] when there is none.
    ``since_ns``: only the collectives created since then (wall clock), e.g. the timed-out test's:
    a process group rebuilt after an earlier failed test numbers its collectives from 1 again, and
    the records of the earlier groups would be taken for this one's."""
    paths = rank_dir.dump_paths(log_dir)
    traces = {}
    for rank in range(world_size):
        trace = load(paths[rank]) if rank in paths else None
        if trace is not None:
            entries = [e for e in trace.get("entries", []) if int(e.get("time_created_ns") or 0) >= since_ns]
            traces[rank] = {**trace, "entries": entries}
    aligned = align(traces, now_ns)
    if not aligned:
        return []
    lines = [f"collectives (c10d flight recorder; raw records: {DUMP_PREFIX}<R> beside the logs):"]
    lines += [f"  {line}" for line in aligned]
    return lines + [f"  {line}" for line in commands(log_dir, sorted(traces), world_size)]


def commands(log_dir: Path, ranks: list[int], world_size: int) -> list[str]:
    """How to read ``log_dir``'s dumps again: this package's summary and torch's own analyser (which
    refuses a partial set of dumps unless told to allow it)."""
    partial = " --allow-incomplete-ranks" if set(ranks) != set(range(world_size)) else ""
    return [
        f"summary again: python -m pytest_megatron_fsdp collectives {log_dir}",
        f"torch's analyser: torchfrtrace {log_dir} -p {DUMP_PREFIX}{partial}",
    ]
