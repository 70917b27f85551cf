"""Megatron-Bridge's modules as the plugin's Bridge switches meet them (megatron.bridge at 067f987df0;
pytest_megatron_fsdp/foreign/bridge.py): the statements that matter, at the same module names,
and a module of another suite. For the unit tests of the switches and the foreign-suite session that
prints them."""

from __future__ import annotations

import textwrap
from pathlib import Path

#: lora_layers imports TE at its top and names it in annotations and isinstance checks;
#: ConfigContainer.validate checks the config (here: records what it sees)
FAKE_BRIDGE = {
    "megatron/bridge/__init__.py": "",
    "megatron/bridge/peft/__init__.py": "",
    "megatron/bridge/peft/lora_layers.py": """
        import transformer_engine.pytorch as te

        class TEFusedLoRALinear:
            def branches(self) -> tuple[te.ops.Sequential, te.ops.Sequential]:
                return te.ops.Sequential(), te.ops.Sequential()

        def is_te_linear(module):
            return isinstance(module, (te.Linear, te.LayerNormLinear))

        def late_import():
            import transformer_engine
            return transformer_engine
    """,
    "megatron/bridge/models/__init__.py": "",
    "megatron/bridge/models/gpt_provider.py": """
        def default_layer_spec(config):
            return "TE layers"

        def local_layer_spec(config):
            return "local layers"
    """,
    "megatron/bridge/training/__init__.py": "",
    "megatron/bridge/training/config.py": '''
        class ConfigContainer:
            """Bridge's config."""

            def __init__(self, model, dataset):
                self.model = model
                self.dataset = dataset
                self.seen = None

            def validate(self):
                """What the config holds when Bridge checks it."""
                import torch._dynamo

                self.seen = dict(vars(self.model), pin_memory=self.dataset.pin_memory,
                                 compile_disabled=torch._dynamo.config.disable)
    ''',
    # initialize_megatron compiles megatron-core's dataset helpers (the real one imports compile_helpers
    # from megatron.core.datasets.utils, which runs make there)
    "megatron/bridge/training/initialize.py": """
        compiled = []

        def compile_helpers():
            compiled.append("make")

        def initialize_megatron():
            compile_helpers()
    """,
    # a module of another suite that asks for TE as megatron-core does
    "other_suite_module.py": """
        try:
            import transformer_engine
            HAVE_TE = True
        except ImportError:
            HAVE_TE = False
    """,
}


def write_fake_bridge(root: Path) -> Path:
    """The modules under ``root`` (put it on ``sys.path``: ``megatron`` is a namespace package)."""
    for relative, text in FAKE_BRIDGE.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root
