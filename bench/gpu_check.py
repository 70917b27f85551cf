"""``make gpu-check``: the functional suite's world-size-1 subset on one GPU, and a dated table.

It runs ``tests/functional/test_world_size_one.py`` over NCCL on one GPU (``--mfsdp-platform=cuda``:
too few GPUs is an error there, never a CPU fallback): Megatron-FSDP against DDP, an fsdp_dtensor
round trip, and the bridge-reference preset in bf16 for 10 iterations, every training run compared
with its golden values at Megatron-LM's GPU tolerances (``tests/data/golden/<stack>/cuda/``). A
stack's first GPU run has none to compare with: ``--golden-mode=record`` writes them (then commit
them). Then it prints a table (test, outcome, preset, dtype, losses, ms/step, peak memory) headed by
the date, the GPU and the stack, for docs/cpu-mode-vs-gpus.md, and writes it beside the JUnit file
and the JSON report.

Without a CUDA GPU it stops at once with one line and exit status 2: it never runs on CPU ranks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

SUBSET = "tests/functional/test_world_size_one.py"
GOLDEN = "tests/data/golden"
#: the whole check on one GPU: the H200 of 2026-11-30 ran 10 bridge-reference steps at 71 ms/step
TIMEOUT_S = 480
NO_GPU = (
    "make gpu-check: no CUDA GPU visible (torch.cuda.is_available() is False): it runs only on a GPU and "
    "never falls back to CPU ranks; `make functional` runs the same file on one CPU rank"
)


def gpu_name() -> str | None:
    """The first GPU's name, None without one."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        return None
    return str(torch.cuda.get_device_name(0))


def stack_line() -> str:
    from pytest_megatron_fsdp.fsdp.versions import stack_description

    return stack_description()


def outcomes(junit: Path) -> dict[str, str]:
    """``{test name: passed | failed | error | skipped (reason)}`` from a JUnit file."""
    result: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "")
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
            elif child.tag == "skipped":
                outcome = f"skipped ({child.get('message', '')})"
        result[name] = outcome
    return result


def table(report: dict[str, Any], results: dict[str, str], heading: str) -> str:
    """The markdown table: one row per test (its first training run's figures), tests that ran no
    training run with their outcome only."""
    runs: dict[str, dict[str, Any]] = {}
    for run in report.get("runs", []):
        runs.setdefault(run["nodeid"].rpartition("::")[2], run)
    lines = [
        heading,
        "",
        "| test | outcome | preset | loss first → last | ms/step | peak memory |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, outcome in results.items():
        run = runs.get(name)
        if run is None:
            lines.append(f"| `{name}` | {outcome} | | | | |")
            continue
        memory = run.get("peak_memory_bytes")
        shown = f"{memory / 2**20:.0f} MiB" if memory else ""
        lines.append(
            f"| `{name}` | {outcome} | {run.get('preset', '')} | {run['first_loss']:.4f} → "
            f"{run['last_loss']:.4f} | {run.get('ms_per_step', 0):.0f} | {shown} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--golden-mode", choices=("compare", "record"), default="compare")
    parser.add_argument("--out", type=Path, default=Path(".pytest_cache/gpu-check"))
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds for the whole run")
    args = parser.parse_args(argv)
    gpu = gpu_name()
    if gpu is None:
        print(NO_GPU, file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    junit, report_path = args.out / "junit.xml", args.out / "report.json"
    command = [
        sys.executable, "-m", "pytest", SUBSET, "-v", "-p", "no:randomly", "--mfsdp-platform=cuda",
        f"--mfsdp-golden={GOLDEN}", f"--mfsdp-golden-mode={args.golden_mode}",
        f"--mfsdp-report-json={report_path}", f"--junitxml={junit}",
    ]  # fmt: skip
    try:
        status = subprocess.run(command, timeout=args.timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"make gpu-check: the run took longer than {args.timeout:g} s", file=sys.stderr)
        return 1
    if not junit.exists():
        return status or 1
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    heading = f"{datetime.date.today().isoformat()}, one {gpu}, {stack_line()}"
    text = table(report, outcomes(junit), heading)
    (args.out / "table.md").write_text(text)
    print(text)
    return status


if __name__ == "__main__":
    sys.exit(main())
