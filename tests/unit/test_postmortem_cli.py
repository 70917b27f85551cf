"""``python -m pytest_megatron_fsdp``, in process, on artefacts made here in the shapes the plugin and
torch write them: flight-recorder dumps (pickles of torch's dump dict), rank logs with
faulthandler's stack dumps, the JSON report (written by the report module itself)."""

from __future__ import annotations

import faulthandler
import io
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_records import run_record

from pytest_megatron_fsdp import postmortem
from pytest_megatron_fsdp.reporting.report import report_document, write_json
from pytest_megatron_fsdp.wire import explain, flight_recorder, rank_dir
from pytest_megatron_fsdp.wire.explain import PostMortem

SECOND = 1_000_000_000
NODEID = "test_stuck.py::test_rank1_skips_the_broadcast"
REPO = Path(__file__).resolve().parents[2]


def fr_entry(record_id, seq, op, sizes, retired, created_s, group=("0", "default_pg")):
    """One entry of a gloo rank's flight-recorder dump, key for key as torch 2.14.1 writes it without
    stack traces (gloo leaves every entry "scheduled"; ``retired`` says it completed)."""
    return {
        "collective_seq_id": seq,
        "input_dtypes": ["Float"],
        "input_sizes": sizes,
        "is_p2p": False,
        "op_id": seq,
        "output_dtypes": ["Float"],
        "output_sizes": sizes,
        "p2p_seq_id": 0,
        "pg_id": 0,
        "process_group": group,
        "profiling_name": f"gloo:{op}",
        "record_id": record_id,
        "retired": retired,
        "state": "scheduled",
        "thread_id": "140172998839168",
        "thread_name": "python",
        "time_created_ns": created_s * SECOND,
        "time_discovered_completed_ns": None,
        "time_discovered_started_ns": None,
        "timeout_ms": 120000,
    }


def fr_dump(entries, world_size=2):
    """A rank's whole dump around ``entries``, as the harness writes it (pg_config completed)."""
    return {
        "version": "2.10",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(world_size)))}},
        "comm_lib_version": "",
        "pg_status": {
            "0": {
                "last_completed_collective": 1,
                "last_enqueued_collective": 2,
                "last_started_collective": -1,
            }
        },
        "entries": entries,
    }


