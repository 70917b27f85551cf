"""Build a small GPT, wrap it with Megatron-FSDP the way Megatron-Bridge does, and train it.

Imports torch and megatron at module level: the plugin loads this module only inside a rank that
runs a distributed test (after the CPU emulation, when there is one, is in place).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    FullyShardedDataParallel,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig

from . import versions
from .config import TRANSFORMER_FIELDS, ConfigError, ConfigWarning, RunConfig, validate
from .environment import DistEnv
from .presets import ModelPreset
from .results import TrainResult

#: the process groups the last initialize_model_parallel created (torch keeps them until destroyed)
_MODEL_PARALLEL_GROUPS: list[Any] = []


def initialize_model_parallel(cfg: RunConfig) -> None:
    """Megatron's model-parallel state and seeded RNGs, as every Megatron test sets them up.

    State already up with the same sizes (an earlier test or run made it) is kept, only reseeded:
    building it again costs a store rendezvous per group, and each gloo group holds sockets and
    threads (17 groups, ~70 fds and ~50 threads per rank on 2 CPU ranks) that the models Megatron
    builds on them keep alive after their test. Other sizes replace it; the old groups are destroyed.
    """
    wanted = (
        cfg.model.tensor_model_parallel_size,
        cfg.model.pipeline_model_parallel_size,
        cfg.model.context_parallel_size,
    )
    if parallel_state.model_parallel_is_initialized() and _model_parallel_sizes() == wanted:
        seed_everything(cfg.train.seed)
        return
    destroy_model_parallel()
    before = set(versions.live_process_groups())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg.model.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.model.pipeline_model_parallel_size,
        context_parallel_size=cfg.model.context_parallel_size,
    )
    _MODEL_PARALLEL_GROUPS[:] = [g for g in versions.live_process_groups() if g not in before]
    seed_everything(cfg.train.seed)


def destroy_model_parallel() -> None:
    """Megatron forgets its model-parallel state; torch destroys the groups made for it.

    Newest first, as torch itself shuts groups down; every rank calls this at the same point, so
    all destroy the same groups in the same order. Groups already gone with the default one
    (a renewed process group) are skipped.
    """
    parallel_state.destroy_model_parallel()
    groups, _MODEL_PARALLEL_GROUPS[:] = list(_MODEL_PARALLEL_GROUPS), []
    if not dist.is_initialized():
        return
    live = set(versions.live_process_groups())
    for group in reversed(groups):
        if group in live:
            dist.destroy_process_group(group)


def _model_parallel_sizes() -> tuple[int, int, int]:
    return (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_context_parallel_world_size(),
    )


def seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # Megatron's tracker: distinct tensor-parallel streams, identical data-parallel ones.
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def transformer_config(cfg: RunConfig, preset: ModelPreset, env: DistEnv) -> TransformerConfig:
    fields: dict[str, Any] = dict(
        num_layers=preset.num_layers,
        hidden_size=preset.hidden_size,
        ffn_hidden_size=preset.ffn_hidden_size,
        num_attention_heads=preset.num_attention_heads,
        num_query_groups=preset.num_query_groups,
        normalization=preset.normalization,
        add_bias_linear=preset.add_bias_linear,
        gated_linear_unit=preset.swiglu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=cfg.model.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.model.pipeline_model_parallel_size,
        context_parallel_size=cfg.model.context_parallel_size,
        bf16=preset.bf16,
        params_dtype=torch.bfloat16 if preset.bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if preset.bf16 else torch.float32,
        # CPU ranks have no device to initialise on; GPUs initialise in place.
        use_cpu_initialization=env.platform == "cpu",
        sequence_parallel=False,
        # Say which layers get_layer_spec builds. It matters to FSDP2's wrapper: told
        # 'transformer_engine' while the layers are local, it also fully_shards ColumnParallelLinear
        # modules nested in already-sharded TransformerLayers, whose DTensor params fully_shard rejects.
        transformer_impl="transformer_engine" if uses_transformer_engine(env) else "local",
    )
    if preset.swiglu:
        fields["activation_func"] = torch.nn.functional.silu
    fields.update({name: getattr(cfg.model, name) for name in TRANSFORMER_FIELDS})
    fields.update(preset.transformer_overrides)
    _check_field_names("model", preset.transformer_overrides, TransformerConfig)
    return TransformerConfig(**fields)


def _check_field_names(section: str, given: dict[str, Any], config_class: type) -> None:
    """Free-form fields must exist on megatron's dataclass (a typo must not pass silently)."""
    known = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ConfigError(
            f"unknown config field {section}.{unknown[0]}: megatron-core's {config_class.__name__} has "
            "no such field; check the spelling"
        )


