"""What the plugin adds to a training run: the smoke test against a bare torchrun script.

Side by side in one run, interleaved round by round (so machine noise hits all alike), medians
over ``--repeat`` rounds:

* bare: ``torchrun --standalone --nproc_per_node=2 bench/bench_harness_overhead.py --bare``: a
  process group, the same tiny GPT with Megatron-FSDP and the DistributedOptimizer (the package's
  ``TrainingRun``, no pytest), 10 iterations;
* plugin, torchrun mode: ``torchrun ... -m pytest tests/functional/...::test_fsdp_pretrain_basic``;
* plugin, plain mode: ``pytest tests/functional/...::test_fsdp_pretrain_basic`` (the plugin
  launches the rank set itself).

Two figures each: whole-process wall time (start to exit, as ``time`` sees it) and training-loop
time (sum of the 10 step times, slowest rank per step; the plugin's come from its JSON report).

Usage: python bench/bench_harness_overhead.py [--repeat N] [--platform cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST = "tests/functional/test_megatron_fsdp.py::TestMegatronFSDP::test_fsdp_pretrain_basic"
ITERATIONS = 10
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def bare(platform: str, out: Path) -> None:
    """One rank of the bare run (under torchrun): what the smoke test trains, without pytest."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if platform == "cpu":
        from pytest_megatron_fsdp.harness import cuda_emulation

        cuda_emulation.enable()  # before megatron is imported, as the plugin does
    import torch
    import torch.distributed as dist

    from pytest_megatron_fsdp.config import RunConfig, enable_megatron_fsdp
    from pytest_megatron_fsdp.environment import DistEnv
    from pytest_megatron_fsdp.fsdp.presets import DEFAULT_PRESET
    from pytest_megatron_fsdp.fsdp.training import TrainingRun

    device = "cpu"
    if platform == "cuda":
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    dist.init_process_group("nccl" if platform == "cuda" else "gloo")
    env = DistEnv(rank, world, local_rank, device, dist.get_backend(), platform, Path(tempfile.gettempdir()))
    cfg = enable_megatron_fsdp(RunConfig())
    cfg.model.preset = DEFAULT_PRESET[platform]
    cfg.train.train_iters = ITERATIONS
    run = TrainingRun(cfg, env)
    result = run.train()
    # Slowest rank per step, as the plugin reports it.
    times = torch.tensor(result.step_times_s, dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    if rank == 0:
        out.write_text(json.dumps({"step_times_s": times.tolist(), "losses": result.losses}))
    run.close()
    dist.destroy_process_group()


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS and not k.startswith("MFSDP_")}


def _timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return elapsed


def _loop_s(report: Path, key: str = "step_times_s") -> float:
    data = json.loads(report.read_text())
    times = data["runs"][0][key] if "runs" in data else data[key]
    assert len(times) == ITERATIONS, times
    return sum(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="rounds; medians are reported")
    parser.add_argument("--platform", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)  # a rank of the bare run
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare:
        bare(args.platform, args.out)
        return
    py = sys.executable
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    pytest_args = ["-q", "-p", "no:cacheprovider", f"--mfsdp-platform={args.platform}", TEST]
    figures: dict[str, dict[str, list[float]]] = {
        name: {"wall": [], "loop": []} for name in ("bare", "plugin-torchrun", "plugin-plain")
    }
    with tempfile.TemporaryDirectory(prefix="mfsdp-bench-") as tmp:
        # torchrun leaves a torchelastic_* dir in $TMPDIR on every launch: keep them in here.
        os.environ["TMPDIR"] = tmp
        out = Path(tmp) / "out.json"
        for round_ in range(args.repeat):
            runs = {
                "bare": [*torchrun, str(Path(__file__).resolve()), "--bare", f"--platform={args.platform}"]
                + [f"--out={out}"],
                "plugin-torchrun": [*torchrun, "-m", "pytest", *pytest_args, f"--mfsdp-report-json={out}"],
                "plugin-plain": [py, "-m", "pytest", *pytest_args, f"--mfsdp-report-json={out}"],
            }
            for name, cmd in runs.items():
                out.unlink(missing_ok=True)
                figures[name]["wall"].append(_timed(cmd))
                figures[name]["loop"].append(_loop_s(out))
            last = (f"{n} {f['wall'][-1]:.2f} s / loop {f['loop'][-1]:.3f} s" for n, f in figures.items())
            print(f"round {round_ + 1}: " + ", ".join(last), flush=True)
    med = {n: {k: statistics.median(v) for k, v in f.items()} for n, f in figures.items()}
    print(f"\nmedians over {args.repeat} rounds ({args.platform}, {ITERATIONS} iterations, 2 ranks):")
    print(f"{'':18}{'whole process':>15}{'training loop':>15}")
    for name, m in med.items():
        print(f"{name:18}{m['wall']:>13.2f} s{m['loop']:>13.3f} s")
    for name in ("plugin-torchrun", "plugin-plain"):
        wall = med[name]["wall"] / med["bare"]["wall"]
        loop = med[name]["loop"] / med["bare"]["loop"]
        print(
            f"ratio {name} / bare: whole process {wall:.3f} ({wall - 1:+.1%}), "
            f"loop {loop:.3f} ({loop - 1:+.1%})"
        )


if __name__ == "__main__":
    main()
