"""Metrics from real 2-rank training runs, in both modes: JSON report, JUnit properties, summary.

One pytester session per mode trains a few runs (tiny preset, CPU ranks): two iteration counts,
an absurd learning rate (NaN losses), and a test that records checkpoint figures.
"""

import json
import os
import statistics
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import jsonschema
import pytest

from pytest_megatron_fsdp import PRESETS
from pytest_megatron_fsdp.reporting.report import report_schema

SCHEMA = report_schema()  # the package data file, as an installed wheel ships it

RUNS = """
import resource
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pytest_megatron_fsdp.metrics import checkpoint_size_bytes, record_checkpoint, run_records

pytestmark = pytest.mark.distributed(world_size=2)


@pytest.mark.parametrize("iters", [3, 6])
def test_iters(megatron_fsdp_run, run_config, iters):
    run_config.train.train_iters = iters
    megatron_fsdp_run(run_config).train()


def test_absurd_lr(megatron_fsdp_run, run_config):
    run_config.optimizer.lr = 1e30
    run_config.ddp.check_for_nan_in_grad = False
    megatron_fsdp_run(run_config).train(4)


def test_reduced_across_ranks(request, megatron_fsdp_run, run_config, dist_env):
    if dist_env.rank == 1:
        ballast = bytearray(300 * 2**20)  # rank 1's peak RSS is well above rank 0's
        ballast[::4096] = b"x" * len(ballast[::4096])
    result = megatron_fsdp_run(run_config).train(3)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
    mine = torch.tensor([rss, *result.step_times_s], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist_env.world_size)]
    dist.all_gather(every, mine)
    if dist_env.rank == 0:
        record = run_records(request)[-1]
        expected = torch.stack(every).max(dim=0).values.tolist()
        assert record.step_times_s == expected[1:]  # each step: the slower rank's time
        # Peaks only grow, and these were read after the record's: rank 1's (with its ballast), not
        # rank 0's own, and not a sum.
        assert every[0][0] + 200 * 2**20 < record.peak_memory_bytes <= every[1][0]
        assert record.step_times_s == expected[1:]


def test_checkpoint(request, megatron_fsdp_run, run_config, dist_env):
    record_checkpoint(request, load_s=0.125)  # before any run: kept for the test's next run record
    run = megatron_fsdp_run(run_config)
    run.train(2)
    start = time.perf_counter()
    if dist_env.rank == 0:
        torch.save({"w": torch.ones(5000)}, "ckpt.pt")
    dist.barrier()
    record_checkpoint(run, bytes=checkpoint_size_bytes("ckpt.pt"), save_s=time.perf_counter() - start)
"""


def _check_report(path: Path, mode: str, workdir: Path) -> dict:
    report = json.loads(path.read_text())
    jsonschema.validate(report, SCHEMA, cls=jsonschema.Draft202012Validator)
    assert report["mode"] == mode
    runs = {r["nodeid"].split("::")[-1]: r for r in report["runs"]}
    assert sorted(runs) == sorted(
        ["test_iters[3]", "test_iters[6]", "test_absurd_lr", "test_reduced_across_ranks", "test_checkpoint"]
    )
    for run in report["runs"]:  # every series is as long as the run was
        assert run["iterations"] == len(run["losses"]) == len(run["grad_norms"]) == len(run["step_times_s"])
    assert runs["test_reduced_across_ranks"]["iterations"] == 3  # train(3), not train_iters
    tiny = PRESETS["tiny"]
    for iters in (3, 6):
        run = runs[f"test_iters[{iters}]"]
        assert run["iterations"] == iters
        assert len(run["losses"]) == len(run["grad_norms"]) == len(run["step_times_s"]) == iters
        assert run["first_loss"] == run["losses"][0]
        assert run["last_loss"] == run["losses"][-1]
        assert run["tokens_per_step"] == tiny.micro_batch_size * tiny.seq_length * 1 * 2
        mean_step = statistics.mean(run["step_times_s"][1:])
        assert run["ms_per_step"] == pytest.approx(1000 * mean_step)
        assert run["tokens_per_s"] == pytest.approx(run["tokens_per_step"] / mean_step)
        assert run["peak_memory_kind"] == "max_rss"
        assert run["peak_memory_bytes"] > 100 * 2**20  # a process with torch and megatron loaded
    # the 6-iteration run continues past the 3-iteration one's length: a real series, not padding
    assert runs["test_iters[6]"]["losses"][:3] == runs["test_iters[3]"]["losses"]
    absurd = runs["test_absurd_lr"]
    assert absurd["last_loss"] == "NaN"
    assert absurd["losses"][-1] == "NaN"
    assert runs["test_checkpoint"]["checkpoint"]["bytes"] == (workdir / "ckpt.pt").stat().st_size
    assert runs["test_checkpoint"]["checkpoint"]["load_s"] == 0.125
    assert runs["test_checkpoint"]["checkpoint"]["save_s"] > 0
    return runs