def write_hang(run_dir: Path, dumped_s: int = 36, legacy: bool = False) -> None:
    """A rank set's log dir after ``NODEID`` timed out: rank 0 waits in broadcast #2, which rank 1
    never entered; both ranks' dumps written at ``dumped_s``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    traces = {
        0: fr_dump(
            [
                fr_entry(0, 1, "all_reduce", [[4]], True, 10),
                fr_entry(1, 2, "broadcast", [[3]], False, 11),
            ]
        ),
        1: fr_dump([fr_entry(0, 1, "all_reduce", [[4]], True, 10)]),
    }
    for rank, trace in traces.items():
        path = run_dir / f"rank{rank}.fr" if legacy else rank_dir.dump_path(run_dir, rank)
        path.write_bytes(pickle.dumps(trace))
        os.utime(path, ns=(dumped_s * SECOND, dumped_s * SECOND))
        (run_dir / f"rank{rank}.expired").write_text(NODEID)
        (run_dir / f"rank{rank}.log").write_text(f"[10:00:00] START {NODEID} (timeout 6 s)\n")


def cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = postmortem.main(list(argv), out=out)
    return code, out.getvalue()


# -- collectives ----------------------------------------------------------------------------------


def test_collectives_lists_each_rank_and_names_the_first_mismatch(tmp_path):
    write_hang(tmp_path / "batch1-world2")
    code, out = cli("collectives", str(tmp_path / "batch1-world2"))
    assert code == 0, out
    lines = out.splitlines()
    assert f"timed-out test: {NODEID}" in lines
    assert "rank 0: last 2 of 2 collectives recorded" in lines
    assert "  #1 (all_reduce, default_pg, sizes [[4]]) completed" in lines
    assert (
        "  #2 (broadcast, default_pg, sizes [[3]]) scheduled, not completed 25.0 s after it was issued"
        in lines
    )
    assert "rank 1: last 1 of 1 collectives recorded" in lines
    assert (
        "first mismatch: rank 1 never entered collective #2 (broadcast, default_pg) that rank 0 has waited "
        "in for 25.0 s"
    ) in lines
    assert f"torch's analyser: torchfrtrace {tmp_path / 'batch1-world2'} -p flight_recorder_rank_" in lines


def test_collectives_with_no_mismatch_says_so(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for rank in range(2):
        trace = fr_dump([fr_entry(0, 1, "all_reduce", [[4]], True, 10)])
        rank_dir.dump_path(run_dir, rank).write_bytes(pickle.dumps(trace))
    code, out = cli("collectives", str(run_dir), "--last", "1")
    assert code == 0
    assert "first mismatch: none (every rank recorded the same collectives)" in out.splitlines()


def test_collectives_reads_the_dumps_earlier_versions_named_rank_r_fr(tmp_path):
    write_hang(tmp_path / "old", legacy=True)
    code, out = cli("collectives", str(tmp_path / "old"))
    assert code == 0, out
    assert "rank 1 never entered collective #2 (broadcast, default_pg)" in out


def test_a_dump_under_the_current_name_wins_over_one_under_the_earlier_name(tmp_path):
    write_hang(tmp_path)
    # an older dump of rank 1 in which it did enter the broadcast: not this run's
    both = [fr_entry(0, 1, "all_reduce", [[4]], True, 10), fr_entry(1, 2, "broadcast", [[3]], False, 11)]
    (tmp_path / "rank1.fr").write_bytes(pickle.dumps(fr_dump(both)))
    code, out = cli("collectives", str(tmp_path))
    assert code == 0, out
    assert "rank 1: last 1 of 1 collectives recorded" in out.splitlines()


def test_collectives_finds_the_newest_run_with_dumps_under_the_default_log_dir(tmp_path, monkeypatch):
    logs = tmp_path / "project" / ".pytest_cache" / "d" / "mfsdp-logs"
    write_hang(logs / "batch1-world2", dumped_s=46)
    write_hang(logs / "batch2-world2", dumped_s=36)
    for path in (logs / "batch2-world2").iterdir():
        os.utime(path, (100, 100))  # older than batch1's files (a name says nothing about age)
    (logs / "batch3-world2").mkdir()  # newest of all, but no dump in it
    (logs / "batch3-world2" / "rank0.log").write_text("[10:00:00] START t.py::test_ok (timeout 6 s)\n")
    monkeypatch.chdir((tmp_path / "project" / "tests").mkdir() or tmp_path / "project" / "tests")
    code, out = cli("collectives")
    assert code == 0, out
    assert out.splitlines()[0].startswith(f"flight-recorder dumps in {logs / 'batch1-world2'}:"), out


def test_the_log_dir_from_the_environment_wins(tmp_path, monkeypatch):
    write_hang(tmp_path / "mine" / "torchrun")
    monkeypatch.setenv("MFSDP_LOG_DIR", str(tmp_path / "mine"))
    monkeypatch.chdir(tmp_path)
    code, out = cli("collectives")
    assert code == 0, out
    assert f"flight-recorder dumps in {tmp_path / 'mine' / 'torchrun'}:" in out


def test_no_dumps_is_one_line_saying_where_it_looked(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "rank0.log").write_text("")
    code, out = cli("collectives", str(tmp_path))
    assert code == 1
    assert out == ""
    assert capsys.readouterr().err == (
        f"python -m pytest_megatron_fsdp collectives: no flight-recorder dumps under {tmp_path}\n"
    )


# -- the failure report names both commands ---------------------------------------------------------


def test_a_timeout_report_names_the_commands_that_read_the_dumps(tmp_path):
    write_hang(tmp_path)
    text = explain.death_text(PostMortem(2, -9, log_dir=tmp_path, timed_out=[0, 1]), 6.0, killed_after=6.0)
    assert f"  summary again: python -m pytest_megatron_fsdp collectives {tmp_path}" in text.splitlines()
    assert f"  torch's analyser: torchfrtrace {tmp_path} -p flight_recorder_rank_" in text.splitlines()


def test_a_missing_dump_asks_torchfrtrace_for_a_partial_analysis(tmp_path):
    write_hang(tmp_path)
    rank_dir.dump_path(tmp_path, 1).unlink()
    lines = flight_recorder.section(tmp_path, 2, 36 * SECOND)
    assert (
        f"  torch's analyser: torchfrtrace {tmp_path} -p flight_recorder_rank_ --allow-incomplete-ranks"
        in lines
    )


def test_no_dumps_no_commands(tmp_path):
    (tmp_path / "rank0.log").write_text("")
    text = explain.death_text(PostMortem(2, -9, log_dir=tmp_path, timed_out=[0, 1]), 6.0, killed_after=6.0)
    assert "pytest_megatron_fsdp collectives" not in text
    assert "torchfrtrace" not in text


def test_dump_names_are_what_torchfrtrace_parses(tmp_path):
    """torchfrtrace takes every file whose name holds the prefix and reads the rank from what follows
    it (``int(name[len(prefix):])``); nothing else the ranks write beside their logs holds it."""
    names = [rank_dir.dump_path(tmp_path, r).name for r in (0, 1, 12)]
    assert [int(n[len(rank_dir.DUMP_PREFIX) :]) for n in names] == [0, 1, 12]
    others = ["rank0.log", "rank0.pid", "rank0.expired", "rank0.aligned", "torchrun.log", "rank0.fr"]
    assert not any(rank_dir.DUMP_PREFIX in name for name in others)


def test_a_gloo_records_nameless_group_config_is_completed_for_torchfrtrace():
    """A gloo rank's record as torch 2.13.0/2.14.1 write it: the group's config under the name "",
    its entries naming group "0". The dump completes the config from torch.distributed's registry
    (the shape of ``_registered_groups``) and keeps what torch named itself."""
    trace = fr_dump([fr_entry(0, 1, "all_reduce", [[4]], True, 10)])
    trace["pg_config"] = {"": {"name": "", "desc": "", "ranks": "[0, 1]"}}
    groups = {
        "0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"},
        "1": {"name": "1", "desc": "undefined", "ranks": "[1]"},
    }
    assert flight_recorder.complete_pg_config(trace, groups)["pg_config"] == groups
    named = {**trace, "pg_config": {"0": {"name": "0", "desc": "torch's own", "ranks": "[0, 1]"}}}
    assert flight_recorder.complete_pg_config(named, groups)["pg_config"]["0"]["desc"] == "torch's own"
    assert flight_recorder.complete_pg_config(trace, {}) == trace  # nothing known: left as torch wrote it


# -- stacks ---------------------------------------------------------------------------------------


def _faulthandler_dump(tmp_path: Path) -> str:
    """faulthandler's own all-threads dump (the format the ranks write into their logs)."""
    with open(tmp_path / "dump.txt", "w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read()


def test_stacks_shows_each_ranks_dump_with_why(tmp_path):
    run_dir = tmp_path / "batch1-world2"
    run_dir.mkdir()
    dump = _faulthandler_dump(tmp_path)
    banner = f"{rank_dir.TIMEOUT_BANNER}: {NODEID} exceeded its 6 s timeout on rank 0; stacks follow"
    (run_dir / "rank0.log").write_text(f"[10:00:00] START {NODEID} (timeout 6 s)\n{banner}\n{dump}after\n")
    (run_dir / "rank1.log").write_text(f"[10:00:00] START {NODEID} (timeout 6 s)\n")
    code, out = cli("stacks", str(tmp_path))
    assert code == 0, out
    lines = out.splitlines()
    assert lines[1] == f"rank 0: 1 stack dump in {run_dir / 'rank0.log'}"
    assert lines[2] == f"  {banner}"
    # the dump's own first line (another thread's, where earlier tests left threads running)
    assert lines[3] == f"  {dump.splitlines()[0]}"
    assert any(line.startswith("  Current thread 0x") for line in lines)
    assert "test_stacks_shows_each_ranks_dump_with_why" in out  # this test's frame, from the dump
    assert "after" not in lines  # the dump ends where faulthandler's output does
    assert f"rank 1: no stack dump in {run_dir / 'rank1.log'}" in lines
    code, out = cli("stacks", str(run_dir), "--rank", "1")
    assert out.splitlines()[1:] == [f"rank 1: no stack dump in {run_dir / 'rank1.log'}"]


def test_stacks_of_faulthandlers_own_watchdog_say_why(tmp_path):
    """The ranks' backup watchdog in C (``faulthandler.dump_traceback_later``) starts its dump with
    ``Timeout (h:mm:ss)!``; made here for real, not written by hand."""
    with open(tmp_path / "rank0.log", "w") as log:
        faulthandler.dump_traceback_later(0.01, file=log)
        time.sleep(0.3)
        faulthandler.cancel_dump_traceback_later()
    code, out = cli("stacks", str(tmp_path))
    assert code == 0, out
    lines = out.splitlines()
    assert lines[2].startswith("  Timeout (0:00:00"), out
    assert lines[3].startswith("  Thread 0x"), out


#: what only the rank directory's module may spell: its file names and the log lines read back
RANK_DIR_SPELLINGS = (
    "MFSDP-TIMEOUT",
    "flight_recorder_rank_",
    "torchrun.log",
    ".expired",
    ".aligned",
    ".pid",
    "START ",
)


def _literal_texts(path):
    """Every string literal of a module but its docstrings, f-strings' literal parts included."""
    import ast

    tree = ast.parse(path.read_text())
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
    ]


