"""Telling a hung test from a slow one.

A wall-clock limit alone cannot tell them apart on a shared or slow machine: a test beside two CPU
hogs, or bf16 on a CPU without native bf16, runs many times longer and still gets somewhere. So each
rank's beacon thread (:class:`ProgressBeacon`) looks, once a second, for signs that the rank is
getting somewhere (:func:`progressed`):

* **a collective completed**: the last completed sequence number of each of its process groups,
  from the status part of torch's flight record (1.5 ms with gloo, torch 2.13 and 2.14; NCCL's record
  has the same status, not yet measured on a GPU);
* **Python moved**: the main thread's stack (code objects and lines) differs from the last look;
* **it computed** (CPU ranks only): the process used at least :data:`BUSY_CPU_PER_S` of a core since
  the last look. A rank waiting in a gloo collective used 0.3 % of a core, a rank training beside two
  CPU hogs on two cores about half of one. GPU ranks leave this sign out: their CPU spins while
  they wait for the GPU.

Each rank counts the looks that found progress and publishes the count in the rendezvous store,
with a sign of life (srun ranks count on it to tell a dead peer); it reads every rank's count back,
so each rank knows when *any* rank last got somewhere. No rank getting anywhere for the session's
no-progress bound (``--mfsdp-hang-after``) is a hang; the test's timeout stays the last net, and
when it runs out the rank says whether the test was still getting somewhere (:class:`Verdict`). The
first rank to find a hang declares it in the store for the test (:meth:`ProgressBeacon.declare_hang`),
so every rank ends the test with the same verdict at once: the interruption of one rank brings its
main thread back to Python, which the others would count as progress.
"""

from __future__ import annotations

import contextlib
import pickle
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..wire.protocol import Verdict

#: seconds between two looks at a rank's progress (and two signs of life)
LOOK_INTERVAL_S = 1.0
#: share of one core a CPU rank uses, on average since the last look, that counts as computing
BUSY_CPU_PER_S = 0.1

#: (process-group name, its last completed collective's sequence number), sorted
Collectives = tuple[tuple[str, int], ...]
#: the main thread's stack: (id of each frame's code object, its line), innermost first
PythonAt = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Look:
    """What one look at this rank saw (:func:`look`)."""

    #: monotonic seconds
    at: float
    #: CPU seconds this process has used (every thread, user and system)
    cpu_s: float
    collectives: Collectives
    python_at: PythonAt


def completed_collectives() -> Collectives:
    """Each process group's last completed collective, from the flight record's status (empty
    where this torch has no recorder or nothing is recorded)."""
    try:
        from torch._C import _distributed_c10d as c10d

        # (include the entries, their stack traces, only the active ones): the status alone
        raw = c10d._dump_fr_trace(False, False, False)  # type: ignore[attr-defined]
        status = pickle.loads(raw).get("pg_status", {})
        return tuple(
            sorted((str(pg), int(s.get("last_completed_collective", -1))) for pg, s in status.items())
        )
    except Exception:  # noqa: BLE001 - no recorder in this torch build: the other signs remain
        return ()


def python_position(thread_id: int) -> PythonAt:
    """Where thread ``thread_id`` is in Python: its frames' code objects and lines."""
    frame = sys._current_frames().get(thread_id)
    position = []
    while frame is not None:
        position.append((id(frame.f_code), frame.f_lineno or 0))
        frame = frame.f_back
    return tuple(position)


def look(main_thread_id: int) -> Look:
    """This process's state now, as :func:`progressed` compares it."""
    return Look(
        at=time.monotonic(),
        cpu_s=time.process_time(),
        collectives=completed_collectives(),
        python_at=python_position(main_thread_id),
    )


def progressed(before: Look, after: Look, counts_cpu: bool) -> str | None:
    """The sign of progress between two looks (None: none): ``"collectives"``, ``"python"`` or,
    where ``counts_cpu``, ``"cpu"``."""
    if after.collectives != before.collectives and after.collectives:
        return "collectives"
    if after.python_at != before.python_at:
        return "python"
    elapsed = after.at - before.at
    if counts_cpu and elapsed > 0 and (after.cpu_s - before.cpu_s) / elapsed >= BUSY_CPU_PER_S:
        return "cpu"
    return None