def ddp_config(cfg: RunConfig, env: DistEnv) -> DistributedDataParallelConfig:
    d = cfg.ddp
    fsdp = cfg.uses_megatron_fsdp
    fields: dict[str, Any] = {
        f.name: getattr(d, f.name) for f in dataclasses.fields(d) if f.name not in ("extra",)
    }
    fields.update(
        use_megatron_fsdp=fsdp,
        # Megatron-FSDP forces both (Megatron's arguments.py); validate() says so when it applies.
        average_in_collective=d.average_in_collective and not fsdp,
        use_distributed_optimizer=_uses_distributed_optimizer(cfg, env),
    )
    if d.gradient_reduce_div_fusion is None:
        # gloo has no ReduceOp.PREMUL_SUM, which the fused divide uses.
        fields["gradient_reduce_div_fusion"] = env.platform != "cpu"
    fields.update(d.extra)
    config_class: type = DistributedDataParallelConfig
    if cfg.dist.use_torch_fsdp2:
        from megatron.core.distributed import TorchFullyShardedDataParallelConfig

        config_class = TorchFullyShardedDataParallelConfig
    _check_field_names("ddp", d.extra, config_class)
    return config_class(**fields)


def _is_plain_ddp(cfg: RunConfig) -> bool:
    return not cfg.uses_megatron_fsdp and not cfg.dist.use_torch_fsdp2


def _uses_distributed_optimizer(cfg: RunConfig, env: DistEnv) -> bool:
    if cfg.uses_megatron_fsdp:
        return True  # Megatron-FSDP requires it (validate() warns when the config said otherwise)
    if cfg.dist.use_torch_fsdp2:
        return False  # FSDP2 shards the parameters itself; Megatron pairs it with the plain optimizer
    return cfg.ddp.use_distributed_optimizer


def optimizer_config(cfg: RunConfig, preset: ModelPreset, env: DistEnv) -> OptimizerConfig:
    o = cfg.optimizer
    clip_grad = o.clip_grad
    if env.platform == "cpu":
        # clip_grad_by_total_norm_fp32 asserts param.grad.type() == 'torch.cuda.FloatTensor'; the
        # grad norm itself is still computed and reported on CPU ranks.
        clip_grad = 0.0
    return OptimizerConfig(
        optimizer=o.optimizer,
        lr=preset.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=clip_grad,
        bf16=preset.bf16,
        params_dtype=torch.bfloat16 if preset.bf16 else torch.float32,
        use_distributed_optimizer=_uses_distributed_optimizer(cfg, env),
    )


def build_gpt(cfg: RunConfig, preset: ModelPreset, env: DistEnv) -> GPTModel:
    config = transformer_config(cfg, preset, env)
    # Meta-device init (Bridge's perf harness): parameters are materialised by Megatron-FSDP,
    # unit by unit, when it wraps the model (reset_parameters on the target device).
    meta = torch.device("meta") if cfg.model.init_model_with_meta_device else contextlib.nullcontext()
    with meta:
        model = _gpt_model(config, preset, env)
    if env.platform == "cuda" and not cfg.model.init_model_with_meta_device:
        model.cuda(env.device)
    if preset.bf16:
        # Megatron training wraps half-precision models before the data-parallel wrapper.
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    return model


def uses_transformer_engine(env: DistEnv) -> bool:
    """Transformer Engine layers on GPUs when it imports (as Bridge runs); else Megatron's local ones."""
    return env.platform == "cuda" and versions.transformer_engine_available()


def layer_spec(preset: ModelPreset, env: DistEnv) -> Any:
    if uses_transformer_engine(env):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec()
    return get_gpt_layer_local_spec(normalization=preset.normalization)