def test_only_the_rank_dir_module_spells_the_rank_directory():
    """Writers (rank/), readers (parent/, wire/explain.py, postmortem) and the flight recorder take every
    name and line format of the rank directory from wire/rank_dir.py: a second spelling drifts apart."""
    package = Path(postmortem.__file__).parent
    found = [
        f"{path.relative_to(package)}: {text!r}"
        for path in sorted(package.rglob("*.py"))
        if path.name != "rank_dir.py" or path.parent.name != "wire"
        for text in _literal_texts(path)
        if any(spelling in text for spelling in RANK_DIR_SPELLINGS)
        or (text.startswith("rank") and text.endswith(".log"))
    ]
    assert found == []


# -- the JSON report ------------------------------------------------------------------------------


def _record(nodeid, losses):
    return run_record(losses, nodeid, checkpoint_bytes=2048, checkpoint_save_s=0.5, checkpoint_load_s=0.25)


def test_report_is_the_sessions_table_and_a_loss_plot(tmp_path):
    records = [
        _record("t.py::test_a", [10.0, 9.0, 8.0, 7.0]),
        _record("t.py::test_nan", [10.0, float("nan"), 9.0]),
    ]
    write_json(tmp_path / "r.json", report_document(records, "plain"))
    code, out = cli("report", str(tmp_path / "r.json"))
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].startswith(f"{tmp_path / 'r.json'}: 2 runs, plain mode, written ")
    assert "t.py::test_a" in lines
    assert "t.py::test_nan" in lines
    assert any("10.0000 → 7.0000" in line for line in lines)
    assert "  checkpoint: 2.0 KiB, save 0.500 s, load 0.250 s" in lines
    plot = lines[lines.index("lm loss per iteration: t.py::test_a (optim_grads_params, tiny)") + 1 :]
    # 4 points from 10 (top row) to 7 (bottom row): a falling line
    assert plot[0] == "  10.0000 |*"
    assert plot[11] == "   7.0000 |   *"
    nan_plot = lines[lines.index("lm loss per iteration: t.py::test_nan (optim_grads_params, tiny)") + 1 :]
    assert nan_plot[11] == "   9.0000 | x*"  # the NaN (iteration 2) is shown, on the bottom row


