"""The plain-mode controller, in process: scripted rank-set events in, test reports out.

No rank set, no subprocess: a fake rank set plays a scripted sequence of protocol events (and a
post-mortem record when it "dies"), the way pytest-xdist tests its scheduler with mock nodes. What
is checked: which phase a rank set's death is charged to, the reports passed on in order, how
deaths, signals, exit codes and timeouts are described, when a batch's end is worth a note, rerun
summaries, and the platform plan.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import pytest

from pytest_megatron_fsdp.environment import DistributedSpec
from pytest_megatron_fsdp.parent import controller as ctl
from pytest_megatron_fsdp.wire import explain, protocol
from pytest_megatron_fsdp.wire.explain import PostMortem, internal_error, log_excerpt
from pytest_megatron_fsdp.wire.protocol import Collected, Finished, Report, Started, Warnings

NODEID = "test_x.py::test_x"


class FakeItem:
    def __init__(self, nodeid: str = NODEID, world_size: int = 2, timeout_s: float = 10.0) -> None:
        self.nodeid = nodeid
        self.location = ("test_x.py", 4, nodeid.rpartition("::")[2])
        self.keywords = {nodeid.rpartition("::")[2]: 1}
        self.user_properties: list = []
        self.path = Path("test_x.py")
        self.stash = pytest.Stash()
        self.stash[protocol.SPEC] = DistributedSpec(world_size=world_size, timeout_s=timeout_s)
        self.markers: list = []
        self.warnings: list = []
        recorded = SimpleNamespace(call_historic=lambda kwargs: self.warnings.append(kwargs))
        self.ihook = SimpleNamespace(pytest_warning_recorded=recorded)

    def add_marker(self, mark) -> None:
        self.markers.append(mark)


class FakeConfig:
    def __init__(self) -> None:
        self.option = SimpleNamespace(capture="fd", collectonly=False)
        self.hook = SimpleNamespace(
            pytest_report_from_serializable=lambda config, data: pytest.TestReport._from_json(data)
        )
        self.pluginmanager = SimpleNamespace(get_plugin=lambda name: None, get_plugins=lambda: [])
        self.stash = pytest.Stash()


class FakeRankSet:
    """Plays ``polls`` (the events each poll delivers, in order); exits after the last poll when
    ``exits`` (or never, to time out); its post-mortem is ``post_mortem``."""

    def __init__(self, polls, exits: bool = True, post_mortem: PostMortem | None = None, finished: int = 0):
        self.world_size = 2
        self.tests_finished = finished
        self.log_dir = Path("/logs/batch1-world2")
        self._polls = deque(polls)
        self._exits = exits
        self._events: deque = deque()
        self._post_mortem = post_mortem or PostMortem(world_size=2, returncode=1)
        self.calls: list[tuple[str, float]] = []

    def poll_events(self):
        if self._polls:
            self._events.extend(self._polls.popleft())
        return self._events

    def exited(self) -> bool:
        return self._exits and not self._polls

    def new_output(self) -> str:
        return ""

    def post_mortem(self) -> PostMortem:
        return self._post_mortem

    def dump_stacks(self) -> None:
        self.calls.append(("dump_stacks", ctl._clock()))

    def kill(self) -> None:
        self.calls.append(("kill", ctl._clock()))
        self._exits, self._polls = True, deque()

    def close(self) -> None:
        self.calls.append(("close", ctl._clock()))


@pytest.fixture(autouse=True)
def fake_clock(monkeypatch):
    """The watch loop's clock advances only by its own sleeps: a 10 s timeout takes no time."""
    now = [0.0]
    monkeypatch.setattr(ctl, "_clock", lambda: now[0])
    monkeypatch.setattr(ctl, "_sleep", lambda s: now.__setitem__(0, now[0] + s))
    return now


def _report(when: str, outcome: str = "passed", nodeid: str = NODEID) -> Report:
    longrepr = None
    if outcome == "failed":
        longrepr = f"{when} failed"
    elif outcome == "skipped":
        longrepr = ("test_x.py", 5, "Skipped: no")
    report = pytest.TestReport(nodeid, ("test_x.py", 4, "test_x"), {}, outcome, longrepr, when)
    return Report(report=json.loads(json.dumps(report._to_json())))  # as it comes off the wire