def decide(elapsed_s: float, timeout_s: float, quiet_s: float | None, hang_after_s: float) -> Verdict | None:
    """The verdict on a running test ``elapsed_s`` into it (None: it may go on).

    Hung before its timeout: no rank got anywhere for ``hang_after_s`` (when that is on). At its
    timeout: hung where no rank got anywhere for the bound or, in a test shorter than the bound,
    for the second half of it (its setup's progress, a fresh rank set's start-up, counts for
    nothing then), and at least one and a half looks; else too slow. A test of a few seconds is
    told apart only as well as looks a second apart allow.
    """
    if hang_after_s > 0 and quiet_s is not None and quiet_s >= hang_after_s and elapsed_s < timeout_s:
        return Verdict(True, elapsed_s, timeout_s, quiet_s, hang_after_s, before_timeout=True)
    if elapsed_s < timeout_s:
        return None
    window = max(elapsed_s / 2, 1.5 * LOOK_INTERVAL_S)
    if hang_after_s > 0:
        window = min(window, hang_after_s)
    hung = quiet_s is not None and quiet_s >= window
    return Verdict(hung, elapsed_s, timeout_s, quiet_s, hang_after_s, before_timeout=False)


class ProgressBeacon:
    """This rank's looks at its progress and its sign of life, published in the rendezvous store
    from a thread of its own through a store connection of its own (a wait on the main connection
    holds it for as long as it waits); every rank's progress read back.

    ``connect``: a new client connection to the rendezvous store; ``main_thread_id``: the thread
    whose Python position counts; ``counts_cpu``: whether CPU use counts as progress (CPU ranks).
    """

    def __init__(
        self,
        connect: Callable[[], Any],
        rank: int,
        world_size: int,
        main_thread_id: int,
        counts_cpu: bool,
        interval_s: float = LOOK_INTERVAL_S,
    ) -> None:
        import torch.distributed as dist

        client = connect()
        self._alive = dist.PrefixStore("mfsdp-alive", client)  # type: ignore[attr-defined]
        self._progress = dist.PrefixStore("mfsdp-progress", client)  # type: ignore[attr-defined]
        self._rank = rank
        self._ranks = [str(r) for r in range(world_size)]
        self._main_thread_id = main_thread_id
        self._counts_cpu = counts_cpu
        self._interval_s = interval_s
        #: one store connection, used from the beacon thread and the watchdog thread
        self._lock = threading.Lock()
        self._looks_with_progress = 0
        #: per rank: its count last read, and when it changed (monotonic)
        self._seen: dict[int, tuple[bytes, float]] = {}
        self._last_progress = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mfsdp-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        before = look(self._main_thread_id)
        beats = 0
        while not self._stop.wait(self._interval_s):
            after = look(self._main_thread_id)
            if progressed(before, after, self._counts_cpu):
                self._looks_with_progress += 1
            before = after
            beats += 1
            try:
                with self._lock:
                    self._alive.set(str(self._rank), str(beats))
                    self._progress.set(str(self._rank), str(self._looks_with_progress))
                    present = [r for r in self._ranks if self._progress.check([r])]
                    counts = self._progress.multi_get(present) if present else []
            except Exception:  # noqa: BLE001 - the store is gone (its host ended): nothing to tell
                return
            self._note(dict(zip(map(int, present), counts, strict=True)), after.at)

    def _note(self, counts: Mapping[int, bytes], now: float) -> None:
        for rank, count in counts.items():
            seen = self._seen.get(rank)
            if seen is None or seen[0] != count:
                self._seen[rank] = (count, now)
                self._last_progress = now

    def quiet_for(self, since: float) -> float:
        """Seconds since any rank last got somewhere, counted from ``since`` at the earliest (a
        test's start: the time before it is not the test's)."""
        return time.monotonic() - max(self._last_progress, since)

    def quiet_ranks(self, since: float) -> dict[int, float]:
        """Per rank, seconds since it last got somewhere (from ``since`` at the earliest)."""
        now = time.monotonic()
        return {rank: now - max(changed, since) for rank, (_count, changed) in sorted(self._seen.items())}

    def declare_hang(self, test_index: int, verdict: Verdict) -> None:
        """Tell every rank that test ``test_index`` hung (each rank's watchdog asks)."""
        with contextlib.suppress(Exception), self._lock:  # a store that is gone: nobody asks any more
            self._progress.set(f"hung/{test_index}", verdict.to_json())

    def hang_declared(self, test_index: int) -> Verdict | None:
        """The verdict a rank declared on test ``test_index``, if one did."""
        key = f"hung/{test_index}"
        try:
            with self._lock:
                if not self._progress.check([key]):
                    return None
                return Verdict.from_json(self._progress.get(key))
        except Exception:  # noqa: BLE001 - a store that is gone: no declaration
            return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