def test_report_plot_is_optional_and_a_png_is_written_with_matplotlib(tmp_path):
    write_json(tmp_path / "r.json", report_document([_record("t.py::test_a", [3.0, 2.0])], "torchrun"))
    code, out = cli("report", str(tmp_path / "r.json"), "--no-plot")
    assert code == 0
    assert "lm loss per iteration" not in out
    pytest.importorskip("matplotlib")
    code, out = cli("report", str(tmp_path / "r.json"), "--png", str(tmp_path / "loss.png"))
    assert code == 0
    assert f"loss plot: {tmp_path / 'loss.png'}" in out
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_needs_a_path_and_a_report(tmp_path, monkeypatch, capsys):
    code, _ = cli("report")
    assert code == 1
    assert (
        "pass the file that --mfsdp-report-json wrote (or set MFSDP_REPORT_JSON)" in capsys.readouterr().err
    )
    (tmp_path / "other.json").write_text('{"schema_version": 7}')
    monkeypatch.setenv("MFSDP_REPORT_JSON", str(tmp_path / "other.json"))
    code, _ = cli("report")
    assert code == 1
    assert f"{tmp_path / 'other.json'}: schema_version 7, expected 1" in capsys.readouterr().err


# -- show -----------------------------------------------------------------------------------------


def test_show_prints_the_last_failed_tests_part_of_every_rank_log(tmp_path, capsys):
    run_dir = tmp_path / "batch1-world2"
    run_dir.mkdir()
    for rank in range(2):
        failed = f"FAILED t.py::test_bad (call) on rank {rank}:\nAssertionError: rank {rank} says no\n"
        (run_dir / f"rank{rank}.log").write_text(
            "[09:59:59] START t.py::test_early (timeout 6 s)\n"
            + ("FAILED t.py::test_early (setup) on rank 0:\nValueError: early\n" if rank == 0 else "")
            + f"[10:00:00] START t.py::test_ok (timeout 6 s)\n"
            f"[10:00:01] START t.py::test_bad (timeout 6 s)\n{failed}"
            f"[10:00:02] START t.py::test_after (timeout 6 s)\n"
        )
    (run_dir / "torchrun.log").write_text("")
    code, out = cli("show", "--log-dir", str(tmp_path))
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == f"t.py::test_bad in {run_dir}"
    assert "AssertionError: rank 1 says no" in lines
    assert "AssertionError: rank 0 says no" in lines
    # the last of the failed tests (test_early failed too), and only its part of the logs
    assert not any(name in line for line in lines[1:] for name in ("test_after", "test_ok", "test_early"))
    assert lines[-1] == f"torchrun's output: {run_dir / 'torchrun.log'}"
    code, out = cli("show", "test_ok", "--log-dir", str(run_dir))
    assert code == 0
    assert out.splitlines()[0] == f"t.py::test_ok in {run_dir} (no failure recorded)"
    code, out = cli("show", "t.py::test_", "--log-dir", str(run_dir))
    assert code == 1
    assert out == ""
    assert capsys.readouterr().err == (
        "python -m pytest_megatron_fsdp show: 't.py::test_' matches 2 tests: "
        "t.py::test_early, t.py::test_bad\n"
    )