def _watch(rank_set: FakeRankSet, item: FakeItem | None = None) -> list[pytest.TestReport]:
    controller = ctl.Controller(FakeConfig(), [], None)
    controller.active[2] = rank_set
    return controller._collect_reports(item or FakeItem(), rank_set)


def _outcomes(reports) -> list[tuple[str, str]]:
    return [(r.when, r.outcome) for r in reports]


SIGSEGV_ON_RANK_1 = PostMortem(
    world_size=2,
    returncode=1,
    exits={1: -11, 0: -15},
    root=1,
    excerpts={0: "START test_x.py::test_x", 1: "Fatal Python error: Segmentation fault"},
    log_dir=Path("/logs/batch1-world2"),
    output_tail="torchrun: ChildFailedError\n",
    output_path=Path("/logs/batch1-world2/torchrun.log"),
)


def test_a_test_that_finishes_passes_its_reports_on_in_order():
    item = FakeItem()
    warning = {"message": "careful", "category": "UserWarning", "filename": "x.py", "lineno": 1}
    rank_set = FakeRankSet(
        [
            [Collected(nodeids=["test_x.py::test_a", NODEID])],
            [Started(nodeid=NODEID), _report("setup")],
            [_report("call", "failed"), Warnings(nodeid=NODEID, warnings=[warning])],
            [_report("teardown"), Finished(nodeid=NODEID)],
        ],
        exits=False,
    )
    reports = _watch(rank_set, item)
    assert _outcomes(reports) == [("setup", "passed"), ("call", "failed"), ("teardown", "passed")]
    assert reports[1].longreprtext == "call failed"
    assert rank_set.tests_finished == 1
    assert not [name for name, _ in rank_set.calls if name in ("kill", "close")]  # the set goes on
    assert [w["nodeid"] for w in item.warnings] == [NODEID]
    assert "careful" in str(item.warnings[0]["warning_message"].message)


@pytest.mark.parametrize(
    ("before_death", "reported", "charged_to"),
    [
        ([], [], "setup"),  # died while starting: the test never began
        ([Collected(nodeids=[NODEID])], [], "setup"),
        ([Started(nodeid=NODEID)], [], "call"),  # started, nothing agreed yet: where ranks die
        ([Started(nodeid=NODEID), _report("setup")], [("setup", "passed")], "call"),
        ([Started(nodeid=NODEID), _report("setup", "failed")], [("setup", "failed")], "teardown"),
        ([Started(nodeid=NODEID), _report("setup", "skipped")], [("setup", "skipped")], "teardown"),
        (
            [Started(nodeid=NODEID), _report("setup"), _report("call")],
            [("setup", "passed"), ("call", "passed")],
            "teardown",
        ),
    ],
)
def test_a_rank_set_death_is_charged_to_the_phase_the_test_had_reached(before_death, reported, charged_to):
    rank_set = FakeRankSet([before_death], post_mortem=SIGSEGV_ON_RANK_1)
    reports = _watch(rank_set)
    assert _outcomes(reports) == [*reported, (charged_to, "failed")]
    death = reports[-1]
    assert death.nodeid == NODEID
    assert death.longreprtext.startswith("rank 1 died (signal SIGSEGV)\n")
    assert "Fatal Python error: Segmentation fault" in death.longreprtext
    assert ("close", 0.0) in rank_set.calls  # the rest of the batch goes to a fresh rank set


def test_the_last_events_arriving_with_the_exit_are_not_a_death():
    # the first poll finds nothing, the set has exited by the second, whose poll brings the finish
    rank_set = FakeRankSet(
        [[], [Started(nodeid=NODEID), _report("setup"), _report("call"), _report("teardown")], []]
    )
    rank_set._polls.append([Finished(nodeid=NODEID)])
    rank_set.exited = lambda: len(rank_set._polls) <= 1
    reports = _watch(rank_set)
    assert _outcomes(reports) == [("setup", "passed"), ("call", "passed"), ("teardown", "passed")]


@pytest.mark.parametrize(
    ("events", "message"),
    [
        (
            [Collected(nodeids=["test_x.py::test_other"])],
            f"the launched ranks did not collect {NODEID} (they collected 1 tests)",
        ),
        ([Started(nodeid="test_x.py::test_other")], "the rank set ran test_x.py::test_other instead"),
    ],
)
def test_a_rank_set_running_something_else_fails_the_test_in_setup(events, message):
    rank_set = FakeRankSet([events], exits=False)
    reports = _watch(rank_set)
    assert _outcomes(reports) == [("setup", "failed")]
    assert reports[0].longreprtext.startswith(message)
    assert [name for name, _ in rank_set.calls] == ["close"]


