"""Rebuild tests/data/pre-digest-checkpoint.tar.xz: a checkpoint as this harness saved it before digests.

That format (commit 35cd11d and earlier) has no digests.json, keeps RNG states and the data
stream per global rank under ``rng_state.rank_<r>`` and Transformer Engine's ``_extra_state``, and
splits nothing. It was saved on the floor stack (Python 3.11, torch 2.13.0, megatron-core 0.16.1),
so loading it on the newest stack is also the cross-version check. To rebuild it::

    git archive 35cd11d | tar -x -C /tmp/pre-digest
    PYTHONPATH=/tmp/pre-digest TMPDIR=$(mktemp -d) .venv/bin/python -m torch.distributed.run \\
        --standalone --nproc_per_node=2 tests/data/make_pre_digest_checkpoint.py /tmp/pre-digest-checkpoint
    tar -C /tmp -cJf tests/data/pre-digest-checkpoint.tar.xz pre-digest-checkpoint

(xz: 185 kB instead of 864 kB of mostly per-tensor container overhead.)
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

#: a smaller tiny GPT, so that the checkpoint stays small in the repository
OVERRIDES = {
    "num_layers": 1,
    "hidden_size": 32,
    "ffn_hidden_size": 64,
    "num_attention_heads": 2,
    "num_query_groups": 2,
}
ITERATIONS = 3


def main() -> None:
    from pytest_megatron_fsdp.emulation import cuda as cuda_emulation
    from pytest_megatron_fsdp.rank.session import RankSession
    from pytest_megatron_fsdp.wire.platform import select_platform
    from pytest_megatron_fsdp.wire.torchrun_env import TorchrunEnv

    target = Path(sys.argv[1])
    torchrun = TorchrunEnv.from_environ()
    cuda_emulation.enable()
    session = RankSession.start(torchrun, select_platform("cpu", torchrun.local_world_size), pg_timeout_s=120)
    from pytest_megatron_fsdp.fsdp import parallel

    session.on_release(parallel.destroy_model_parallel)
    try:
        from pytest_megatron_fsdp.checkpoint import save_checkpoint
        from pytest_megatron_fsdp.config import RunConfig, enable_megatron_fsdp
        from pytest_megatron_fsdp.fsdp.training import TrainingRun

        cfg = enable_megatron_fsdp(RunConfig())
        cfg.model.overrides.update(OVERRIDES)
        run = TrainingRun(cfg, session.env)
        run.train(ITERATIONS)
        if session.env.rank == 0:
            shutil.rmtree(target, ignore_errors=True)
        save_checkpoint(run, target)
    finally:
        session.close()


if __name__ == "__main__":
    main()
