"""The GPU-only causes: each is recognised by its exact signs only, in an exception's chain or in a
collection error's text; anything else is a real failure."""

import pytest

from pytest_megatron_fsdp.foreign import gpu_only


def _raised(make):
    try:
        make()
    except BaseException as exc:  # noqa: BLE001 - the exception is what the test looks at
        return exc
    raise AssertionError("nothing raised")


def _no_module(name):
    raise ModuleNotFoundError(f"No module named '{name}'", name=name)


@pytest.mark.parametrize(
    ("exc", "cause"),
    [
        (
            ModuleNotFoundError("No module named 'transformer_engine'", name="transformer_engine"),
            "Transformer Engine",
        ),
        (
            ModuleNotFoundError(
                "No module named 'transformer_engine.pytorch'", name="transformer_engine.pytorch"
            ),
            "Transformer Engine",
        ),
        (ValueError("apply_rope_fusion is not available. Please install TE >= 1.4."), "Transformer Engine"),
        (
            ImportError("MambaSSM is not installed. Please install it with `pip install mamba-ssm`."),
            "mamba_ssm",
        ),
        (ModuleNotFoundError("No module named 'mamba_ssm'", name="mamba_ssm"), "mamba_ssm"),
        (
            ImportError(
                "Transformer Engine is not installed. "
                "Please install it with `pip install transformer-engine`."
                " when instantiating MoETransformerLayer"
            ),
            "Transformer Engine",
        ),
        (
            AssertionError("assert device(type='cpu') == device(type='cuda', index=0)"),
            "CUDA device placement",
        ),
        (
            AssertionError(
                "assert device(type='cpu') == device(type='cuda', index=1)\n"
                " +  where device(type='cpu') = DTensor(...).device"
            ),
            "CUDA device placement",
        ),
    ],
)
def test_each_cause_by_its_signs(exc, cause):
    found = gpu_only.cause_of(exc)
    assert found is not None
    assert found.name.startswith(cause)
    assert found.reason() == f"GPU-only: {found.name}"


def test_a_cause_deeper_in_the_chain_counts():
    def wrapped():
        try:
            _no_module("transformer_engine")
        except ModuleNotFoundError as exc:
            raise RuntimeError("building the layer failed") from exc

    assert gpu_only.cause_of(_raised(wrapped)).name == "Transformer Engine"


@pytest.mark.parametrize(
    "exc",
    [
        AssertionError("losses differ"),
        ModuleNotFoundError("No module named 'transformer_engines'", name="transformer_engines"),
        ModuleNotFoundError("No module named 'click'", name="click"),
        RuntimeError("apply_rope_fusion is not available. Please install TE >= 1.4."),  # another class
        ValueError("TE >= 1.4 is fine"),
        RuntimeError("Found no NVIDIA driver on your system."),  # the emulation's job, not a GPU-only cause
        # the emulation's own classes only: a look-alike of another class stays a failure
        RuntimeError(
            "the emulated CUDA device (a CPU rank) has no CUDA graphs: torch.cuda.CUDAGraph needs a GPU"
        ),
        ValueError("has no CUDA memory accounting"),
        ImportError("Transformer Engine is not installed."),  # not megatron's full sentence
        # device placement: only a CPU tensor asserted to be on a CUDA device
        AssertionError("assert device(type='cuda', index=0) == device(type='cuda', index=1)"),
        AssertionError("assert device(type='cpu') == device(type='meta')"),
        RuntimeError("assert device(type='cpu') == device(type='cuda', index=0)"),
        AssertionError("assert 94074144032192 == 94074144189696"),
    ],
)
def test_anything_else_is_a_real_failure(exc):
    assert gpu_only.cause_of(exc) is None


def test_a_collection_errors_text_names_its_cause():
    text = (
        "ImportError while importing test module 'tests/unit_tests/distributed/mfsdp_v2/test_optimizer.py'.\n"
        "tests/unit_tests/distributed/mfsdp_v2/test_optimizer.py:9: in <module>\n"
        "    import transformer_engine as te\n"
        "E   ModuleNotFoundError: No module named 'transformer_engine'\n"
    )
    assert gpu_only.cause_in(text).name == "Transformer Engine"
    assert gpu_only.cause_in(
        "E   ValueError: apply_rope_fusion is not available. Please install TE >= 1.4."
    ).name
    assert gpu_only.cause_in("E   ModuleNotFoundError: No module named 'click'") is None
    # the class and the message must be on one line
    assert gpu_only.cause_in("E   ValueError: bad\nis not available. Please install TE") is None


@pytest.mark.parametrize(
    ("feature", "cause"),
    [
        ("CUDA graphs", "CUDA graphs"),
        ("symmetric memory", "symmetric memory"),
        ("CUDA memory accounting", "CUDA memory accounting"),
        ("CUDA kernel trace", "CUDA kernel trace (profiler)"),
    ],
)
def test_what_the_emulated_device_lacks_by_the_errors_class_and_text(feature, cause):
    # the emulation's error (emulation/device_limits.py), known here by its class name and text only
    lacks = type("EmulatedDeviceLacks", (RuntimeError,), {})
    found = gpu_only.cause_of(lacks(f"the emulated CUDA device (a CPU rank) has no {feature}: x needs a GPU"))
    assert found is not None
    assert found.name == cause
    assert gpu_only.cause_of(lacks(f"{feature} is fine")) is None  # the text must say it has none


# as megatron-core's GPT layer specs bind it where Transformer Engine is missing
MODULE_WITHOUT_TE = """
try:
    import transformer_engine
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
except ImportError:
    TESpecProvider = None

make_adapter = None

def te_layer_spec():
    return TESpecProvider()

def other_none():
    return make_adapter()
"""


def _raised_in(tmp_path, monkeypatch, function):
    path = tmp_path / "layer_specs.py"
    path.write_text(MODULE_WITHOUT_TE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    module = importlib.import_module("layer_specs")
    with pytest.raises(TypeError) as raised:
        getattr(module, function)()
    return raised.value, path


def test_calling_a_te_name_bound_to_none_without_te_is_gpu_only(tmp_path, monkeypatch):
    """megatron-core binds some 15 TE names to None where TE is missing; calling one says only
    "'NoneType' object is not callable": the call's name tells it apart."""
    exc, path = _raised_in(tmp_path, monkeypatch, "te_layer_spec")
    assert gpu_only.missing_te_call(exc) == f"TESpecProvider() at {path}:11"
    assert gpu_only.cause_of(exc) is gpu_only.TRANSFORMER_ENGINE


def test_another_none_called_stays_a_failure(tmp_path, monkeypatch):
    """A None called for another reason (a bug, a mutation of the code under test) is no GPU-only
    cause: only a TE name counts, and only where Transformer Engine is missing."""
    exc, _ = _raised_in(tmp_path, monkeypatch, "other_none")
    assert gpu_only.missing_te_call(exc) is None
    assert gpu_only.cause_of(exc) is None