def test_show_of_a_timed_out_test_includes_the_collectives(tmp_path):
    write_hang(tmp_path / "run")
    code, out = cli("show", "--log-dir", str(tmp_path))
    assert code == 0, out
    assert out.splitlines()[0] == f"{NODEID} in {tmp_path / 'run'}"
    assert "rank 1 never entered collective #2 (broadcast, default_pg)" in out


# -- no torch -------------------------------------------------------------------------------------

#: runs the CLI in an interpreter where importing torch (and pytest, numpy, ...) fails
WITHOUT_TORCH = Path(__file__).with_name("postmortem_without_torch.py")


def test_the_cli_runs_where_torch_cannot_be_imported(tmp_path):
    write_hang(tmp_path / "run")
    write_json(tmp_path / "r.json", report_document([_record("t.py::test_a", [3.0, 2.0])], "plain"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    blocked = subprocess.run(
        [sys.executable, str(WITHOUT_TORCH), "--check-blocker"], capture_output=True, text=True, env=env
    )
    assert "torch is blocked in this test" in blocked.stderr  # the blocker works
    for argv in (
        ["collectives", str(tmp_path / "run")],
        ["report", str(tmp_path / "r.json")],
        ["show", "--log-dir", str(tmp_path)],
    ):
        done = subprocess.run(
            [sys.executable, str(WITHOUT_TORCH), *argv], capture_output=True, text=True, env=env, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout
