"""``make gpu-check`` (bench/gpu_check.py): without a GPU it stops in one line and never runs on CPU
ranks; its table carries each test's outcome and first run's figures."""

import json

import pytest
import torch

from bench import gpu_check


def test_without_a_gpu_it_stops_in_one_line_before_running_anything(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def no_run(*args, **kwargs):
        raise AssertionError(f"started {args}")

    monkeypatch.setattr(gpu_check.subprocess, "run", no_run)
    assert gpu_check.main(["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == gpu_check.NO_GPU + "\n"
    assert "never falls back to CPU ranks" in err
    assert not (tmp_path / "out").exists()


def test_with_a_gpu_it_runs_the_subset_on_cuda_against_golden_values(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(gpu_check, "gpu_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(gpu_check, "stack_line", lambda: "torch 2.14.1, megatron-core 0.19.2")
    commands = []

    def run(command, timeout):
        commands.append(command)
        out = tmp_path / "out"
        (out / "junit.xml").write_text(
            '<testsuites><testsuite><testcase name="test_a[x]"/>'
            '<testcase name="test_b"><failure message="boom"/></testcase>'
            '<testcase name="test_c"><skipped message="why"/></testcase></testsuite></testsuites>'
        )
        run_a = {"nodeid": "t.py::test_a[x]", "preset": "bridge-reference", "first_loss": 9.262,
                 "last_loss": 8.0277, "ms_per_step": 71.2, "peak_memory_bytes": 800 * 2**20}  # fmt: skip
        (out / "report.json").write_text(json.dumps({"runs": [run_a]}))
        return gpu_check.subprocess.CompletedProcess(command, 1)

    monkeypatch.setattr(gpu_check.subprocess, "run", run)
    assert (
        gpu_check.main(["--out", str(tmp_path / "out"), "--golden-mode", "record"]) == 1
    )  # the run's status
    (command,) = commands
    assert gpu_check.SUBSET in command
    assert "--mfsdp-platform=cuda" in command  # never auto: too few GPUs is an error, not CPU ranks
    assert "--mfsdp-golden-mode=record" in command
    assert f"--mfsdp-golden={gpu_check.GOLDEN}" in command
    table = (tmp_path / "out" / "table.md").read_text()
    assert table in capsys.readouterr().out
    assert ", one NVIDIA H200, torch 2.14.1, megatron-core 0.19.2" in table.splitlines()[0]
    assert "| `test_a[x]` | passed | bridge-reference | 9.2620 → 8.0277 | 71 | 800 MiB |" in table
    assert "| `test_b` | failed | | | | |" in table
    assert "| `test_c` | skipped (why) | | | | |" in table


def test_another_golden_mode_is_refused_by_argparse():
    with pytest.raises(SystemExit):
        gpu_check.main(["--golden-mode", "neither"])
