"""What the plugin adds to a training run: the smoke test against a bare torchrun script.

Side by side in one run, interleaved round by round (the order rotates each round, so machine noise
and any ordering effect hit all alike), medians over ``--repeat`` rounds:

* bare: ``torchrun --standalone --nproc_per_node=2 bench/bench_harness_overhead.py --bare``: a
  process group, the same tiny GPT with Megatron-FSDP and the DistributedOptimizer (the package's
  ``TrainingRun``, no pytest), 10 iterations;
* plugin, torchrun mode: ``torchrun ... -m pytest tests/functional/...::test_fsdp_pretrain_basic``;
* plugin, plain mode: ``pytest tests/functional/...::test_fsdp_pretrain_basic`` (the plugin
  launches the rank set itself).

Figures: whole-process wall time (start to exit, as ``time`` sees it), training-loop time (sum of
the 10 step times, slowest rank per step; the plugin's come from its JSON report), and a per-phase
breakdown from a timeline every process of every run records (``bench/timeline.py``, loaded at
interpreter start through a ``sitecustomize.py``; ``bench/mfsdp_timeline.py`` adds pytest's
milestones). Each phase is the slowest rank's; phases of different processes may overlap.

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
from collections.abc import Callable
from pathlib import Path

import timeline

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
TEST = "tests/functional/test_megatron_fsdp.py::TestMegatronFSDP::test_fsdp_pretrain_basic"
ITERATIONS = 10
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
MODES = ("bare", "plugin-torchrun", "plugin-plain")


def bare(platform: str, out: Path) -> None:
    """One rank of the bare run (under torchrun): what the smoke test trains, without pytest."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if platform == "cpu":
        from pytest_megatron_fsdp.emulation import cuda as cuda_emulation

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
    timeline.record("pg-up")
    env = DistEnv(rank, world, local_rank, device, dist.get_backend(), platform, Path(tempfile.gettempdir()))
    cfg = enable_megatron_fsdp(RunConfig())
    cfg.model.preset = DEFAULT_PRESET[platform]
    cfg.train.train_iters = ITERATIONS
    run = TrainingRun(cfg, env)
    timeline.record("built")
    result = run.train()
    timeline.record("trained")
    # Slowest rank per step, as the plugin reports it.
    times = torch.tensor(result.step_times_s, dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    if rank == 0:
        out.write_text(json.dumps({"step_times_s": times.tolist(), "losses": result.losses}))
    run.close()
    dist.destroy_process_group()


def _env(timeline_path: Path, site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS and not k.startswith("MFSDP_")}
    env["MFSDP_TIMELINE"] = str(timeline_path)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), str(BENCH), env.get("PYTHONPATH")]))
    return env


def _timed(cmd: list[str], env: dict[str, str], tries: int = 2) -> tuple[float, float, float]:
    """(start, end, elapsed) of one run, wall clock. A failed run is reported and run once more
    (a crash of the bare script on a loaded machine was seen once); a second failure ends the bench."""
    for attempt in range(1, tries + 1):
        Path(env["MFSDP_TIMELINE"]).unlink(missing_ok=True)  # this attempt's timeline only
        start, clock = time.time(), time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        elapsed = time.perf_counter() - clock
        if done.returncode == 0:
            return start, start + elapsed, elapsed
        output = f"{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
        report = f"failed (exit code {done.returncode}): {' '.join(cmd)}\n{output}"
        if attempt == tries:
            sys.exit(report)
        print(f"{report}\n(run again)", flush=True)
    raise AssertionError("unreachable")


def _loop_s(report: Path, key: str = "step_times_s") -> float:
    data = json.loads(report.read_text())
    times = data["runs"][0][key] if "runs" in data else data[key]
    assert len(times) == ITERATIONS, times
    return sum(times)


# -- the breakdown ------------------------------------------------------------------------------------

#: (phase, description); the order the table prints them in
PHASES = (
    ("launch wait", "start until torchrun's agent runs (plain: the parent's own start and collection)"),
    ("  parent start", "plain: python, pytest and plugins in the parent, until configured"),
    ("  parent collection", "plain: configured until collected (the rank set launches during it)"),
    ("torchrun start", "the agent's start (it imports torch) until the first rank process runs"),
    ("rank start", "a rank's python and pytest start, until configured, less its imports"),
    ("imports", "torch and megatron.core, first import in a rank"),
    ("rank collection", "pytest collection in a rank"),
    ("process group", "collected until the process group is up (bare: init_process_group)"),
    ("test set-up", "fixtures: model, wrapper and optimizer built (less megatron's import)"),
    ("training", "the test's call (bare: run.train()), 10 iterations"),
    ("teardown", "teardown, after-test check and the ranks' agreement on the outcome"),
    ("rank exit", "end of the test until the rank process exits"),
    ("top exit", "the last rank's exit until the whole command exits (torchrun, plain parent)"),
)


