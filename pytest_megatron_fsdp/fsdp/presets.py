"""Model presets: the tiny CPU default and the Megatron-Bridge reference model (the model of
Bridge's ``tests/functional_tests/training/test_megatron_fsdp.py``), each with the optimizer and
learning-rate schedule it trains with.

Plain data, no torch import: the plugin validates ``--mfsdp-preset`` against these names at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class TrainingRecipe:
    """How a preset trains, in Bridge's field names: ``OptimizerConfig``'s (``lr`` ... ``adam_eps``)
    and ``SchedulerConfig``'s (the rest, Megatron's ``OptimizerParamScheduler``).

    A run config's ``optimizer.<field>`` / ``scheduler.<field>`` left at None takes the value here.
    The defaults are the harness's plain schedule: a constant learning rate, no warm-up.
    """

    lr: float = 1e-3
    min_lr: float = 0.0
    weight_decay: float = 0.01
    #: the global gradient norm is clipped to this (0: no clipping; the norm is measured either way)
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    lr_decay_style: str = "constant"
    #: None: ``train.train_iters``
    lr_decay_iters: int | None = None
    lr_warmup_iters: int = 0
    #: a fraction of the decay iterations instead of ``lr_warmup_iters`` (not both)
    lr_warmup_fraction: float | None = None
    lr_warmup_init: float = 0.0
    #: None: ``weight_decay`` (Megatron-LM's default)
    start_weight_decay: float | None = None
    end_weight_decay: float | None = None
    weight_decay_incr_style: str = "constant"
    lr_wsd_decay_style: str = "exponential"
    #: the annealing iterations of the WSD schedule (needed with ``lr_decay_style='WSD'``)
    lr_wsd_decay_iters: int | None = None
    #: on load: take the schedule from the config, not from the checkpoint
    override_opt_param_scheduler: bool = False
    #: on load: take the schedule from the checkpoint, not from the config
    use_checkpoint_opt_param_scheduler: bool = False


@dataclass(frozen=True)
class StepSize:
    """The tokens one optimizer step trains on, per rank: ``micro_batch_size`` sequences of
    ``seq_length`` tokens, ``num_microbatches`` times."""

    seq_length: int
    micro_batch_size: int
    num_microbatches: int


@dataclass(frozen=True)
class ModelPreset:
    """A GPT shape plus the training sizes that go with it."""

    name: str
    #: what the shape does not say (whose model it is); the rest of :attr:`description` is made
    #: from the fields
    summary: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    seq_length: int
    normalization: str = "LayerNorm"
    swiglu: bool = False
    position_embedding_type: str = "learned_absolute"
    rotary_base: int = 10000
    add_bias_linear: bool = True
    untie_embeddings_and_output_weights: bool = False
    bf16: bool = False
    micro_batch_size: int = 2
    #: micro-batches per rank per optimizer step (gradient accumulation), unless the config says
    num_microbatches: int = 1
    #: the batches it trains on: "counting" (counting sequences from random offsets, learnable in a
    #: few steps by a small vocabulary) or "mock-gpt" (Megatron's mock GPT documents, as Bridge's
    #: functional test trains; see fsdp.training)
    data: str = "counting"
    #: None: a ``GPTModel``. A pattern: a ``HybridModel`` (megatron-core 0.19 and later), one layer per
    #: symbol, ``*`` self-attention and ``-`` MLP (``*-`` per GPT block: the layout Megatron-LM's
    #: hybrid-model migration guide gives GPT users); ``num_layers`` is the pattern's length
    hybrid_layer_pattern: str | None = None
    #: the step a bf16 run of this preset takes where bf16 matmuls are slow (a CPU without native bf16:
    #: ``train.slow_bf16_step``); None: its own step, cheap enough everywhere
    slow_bf16_step: StepSize | None = None
    #: extra TransformerConfig fields
    transformer_overrides: dict[str, Any] = field(default_factory=dict)
    #: the optimizer and learning-rate schedule
    recipe: TrainingRecipe = field(default_factory=TrainingRecipe)

    @property
    def description(self) -> str:
        """The preset in one line, made from its fields (so it cannot drift from them)."""
        shape = [
            f"{self.num_layers} layers",
            f"hidden {self.hidden_size}",
            f"ffn {self.ffn_hidden_size}",
            f"{self.num_attention_heads} heads",
        ]
        if self.num_query_groups != self.num_attention_heads:
            shape.append(f"{self.num_query_groups} query groups")
        shape += [f"vocab {self.vocab_size}", f"seq {self.seq_length}"]
        if self.normalization != "LayerNorm":
            shape.append(self.normalization)
        if self.swiglu:
            shape.append("SwiGLU")
        if self.position_embedding_type == "rope":
            shape.append("RoPE")
        if self.untie_embeddings_and_output_weights:
            shape.append("untied embeddings")
        if self.hybrid_layer_pattern:
            shape.append(f"HybridModel pattern {self.hybrid_layer_pattern}")
        experts = self.transformer_overrides.get("num_moe_experts")
        if experts:
            shape.append(
                f"MoE of {experts} experts, top-{self.transformer_overrides.get('moe_router_topk', 1)}"
            )
        shape.append("bf16" if self.bf16 else "fp32")
        return f"{self.summary}: {', '.join(shape)}"

    def with_overrides(self, **changes: Any) -> ModelPreset:
        return replace(self, **changes)

    @property
    def padded_vocab_size(self) -> int:
        # Megatron pads the vocabulary to a multiple of 128 (make_vocab_size_divisible_by).
        return -(-self.vocab_size // 128) * 128


#: the default on CPU ranks; the hybrid presets below are it as a HybridModel
_TINY = ModelPreset(
    name="tiny",
    summary="the CPU default, trains in about a second",
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=256,
    num_attention_heads=4,
    num_query_groups=4,
    vocab_size=128,
    seq_length=32,
    micro_batch_size=2,
    # Constant lr 1e-3 without clipping: the strategy-parity tests compare its fp32 losses with
    # Megatron DDP's bit for bit, and a clip coefficient computed from a norm that the two
    # wrappers sum in a different order differs in the last bits (set optimizer.clip_grad to clip).
    recipe=TrainingRecipe(lr=1e-3, clip_grad=0.0),
)

#: the tiny GPT's sizes and recipe (exact parity with DDP) as a HybridModel; the MoE preset below is
#: it with one MLP layer made a MoE layer
_TINY_HYBRID = replace(
    _TINY,
    name="tiny-hybrid",
    summary="the tiny GPT as a HybridModel (attention, MLP, attention, MLP)",
    num_layers=4,
    hybrid_layer_pattern="*-*-",
)

PRESETS: dict[str, ModelPreset] = {
    "tiny": _TINY,
    "tiny-hybrid": _TINY_HYBRID,
    "tiny-hybrid-moe": replace(
        _TINY_HYBRID,
        name="tiny-hybrid-moe",
        summary="the tiny HybridModel with every layer kind built without CUDA kernels (local experts)",
        hybrid_layer_pattern="*-*E",
        # no biases, as MoE models are built: megatron-core's local experts (SequentialMLP) add the
        # expert bias in place onto RowParallelLinear's output, which at tensor-parallel size 1 is a
        # view returned by a custom autograd Function, and autograd refuses that (measured on
        # Megatron-LM main of 2026-08-22: "Output 0 of _ReduceFromModelParallelRegion is a view and
        # is being modified inplace")
        add_bias_linear=False,
        # no auxiliary load-balancing loss: the losses compare with DDP's as the language-model loss
        transformer_overrides={
            "num_moe_experts": 4,
            "moe_router_topk": 2,
            "moe_ffn_hidden_size": 128,
            "moe_aux_loss_coeff": 0.0,
            "moe_router_load_balancing_type": "none",
        },
    ),
    "bridge-reference": ModelPreset(
        name="bridge-reference",
        summary="Megatron-Bridge's functional-test model (the GPU default)",
        num_layers=2,
        hidden_size=768,
        ffn_hidden_size=2688,
        num_attention_heads=16,
        num_query_groups=8,
        vocab_size=10000,
        seq_length=512,
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        rotary_base=500000,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        bf16=True,
        micro_batch_size=1,
        # Bridge's global batch of 8 on its 2 GPUs: micro-batch 1 x 4 micro-batches x 2 ranks
        num_microbatches=4,
        data="mock-gpt",
        # One step of 4 x 512 tokens is bf16 matmuls of hidden 768 and ffn 2688: 195 s on a CPU
        # without native bf16 (AVX2 only, ~1 GFLOP/s in bf16), under a second with avx512_bf16.
        # One micro-batch of 64 tokens keeps the model (its layers, shapes and checkpoint layout).
        slow_bf16_step=StepSize(seq_length=64, micro_batch_size=1, num_microbatches=1),
        transformer_overrides={"init_method_std": 0.01, "layernorm_epsilon": 1e-5},
        # Bridge's create_base_optimizer_config / create_base_scheduler_config: Adam, lr 3e-3 with
        # 2 warm-up iterations from 0 and cosine decay to 1e-6 over the run, clipping at 1.0; the
        # scheduler applies weight decay 0.033 (optimizer.weight_decay=0.01 is overridden by it).
        recipe=TrainingRecipe(
            lr=3e-3,
            min_lr=1e-6,
            weight_decay=0.01,
            clip_grad=1.0,
            adam_eps=1e-5,
            lr_decay_style="cosine",
            lr_warmup_iters=2,
            lr_warmup_init=0.0,
            start_weight_decay=0.033,
            end_weight_decay=0.033,
            weight_decay_incr_style="constant",
            override_opt_param_scheduler=True,
        ),
    ),
}

#: Which preset a platform uses when none is chosen.
DEFAULT_PRESET = {"cpu": "tiny", "cuda": "bridge-reference"}


def get_preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; choose one of: {', '.join(sorted(PRESETS))}"
        ) from None
