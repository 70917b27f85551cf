"""Model presets: the tiny CPU default and the Megatron-Bridge reference model (the model of
Bridge's ``tests/functional_tests/test_groups/megatron_fsdp/test_megatron_fsdp.py``).

Plain data, no torch import: the plugin validates ``--mfsdp-preset`` against these names at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class ModelPreset:
    """A GPT shape plus the training sizes that go with it."""

    name: str
    description: str
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
    lr: float = 1e-3
    micro_batch_size: int = 2
    #: extra TransformerConfig fields
    transformer_overrides: dict[str, Any] = field(default_factory=dict)

    def with_overrides(self, **changes: Any) -> ModelPreset:
        return replace(self, **changes)

    @property
    def padded_vocab_size(self) -> int:
        # Megatron pads the vocabulary to a multiple of 128 (make_vocab_size_divisible_by).
        return -(-self.vocab_size // 128) * 128


PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset(
        name="tiny",
        description="2 layers, hidden 64, 4 heads, vocab 128, seq 32, fp32: trains in about a second on CPU",
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=256,
        num_attention_heads=4,
        num_query_groups=4,
        vocab_size=128,
        seq_length=32,
        lr=1e-3,
        micro_batch_size=2,
    ),
    "bridge-reference": ModelPreset(
        name="bridge-reference",
        description=(
            "Megatron-Bridge's functional-test model: 2 layers, hidden 768, ffn 2688, 16 heads, "
            "8 query groups, RMSNorm, SwiGLU, RoPE, seq 512, vocab 10000, bf16 (the GPU default)"
        ),
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
        lr=3e-3,
        micro_batch_size=1,
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
