"""Megatron-Bridge's switches on CPU ranks (pytest_megatron_fsdp/foreign/bridge.py), against
stand-ins of the Bridge modules they act on (tests/fake_bridge.py): each switch, its scope (Bridge's
modules only), and everything undone."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch._dynamo
from fake_bridge import write_fake_bridge

from pytest_megatron_fsdp.foreign import bridge as foreign_bridge
from pytest_megatron_fsdp.foreign import bridge_plugin as role_foreign_bridge
from pytest_megatron_fsdp.foreign import gpu_only


def _forget_fakes() -> None:
    for name in [n for n in sys.modules if n.startswith("megatron.bridge") or n == "other_suite_module"]:
        del sys.modules[name]


@pytest.fixture
def fake_bridge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    write_fake_bridge(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # `megatron` is a namespace package: megatron.bridge joins it
    _forget_fakes()
    assert importlib.util.find_spec("transformer_engine") is None, (
        "these tests need Transformer Engine missing"
    )
    yield tmp_path
    foreign_bridge.unwatch()
    _forget_fakes()
    importlib.invalidate_caches()


@pytest.fixture
def watched(fake_bridge: Path) -> Path:
    foreign_bridge.watch()
    return fake_bridge


def _gpu_config() -> tuple[SimpleNamespace, SimpleNamespace]:
    from megatron.bridge.models import gpt_provider

    model = SimpleNamespace(
        apply_rope_fusion=True,
        persist_layer_norm=True,
        masked_softmax_fusion=True,
        bias_activation_fusion=True,
        transformer_layer_spec=gpt_provider.default_layer_spec,
    )
    return model, SimpleNamespace(pin_memory=True)


def test_without_the_watch_bridges_lora_layers_cannot_be_imported(fake_bridge):
    with pytest.raises(ModuleNotFoundError, match="transformer_engine"):
        importlib.import_module("megatron.bridge.peft.lora_layers")


def test_lora_layers_import_a_te_stand_in_whose_use_is_a_gpu_only_skip(watched):
    lora_layers = importlib.import_module("megatron.bridge.peft.lora_layers")
    assert lora_layers.is_te_linear(torch.nn.Linear(2, 2)) is False  # nothing is a TE module
    for use in (
        lora_layers.TEFusedLoRALinear().branches,
        lambda: lora_layers.late_import().pytorch.Linear(2, 2),
    ):
        with pytest.raises(ModuleNotFoundError) as raised:
            use()
        assert raised.value.name == "transformer_engine"
        assert gpu_only.cause_of(raised.value).reason() == "GPU-only: Transformer Engine"


def test_only_lora_layers_sees_the_stand_in(watched):
    importlib.import_module("megatron.bridge.peft.lora_layers")
    assert "transformer_engine" not in sys.modules
    assert importlib.import_module("other_suite_module").HAVE_TE is False  # megatron-core's own check
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("transformer_engine")


def test_with_transformer_engine_installed_lora_layers_imports_the_real_one(watched, monkeypatch):
    monkeypatch.setattr(foreign_bridge, "_te_missing", lambda: False)
    with pytest.raises(ModuleNotFoundError, match="transformer_engine"):  # no stand-in: the real (missing) TE
        importlib.import_module("megatron.bridge.peft.lora_layers")
    assert all(foreign_bridge.TE_STAND_IN.name not in line for line in foreign_bridge.switch_lines())


def test_validate_sees_the_config_switched_for_cpu_ranks(watched):
    from megatron.bridge.training.config import ConfigContainer

    model, dataset = _gpu_config()
    config = ConfigContainer(model, dataset)
    config.validate()
    assert config.seen == {
        "apply_rope_fusion": False,
        "persist_layer_norm": False,
        "masked_softmax_fusion": False,
        "bias_activation_fusion": True,  # runs (eagerly): no switch of its own
        "transformer_layer_spec": importlib.import_module(
            "megatron.bridge.models.gpt_provider"
        ).local_layer_spec,
        "pin_memory": False,
        "compile_disabled": True,
    }
    assert ConfigContainer.validate.__doc__ == "What the config holds when Bridge checks it."


def test_a_layer_spec_of_the_tests_own_stays(watched):
    from megatron.bridge.training.config import ConfigContainer

    model, dataset = _gpu_config()
    model.transformer_layer_spec = own = object()
    config = ConfigContainer(model, dataset)
    config.validate()
    assert config.seen["transformer_layer_spec"] is own


def test_a_suite_that_never_imports_bridge_sees_nothing(fake_bridge):
    foreign_bridge.watch()
    hook = sys.meta_path[0]
    assert importlib.import_module("other_suite_module").HAVE_TE is False
    assert [hook.find_spec(name, None) for name in ("other_suite_module", "megatron.core", "json")] == [
        None
    ] * 3
    assert not foreign_bridge.bridge_seen()
    assert torch._dynamo.config.disable is False


def test_unwatch_undoes_the_hook_validate_and_torch_compile(watched):
    from megatron.bridge.training.config import ConfigContainer

    ConfigContainer(*_gpu_config()).validate()
    assert foreign_bridge.bridge_seen()
    assert torch._dynamo.config.disable is True
    foreign_bridge.unwatch()
    assert torch._dynamo.config.disable is False
    assert not any(type(f).__name__ == "_BridgeHook" for f in sys.meta_path)
    config = ConfigContainer(*_gpu_config())
    config.validate()
    assert config.seen["apply_rope_fusion"] is True  # the original validate again
    _forget_fakes()
    with pytest.raises(ModuleNotFoundError):  # and no stand-in for a fresh import
        importlib.import_module("megatron.bridge.peft.lora_layers")


@pytest.mark.parametrize("prebuilt", [True, False])
def test_initialize_compiles_the_dataset_helpers_only_where_not_prebuilt(watched, monkeypatch, prebuilt):
    """megatron-core's wheel ships its dataset helpers compiled and no Makefile: Bridge's make there
    would fail and exit; a checkout (a Makefile beside them) still compiles."""
    monkeypatch.setattr(foreign_bridge, "_helpers_prebuilt", lambda: prebuilt)
    from megatron.bridge.training import initialize

    initialize.initialize_megatron()
    assert initialize.compiled == ([] if prebuilt else ["make"])
    assert (foreign_bridge.PREBUILT_HELPERS.line() in foreign_bridge.switch_lines()) is prebuilt
    foreign_bridge.unwatch()
    initialize.initialize_megatron()
    assert initialize.compiled == ["make"] if prebuilt else ["make", "make"]


def test_the_helpers_count_as_prebuilt_only_without_a_makefile_beside_them(tmp_path, monkeypatch):
    package = tmp_path / "wheel_datasets"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "helpers_cpp.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(foreign_bridge, "HELPERS_MODULE", "wheel_datasets.helpers_cpp")
    assert foreign_bridge._helpers_prebuilt()  # a wheel's layout
    (package / "Makefile").write_text("all:\n")
    assert not foreign_bridge._helpers_prebuilt()  # a checkout's
    monkeypatch.setattr(foreign_bridge, "HELPERS_MODULE", "wheel_datasets.not_built")
    assert not foreign_bridge._helpers_prebuilt()


def test_each_switch_is_one_line_naming_it_and_why(monkeypatch):
    monkeypatch.setattr(foreign_bridge, "_helpers_prebuilt", lambda: True)
    lines = foreign_bridge.switch_lines()
    assert len(lines) == len(foreign_bridge.SWITCHES) == 8
    for switch, line in zip(foreign_bridge.SWITCHES, lines, strict=True):
        assert "\n" not in line
        assert switch.name in line
        assert switch.why in line
    named = " ".join(lines)
    for field, _why in foreign_bridge.MODEL_SWITCHES:
        assert f"{field}=False" in named


class _Reporter:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def write_line(self, line: str) -> None:
        self.lines.append(line)


def _session(reporter: _Reporter) -> SimpleNamespace:
    manager = SimpleNamespace(get_plugin=lambda name: reporter if name == "terminalreporter" else None)
    return SimpleNamespace(config=SimpleNamespace(pluginmanager=manager))


@pytest.mark.parametrize(
    ("rank", "imports_bridge", "printed"), [(0, True, True), (1, True, False), (0, False, False)]
)
def test_rank_0_prints_the_switches_once_bridge_is_imported(watched, rank, imports_bridge, printed):
    if imports_bridge:
        importlib.import_module("megatron.bridge.training.config")
    reporter = _Reporter()
    role_foreign_bridge.BridgeSwitchesReport(rank).pytest_collection_finish(_session(reporter))
    assert reporter.lines == (foreign_bridge.switch_lines() if printed else [])


def test_the_rank_registers_the_report_and_undoes_the_watch_at_unconfigure(fake_bridge, pytester):
    config = pytester.parseconfig()
    role_foreign_bridge.watch(config, 0)
    plugin = config.pluginmanager.get_plugin("mfsdp-foreign-bridge")
    assert isinstance(plugin, role_foreign_bridge.BridgeSwitchesReport)
    assert type(sys.meta_path[0]).__name__ == "_BridgeHook"
    plugin.pytest_unconfigure(config)
    assert not any(type(f).__name__ == "_BridgeHook" for f in sys.meta_path)
