"""Megatron-Bridge's own config and rules, checked in a plain process, as the one that launches ranks is.

With megatron-bridge importable (the newest stack; :func:`versions.megatron_bridge_problem` says why not),
the seed's config is Bridge's own ``ConfigContainer``: Bridge's recipe function, the seed's Megatron-FSDP
override (:func:`apply_seed_override`) and a CPU-sized model (:func:`shrink_for_cpu`), checked by Bridge's
own ``runtime_config_update`` (what ``pretrain()`` runs first: the mixed-precision string resolved, the
data-parallel size computed, then ``ConfigContainer.validate()``). It runs in a plain process: no process
group, no CUDA; Bridge reads the world size from the environment. A session asks for it with
``--mfsdp-bridge-rules`` (:func:`session_refusal`, in a fresh interpreter the parent starts before any
rank); the tests call it too (``tests/unit/test_bridge_config.py``).

A refusal is worded once, by the plugin's own rules (:mod:`.config`): the config is mirrored into a
:class:`RunConfig` (:func:`run_config_of`) and the first rule that refuses it gives the line (field,
value, fix), Bridge's own message appended. Where no plugin rule refuses it (a rule only Bridge has),
:func:`.config.upstream_refusal` words Bridge's message.

Importing Bridge without Transformer Engine needs the TE stand-in of ``foreign/bridge.py`` (its
``peft/lora_layers`` imports TE at its top), and a CPU process needs its config switches (Bridge's
``validate`` finalizes the model, which refuses TE-only fusions without TE): the caller switches them
on (``foreign.bridge.watch()``; this room imports no harness). Imports no pytest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from . import versions
from .config import ConfigError, RunConfig, enable_megatron_fsdp, findings, upstream_line, upstream_refusal

#: Bridge's recipe that builds without the hub: a bare GPTModelProvider, mock data, NullTokenizer
VANILLA_GPT = "megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config"
#: the seed's recipe; its model comes from the hub's config of meta-llama/Meta-Llama-3-8B
LLAMA3_8B = "megatron.bridge.recipes.llama.llama3:llama3_8b_pretrain_config"

#: the exceptions Bridge's validation refuses a config with; anything else is a crash, not a verdict
REFUSALS = (AssertionError, ValueError)

#: RunConfig section -> the fields mirrored from Bridge's section of the same name (those both name)
_MIRRORED_SECTIONS = ("dist", "ddp", "checkpoint", "model")
_NOT_MIRRORED = frozenset({"extra", "overrides", "preset", "backend"})


def recipe(path: str = VANILLA_GPT) -> Any:
    """A fresh ``ConfigContainer`` from Bridge's recipe function ``module:function``."""
    module, _, function = path.partition(":")
    return getattr(importlib.import_module(module), function)()


def apply_seed_override(cfg: Any) -> Any:
    """The seed's Megatron-FSDP card, on a Bridge ``ConfigContainer``: the plugin's own statement of
    it (:func:`.config.enable_megatron_fsdp`), whose sections and fields are Bridge's."""
    return enable_megatron_fsdp(cfg)


def shrink_for_cpu(cfg: Any) -> Any:
    """A recipe's config at the size 2 CPU ranks train in seconds: 2 layers of hidden size 64, sequences of
    64 tokens, 4 samples a step; context parallelism off (only Transformer Engine's attention has it);
    nothing written (no checkpoint or TensorBoard directory: a case that saves names its own)."""
    model = cfg.model
    model.num_layers = 2
    model.hidden_size = 64
    model.ffn_hidden_size = 256
    model.num_attention_heads = 4
    if getattr(model, "num_query_groups", None):
        model.num_query_groups = 2
    if getattr(model, "kv_channels", None):
        model.kv_channels = 16
    model.seq_length = 64
    model.context_parallel_size = 1
    cfg.dataset.seq_length = 64
    cfg.dataset.num_workers = 1
    cfg.train.train_iters = 4
    cfg.train.global_batch_size = 4
    cfg.train.micro_batch_size = 1
    cfg.scheduler.lr_warmup_iters = 1
    cfg.validation.eval_interval = None
    cfg.validation.eval_iters = 0
    cfg.checkpoint.save = None
    cfg.checkpoint.load = None
    cfg.logger.tensorboard_dir = None
    return cfg


def seed_config(path: str = VANILLA_GPT) -> Any:
    """Bridge's recipe ``path``, shrunk for CPU ranks, with the seed's override applied last."""
    return apply_seed_override(shrink_for_cpu(recipe(path)))


def set_field(cfg: Any, dotted: str, value: Any) -> None:
    """``cfg.<section>.<field> = value`` (``dotted``: ``section.field``, Bridge's names)."""
    section, _, name = dotted.rpartition(".")
    target = cfg
    for part in section.split(".") if section else ():
        target = getattr(target, part)
    if not hasattr(target, name):
        raise AttributeError(f"Megatron-Bridge's config has no field {dotted!r}")
    setattr(target, name, value)