def test_a_hang_is_killed_after_timeout_and_grace_counted_from_the_start(fake_clock):
    hang = PostMortem(world_size=2, returncode=-9, excerpts={0: "Thread 0x1 (most recent call first)"})
    rank_set = FakeRankSet([[], [Started(nodeid=NODEID)]], exits=False, post_mortem=hang, finished=1)
    reports = _watch(rank_set, FakeItem(timeout_s=10.0))
    (dump, dumped_at), (kill, killed_at) = rank_set.calls[:2]
    assert (dump, kill) == ("dump_stacks", "kill")
    started_at = 0.05  # the second poll, after one sleep
    assert started_at + 10.0 + ctl.KILL_GRACE_S < dumped_at < started_at + 10.0 + ctl.KILL_GRACE_S + 0.1
    assert killed_at == pytest.approx(dumped_at + 1.0)
    assert _outcomes(reports) == [("call", "failed")]
    assert reports[0].longreprtext.startswith(
        "timed out: the test exceeded its 10 s timeout; every rank's stacks were dumped and the rank set "
        "was killed\n"
    )


def test_a_fresh_rank_set_gets_the_startup_allowance_before_its_first_test(fake_clock):
    rank_set = FakeRankSet([], exits=False, finished=0)
    reports = _watch(rank_set, FakeItem(timeout_s=10.0))
    dumped_at = rank_set.calls[0][1]
    allowed = 10.0 + ctl.KILL_GRACE_S + ctl.STARTUP_ALLOWANCE_S
    assert allowed < dumped_at < allowed + 0.1
    assert _outcomes(reports) == [("setup", "failed")]


# -- describing a death (the post-mortem, formatted) ------------------------------------------------


def test_the_root_cause_rank_comes_first_and_the_others_as_stopped_by_torchrun():
    text = explain.describe_death(SIGSEGV_ON_RANK_1, 10.0)
    assert text.splitlines()[:2] == [
        "rank 1 died (signal SIGSEGV)",
        "rank 0 then ended (signal SIGTERM; stopped by torchrun after rank 1)",
    ]
    assert (
        "---------- rank 0 (log: /logs/batch1-world2/rank0.log) ----------\nSTART test_x.py::test_x" in text
    )
    assert "---------- rank 1 (log: /logs/batch1-world2/rank1.log) ----------\nFatal Python error" in text
    assert text.endswith(
        "---------- torchrun output (tail; whole: /logs/batch1-world2/torchrun.log) ----------\n"
        "torchrun: ChildFailedError"
    )


@pytest.mark.parametrize(
    ("post_mortem", "first_lines"),
    [
        # no root cause named: the lowest rank first
        (
            PostMortem(2, 1, exits={1: 3, 0: 3}),
            ["rank 0 died (exit code 3)", "rank 1 then ended (exit code 3;"],
        ),
        (PostMortem(2, 1, exits={0: -6}), ["rank 0 died (signal SIGABRT)", "---------- rank 0"]),
        (PostMortem(2, 1, exits={0: -200}), ["rank 0 died (signal 200)", "---------- rank 0"]),
        # a rank's watchdog ended it: a timeout, not a death, even with the others stopped
        (
            PostMortem(2, 1, exits={0: 124, 1: -15}, timed_out=[0]),
            [
                "timed out: the test exceeded its 10 s timeout; every rank's stacks were dumped and the "
                "rank set was killed",
                "---------- rank 0",
            ],
        ),
        # a watchdog's exit status (124) is no death: the rank dead otherwise is named
        (PostMortem(2, 1, exits={0: 124, 1: -15}), ["rank 1 died (signal SIGTERM)", "---------- rank 0"]),
        # nothing in torchrun's summary: its own exit status
        (PostMortem(2, -9), ["the rank set ended unexpectedly (signal SIGKILL)", "---------- rank 0"]),
        (PostMortem(2, None), ["the rank set ended unexpectedly (exit code 0)", "---------- rank 0"]),
    ],
)
def test_each_kind_of_abnormal_end_is_described(post_mortem, first_lines):
    lines = explain.describe_death(post_mortem, 10.0).splitlines()
    assert lines[0] == first_lines[0]
    assert lines[1].startswith(first_lines[1])


