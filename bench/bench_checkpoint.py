"""Plugin save+load against a bare torch.distributed.checkpoint save+load of the same state dict.

Run on 2 ranks (CPU ranks over gloo here, GPUs over NCCL where there are two)::

    .venv-newest/bin/python -m torch.distributed.run --standalone --nproc_per_node=2 bench/bench_checkpoint.py

Both sides save and load the same fsdp_dtensor state dict in Megatron-LM's layout (model DTensors,
the optimizer's fsdp_dtensor state, RNG states, data stream), built the same way; the plugin adds
what makes it safe: config validation, a SHA-256 of every file taken while DCP writes it and
checked before the load (each rank the files its read plan touches), the checks of keys, shapes
and byte ranges (a second, side-effect-free build of the load's state dict), the collectives that
agree on every outcome, fsync, the temp directory and its rename, the train-state file, the
digests and the tracker, Megatron-FSDP's post-load hook and restoring RNGs and data stream.
Each round's time is the slowest rank's; rank 0 prints medians and the ratio.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--preset", default=None, help="model preset (default: the platform's)")
    parser.add_argument("--platform", default="auto", choices=("auto", "cpu", "cuda"))
    args = parser.parse_args()

    from pytest_megatron_fsdp.rank.session import RankSession
    from pytest_megatron_fsdp.wire.platform import select_platform
    from pytest_megatron_fsdp.wire.torchrun_env import TorchrunEnv

    torchrun = TorchrunEnv.from_environ()
    if torchrun is None:
        raise SystemExit("run under python -m torch.distributed.run --nproc_per_node=2")
    choice = select_platform(args.platform, torchrun.local_world_size)
    if choice.platform == "cpu":
        from pytest_megatron_fsdp.emulation import cuda as cuda_emulation

        cuda_emulation.enable()  # before anything imports megatron
    session = RankSession.start(torchrun, choice, pg_timeout_s=120)
    from pytest_megatron_fsdp.fsdp import parallel  # megatron: after the emulation

    session.on_release(parallel.destroy_model_parallel)
    try:
        _bench(session.env, args)
    finally:
        session.close()


def _bench(env, args) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from pytest_megatron_fsdp.config import RunConfig, enable_megatron_fsdp
    from pytest_megatron_fsdp.fsdp import checkpoint as ckpt
    from pytest_megatron_fsdp.fsdp import megatron_layout
    from pytest_megatron_fsdp.fsdp.presets import DEFAULT_PRESET
    from pytest_megatron_fsdp.fsdp.training import TrainingRun

    cfg = enable_megatron_fsdp(RunConfig())
    cfg.model.preset = args.preset or DEFAULT_PRESET[env.platform]
    run = TrainingRun(cfg, env)
    run.train(2)

    names = [tempfile.mkdtemp(prefix="mfsdp-bench-") if env.rank == 0 else None]
    dist.broadcast_object_list(names, src=0)
    root = Path(names[0])

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64, device=env.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def plugin_round() -> float:
        dist.barrier()
        start = time.perf_counter()
        ckpt.save_checkpoint(run, root / "plugin")
        ckpt.load_checkpoint(run, root / "plugin")
        return slowest(time.perf_counter() - start)

    def bare_round() -> float:
        dist.barrier()
        start = time.perf_counter()
        state_dict = megatron_layout.save_state_dict(run, megatron_layout.local_save_state(run))
        dcp.save(state_dict, checkpoint_id=root / "bare")
        metadata = dcp.FileSystemReader(root / "bare").read_metadata()
        loaded = megatron_layout.load_state_dict(run, metadata)
        dcp.load(loaded.state_dict, checkpoint_id=root / "bare")
        return slowest(time.perf_counter() - start)

    try:
        plugin_round(), bare_round()  # warm-up: first-call imports and allocations
        plugin_s, bare_s = [], []
        for _ in range(args.rounds):  # interleaved, so drift hits both sides alike
            plugin_s.append(plugin_round())
            bare_s.append(bare_round())
    finally:
        dist.barrier()
        files = [p for p in (root / "plugin").rglob("*") if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        # What the digests hash: every file of the iteration (the shards are most of it).
        hashed = b"".join(p.read_bytes() for p in files if p.parent.name.startswith("iter_"))
        if env.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        run.close()

    if env.rank == 0:
        plugin_med, bare_med = statistics.median(plugin_s), statistics.median(bare_s)
        print(
            f"checkpoint bench: platform={env.platform}, preset={cfg.model.preset}, "
            f"world_size={env.world_size}, rounds={args.rounds}" + (f", {size} bytes" if size else "")
        )
        print(f"  plugin save+load : median {1000 * plugin_med:8.1f} ms  (min {1000 * min(plugin_s):.1f})")
        print(f"  bare DCP save+load: median {1000 * bare_med:8.1f} ms  (min {1000 * min(bare_s):.1f})")
        print(f"  ratio plugin/bare: {plugin_med / bare_med:.2f}x")
        print(f"  digest throughput on this checkpoint's {len(hashed)} bytes (one core, best of 5):")
        for name, rate in _digest_throughputs(hashed).items():
            print(f"    {name:<14} {rate / 1e9:6.2f} GB/s")


def _digest_throughputs(data: bytes) -> dict[str, float]:
    """Bytes per second of a few candidate digests over ``data``, measured side by side.

    The checkpoint uses SHA-256 (fsdp/integrity.py); zlib's CRC-32 is the fastest baseline
    there is (32 bits, not a hashlib digest).
    """
    import hashlib
    import zlib

    data = data * max(1, (64 << 20) // max(len(data), 1))  # ~64 MiB, so the rate is the hash's
    candidates = {
        "sha256": lambda: hashlib.sha256(data).digest(),
        "blake2b": lambda: hashlib.blake2b(data).digest(),
        "sha1": lambda: hashlib.sha1(data).digest(),
        "md5": lambda: hashlib.md5(data).digest(),
        "crc32 (zlib)": lambda: zlib.crc32(data),
    }
    rates = {}
    for name, digest in candidates.items():
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            digest()
            best = min(best, time.perf_counter() - start)
        rates[name] = len(data) / best
    return rates


if __name__ == "__main__":
    main()