def apply_assignments(cfg: Any, assignments: Sequence[str]) -> list[str]:
    """The ``--mfsdp-set`` assignments (Bridge's names) on Bridge's ``cfg``, each value typed as the
    plugin's :class:`RunConfig` types it; returns the fields Bridge's config does not have (the
    plugin's preset and free-form fields), left out."""
    left_out = []
    for text in assignments:
        scratch = RunConfig()
        scratch.assign(text)
        dotted = text.partition("=")[0].strip()
        section_name, _, name = dotted.partition(".")
        section = getattr(scratch, section_name)
        if name in {f.name for f in dataclasses.fields(section)}:
            value = getattr(section, name)
        else:  # a megatron-core field the section does not spell out: ddp.extra, model.overrides
            value = (section.extra if section_name == "ddp" else section.overrides)[name]
        try:
            set_field(cfg, dotted, value)
        except AttributeError:
            left_out.append(dotted)
    return left_out


def session_refusal(
    assignments: Sequence[str], use_megatron_fsdp: bool, environ: Mapping[str, str]
) -> str | None:
    """A session's starting config as Bridge's: its vanilla GPT recipe shrunk for CPU ranks, the seed's
    Megatron-FSDP override where the session wraps with Megatron-FSDP, the session's ``--mfsdp-set``
    assignments, checked by Bridge's own validation as a rank with ``environ`` (a rank's torchrun
    variables: Bridge reads the world size there): the refusal's one line, or None where Bridge
    accepts it."""
    cfg = shrink_for_cpu(recipe())
    if use_megatron_fsdp:
        cfg = apply_seed_override(cfg)
    apply_assignments(cfg, assignments)
    try:
        validate_bridge_config(cfg, environ)
    except ConfigError as exc:
        return str(exc)
    return None


def run_config_of(cfg: Any) -> RunConfig:
    """The plugin's :class:`RunConfig` of a Bridge ``ConfigContainer``: every field the two name alike in
    ``dist``, ``ddp``, ``checkpoint`` and ``model`` (the FSDP, parallelism and checkpoint fields the rules
    read). Not mirrored: the model's shape and the batch sizes (the plugin's come from its presets), and
    ``dist.backend`` (Bridge's ``distributed_backend`` names the GPU one; the session's is checked on
    the ranks)."""
    mirror = RunConfig()
    for section_name in _MIRRORED_SECTIONS:
        section = getattr(mirror, section_name)
        theirs = getattr(cfg, section_name)
        for f in dataclasses.fields(section):
            if f.name not in _NOT_MIRRORED and hasattr(theirs, f.name):
                setattr(section, f.name, getattr(theirs, f.name))
    return mirror


@contextlib.contextmanager
def environment(overlay: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with ``overlay`` for the block, then exactly as before: Bridge reads the world size
    from it, and ``runtime_config_update`` sets the recipe's ``env_vars`` in it (``NCCL_*``,
    ``PYTORCH_CUDA_ALLOC_CONF``, ``TORCH_NCCL_*``), which must not leak into the process that launches
    the ranks."""
    before = dict(os.environ)
    os.environ.update(overlay)
    try:
        yield
    finally:
        for name in [n for n in os.environ if n not in before]:
            del os.environ[name]
        for name, value in before.items():
            if os.environ.get(name) != value:
                os.environ[name] = value


def bridge_refusal(cfg: Any, environ: Mapping[str, str] | None = None) -> BaseException | None:
    """What Bridge's own ``runtime_config_update`` (then ``validate()``) refuses ``cfg`` with (None:
    accepted), in this process, under ``os.environ`` plus ``environ``. It completes ``cfg`` as Bridge
    does (both FSDP flags set, the distributed optimizer on, ...). Anything but a refusal is raised."""
    from megatron.bridge.training.config import runtime_config_update

    with environment(environ or {}):
        try:
            runtime_config_update(cfg)
        except REFUSALS as exc:
            return exc
    return None


def bridge_world_size(environ: Mapping[str, str] | None = None) -> int:
    """The world size Bridge's validation sees under ``os.environ`` plus ``environ`` (its own reader)."""
    from megatron.bridge.utils.common_utils import get_world_size_safe

    with environment(environ or {}):
        return int(get_world_size_safe())


def validate_bridge_config(
    cfg: Any, environ: Mapping[str, str] | None = None, *, purpose: str = "build"
) -> list[str]:
    """Bridge's own validation of ``cfg``; raise :class:`ConfigError` in one line on a refusal (the
    plugin's rule's line where one refuses the mirrored config, else Bridge's message worded by
    :func:`.config.upstream_refusal`). Returns the plugin's warnings of the mirrored config (where Bridge
    adjusts the config itself). ``cfg`` is completed by Bridge as it validates."""
    mirror = run_config_of(cfg)
    world_size = bridge_world_size(environ)
    with environment(environ or {}):
        found = findings(mirror, world_size, dict(os.environ), purpose=purpose)
    refusal = bridge_refusal(cfg, environ)
    if refusal is None:
        return [message for rule, message in found if rule.warns]
    source = f"Megatron-Bridge {versions.package_version('megatron-bridge')}"
    refused_by = [(rule, message) for rule, message in found if not rule.warns]
    if refused_by:
        rule, message = refused_by[0]
        raise ConfigError(f"{message} ({source}: {upstream_line(refusal)})", rule=rule.name) from refusal
    raise ConfigError(upstream_refusal(source, refusal)) from refusal
