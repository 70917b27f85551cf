"""Failure output a person reads at a glance: one traceback for an error every rank raised alike,
no note about a rank set that ended normally, the note on its own line when one did not, and no
log line the CPU emulation causes.

The pure parts here (the merged failure text, the log filter, xfail reasons); the plain-mode
sessions of 2 CPU ranks, read as a user would, are tests/integration/test_messages_sessions.py.
"""

import logging
from pathlib import Path

from pytest_megatron_fsdp.emulation.cpu_mode import EMULATED_DEVICE_WARNING, MEGATRON_FSDP_LOGGERS
from pytest_megatron_fsdp.rank.agreement import error_signature, failure_text

LOGS = Path("/logs")
TRACEBACK = """\
dist_env = DistEnv(rank={rank}, world_size=2)
run = <pytest_megatron_fsdp.fsdp.training.TrainingRun object at 0x7f{address}>

    def test_x(dist_env, run):
>       assert run.loss < 1, "the loss is 4.2"
E       AssertionError: the loss is 4.2
E       assert 4.2 < 1
E        +  where 4.2 = <TrainingRun object at 0x7f{address}>.loss

test_x.py:9: AssertionError"""


def test_an_error_every_rank_raised_alike_is_shown_once_with_every_log():
    text = failure_text(
        {0: TRACEBACK.format(rank=0, address="aa11ee"), 1: TRACEBACK.format(rank=1, address="bb22ff")},
        [],
        LOGS,
    )
    lines = text.splitlines()
    assert lines[0] == "failed on ranks 0, 1 (same error)"
    assert lines[1] == "---------- ranks 0, 1 (logs: /logs/rank0.log, /logs/rank1.log) ----------"
    assert text.count("E       AssertionError: the loss is 4.2") == 1
    assert "DistEnv(rank=0" in text
    assert "DistEnv(rank=1" not in text  # rank 0's own traceback


def test_different_errors_are_each_shown_under_their_ranks():
    other = TRACEBACK.format(rank=2, address="cc").replace("the loss is 4.2", "the loss is nan")
    text = failure_text(
        {0: TRACEBACK.format(rank=0, address="aa"), 1: other, 3: TRACEBACK.format(rank=3, address="dd")},
        [2],
        LOGS,
    )
    lines = text.splitlines()
    assert lines[0] == "failed on ranks 0, 1, 3 (passed on 2)"
    assert "---------- ranks 0, 3 (logs: /logs/rank0.log, /logs/rank3.log) ----------" in lines
    assert "---------- rank 1 (log: /logs/rank1.log) ----------" in lines
    assert text.count("E       AssertionError: the loss is 4.2") == 1
    assert text.count("E       AssertionError: the loss is nan") == 1


def test_one_failing_rank_reads_as_before():
    text = failure_text({1: "boom"}, [0], LOGS)
    assert text.splitlines() == [
        "failed on rank 1 (passed on 0)",
        "---------- rank 1 (log: /logs/rank1.log) ----------",
        "boom",
    ]


def test_the_error_signature_is_the_exception_and_where_it_was_raised():
    a, b = TRACEBACK.format(rank=0, address="aa"), TRACEBACK.format(rank=1, address="bb")
    assert a != b
    assert error_signature(a) == error_signature(b)
    assert error_signature(a) == "E       AssertionError: the loss is 4.2\ntest_x.py:9: AssertionError"
    assert error_signature(a.replace("test_x.py:9", "test_x.py:10")) != error_signature(a)
    # without pytest's E-lines (--tb=native): the whole text, addresses masked
    native = 'File "x.py", line 3, in f\nValueError: <object at 0x7f1234>'
    assert error_signature(native) == 'File "x.py", line 3, in f\nValueError: <object at 0x?>'


def test_the_emulations_device_warning_is_dropped_and_nothing_else():
    def record(message):
        return logging.LogRecord(MEGATRON_FSDP_LOGGERS[0], logging.WARNING, "m.py", 1, message, None, None)

    emulated = (
        "[Rank 0] Megatron-FSDP is using device cpu instead of the current device cuda:0, which may cause "
        "process-to-device mapping issues"
    )
    assert not EMULATED_DEVICE_WARNING.filter(record(emulated))
    assert EMULATED_DEVICE_WARNING.filter(record(emulated.replace("device cpu", "device cuda:1")))
    assert EMULATED_DEVICE_WARNING.filter(record("Megatron-FSDP ran out of memory"))


def test_xfail_reasons_are_short_and_name_the_bug_and_its_upstream_reference():
    import importlib.util

    from pytest_megatron_fsdp.fsdp.versions import KNOWN_BUGS

    spec = importlib.util.spec_from_file_location(
        "functional_conftest", Path(__file__).parents[1] / "functional" / "conftest.py"
    )
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    for name, bug in KNOWN_BUGS.items():
        reason = conftest.short_reason(bug)
        assert len(reason) <= 100, reason
        assert reason.startswith(f"upstream bug {name} (")
        assert "fixed in" in reason or "no fix released" in reason
        if "no upstream report found" in bug.reason:
            # then the repo carries the reproduction (torch's gloo bug): it must exist
            path = bug.reason.split("reproduction: ")[1].split()[0]
            assert (Path(__file__).parents[2] / path).is_file(), path
        else:
            assert "PR #" in reason or "issue #" in reason
    assert conftest.short_reason(KNOWN_BUGS["no_shard_param_sync"]) == (
        "upstream bug no_shard_param_sync (Megatron-LM PR #3754; fixed in megatron-core 0.18)"
    )


def test_a_strict_xfail_that_passed_on_every_rank_headlines_with_its_own_line():
    line = "[XPASS(strict)] known bug x no longer reproduces with megatron-core 0.20.0: set fixed_in='0.20.0'"
    text = failure_text({0: line, 1: line}, [], LOGS)
    assert text.splitlines()[0] == f"{line} (failed on ranks 0, 1 (same error))"
    # an ordinary one-line failure keeps the ranks' summary as its headline
    assert (
        failure_text({0: "boom", 1: "boom"}, [], LOGS).splitlines()[0] == "failed on ranks 0, 1 (same error)"
    )
