"""``tests/upstream_code`` runs as Megatron-Bridge's own functional tests run: each test on every rank, in
the plugin's foreign-suite mode (``make upstream-code``: torchrun and ``--mfsdp-foreign-suite=true``), whose
Transformer Engine stand-in lets ``import megatron.bridge`` work without TE and whose CUDA answers let
Megatron-LM's ``validate_args`` ask for the device's architecture. Any other session stops before
a test module is imported, saying so in one line; collecting only is fine (``make lint``): the module then
skips itself where Bridge cannot be imported."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pytest_megatron_fsdp.options import session_values


def pytest_collectstart(collector: pytest.Collector) -> None:
    config = collector.config
    if isinstance(collector, pytest.Module) and not (
        config.option.collectonly or session_values(config).foreign_suite
    ):
        raise pytest.UsageError(
            f"{collector.path.parent.name}/: these tests run in the foreign-suite mode: add "
            "--mfsdp-foreign-suite=true (make upstream-code runs them under torchrun)"
        )


@pytest.fixture
def megatron_lm_args(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Any]]:
    """``megatron_lm_args(run, save=None, load=None, *flags)``: Megatron-LM's global arguments for the
    plugin's ``run`` (``mlm_args.megatron_lm_args``; imported here only when a test asks, since
    ``megatron.training`` exists on some stacks only)."""
    import mlm_args

    yield from mlm_args.megatron_lm_args(monkeypatch)
