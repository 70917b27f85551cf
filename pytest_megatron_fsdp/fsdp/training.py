"""A training run: a wrapped GPT, its optimizer and a data stream, trained the way Megatron trains.

Imports torch and megatron at module level: loaded only inside a rank that runs a distributed
test (after the CPU emulation, when there is one, is in place). What a run measures goes to the
observer its owner installs (the ``megatron_fsdp_run`` fixture records it); the domain itself
knows nothing of tests or reports.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func

from ..environment import DistEnv
from . import megatron_layout
from . import model as model_builder
from .collectives import data_parallel_mean
from .config import ConfigWarning, RunConfig, validate
from .parallel import initialize_model_parallel
from .presets import ModelPreset
from .results import RunFacts, TrainResult, memory_in_use_bytes
from .run import CheckpointLayout, RunBase, RunObserver


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


#: MockGPTLowLevelDataset's document lengths: uniform in [1, MOCK_MAX_DOCUMENT_LENGTH)
MOCK_MAX_DOCUMENT_LENGTH = 4096


def mock_gpt_batch(
    preset: ModelPreset, micro_batch_size: int, generator: torch.Generator, device: str
) -> dict[str, torch.Tensor]:
    """Windows of Megatron's mock GPT data, which Bridge's functional test trains on
    (``MockGPTDatasetConfig``): documents ``1, 2, ..., L-1, <eod>`` (``MockGPTLowLevelDataset``,
    ``L`` uniform in [1, 4096), the end-of-document token being NullTokenizer's ``vocab_size``),
    packed back to back. Each window starts at a random point of a random document; every draw
    comes from ``generator``, so the stream's position is the generator's state."""
    seq = preset.seq_length
    rows = []
    for _ in range(micro_batch_size):
        pieces: list[torch.Tensor] = []
        have = 0
        while have < seq + 1:
            length = int(torch.randint(1, MOCK_MAX_DOCUMENT_LENGTH, (1,), generator=generator))
            document = torch.cat(
                [(torch.arange(length - 1) + 1) % preset.vocab_size, torch.tensor([preset.vocab_size])]
            )
            if not pieces:  # the window starts somewhere inside its first document
                document = document[int(torch.randint(0, length, (1,), generator=generator)) :]
            pieces.append(document)
            have += len(document)
        rows.append(torch.cat(pieces)[: seq + 1])
    tokens = torch.stack(rows)
    return {
        "tokens": tokens[:, :-1].contiguous().to(device),
        "labels": tokens[:, 1:].contiguous().to(device),
        "loss_mask": torch.ones(micro_batch_size, seq, device=device),
        "position_ids": torch.arange(seq, device=device).unsqueeze(0).expand(micro_batch_size, -1),
    }


#: ModelPreset.data -> the batches a run of it trains on
DATA_STREAMS = {"counting": learnable_batch, "mock-gpt": mock_gpt_batch}


class TrainingRun(RunBase):
    """A Megatron-FSDP model, its DistributedOptimizer and a data stream, ready to train (a
    :class:`~.run.Run`; checkpointed in Megatron-LM's fsdp_dtensor layout, :mod:`.megatron_layout`)."""

    checkpoint_layout: ClassVar[CheckpointLayout] = megatron_layout
    #: the scheduler holds the optimizer: closing drops it too
    released: ClassVar[tuple[str, ...]] = ("model", "optimizer", "scheduler")

    def __init__(
        self,
        cfg: RunConfig,
        env: DistEnv,
        observer: RunObserver | None = None,
        pre_wrap_hook: Callable[[torch.nn.Module], None] | None = None,
    ) -> None:
        """``pre_wrap_hook(model)``: called on the built model before the data-parallel wrapper
        wraps it, as Megatron-Bridge's pre-wrap hooks are (PEFT freezes the base model there)."""
        self.warnings = validate(cfg, env.world_size, platform=env.platform, backend=env.backend)
        for message in self.warnings:
            warnings.warn(message, ConfigWarning, stacklevel=2)
        self.cfg = cfg
        self.env = env
        #: told of every result and checkpoint (the megatron_fsdp_run fixture's records them)
        self.observer = observer
        self.preset: ModelPreset = cfg.resolved_preset()
        m = cfg.model
        initialize_model_parallel(
            m.tensor_model_parallel_size,
            m.pipeline_model_parallel_size,
            m.context_parallel_size,
            cfg.train.seed,
            cfg.ddp.num_distributed_optimizer_instances,
        )
        gpt = model_builder.build_gpt(cfg, self.preset, env)
        if pre_wrap_hook is not None:
            pre_wrap_hook(gpt)
        self.model = model_builder.wrap_data_parallel(cfg, gpt, env)
        try:
            self.optimizer = get_megatron_optimizer(
                model_builder.optimizer_config(cfg, self.preset, env), [self.model]
            )
        except BaseException:
            # else the wrapper's hooks keep it alive for the rest of the process; no waits: the
            # failure may be this rank's alone
            self.close(wait_collectives=False)
            raise
        config = self.model.config
        config.no_sync_func = self.model.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        p = self.preset
        dp = env.world_size // cfg.model_parallel_size
        #: samples per optimizer step over all data-parallel ranks (the scheduler counts samples)
        self.global_batch_size = p.micro_batch_size * p.num_microbatches * dp
        #: Megatron's OptimizerParamScheduler, as Bridge builds it; its state is checkpointed
        self.scheduler = model_builder.build_scheduler(cfg, p, self.optimizer, self.global_batch_size)
        self.iteration = 0
        # Each data-parallel rank draws its own samples, reproducibly.
        self._generator = torch.Generator().manual_seed(
            cfg.train.seed * 1000 + parallel_state.get_data_parallel_rank()
        )

    def _data(self, count: int) -> Iterator[dict[str, torch.Tensor]]:
        for _ in range(count):
            yield DATA_STREAMS[self.preset.data](
                self.preset, self.preset.micro_batch_size, self._generator, self.env.device
            )

    def _forward_step(
        self, data_iterator: Iterator[dict[str, torch.Tensor]], model: Any
    ) -> tuple[Any, Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]]:
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        loss_mask = batch["loss_mask"]

        def loss_func(output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss = (output_tensor.float().view(-1) * loss_mask.view(-1)).sum() / loss_mask.sum()
            # clone: Megatron's schedule divides the returned loss by num_microbatches in place,
            # which would shrink a detached view of it too (the logged loss would read 1/n).
            return loss, {"lm loss": loss.detach().clone()}

        return output, loss_func

    def _forward_backward(self, forward_only: bool) -> float:
        n = self.preset.num_microbatches
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

    def _optimizer_step(self) -> tuple[bool, float, float]:
        """Megatron's optimizer step: (whether the update happened, the global grad norm, the zeros
        in the gradient; both NaN when no update happened)."""
        if self.optimizer.config.clip_grad > 0:
            # Megatron's own step: grads prepared (inf/nan found -> no update), norm measured and
            # the gradients clipped to it, zeros counted (log_num_zeros_in_grad), then the update.
            success, grad_norm, num_zeros = self.optimizer.step()
            return (
                bool(success),
                float("nan") if grad_norm is None else float(grad_norm),
                float("nan") if num_zeros is None else float(num_zeros),
            )
        # Without clipping Megatron's step() measures no norm: run its phases here and measure the
        # norm in between, where step() would clip (and count the zeros after it, as step() does).
        with torch.no_grad():
            if self.optimizer.prepare_grads():  # found inf/nan: no update, as step() does
                return False, float("nan"), float("nan")
            grad_norm = self.optimizer.get_grad_norm()
            num_zeros = self.optimizer.count_zeros()
            success = self.optimizer.step_with_ready_grads()
        return bool(success), float(grad_norm), float(num_zeros)

    def learning_rate(self) -> float:
        """The learning rate the next optimizer step uses (the scheduler sets every group's)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def train(self, iterations: int | None = None) -> TrainResult:
        """Train ``iterations`` steps (default: ``train.train_iters``); returns per-step figures."""
        result = TrainResult(first_iteration=self.iteration + 1)
        for _ in range(iterations or self.cfg.train.train_iters):
            start = time.perf_counter()
            lr = self.learning_rate()
            self.model.train()
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            local = self._forward_backward(forward_only=False)
            updated, grad_norm, num_zeros = self._optimizer_step()
            if updated:
                # Bridge's train_step: the schedule advances by the samples of a successful step.
                self.scheduler.step(increment=self.global_batch_size)
            if self.env.platform == "cuda":
                torch.cuda.synchronize()
            result.step_times_s.append(time.perf_counter() - start)
            result.local_losses.append(local)
            result.losses.append(
                data_parallel_mean(local, self.env.device, parallel_state.get_data_parallel_group())
            )
            result.grad_norms.append(grad_norm)
            result.learning_rates.append(lr)
            result.num_zeros.append(num_zeros)
            result.memory_bytes.append(memory_in_use_bytes(self.env.platform))
            self.iteration += 1
            if self.env.rank == 0:
                # Megatron's log line; shown with -s, kept in the captured output otherwise.
                print(
                    f" iteration {self.iteration:>4} | learning rate {lr:.6E} | "
                    f"lm loss {result.losses[-1]:.6E} | grad norm {grad_norm:.3f} | "
                    f"{1000 * result.step_times_s[-1]:.1f} ms/step",
                    flush=True,
                )
        if self.observer is not None:
            self.observer.on_result(self, result)
        return result

    def forward_loss(self) -> float:
        """Forward-only loss on the next batch, data-parallel mean."""
        self.model.eval()
        with torch.no_grad():
            local = self._forward_backward(forward_only=True)
        return data_parallel_mean(local, self.env.device, parallel_state.get_data_parallel_group())

    def parts(self) -> dict[str, object]:
        return {
            "model": self.model,
            "module": getattr(self.model, "module", None),  # the model inside the wrapper
            "optimizer": self.optimizer,
        }

    # Checkpointing (pytest_megatron_fsdp.checkpoint): the data stream's position is part of the
    # saved train state, so a resumed run draws the batches the uninterrupted one would have.
    def data_stream_state(self) -> torch.Tensor:
        """The data generator's state (a uint8 tensor): where this rank's data stream stands."""
        return self._generator.get_state()

    def load_data_stream_state(self, state: torch.Tensor) -> None:
        self._generator.set_state(state)

    def facts(self) -> RunFacts:
        dp = self.env.world_size // self.cfg.model_parallel_size
        if self.cfg.uses_megatron_fsdp:
            strategy = self.cfg.ddp.data_parallel_sharding_strategy
        else:
            strategy = "fsdp2" if self.cfg.dist.use_torch_fsdp2 else "ddp"
        p = self.preset
        return RunFacts(
            platform=self.env.platform,
            preset=p.name,
            strategy=strategy,
            world_size=self.env.world_size,
            data_parallel_size=dp,
            tokens_per_step=p.micro_batch_size * p.seq_length * p.num_microbatches * dp,
        )