def breakdown(events: list[dict], start: float, end: float, mode: str) -> dict[str, float]:
    """Seconds per phase of one run (the slowest rank's where ranks differ)."""

    def at(role: str, event: str, last: bool = False) -> float | None:
        times = [e["t"] for e in events if e["role"] == role and e["event"] == event]
        return (max(times) if last else min(times)) if times else None

    ranks = sorted({e["role"] for e in events if e["role"].startswith("rank")})

    def slowest(span: Callable[[str], float | None]) -> float | None:
        values = [v for r in ranks if (v := span(r)) is not None]
        return max(values) if values else None

    def between(role: str, a: str, b: str) -> float | None:
        ta, tb = at(role, a), at(role, b, last=True)
        return None if ta is None or tb is None else tb - ta

    def imports(role: str) -> float:
        return sum(
            between(role, f"import-start:{n}", f"import-end:{n}") or 0.0 for n in timeline.TIMED_IMPORTS
        )

    def rank_start(role: str) -> float | None:
        if mode == "bare":
            return between(role, "process-start", "import-start:torch")
        span = between(role, "process-start", "configured")
        torch_import = between(role, "import-start:torch", "import-end:torch") or 0.0
        return None if span is None else span - torch_import

    def set_up(role: str) -> float | None:
        if mode == "bare":
            return between(role, "pg-up", "built")
        span = between(role, "setup-start", "call-start")
        megatron = between(role, "import-start:megatron.core", "import-end:megatron.core") or 0.0
        return None if span is None else span - megatron

    agent = at("torchrun", "process-start")
    first_rank = min((t for r in ranks if (t := at(r, "process-start")) is not None), default=None)
    last_exit = slowest(lambda r: at(r, "exit", last=True))
    plugin = mode != "bare"
    figures = {
        "launch wait": None if agent is None else agent - start,
        "  parent start": at("parent", "configured") - start if mode == "plugin-plain" else None,
        "  parent collection": between("parent", "configured", "collected")
        if mode == "plugin-plain"
        else None,
        "torchrun start": None if agent is None or first_rank is None else first_rank - agent,
        "rank start": slowest(rank_start),
        "imports": slowest(imports),
        "rank collection": slowest(lambda r: between(r, "configured", "collected")) if plugin else None,
        "process group": slowest(
            (lambda r: between(r, "collected", "session-up"))
            if plugin
            else (lambda r: between(r, "import-end:megatron.core", "pg-up"))
        ),
        "test set-up": slowest(set_up),
        "training": slowest(
            (lambda r: between(r, "call-start", "teardown-start"))
            if plugin
            else (lambda r: between(r, "built", "trained"))
        ),
        "teardown": slowest(lambda r: between(r, "teardown-start", "test-done")) if plugin else None,
        "rank exit": slowest(
            (lambda r: between(r, "test-done", "exit"))
            if plugin
            else (lambda r: between(r, "trained", "exit"))
        ),
        "top exit": None if last_exit is None else end - last_exit,
    }
    return {k: v for k, v in figures.items() if v is not None}


def _site(tmp: Path) -> Path:
    site = tmp / "site"
    site.mkdir()
    # Every python process of a run (parent, torchrun's agent, ranks) records its timeline from start.
    (site / "sitecustomize.py").write_text("import timeline\n\ntimeline.install()\n")
    return site


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
    pytest_args = [
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "mfsdp_timeline",
        f"--mfsdp-platform={args.platform}",
    ]
    figures: dict[str, dict[str, list[float]]] = {name: {"wall": [], "loop": []} for name in MODES}
    phases: dict[str, dict[str, list[float]]] = {name: {} for name in MODES}
    with tempfile.TemporaryDirectory(prefix="mfsdp-bench-") as tmp:
        # torchrun leaves a torchelastic_* dir in $TMPDIR on every launch: keep them in here.
        os.environ["TMPDIR"] = tmp
        site = _site(Path(tmp))
        out = Path(tmp) / "out.json"
        events_path = Path(tmp) / "timeline.jsonl"
        runs = {
            "bare": [
                *torchrun,
                str(Path(__file__).resolve()),
                "--bare",
                f"--platform={args.platform}",
                f"--out={out}",
            ],
            "plugin-torchrun": [*torchrun, "-m", "pytest", *pytest_args, f"--mfsdp-report-json={out}", TEST],
            "plugin-plain": [py, "-m", "pytest", *pytest_args, f"--mfsdp-report-json={out}", TEST],
        }
        for round_ in range(args.repeat):
            order = MODES[round_ % 3 :] + MODES[: round_ % 3]
            for name in order:
                out.unlink(missing_ok=True)
                start, end, wall = _timed(runs[name], _env(events_path, site))
                figures[name]["wall"].append(wall)
                figures[name]["loop"].append(_loop_s(out))
                events = [json.loads(line) for line in events_path.read_text().splitlines()]
                for phase, seconds in breakdown(events, start, end, name).items():
                    phases[name].setdefault(phase, []).append(seconds)
            last = (
                f"{n} {figures[n]['wall'][-1]:.2f} s / loop {figures[n]['loop'][-1]:.3f} s" for n in MODES
            )
            print(f"round {round_ + 1} ({', '.join(order)}): " + ", ".join(last), flush=True)
    med = {n: {k: statistics.median(v) for k, v in f.items()} for n, f in figures.items()}
    print(f"\nmedians over {args.repeat} rounds ({args.platform}, {ITERATIONS} iterations, 2 ranks):")
    print(f"{'':18}{'whole process':>15}{'training loop':>15}")
    for name, m in med.items():
        print(f"{name:18}{m['wall']:>13.2f} s{m['loop']:>13.3f} s")
    print("\nper phase, seconds (medians; the slowest rank's; phases of different processes may overlap):")
    print(f"{'':22}" + "".join(f"{n:>17}" for n in MODES))
    for phase, description in PHASES:
        cells = "".join(
            f"{statistics.median(phases[n][phase]):>17.2f}" if phase in phases[n] else f"{'-':>17}"
            for n in MODES
        )
        print(f"{phase:22}{cells}   {description}")
    print()
    for name in ("plugin-torchrun", "plugin-plain"):
        wall = med[name]["wall"] / med["bare"]["wall"]
        loop = med[name]["loop"] / med["bare"]["loop"]
        print(
            f"ratio {name} / bare: whole process {wall:.3f} ({wall - 1:+.1%}), "
            f"loop {loop:.3f} ({loop - 1:+.1%})"
        )


if __name__ == "__main__":
    main()
