"""What a rank does once a test ran, before the ranks agree on it: the checks fixtures registered for
after the test, and letting go of the failed test's frames, whose objects (a model, a process group)
would otherwise outlive it."""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from types import TracebackType

import pytest

from ..fsdp.dtensor_caches import forget_dtensor_shardings
from .log import RankLog
from .session import RankSession


def check_after_test(
    item: pytest.Item, reports: list[pytest.TestReport], rank_session: RankSession, log: RankLog
) -> None:
    """The checks fixtures registered for after the test (``RankSession.after_test``); a problem
    fails the test's teardown report (or joins it as a section when teardown already failed)."""
    release_failed_test_frames(item)
    # The next test's meshes may compare equal to this one's, over other groups (a changed
    # model-parallel layout, a renewed process group): no cached sharding may carry this one's.
    forget_dtensor_shardings()

    def check() -> None:
        problems = rank_session.run_after_test_checks()
        if problems:
            pytest.fail("\n".join(problems), pytrace=False)

    call = pytest.CallInfo.from_call(check, when="teardown")
    if call.excinfo is None:
        return
    # Not through the makereport hook: that would release the peers and renew the process
    # group, which a problem found after the test (no collective in flight) does not need.
    found = pytest.TestReport.from_item_and_call(item, call)
    teardown = next((r for r in reports if r.when == "teardown"), None)
    if teardown is None:
        reports.append(found)
    elif teardown.failed:
        teardown.sections.append(("megatron-fsdp: after the test", found.longreprtext))
    else:
        teardown.outcome = "failed"
        teardown.longrepr = found.longrepr
    log.line(f"after {item.nodeid}: {found.longreprtext}")


def raised_in_torch_distributed(excinfo: pytest.ExceptionInfo[BaseException]) -> bool:
    """Whether the exception came out of torch.distributed (a collective, or the missing group)."""
    import torch.distributed

    root = os.path.dirname(torch.distributed.__file__) + os.sep
    return any(str(entry.path).startswith(root) for entry in excinfo.traceback)


def drop_exception_locals(exc: BaseException) -> None:
    """:func:`drop_locals` for ``exc``'s traceback and those of the exceptions it chains (its cause and
    context): a timeout raised while a collective's own error unwinds (``During handling of the above
    exception...``) keeps the collective's frames, and so the model, in the chained one's traceback."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        drop_locals(current.__traceback__)
        pending += [current.__cause__, current.__context__]


def drop_locals(tb: TracebackType | None) -> None:
    """Let go of what a failed test's frames hold, before its process group is released: a group
    one of them still references (the frame of the collective the test was interrupted in, or
    failed in) keeps its connections when destroyed, and a peer waiting in a collective this rank
    never enters then waits until the group's timeout (gloo: neither its destroy nor its abort
    closes them while the backend lives; torch 2.14.1). The report is made already; ``--pdb``
    finds no locals in these frames afterwards."""
    for frame, _line in traceback.walk_tb(tb):
        with contextlib.suppress(Exception):  # the snapshot pytest's report took (Python < 3.13)
            frame.f_locals.clear()
        with contextlib.suppress(RuntimeError):  # a frame still running keeps its locals
            frame.clear()


def release_failed_test_frames(item: pytest.Item) -> None:
    """Drop pytest's reference to a test that failed in its call, as pytest does before the next.

    pytest keeps the failure in ``sys.last_value`` / ``sys.last_traceback`` for post-mortem
    debugging, which is over once the report is made (``--pdb`` runs during the call). Its frames
    hold the test's locals, its model among them, until the next failure replaces them. Clearing
    the frames is not enough: ``frame.clear()`` keeps the ``f_locals`` snapshot that pytest's
    failure report took (Python 3.11 and 3.12).
    """
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)
    # pytest-rerunfailures keeps each failed phase's ExceptionInfo on the item until its own rerun
    # protocol ends (for the whole session where it reruns nothing). A rank never reruns in place
    # (the parent reruns a test in a fresh rank set), so a rank needs none of them.
    excinfos = getattr(item, "_rerun_condition_excinfos", None)
    if isinstance(excinfos, dict):
        excinfos.clear()
