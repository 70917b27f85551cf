"""Parity of the plugin's config rules (:mod:`.config`) with Megatron-Bridge's own ``validate()``.

Without Bridge the plugin checks a run's config with its own copy of Bridge's Megatron-FSDP rules; with
Bridge it is Bridge's check (:mod:`.bridge_config`). :data:`CASES` is a table of configs (the seed's
override on Bridge's recipe, then one change each) with the verdict both must reach; every case runs
through both, and any disagreement is reported, so the day Bridge changes a rule the table fails.
Differences that are meant are declared in :data:`KNOWN_DIFFERENCES`, each with why; a declared difference
that no longer shows is reported too (the declaration is then out of date).

Importing Bridge without Transformer Engine needs the TE stand-in of ``foreign/bridge.py``, which the
caller switches on (this room imports no harness). Imports no pytest.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .bridge_config import (
    VANILLA_GPT,
    bridge_refusal,
    bridge_world_size,
    environment,
    run_config_of,
    seed_config,
    set_field,
)
from .config import findings, upstream_line

#: where a case saves or loads: a path nothing creates (validation only compares it with None)
CHECKPOINT_DIR = "/nonexistent/pytest-megatron-fsdp/bridge-parity"


@dataclass(frozen=True)
class Case:
    """One config: the seed's on Bridge's recipe with ``changes`` (Bridge's dotted field names) under
    ``environ``; ``refused``: the verdict both checks must reach; ``rule``: the plugin rule that refuses
    it (so the case tests what it says)."""

    name: str
    changes: Mapping[str, Any] = field(default_factory=dict)
    refused: bool = False
    rule: str | None = None
    environ: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class KnownDifference:
    """A case where the two checks differ on purpose: who refuses it, and why."""

    plugin_refuses: bool
    bridge_refuses: bool
    why: str


SAVING = {"checkpoint.save": CHECKPOINT_DIR}
NO_MEGATRON_FSDP = {"dist.use_megatron_fsdp": False, "ddp.use_megatron_fsdp": False}

CASES: tuple[Case, ...] = (
    Case("seed override"),
    Case("seed override, saving", SAVING),
    Case("seed override, loading", {"checkpoint.load": CHECKPOINT_DIR}),
    Case(
        "Megatron-FSDP with torch FSDP2",
        {"dist.use_torch_fsdp2": True},
        refused=True,
        rule="megatron-fsdp-excludes-fsdp2",
    ),
    Case(
        "Megatron-FSDP with use_tp_pp_dp_mapping",
        {"dist.use_tp_pp_dp_mapping": True},
        refused=True,
        rule="tp-pp-dp-mapping",
    ),
    Case(
        "torch_dist while saving",
        {"checkpoint.ckpt_format": "torch_dist", **SAVING},
        refused=True,
        rule="megatron-fsdp-needs-fsdp-dtensor",
    ),
    Case(
        "torch while loading",
        {"checkpoint.ckpt_format": "torch", "checkpoint.load": CHECKPOINT_DIR},
        refused=True,
        rule="megatron-fsdp-needs-fsdp-dtensor",
    ),
    Case(
        "torch_dist, nothing saved or loaded",
        {"checkpoint.ckpt_format": "torch_dist"},
        refused=True,
        rule="megatron-fsdp-needs-fsdp-dtensor",
    ),
    Case(
        "CUDA_DEVICE_MAX_CONNECTIONS=1",
        environ={"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
        refused=True,
        rule="cuda-device-max-connections",
    ),
    Case(
        "fsdp_dtensor saved without Megatron-FSDP",
        {**NO_MEGATRON_FSDP, **SAVING},
        refused=True,
        rule="fsdp-dtensor-needs-megatron-fsdp",
    ),
    Case("only ddp.use_megatron_fsdp set", {"dist.use_megatron_fsdp": False}),
    Case("only dist.use_megatron_fsdp set", {"ddp.use_megatron_fsdp": False}),
    Case("average_in_collective on (both turn it off)", {"ddp.average_in_collective": True}),
    Case("distributed optimizer off (both turn it on)", {"ddp.use_distributed_optimizer": False}),
    Case("async save of fsdp_dtensor", {"checkpoint.async_save": True, **SAVING}),
    Case(
        "only ddp.use_megatron_fsdp set, with torch FSDP2",
        {"dist.use_megatron_fsdp": False, "dist.use_torch_fsdp2": True},
        refused=True,
        rule="ddp-megatron-fsdp-excludes-fsdp2",
    ),
)

KNOWN_DIFFERENCES: dict[str, KnownDifference] = {
    "torch_dist, nothing saved or loaded": KnownDifference(
        plugin_refuses=True,
        bridge_refuses=False,
        why=(
            "Bridge checks the format only when checkpoint.save or load is set; the plugin refuses it "
            "always, as Megatron-LM's arguments.py does: a run that cannot checkpoint is not the run gated"
        ),
    ),
    "only ddp.use_megatron_fsdp set, with torch FSDP2": KnownDifference(
        plugin_refuses=True,
        bridge_refuses=False,
        why=(
            "Bridge checks the exclusion on dist.use_megatron_fsdp before it copies ddp's flag into dist, "
            "and does not check again; both wrappers then end up requested"
        ),
    ),
}


@dataclass(frozen=True)
class Verdict:
    """What each check said of one case: the plugin's refusing rule and line, Bridge's exception line."""

    case: Case
    plugin_rule: str | None
    plugin_line: str | None
    bridge_line: str | None

    @property
    def plugin_refuses(self) -> bool:
        return self.plugin_rule is not None

    @property
    def bridge_refuses(self) -> bool:
        return self.bridge_line is not None


def verdict(case: Case, recipe: str = VANILLA_GPT) -> Verdict:
    """``case`` through the plugin's rules (on the mirrored config, at Bridge's world size) and through
    Bridge's own validation, each on a fresh config from Bridge's recipe."""
    cfg = seed_config(recipe)
    for dotted, value in case.changes.items():
        set_field(cfg, dotted, value)
    world_size = bridge_world_size(case.environ)
    with environment(case.environ):
        found = findings(run_config_of(cfg), world_size, dict(os.environ))
    refusals = [(rule.name, message) for rule, message in found if not rule.warns]
    refusal = bridge_refusal(cfg, case.environ)
    return Verdict(
        case,
        refusals[0][0] if refusals else None,
        refusals[0][1] if refusals else None,
        None if refusal is None else upstream_line(refusal),
    )


def _said(refuses: bool, line: str | None) -> str:
    return f"refuses ({line})" if refuses else "accepts"


def disagreements(verdicts: Sequence[Verdict]) -> list[str]:
    """One line per case where the checks disagree (and no known difference says so), where a declared
    difference no longer shows, or where the plugin refuses with another rule than the case names."""
    lines = []
    for v in verdicts:
        case = v.case
        known = KNOWN_DIFFERENCES.get(case.name)
        expected_plugin = known.plugin_refuses if known else case.refused
        expected_bridge = known.bridge_refuses if known else case.refused
        said = (
            f"plugin {_said(v.plugin_refuses, v.plugin_line)}, "
            f"Megatron-Bridge {_said(v.bridge_refuses, v.bridge_line)}"
        )
        if (v.plugin_refuses, v.bridge_refuses) != (expected_plugin, expected_bridge):
            wanted = "both " + ("refuse" if case.refused else "accept") if not known else known.why
            lines.append(f"{case.name}: {said}; expected: {wanted}")
        elif v.plugin_refuses and v.plugin_rule != case.rule:
            lines.append(f"{case.name}: the plugin refuses by rule {v.plugin_rule}, not {case.rule}: {said}")
    return lines