def _gpt_model(config: TransformerConfig, preset: ModelPreset, env: DistEnv) -> GPTModel:
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(preset, env),
        vocab_size=preset.padded_vocab_size,
        max_sequence_length=preset.seq_length,
        share_embeddings_and_output_weights=not preset.untie_embeddings_and_output_weights,
        position_embedding_type=preset.position_embedding_type,
        rotary_base=preset.rotary_base,
    )


def wrap_data_parallel(cfg: RunConfig, model: torch.nn.Module, env: DistEnv) -> torch.nn.Module:
    """Bridge's ``_ddp_wrap``: the data-parallel wrapper the config asks for."""
    config = model.config
    ddp_cfg = ddp_config(cfg, env)
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    if cfg.uses_megatron_fsdp:
        return FullyShardedDataParallel(
            config=config,
            ddp_config=ddp_cfg,
            module=model,
            device=torch.device(env.device),
            pg_collection=pg_collection,
        )
    if cfg.dist.use_torch_fsdp2:
        from megatron.core.distributed import TorchFullyShardedDataParallel

        # Takes process_group, not pg_collection: passing pg_collection is Bridge #2785's TypeError.
        return TorchFullyShardedDataParallel(
            config=config,
            ddp_config=ddp_cfg,
            module=model,
            process_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
        )
    return DistributedDataParallel(
        config=config, ddp_config=ddp_cfg, module=model, pg_collection=pg_collection
    )


def learnable_batch(
    preset: ModelPreset, micro_batch_size: int, generator: torch.Generator, device: str
) -> dict[str, torch.Tensor]:
    """Counting sequences from random offsets: next-token prediction a small GPT learns in steps."""
    seq = preset.seq_length
    offsets = torch.randint(0, preset.vocab_size, (micro_batch_size, 1), generator=generator)
    tokens = (offsets + torch.arange(seq + 1)) % preset.vocab_size
    return {
        "tokens": tokens[:, :-1].contiguous().to(device),
        "labels": tokens[:, 1:].contiguous().to(device),
        "loss_mask": torch.ones(micro_batch_size, seq, device=device),
        "position_ids": torch.arange(seq, device=device).unsqueeze(0).expand(micro_batch_size, -1),
    }