def _check_junit(path: Path) -> None:
    cases = {c.get("name"): c for c in ET.parse(path).getroot().iter("testcase")}
    props = {name: {p.get("name"): p.get("value") for p in c.iter("property")} for name, c in cases.items()}
    assert props["test_iters[3]"]["mfsdp.iterations"] == "3"
    assert props["test_iters[6]"]["mfsdp.iterations"] == "6"
    assert props["test_iters[6]"]["mfsdp.strategy"] == "optim_grads_params"
    assert float(props["test_iters[6]"]["mfsdp.tokens_per_s"]) > 0
    assert props["test_absurd_lr"]["mfsdp.last_loss"] == "NaN"
    assert props["test_checkpoint"]["mfsdp.checkpoint_load_s"] == "0.125"


def _check_summary(stdout: str) -> None:
    assert "megatron-fsdp training runs" in stdout
    lines = stdout.splitlines()
    lines = lines[lines.index(next(x for x in lines if "megatron-fsdp training runs" in x)) :]
    absurd = lines[lines.index(next(x for x in lines if x.endswith("::test_absurd_lr"))) + 2]
    assert "→ NaN" in absurd
    assert "×" in absurd
    six = lines[lines.index(next(x for x in lines if x.endswith("::test_iters[6]"))) + 2]
    assert " 6 " in six
    assert "max RSS" in six
    assert "checkpoint:" in stdout


def test_plain_mode_report_junit_and_summary(pytester):
    pytester.makepyfile(test_runs=RUNS)
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "--mfsdp-platform=cpu",
        "--mfsdp-report-json=out/report.json",
        "--junitxml=out/junit.xml",
        "--mfsdp-log-dir=logs",
        "--mfsdp-plot=out/loss.png",
        timeout=400,
    )
    result.assert_outcomes(passed=5)
    # The launched ranks get the parent's flags too, but only the parent writes the report.
    rank_logs = [p.read_text() for p in (pytester.path / "logs").rglob("rank*.log")]
    assert len(rank_logs) == 2
    assert all("START test_runs.py::test_checkpoint" in log for log in rank_logs)
    assert not [log for log in rank_logs if "JSON report:" in log or "training runs" in log]
    _check_report(pytester.path / "out" / "report.json", "plain", pytester.path)
    _check_junit(pytester.path / "out" / "junit.xml")
    _check_summary(result.stdout.str())
    plot = pytester.path / "out" / "loss.png"
    result.stdout.fnmatch_lines([f"loss plot: {plot}"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_torchrun_mode_report_junit_and_summary(pytester, torchrun_pytest):
    pytester.makepyfile(test_runs=RUNS)
    # Environment, not flag, for the report: the options registry's env route, as CI would set it.
    env = dict(os.environ)  # plain: tests/conftest.py's plain_environment removed torchrun variables
    env["MFSDP_REPORT_JSON"] = "out/report.json"
    done = subprocess.run(
        torchrun_pytest("-p", "no:cacheprovider", "--mfsdp-platform=cpu", "--junitxml=out/junit.xml"),
        cwd=pytester.path,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "5 passed" in done.stdout
    _check_report(pytester.path / "out" / "report.json", "torchrun", pytester.path)
    _check_junit(pytester.path / "out" / "junit.xml")
    _check_summary(done.stdout)