def test_a_rank_dead_of_a_pytest_internal_error_is_named_with_its_exception():
    pm = PostMortem(2, 1, exits={0: 3, 1: -15}, root=0, internal_errors={0: "ValueError: a harness bug"})
    assert explain.describe_death(pm, 10.0).splitlines()[0] == (
        "rank 0 died (exit code 3: a pytest internal error in the rank: ValueError: a harness bug)"
    )


def _internal_error(frames: int, exception: list[str]) -> list[str]:
    """A pytest INTERNALERROR block as a rank writes it into its log."""
    lines = ["Traceback (most recent call last):"]
    for n in range(frames):
        lines += [
            f'  File "/site-packages/pluggy/_callers.py", line {n}, in _multicall',
            "    res = hook(*args)",
        ]
    return [f"INTERNALERROR> {line}" for line in [*lines, *exception]]


def test_a_pytest_internal_error_is_its_last_tracebacks_exception_first_line():
    first = _internal_error(
        2, ["KeyError: 'x'", "", "During handling of the above exception, another exception occurred:", ""]
    )
    last = _internal_error(3, ["RuntimeError: gloo: Connection closed by peer", "second line of the message"])
    log = "\n".join(
        ["START t", "FAILED t (call) on rank 0:", *first, *last, "", "=== no tests ran in 30.1s ==="]
    )
    assert internal_error(log) == "RuntimeError: gloo: Connection closed by peer"
    assert (
        internal_error("START t\nFAILED t\nTraceback (most recent call last):\nValueError: not pytest's")
        is None
    )


def test_a_rank_log_excerpt_keeps_an_internal_errors_end_not_its_hook_calls():
    block = _internal_error(40, ["ValueError: a harness bug"])
    excerpt = log_excerpt("\n".join(["START t", "x", *block, "", "=== no tests ran ==="])).splitlines()
    assert excerpt[:3] == [
        "START t",
        "x",
        f"INTERNALERROR> [{len(block) - 16} lines of hook calls left out: see the log]",
    ]
    assert excerpt[3:] == [*block[-16:], "", "=== no tests ran ==="]
    short = _internal_error(2, ["ValueError: short"])
    assert log_excerpt("\n".join(["START t", *short])).splitlines() == ["START t", *short]


def test_an_interrupted_test_with_no_death_says_only_what_its_ranks_logged():
    text = explain.describe_death(
        PostMortem(2, -9, excerpts={0: "START a", 1: "START a"}), 10.0, interrupted=True
    )
    assert text.splitlines()[0] == "---------- rank 0 (log: rank0.log) ----------"


def test_a_timeout_lists_the_collectives_section():
    text = explain.describe_death(
        PostMortem(2, -9), 5.0, killed_after=5.0, collectives=["collectives (...):"]
    )
    assert text.splitlines()[:2] == [
        "timed out: the test exceeded its 5 s timeout; every rank's stacks were dumped and the rank set was "
        "killed",
        "collectives (...):",
    ]


@pytest.mark.parametrize(
    ("log", "excerpt"),
    [
        ("a\nSTART t1\nb\nSTART t2\nc\nMFSDP-TIMEOUT t2\nstack\n", "MFSDP-TIMEOUT t2\nstack"),
        ("START t1\nFatal Python error: Aborted\nThread 0x1\n", "Fatal Python error: Aborted\nThread 0x1"),
        ("START t1\nx\nThread 0x2 (most recent call first):\n", "Thread 0x2 (most recent call first):"),
        ("START t1\nx\nSTART t2\ny\n", "START t2\ny"),
        ("z" * 5000, "z" * 3000),
    ],
)
def test_a_rank_log_excerpt_starts_where_the_log_explains_the_end(log, excerpt):
    assert log_excerpt(log) == excerpt


#: rank 1's log where it failed on its own (in its backward) and then waited for its peer, which
#: waited in a collective rank 1 never entered, until the watchdog's hang bound
OWN_FAILURE_THEN_HANG = """START t.py::t (timeout 300 s)
FAILED t.py::t (call) on rank 1:
    def t():
>       run.train(3)
E       RuntimeError: rank 1 fails in its backward
t.py:3: RuntimeError
MFSDP-TIMEOUT: t.py::t hung on rank 1 (no progress on any rank for 60 s)
Thread 0x1 (most recent call first):
"""


def test_a_rank_log_excerpt_keeps_the_failure_before_the_timeout():
    excerpt = log_excerpt(OWN_FAILURE_THEN_HANG).splitlines()
    assert excerpt[0] == "FAILED t.py::t (call) on rank 1:"
    assert excerpt[-2:] == [
        "MFSDP-TIMEOUT: t.py::t hung on rank 1 (no progress on any rank for 60 s)",
        "Thread 0x1 (most recent call first):",
    ]
    # a failure of an earlier test is that test's, reported already
    earlier = OWN_FAILURE_THEN_HANG.replace("MFSDP-TIMEOUT", "START t.py::u (timeout 300 s)\nMFSDP-TIMEOUT")
    assert explain.failure_before_the_timeout(earlier) == ""


def test_a_hang_after_a_rank_failed_on_its_own_names_that_rank_and_its_exception():
    failed = explain.failure_before_the_timeout(OWN_FAILURE_THEN_HANG)
    pm = PostMortem(2, -9, timed_out=[0, 1], failed_first={1: explain.exception_line(failed)})
    assert explain.describe_death(pm, 300.0, killed_after=60.0).splitlines()[1] == (
        "rank 1 had failed on its own before (its failure below): RuntimeError: rank 1 fails in its backward"
    )


# -- the note after a batch's last test -----------------------------------------------------------


@pytest.mark.parametrize(
    ("post_mortem", "note"),
    [
        # a batch with failures: pytest exits 1 on a rank, torchrun stops the other: no note
        (PostMortem(2, 1, exits={0: 1, 1: -15}), ""),
        (PostMortem(2, 1, exit_statuses={0: 1, 1: 1}), ""),
        # pytest's own status wins over torchrun's view of the same rank
        (PostMortem(2, 1, exits={0: -15, 1: -15}, exit_statuses={0: 1}), ""),
        (PostMortem(2, 1, exits={1: -11}), "rank 1: signal SIGSEGV"),
        (PostMortem(2, 1, exit_statuses={0: 3, 1: 1}), "rank 0: exit code 3, rank 1: exit code 1"),
        (PostMortem(2, -9), "torchrun signal SIGKILL, no rank exit codes in its output"),
    ],
)
def test_a_batch_end_is_noted_only_when_it_is_abnormal(post_mortem, note):
    assert explain.abnormal_exits(post_mortem) == note


# -- reruns ---------------------------------------------------------------------------------------


def _test_report(nodeid: str, when: str, outcome: str, text: str | None = None) -> pytest.TestReport:
    return pytest.TestReport(nodeid, ("t.py", 0, "t"), {}, outcome, text, when)


def test_earlier_attempts_become_sections_of_the_last_attempts_failure():
    first = _test_report("t.py::a", "call", "failed", "first boom")
    last = [_test_report("t.py::a", "setup", "passed"), _test_report("t.py::a", "call", "failed", "boom")]
    last.append(_test_report("t.py::a", "teardown", "passed"))
    explain.note_attempts(last, [("batch2-world2", first)], 2)
    assert last[1].sections == [
        ("megatron-fsdp: attempt 1 of 2 failed (call; rank set batch2-world2)", "first boom")
    ]
    assert last[0].sections == last[2].sections == []
    assert {(r.mfsdp_attempts, r.mfsdp_max_attempts) for r in last} == {(2, 2)}
    assert explain.rerun_summary(last) == ["FAILED t.py::a: failed all 2 attempts, each in a fresh rank set"]


def test_a_pass_on_a_rerun_is_flaky_and_its_failures_go_to_its_call_report():
    failures = [("batch1-world2", _test_report("t.py::b", "call", "failed", "one"))]
    failures.append(("batch2-world2", _test_report("t.py::b", "setup", "failed", "two")))
    last = [_test_report("t.py::b", w, "passed") for w in ("setup", "call", "teardown")]
    explain.note_attempts(last, failures, 4)
    assert [title for title, _ in last[1].sections] == [
        "megatron-fsdp: attempt 1 of 4 failed (call; rank set batch1-world2)",
        "megatron-fsdp: attempt 2 of 4 failed (setup; rank set batch2-world2)",
    ]
    plain = _test_report("t.py::c", "call", "passed")  # never rerun: not in the summary
    assert explain.rerun_summary([*last, plain]) == [
        "FLAKY t.py::b: passed on attempt 3 of 4, in a fresh rank set; the earlier failures are sections "
        "of its report (-rP shows them)"
    ]


def test_a_failure_in_teardown_after_a_passing_call_fails_the_summary_line():
    reports = [_test_report("t.py::d", "call", "passed"), _test_report("t.py::d", "teardown", "failed", "x")]
    for report in reports:
        report.mfsdp_attempts, report.mfsdp_max_attempts = 2, 2
    assert explain.rerun_summary(reports) == [
        "FAILED t.py::d: failed all 2 attempts, each in a fresh rank set"
    ]


# -- the platform plan ------------------------------------------------------------------------------


def test_cpu_world_sizes_past_the_hosts_limit_are_a_usage_error(monkeypatch):
    monkeypatch.setattr(ctl, "max_cpu_ranks", lambda: 4)
    controller = ctl.Controller(FakeConfig(), [], None)
    lines = ctl.plan_platforms(controller, "cpu", [FakeItem(world_size=4), FakeItem(world_size=2)])
    assert controller.platforms == {2: "cpu", 4: "cpu"}
    assert lines == [
        "world_size=2 -> platform=cpu, backend=gloo (requested)",
        "world_size=4 -> platform=cpu, backend=gloo (requested)",
    ]
    with pytest.raises(pytest.UsageError, match=r"^world_size=8 cannot be hosted here: at most 4 CPU ranks"):
        ctl.plan_platforms(controller, "cpu", [FakeItem(world_size=8)])


def test_tests_needing_more_gpus_than_visible_are_skipped_with_the_reason(monkeypatch):
    from pytest_megatron_fsdp.wire import platform

    monkeypatch.setattr(platform, "visible_gpu_count", lambda fast=False: 2)
    controller = ctl.Controller(FakeConfig(), [], None)
    small, big = FakeItem(world_size=2), FakeItem(world_size=4)
    lines = ctl.plan_platforms(controller, "cuda", [small, big])
    assert controller.platforms == {2: "cuda"}
    assert lines[0] == "world_size=2 -> platform=cuda, backend=nccl (requested)"
    assert lines[1].startswith("world_size=4: skipped (--mfsdp-platform=cuda needs one GPU per local rank")
    reason = "needs 4 GPUs (world_size=4, --mfsdp-platform=cuda); 2 visible"
    assert big.stash[ctl.UNHOSTABLE] == reason
    assert [m.kwargs for m in big.markers] == [{"reason": reason}]
    assert ctl.UNHOSTABLE not in small.stash
    assert small.markers == []


def test_asking_for_cuda_with_no_gpu_at_all_is_a_usage_error(monkeypatch):
    from pytest_megatron_fsdp.wire import platform

    monkeypatch.setattr(platform, "visible_gpu_count", lambda fast=False: 0)
    with pytest.raises(platform.PlatformError, match="--mfsdp-platform=cuda needs one GPU per local rank"):
        ctl.plan_platforms(ctl.Controller(FakeConfig(), [], None), "cuda", [FakeItem()])


# -- the wire ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "event",
    [
        Collected(nodeids=["a.py::t", "a.py::u"]),
        Started(nodeid="a.py::t"),
        Warnings(nodeid="a.py::t", warnings=[{"message": "m"}]),
        _report("call"),
        Finished(nodeid="a.py::t"),
    ],
)
def test_every_event_crosses_the_wire_as_itself(event):
    line = protocol.encode_event(event)
    assert line.endswith("\n")
    assert line.count("\n") == 1
    assert protocol.decode_event(line.encode()) == event


def test_the_wire_format_is_kind_and_fields():
    assert protocol.encode_event(Started(nodeid="a.py::t")) == '{"event": "start", "nodeid": "a.py::t"}\n'


@pytest.mark.parametrize("line", [b'{"event": "stop", "nodeid": "x"}', b'{"event": "start", "id": "x"}'])
def test_a_line_that_is_no_event_is_refused_naming_it(line):
    with pytest.raises(ValueError, match="not an event of the rank-set protocol"):
        protocol.decode_event(line)


def test_every_event_type_has_its_handler():
    assert set(ctl._HANDLERS) == set(protocol.EVENT_TYPES.values())


# -- merging every rank's reports into one outcome (what rank 0 sends) ------------------------------


def _phases(**outcomes: str) -> dict:
    return {
        when: {"outcome": outcome, "duration": 0.5, "sections": [], "text": f"{when} {outcome} here"}
        for when, outcome in outcomes.items()
    }


def _merge(per_rank: dict) -> list[pytest.TestReport]:
    from pytest_megatron_fsdp.rank.agreement import merge_reports

    return merge_reports(FakeItem(), [], per_rank, 0, Path("/logs"))


def test_a_phase_failing_on_one_rank_fails_on_all_with_that_ranks_text():
    merged = _merge(
        {
            0: _phases(setup="passed", call="passed", teardown="passed"),
            1: _phases(setup="passed", call="failed", teardown="passed"),
        }
    )
    assert _outcomes(merged) == [("setup", "passed"), ("call", "failed"), ("teardown", "passed")]
    assert "call failed here" in merged[1].longreprtext
    assert "rank 1" in merged[1].longreprtext


def test_a_skip_on_some_ranks_is_a_skip_everywhere_naming_them():
    merged = _merge(
        {
            0: _phases(setup="passed", call="passed", teardown="passed"),
            1: _phases(setup="skipped", teardown="passed"),
        }
    )
    assert _outcomes(merged) == [("setup", "skipped"), ("teardown", "passed")]
    assert merged[0].longrepr[2] == "setup skipped here (skipped on rank 1 only; rank 0 did not skip)"


def test_a_failed_call_behind_another_ranks_skip_does_not_vanish():
    merged = _merge(
        {
            0: _phases(setup="skipped", teardown="passed"),
            1: _phases(setup="passed", call="failed", teardown="passed"),
        }
    )
    assert _outcomes(merged)[0] == ("setup", "failed")
    assert "call failed here" in merged[0].longreprtext


def test_a_failure_on_one_rank_wins_over_a_skip_on_another():
    merged = _merge(
        {
            0: _phases(setup="passed", call="skipped", teardown="passed"),
            1: _phases(setup="passed", call="failed", teardown="passed"),
        }
    )
    assert _outcomes(merged) == [("setup", "passed"), ("call", "failed"), ("teardown", "passed")]


# -- the real duration of a failure the controller makes itself (JUnit time=, --durations) ---------


def _timed_report(when: str, duration: float) -> Report:
    location = ("test_x.py", 4, "test_x")
    report = pytest.TestReport(NODEID, location, {}, "passed", None, when, duration=duration)
    return Report(report=json.loads(json.dumps(report._to_json())))


def test_a_timeout_carries_the_time_the_test_ran_and_its_kind(fake_clock):
    hang = PostMortem(world_size=2, returncode=-9)
    rank_set = FakeRankSet([[], [Started(nodeid=NODEID)]], exits=False, post_mortem=hang, finished=1)
    reports = _watch(rank_set, FakeItem(timeout_s=10.0))
    killed_at = rank_set.calls[1][1]
    started_at = 0.05
    # from the test's start to the kill: its 10 s timeout, the grace, the second for the stacks
    assert reports[0].duration == pytest.approx(killed_at - started_at)
    assert reports[0].duration > 10.0 + ctl.KILL_GRACE_S
    assert reports[0].mfsdp_failure == "timeout"


def test_a_death_carries_the_time_since_the_test_started_less_its_reported_phases(fake_clock):
    waiting = [[] for _ in range(100)]  # 100 polls, 0.05 s apart: 5 s
    rank_set = FakeRankSet(
        [[Started(nodeid=NODEID)], *waiting, [_timed_report("setup", 2.0)], *waiting],
        post_mortem=SIGSEGV_ON_RANK_1,
    )
    reports = _watch(rank_set)
    assert _outcomes(reports) == [("setup", "passed"), ("call", "failed")]
    died_at = fake_clock[0]
    assert reports[1].duration == pytest.approx(died_at - 2.0)  # setup's 2 s are its own report's
    assert died_at > 10.0 - 0.1
    assert reports[1].mfsdp_failure == "rank-death"
    # the watchdog's own timeout (its banner in a log), reported by the rank set's exit: a timeout
    timed_out = PostMortem(world_size=2, returncode=1, exits={0: 124}, timed_out=[0, 1])
    reports = _watch(FakeRankSet([[Started(nodeid=NODEID)]], post_mortem=timed_out))
    assert reports[-1].mfsdp_failure == "timeout"
