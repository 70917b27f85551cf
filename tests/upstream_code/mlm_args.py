"""Megatron-LM's own arguments and checkpoint calls for the plugin's run, shared by the modules here:
the command line a Megatron-LM user passes for the run's model (``pretrain_gpt.py``'s flags), the
global arguments Megatron-LM's parser and ``validate_args`` make of it, and ``save_checkpoint`` /
``load_checkpoint`` on the run. Importable only where ``megatron.training`` is (its importers skip first).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from megatron.core.num_microbatches_calculator import unset_num_microbatches_calculator
from megatron.core.rerun_state_machine import destroy_rerun_state_machine
from megatron.training import checkpointing as megatron_lm
from megatron.training.arguments import parse_args, validate_args
from megatron.training.global_vars import set_global_variables, unset_global_variables


def command_line(run: Any, save: Path | None, load: Path | None, *flags: str) -> list[str]:
    """The Megatron-LM command line for ``run``'s model and Megatron-FSDP settings (``pretrain_gpt.py``'s
    flags), saving to ``save`` and loading from ``load``, then ``flags``."""
    p, cfg = run.preset, run.cfg
    dp = dist.get_world_size() // cfg.model_parallel_size
    line = [
        *("--num-layers", str(p.num_layers), "--hidden-size", str(p.hidden_size)),
        *("--ffn-hidden-size", str(p.ffn_hidden_size), "--num-attention-heads", str(p.num_attention_heads)),
        *("--seq-length", str(p.seq_length), "--max-position-embeddings", str(p.seq_length)),
        *("--micro-batch-size", str(p.micro_batch_size)),
        *("--global-batch-size", str(p.micro_batch_size * p.num_microbatches * dp)),
        *("--tokenizer-type", "NullTokenizer", "--vocab-size", str(p.vocab_size)),
        *("--normalization", p.normalization, "--position-embedding-type", p.position_embedding_type),
        *("--train-iters", str(cfg.train.train_iters), "--lr", str(run.optimizer.param_groups[0]["lr"])),
        *("--tensor-model-parallel-size", str(cfg.model.tensor_model_parallel_size)),
        "--use-megatron-fsdp",
        *("--data-parallel-sharding-strategy", cfg.ddp.data_parallel_sharding_strategy),
        *("--ckpt-format", "fsdp_dtensor", "--save-interval", "1"),
        # megatron-core's fused weight-gradient accumulation is a CUDA kernel (Bridge's recipes turn it
        # off for Megatron-FSDP too)
        "--no-gradient-accumulation-fusion",
    ]
    if cfg.ddp.megatron_fsdp_version == 2:  # V2 has an optimizer of its own
        line += ["--megatron-fsdp-version", "2"]
    else:
        line.append("--use-distributed-optimizer")
    experts = p.transformer_overrides.get("num_moe_experts")
    if experts:
        line += [
            "--num-experts",
            str(experts),
            "--moe-router-topk",
            str(p.transformer_overrides["moe_router_topk"]),
        ]
        line += ["--moe-ffn-hidden-size", str(p.transformer_overrides["moe_ffn_hidden_size"])]
    if p.hybrid_layer_pattern:
        line += ["--hybrid-layer-pattern", p.hybrid_layer_pattern]
    if p.num_query_groups != p.num_attention_heads:
        line += ["--group-query-attention", "--num-query-groups", str(p.num_query_groups)]
    if p.swiglu:
        line.append("--swiglu")
    if p.untie_embeddings_and_output_weights:
        line.append("--untie-embeddings-and-output-weights")
    if not p.add_bias_linear:
        line.append("--disable-bias-linear")
    if run.model.config.bf16:
        line.append("--bf16")
    if save is not None:
        line += ["--save", str(save)]
    if load is not None:
        line += ["--load", str(load)]
    return [*line, *flags]


def megatron_lm_args(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Any]]:
    """The ``megatron_lm_args`` fixture's body (``conftest.py``): ``use(run, save=None, load=None,
    *flags)`` sets Megatron-LM's global arguments for ``run``, parsed by its own parser from
    :func:`command_line` and checked by its ``validate_args``, as ``pretrain_gpt.py`` sets them (each call
    replaces the previous ones; none are left after the test)."""

    def use(run: Any, save: Path | None = None, load: Path | None = None, *flags: str) -> Any:
        forget_megatron_lm_args()
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *command_line(run, save, load, *flags)])
        args = parse_args()
        validate_args(args)
        set_global_variables(args, build_tokenizer=False)
        return args

    yield use
    forget_megatron_lm_args()


def save(run: Any) -> None:
    """Megatron-LM's ``save_checkpoint`` of ``run`` (to ``--save``) at its iteration."""
    megatron_lm.save_checkpoint(run.iteration, [run.model], run.optimizer, run.scheduler, 0)


def load(run: Any) -> int:
    """Megatron-LM's ``load_checkpoint`` into ``run`` (from ``--load``); the iteration it returns."""
    iteration, _flops = megatron_lm.load_checkpoint([run.model], run.optimizer, run.scheduler)
    return int(iteration)


def forget_megatron_lm_args() -> None:
    """Megatron-LM's global arguments, microbatch calculator and rerun state machine (its
    ``save_checkpoint`` makes one) unset: Bridge's ``pretrain()`` sets its own, and refuses to start
    where they are set."""
    unset_global_variables()
    unset_num_microbatches_calculator()
    destroy_rerun_state_machine()