class TrainingRun:
    """A Megatron-FSDP model, its DistributedOptimizer and a data stream, ready to train."""

    def __init__(self, cfg: RunConfig, env: DistEnv) -> None:
        self.warnings = validate(cfg, env.world_size)
        if cfg.dist.backend is not None and cfg.dist.backend != env.backend:
            raise ConfigError(
                f"dist.backend={cfg.dist.backend!r} but this session's process group uses "
                f"{env.backend!r} (platform {env.platform}): set dist.backend=None or switch platform"
            )
        if env.platform == "cpu" and _is_plain_ddp(cfg) and cfg.ddp.use_distributed_optimizer:
            raise ConfigError(
                "ddp.use_distributed_optimizer=True with Megatron DDP on CPU ranks: megatron-core's "
                "DDP + DistributedOptimizer path fails a torch.cuda type check on CPU; set "
                "ddp.use_distributed_optimizer=False"
            )
        for message in self.warnings:
            warnings.warn(message, ConfigWarning, stacklevel=2)
        self.cfg = cfg
        self.env = env
        self.preset = cfg.resolved_preset()
        initialize_model_parallel(cfg)
        self.model = wrap_data_parallel(cfg, build_gpt(cfg, self.preset, env), env)
        self.optimizer = get_megatron_optimizer(optimizer_config(cfg, self.preset, env), [self.model])
        config = self.model.config
        config.no_sync_func = self.model.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        self.iteration = 0
        #: called with every TrainResult that train() returns (the plugin records it)
        self.on_result: Callable[[TrainResult], None] | None = None
        # Each data-parallel rank draws its own samples, reproducibly.
        self._generator = torch.Generator().manual_seed(
            cfg.train.seed * 1000 + parallel_state.get_data_parallel_rank()
        )

    def _data(self, count: int) -> Iterator[dict[str, torch.Tensor]]:
        for _ in range(count):
            yield learnable_batch(self.preset, self.preset.micro_batch_size, self._generator, self.env.device)

    def _forward_step(self, data_iterator: Iterator[dict[str, torch.Tensor]], model: Any):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        loss_mask = batch["loss_mask"]

        def loss_func(output_tensor: torch.Tensor):
            loss = (output_tensor.float().view(-1) * loss_mask.view(-1)).sum() / loss_mask.sum()
            # clone: Megatron's schedule divides the returned loss by num_microbatches in place,
            # which would shrink a detached view of it too (the logged loss would read 1/n).
            return loss, {"lm loss": loss.detach().clone()}

        return output, loss_func

    def _forward_backward(self, forward_only: bool) -> float:
        n = self.cfg.train.num_microbatches
        outputs = get_forward_backward_func()(
            forward_step_func=self._forward_step,
            data_iterator=self._data(n),
            model=[self.model],
            num_microbatches=n,
            seq_length=self.preset.seq_length,
            micro_batch_size=self.preset.micro_batch_size,
            forward_only=forward_only,
        )
        return sum(float(o["lm loss"]) for o in outputs) / n

    def _optimizer_step(self) -> float:
        if self.env.platform == "cuda":
            _, grad_norm, _ = self.optimizer.step()
            return float("nan") if grad_norm is None else float(grad_norm)
        # CPU ranks run without clipping (see optimizer_config); step() then reports no norm, so
        # run its phases here and measure the norm in between, as step() does before clipping.
        with torch.no_grad():
            if self.optimizer.prepare_grads():  # found inf/nan: step skipped, as step() does
                return float("nan")
            grad_norm = self.optimizer.get_grad_norm()
            self.optimizer.step_with_ready_grads()
        return float(grad_norm)

    def _data_parallel_mean(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.env.device)
        group = parallel_state.get_data_parallel_group()
        dist.all_reduce(t, group=group)
        return float(t.item()) / dist.get_world_size(group)

    def train(self, iterations: int | None = None) -> TrainResult:
        """Train ``iterations`` steps (default: ``train.train_iters``); returns per-step figures."""
        result = TrainResult()
        for _ in range(iterations or self.cfg.train.train_iters):
            start = time.perf_counter()
            self.model.train()
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            local = self._forward_backward(forward_only=False)
            grad_norm = self._optimizer_step()
            if self.env.platform == "cuda":
                torch.cuda.synchronize()
            result.step_times_s.append(time.perf_counter() - start)
            result.local_losses.append(local)
            result.losses.append(self._data_parallel_mean(local))
            result.grad_norms.append(grad_norm)
            self.iteration += 1
            if self.env.rank == 0:
                # Megatron's log line; shown with -s, kept in the captured output otherwise.
                print(
                    f" iteration {self.iteration:>4} | lm loss {result.losses[-1]:.6E} | "
                    f"grad norm {grad_norm:.3f} | {1000 * result.step_times_s[-1]:.1f} ms/step",
                    flush=True,
                )
        if self.on_result is not None:
            self.on_result(result)
        return result

    def forward_loss(self) -> float:
        """Forward-only loss on the next batch, data-parallel mean."""
        self.model.eval()
        with torch.no_grad():
            local = self._forward_backward(forward_only=True)
        return self._data_parallel_mean(local)

    def close(self) -> None:
        """Drop this run's model and optimizer.

        Megatron's model-parallel state stays up for the next run or test with the same sizes;
        the rank session tears it down with the process group.
        """
        self.model = None
        self.optimizer = None

    # Checkpointing (pytest_megatron_fsdp.checkpoint): the data stream's position is part of the
    # saved train state, so a resumed run draws the batches the uninterrupted one would have.
    def data_stream_state(self) -> torch.Tensor:
        """The data generator's state (a uint8 tensor): where this rank's data stream stands."""
        return self._generator.get_state()

    def load_data_stream_state(self, state: torch.Tensor) -> None:
        self._generator.set_state(state)

    def save_checkpoint(self, save_dir: Any = None) -> Any:
        """``checkpoint.save_checkpoint(self, save_dir)``: an fsdp_dtensor checkpoint, every rank calls it."""
        from .checkpoint import save_checkpoint

        return save_checkpoint(self, save_dir)

    def load_checkpoint(self, load_dir: Any = None, iteration: int | None = None) -> int:
        """``checkpoint.load_checkpoint(self, load_dir)``: returns the loaded iteration."""
        from .checkpoint import load_checkpoint

        return load_checkpoint(self, load_dir, iteration)
