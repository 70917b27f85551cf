"""Every megatron-core / torch version difference the harness cares about, in one place.

Reads package metadata only: importing this module imports neither torch nor megatron.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any
from urllib.parse import unquote, urlparse

from packaging.version import InvalidVersion, Version


def parse_version(text: str | Version) -> Version | None:
    """``text`` as a PEP 440 version (``packaging``'s ordering: ``0.20.0.dev1 < 0.20.0rc2 < 0.20.0 <
    0.20.0+gitabc < 0.20.0.post1``); None for "not installed" or a string that is no version."""
    if isinstance(text, Version):
        return text
    try:
        return Version(text)
    except InvalidVersion:
        return None


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def megatron_core_version() -> Version | None:
    """The installed megatron-core's version (None: not installed)."""
    return parse_version(package_version("megatron-core"))


def _git_commit(path: str) -> str | None:
    """The short commit of the git work tree ``path`` is in (megatron-fsdp's source is a subdirectory
    of a Megatron-LM checkout), read locally (no network); None where ``path`` is in no git work tree
    (an exported snapshot), or git is missing or refuses (e.g. another user's repository)."""
    if not os.path.isdir(path):
        return None
    try:
        done = subprocess.run(
            ["git", "-C", path, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and re.fullmatch(r"[0-9a-f]{4,40}", commit) else None


def package_source(name: str) -> str | None:
    """Where the installed distribution ``name`` came from, for headers and messages; None where it
    came from a package index (its version says it all) or is not installed.

    Reads the PEP 610 record (``direct_url.json``) pip writes for a direct install: ``-e PATH@COMMIT``
    for an editable checkout, ``PATH@COMMIT`` for a local directory (``no git commit`` where PATH is
    no git work tree, e.g. an exported snapshot), the file for a wheel, ``URL@COMMIT`` for a VCS URL.
    """
    try:
        record = metadata.distribution(name).read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    if not record:
        return None
    try:
        direct = json.loads(record)
    except ValueError:
        return None
    url = str(direct.get("url", ""))
    if "vcs_info" in direct:
        vcs = direct["vcs_info"]
        return f"{vcs.get('vcs', 'vcs')}+{url}@{str(vcs.get('commit_id', '?'))[:9]}"
    parsed = urlparse(url)
    if parsed.scheme != "file":
        return url or None
    path = unquote(parsed.path)
    if "dir_info" not in direct:
        return path  # a wheel or sdist file
    commit = _git_commit(path)
    editable = "-e " if direct["dir_info"].get("editable") else ""
    return f"{editable}{path}@{commit}" if commit else f"{editable}{path}, no git commit"


def _described(name: str) -> str:
    version = package_version(name)
    source = package_source(name)
    return f"{name} {version}" + (f" ({source})" if source else "")


def stack_description() -> str:
    """The stack under test, for headers: ``Python X, torch Y, megatron-core Z[, megatron-fsdp W]``,
    each megatron package with its source where it is not an index release (see :func:`package_source`)."""
    import platform

    text = (
        f"Python {platform.python_version()}, torch {package_version('torch')}, {_described('megatron-core')}"
    )
    if package_version("megatron-fsdp") == "not installed":
        return text
    problem = fully_shard_problem()
    return f"{text}, {_described('megatron-fsdp')}" + (f" (unusable: {problem})" if problem else "")


#: the stacks the repo's golden values are recorded on (the Makefile's STACK pins): name -> versions
#: (a local version label such as torch's ``+cpu`` is ignored)
GOLDEN_STACKS = {
    "newest": {"torch": "2.14.1", "megatron-core": "0.19.2", "megatron-fsdp": "0.6.1"},
    "floor": {"torch": "2.13.0", "megatron-core": "0.16.1", "megatron-fsdp": "not installed"},
}


def golden_stack() -> str:
    """The name of the installed stack for golden values: a :data:`GOLDEN_STACKS` name when the
    installed torch, megatron-core and megatron-fsdp are its versions, else one made of them
    (``torch2.15.0-mcore0.20.0-mfsdp0.7.0``; without ``-mfsdp...`` when it is not installed)."""
    installed = {
        name: package_version(name).split("+", 1)[0] for name in ("torch", "megatron-core", "megatron-fsdp")
    }
    for name, pins in GOLDEN_STACKS.items():
        if installed == pins:
            return name
    text = f"torch{installed['torch']}-mcore{installed['megatron-core']}"
    if installed["megatron-fsdp"] != "not installed":
        text += f"-mfsdp{installed['megatron-fsdp']}"
    return text


def live_process_groups() -> list[Any]:
    """This rank's process groups, oldest first (the default group included).

    torch has no public list of them; ``distributed_c10d._world.pg_names`` (a dict in creation
    order) has held it since torch 2.0. Empty if that layout ever changes: nothing is then released
    early, groups just live until the session's process group is destroyed.
    """
    from torch.distributed import distributed_c10d

    names = getattr(getattr(distributed_c10d, "_world", None), "pg_names", None)
    return list(names) if isinstance(names, dict) else []


def transformer_engine_available() -> bool:
    """Whether Transformer Engine imports (it needs CUDA; never on this project's CPU machines)."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


#: megatron-core dataclasses whose field names the config checks: the files defining them and the
#: classes whose fields they inherit
_DDP_SOURCE = "distributed/distributed_data_parallel_config.py"
_MEGATRON_CONFIG_SOURCES = {
    "DistributedDataParallelConfig": ((_DDP_SOURCE,), {"DistributedDataParallelConfig"}),
    "TorchFullyShardedDataParallelConfig": (
        ("distributed/torch_fully_sharded_data_parallel_config.py", _DDP_SOURCE),
        {"TorchFullyShardedDataParallelConfig", "DistributedDataParallelConfig"},
    ),
    "TransformerConfig": (
        ("transformer/transformer_config.py", "model_parallel_config.py"),
        {"TransformerConfig", "ModelParallelConfig"},
    ),
}


def _dataclass_fields(package: str, sources: tuple[str, ...], classes: set[str]) -> frozenset[str] | None:
    """Field names of ``classes`` as defined in ``package``'s ``sources``, read with ``ast``.
    ``find_spec`` of a subpackage imports its parent only (``megatron``, a namespace package: no code)."""
    import ast
    from importlib import util

    try:
        spec = util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    names: set[str] = set()
    for relative in sources:
        for root in spec.submodule_search_locations:
            try:
                with open(f"{root}/{relative}", encoding="utf-8") as source:
                    tree = ast.parse(source.read())
            except OSError:
                continue
            for node in tree.body:
                if isinstance(node, ast.ClassDef) and node.name in classes:
                    names.update(
                        item.target.id
                        for item in node.body
                        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                    )
            break
    return frozenset(names) or None


@functools.cache
def megatron_config_fields(class_name: str) -> frozenset[str] | None:
    """Field names of the installed megatron-core's ``DistributedDataParallelConfig``,
    ``TorchFullyShardedDataParallelConfig`` or ``TransformerConfig`` (with the classes they inherit).

    Importing megatron would import torch; the plugin checks ``--mfsdp-set`` at configure time,
    before any rank work, so it reads the dataclass definitions instead. None when megatron-core
    is not installed or its layout is unknown (the run then checks when it builds the configs).
    """
    sources, classes = _MEGATRON_CONFIG_SOURCES[class_name]
    # megatron.core's own locations: an editable install (a Megatron-LM checkout) lists no directory
    # for the namespace package `megatron`, only its finder's placeholder
    return _dataclass_fields("megatron.core", sources, classes)


@functools.cache
def fully_shard_problem() -> str | None:
    """Why ``megatron_fsdp.fully_shard`` cannot run here, in one line (None: it can).

    When megatron-core imports, megatron-fsdp builds megatron-core's ``DistributedDataParallelConfig``
    instead of its own, so the pair must agree on that config's fields (megatron-fsdp 0.6.1 beside
    megatron-core 0.16.1 fails: ``unexpected keyword argument 'fsdp_db_use_persist_buf_on_alloc_fail'``).
    """
    standalone = package_version("megatron-fsdp")
    if standalone == "not installed":
        return "megatron-fsdp is not installed (pip install -e '.[fully-shard]')"
    core = package_version("megatron-core")
    if core == "not installed":
        return None
    wanted = _dataclass_fields(
        "megatron_fsdp", (_DDP_SOURCE.split("/")[-1],), {"DistributedDataParallelConfig"}
    )
    have = megatron_config_fields("DistributedDataParallelConfig")
    missing = sorted((wanted or set()) - (have or set())) if wanted and have else []
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        return (
            f"megatron-fsdp {standalone} cannot run beside megatron-core {core}: fully_shard builds "
            f"megatron-core's DistributedDataParallelConfig, which has no {missing[0]}{more}; "
            "use megatron-core >= 0.19 (or uninstall megatron-fsdp)"
        )
    return None


def meta_device_init_problem() -> str | None:
    """Why ``init_model_with_meta_device=True`` cannot build the harness's GPT on this
    megatron-core, as one line naming the field, the value and the fix; None when it can.

    Megatron-FSDP materialises meta parameters by calling each owning module's
    ``reset_parameters`` (or ``_reset_parameters``) and raises ValueError for a module without one
    (``param_and_grad_buffer.py``: "does not have a reset_parameters or _reset_parameters method").
    The GPT's word embedding is megatron-core's VocabParallelEmbedding in either layer spec (local
    or Transformer Engine). A feature check, not a version number: imports megatron (call it inside
    a rank only).
    """
    from megatron.core.tensor_parallel import VocabParallelEmbedding

    if any(hasattr(VocabParallelEmbedding, name) for name in ("reset_parameters", "_reset_parameters")):
        return None
    return (
        "model.init_model_with_meta_device=True cannot build this GPT: Megatron-FSDP materialises "
        "meta parameters through each module's reset_parameters, and this megatron-core's "
        "VocabParallelEmbedding (the word embedding) has none; set "
        "model.init_model_with_meta_device=False"
    )


def megatron_fsdp_wrapper_types(wrapper: Any = None) -> tuple[type, ...]:
    """The classes a model wrapped by megatron-core's ``FullyShardedDataParallel`` is an instance of.

    Up to 0.19 it is a class. On upstream main it is a factory returning ``FullyShardedDataParallelV1``
    or ``V2`` (chosen by the DDP config's ``megatron_fsdp_version``), so ``isinstance`` against it
    fails (Megatron-Bridge #5232, #5357): then the ``FullyShardedDataParallelV*`` classes of the
    factory's module. ``wrapper``: the object to inspect (default: megatron-core's; imports megatron).
    """
    import sys

    if wrapper is None:
        from megatron.core.distributed import FullyShardedDataParallel

        wrapper = FullyShardedDataParallel
    if isinstance(wrapper, type):
        return (wrapper,)
    namespace = vars(sys.modules[wrapper.__module__])
    found = tuple(
        value
        for name, value in sorted(namespace.items())
        if name.startswith("FullyShardedDataParallelV") and isinstance(value, type)
    )
    if not found:
        raise TypeError(
            f"{wrapper.__module__}.{getattr(wrapper, '__name__', wrapper)} is neither a class nor a factory "
            "beside FullyShardedDataParallelV* classes: this megatron-core's wrapper layout is unknown"
        )
    return found


# -- Megatron-FSDP V2 and HybridModel -----------------------------------------------------------


def megatron_fsdp_v2_problem() -> str | None:
    """Why this megatron-core cannot build Megatron-FSDP V2, in one line (None: it can).

    V2 is chosen by ``DistributedDataParallelConfig.megatron_fsdp_version=2`` (Megatron-LM PR
    #5865, after megatron-core 0.19): a feature check on that field, read from the dataclass
    definition without importing megatron (the plugin asks at collection time). Looked up through
    ``megatron.core``'s own spec, which an editable install of a Megatron-LM checkout answers too.
    """
    fields = _dataclass_fields("megatron.core", (_DDP_SOURCE,), {"DistributedDataParallelConfig"})
    if fields is not None and "megatron_fsdp_version" in fields:
        return None
    return (
        f"megatron-core {package_version('megatron-core')} has no Megatron-FSDP V2 "
        "(DistributedDataParallelConfig.megatron_fsdp_version, Megatron-LM PR #5865)"
    )


def megatron_fsdp_v2_refusal(
    strategy: str, outer_strategy: str = "no_shard", optimizer_instances: int = 1
) -> str | None:
    """Why this megatron-core's ``FullyShardedDataParallelV2`` refuses a sharding layout, in one
    line (None: it accepts it): the wrapper's own config check, asked with a stand-in model.

    Megatron-LM main of 2026-08-22 accepts ``optim_grads_params`` only, with no outer (HSDP)
    sharding; no_shard/ZeRO-1/ZeRO-2 and HSDP are upstream work in progress (PR #6137, #5743,
    #5972, #6873). Asking the check itself keeps this true as upstream widens it. Imports megatron
    (call it inside a rank, where V2 exists: see :func:`megatron_fsdp_v2_problem`).
    """
    import types

    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallelV2
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        megatron_fsdp_version=2,
        data_parallel_sharding_strategy=strategy,
        outer_dp_sharding_strategy=outer_strategy,
        num_distributed_optimizer_instances=optimizer_instances,
    )
    groups = types.SimpleNamespace(dp_cp=None, tp=None, pp=None, cp=None, ep=None, expt_dp=None)
    try:
        FullyShardedDataParallelV2._validate_config(config, ddp_config, torch.nn.Module(), groups, False)
    except ValueError as exc:
        return (
            f"megatron-core {package_version('megatron-core')}'s FullyShardedDataParallelV2 refuses it: {exc}"
        )
    return None


def hybrid_model_problem() -> str | None:
    """Why this megatron-core cannot build a ``HybridModel``, in one line (None: it can).

    ``megatron.core.models.hybrid`` (``HybridModel`` with ``hybrid_layer_pattern``) ships in
    megatron-core 0.19.2 and on main, not in 0.16.1. Looks for the file through ``megatron.core``'s
    spec (editable installs included): importing it would import megatron at collection time.
    """
    import os
    from importlib import util

    try:
        spec = util.find_spec("megatron.core")
    except (ImportError, ValueError):
        spec = None
    roots = spec.submodule_search_locations if spec is not None else None
    hybrid = os.path.join("models", "hybrid", "hybrid_model.py")
    if any(os.path.isfile(os.path.join(root, hybrid)) for root in roots or ()):
        return None
    return (
        f"megatron-core {package_version('megatron-core')} has no HybridModel "
        "(megatron/core/models/hybrid/hybrid_model.py)"
    )


def v2_fully_shard_problem() -> str | None:
    """Why this megatron-core has no standalone Megatron-FSDP V2 API, in one line (None: it has).

    ``megatron_fsdp.experimental`` with ``fully_shard_context``, ``Placements`` and its own DCP
    ``save_checkpoint``/``load_checkpoint`` (``experimental/checkpoint.py``, Megatron-LM PR #6024)
    is on Megatron-LM main; megatron-core 0.19.2 ships an earlier ``experimental`` package without
    them, 0.16.1 none. Reads the files through ``megatron.core``'s spec (editable installs
    included), importing nothing.
    """
    import os
    from importlib import util

    try:
        spec = util.find_spec("megatron.core")
    except (ImportError, ValueError):
        spec = None
    experimental = os.path.join("distributed", "fsdp", "src", "megatron_fsdp", "experimental")
    roots = spec.submodule_search_locations if spec is not None else None
    for root in roots or ():
        entry = os.path.join(root, experimental, "fully_shard.py")
        if os.path.isfile(os.path.join(root, experimental, "checkpoint.py")) and os.path.isfile(entry):
            with open(entry, encoding="utf-8") as source:
                text = source.read()
            if "def fully_shard_context" in text and "class Placements" in text:
                return None
    return (
        f"megatron-core {package_version('megatron-core')} has no standalone Megatron-FSDP V2 API "
        "(megatron_fsdp.experimental: fully_shard_context, Placements, save_checkpoint; Megatron-LM PR #6024)"
    )


def missing_features_line() -> str | None:
    """The session header's line for what this megatron-core lacks of V2 and HybridModel (their
    tests skip, one line each); None when it has both."""
    problems = [p for p in (megatron_fsdp_v2_problem(), hybrid_model_problem()) if p]
    if not problems:
        return None
    return "megatron-fsdp: " + "; ".join(problems) + ": those tests skip"


# -- known upstream bugs ------------------------------------------------------------------------


@dataclass(frozen=True)
class KnownBug:
    """An upstream bug and the versions of ``package`` that have it: ``first <= version < fixed_in``.

    Tests mark themselves strict-xfail where :meth:`present` (the test must fail there, or it
    XPASSes loudly, see :func:`no_longer_reproduces`) and run as ordinary tests elsewhere (where the
    fix must hold).

    Versions compare as PEP 440 versions (``packaging.version``), so the ordering is
    ``0.20.0.dev1 < 0.20.0rc1 < 0.20.0 <= 0.20.0+gitabc < 0.20.0.post1``. ``fixed_in`` is the first
    version known to carry the fix, written as that version reports itself: ``"0.20.0"`` when the
    fix is first seen in 0.20.0 (or in a checkout reporting 0.20.0, as Megatron-LM main does), in
    which case the pre-releases 0.20.0rcN count as still having the bug; ``"0.7.0rc0"`` when a
    pre-release carries it (every later rc and the release then count as fixed). A pre-release that
    turns out to have the fix XPASSes, and the failure says to lower ``fixed_in`` to it. A local
    version (``0.20.0+d98e8a6``, a checkout) counts as its public version. A checkout whose version
    is already past ``fixed_in`` but whose branch predates the fix is out of reach of any version
    check: its test fails as an ordinary failure.
    """

    #: one line for the xfail reason, citing the upstream issue or PR
    reason: str
    #: the first version of ``package`` with the fix (a PEP 440 string); None: no fixed version known
    fixed_in: str | None
    #: the first version of ``package`` with the bug
    first: str = "0"
    #: an extra condition beyond the version (e.g. "without Transformer Engine")
    only_if: Callable[[], bool] | None = None
    #: the distribution whose version decides ("megatron-fsdp" for the standalone fully_shard)
    package: str = "megatron-core"

    def __post_init__(self) -> None:
        for field in ("first", "fixed_in"):
            value = getattr(self, field)
            if value is not None and parse_version(value) is None:
                raise ValueError(f"KnownBug.{field}={value!r} is no PEP 440 version; write e.g. '0.20.0'")

    def present(self, version: str | Version | None = None) -> bool:
        """Whether ``version`` (default: the installed ``package``'s) has the bug. A package that is
        not installed, or whose version is no PEP 440 version, has none."""
        parsed = parse_version(package_version(self.package) if version is None else version)
        if parsed is None:
            return False
        in_range = Version(self.first) <= parsed and (
            self.fixed_in is None or parsed < Version(self.fixed_in)
        )
        return in_range and (self.only_if is None or self.only_if())


#: ``no_shard`` with ``overlap_param_gather=False``: ``start_param_sync`` fetches a bucket of the
#: weight buffer no_shard does not have (``'NoneType' object has no attribute 'fetch_bucket'``).
NO_SHARD_PARAM_SYNC = KnownBug(
    "upstream bug: no_shard + overlap_param_gather=False crashes in MegatronFSDP.start_param_sync "
    "(fetch_bucket on None); fixed in megatron-core 0.18 (Megatron-LM PR #3754)",
    fixed_in="0.18",
)

#: ``optim`` with ``overlap_grad_reduce=True``: ``_bucket_group_gradient_reduce`` reduce-scatters
#: into a fresh tensor and adds it onto the rank's still-unreduced shard (``local_grad +=
#: reduced_grad``), so that shard counts its own rank twice; 0.17 copies instead.
OPTIM_OVERLAP_DOUBLE_COUNT = KnownBug(
    "upstream bug: 'optim' + overlap_grad_reduce=True adds the reduced shard onto the unreduced "
    "local gradient (local_grad += reduced_grad); changed in megatron-core 0.17 (Megatron-LM PR #3067)",
    fixed_in="0.17",
)

#: ``optim`` with ``overlap_grad_reduce=False`` on 0.19: the post-backward hook reduces the
#: gradients on the last micro-batch (``_process_post_backward_gradients`` ->
#: ``grad_reduce_pipeline.reduce_gradients``), then ``finish_grad_sync`` -> ``synchronize_gradient_reduce``
#: -> ``start_grad_sync`` reduce-scatters the same buffer again (``reduce_scatter_gradients``). For
#: 'optim' the buffer is not sharded, so the second pass mixes reduced and unreduced values. Measured
#: on CPU ranks: 4.811087 vs DDP's 4.809149 at iteration 2; without the second pass, exact parity.
#: Megatron-LM PR #6357 (2026-08-18) stops the second reduction on main, which reports megatron-core
#: 0.20.0; on main of 2026-08-22 (d98e8a6) the parity test with DDP passes.
OPTIM_SYNC_DOUBLE_REDUCE = KnownBug(
    "upstream bug (measured on 0.19.2): 'optim' + overlap_grad_reduce=False reduces gradients twice "
    "(post-backward hook, then finish_grad_sync -> start_grad_sync); fixed on Megatron-LM main "
    "(megatron-core 0.20.0) by PR #6357",
    first="0.19",
    fixed_in="0.20.0",
)

#: Megatron-FSDP V1 on a model with frozen parameters (fine-tuning: PEFT freezes the base model before
#: the wrapper): each unit's post-accumulate-grad hook is registered on every parameter, and torch
#: refuses one on a parameter that does not require grad. Megatron-LM PR #2841 (2026-02-12, first in
#: core_v0.17.0) registers them on trainable parameters only.
FSDP_FROZEN_PARAMS_HOOK = KnownBug(
    "upstream bug (measured on megatron-core 0.16.1): wrapping a model with frozen parameters in "
    "Megatron-FSDP raises 'cannot register a hook on a tensor that doesn't require gradient' (its "
    "post-accumulate-grad hooks go on every parameter); fixed in megatron-core 0.17 (Megatron-LM PR #2841)",
    fixed_in="0.17",
)

#: A data-parallel size of 1 on megatron-core 0.16: optim_grads_params reports twice DDP's grad norm.
FSDP_GRAD_NORM_DOUBLED_AT_DP1 = KnownBug(
    "upstream bug (measured 2026-12-03 on megatron-core 0.16.1, one CPU rank): with a data-parallel "
    "size of 1, Megatron-FSDP optim_grads_params reports a global grad norm exactly twice DDP's (4.3445 "
    "vs 2.1722 at iteration 1; losses within 1e-7), so clip_grad would clip by it; no upstream report "
    "found; equal to DDP's from megatron-core 0.19.2 (0.17, 0.18 not measured); reproduction: "
    "tests/functional/test_world_size_one.py (test_one_rank_trains_to_ddps_losses[optim_grads_params])",
    first="0.16",
    fixed_in="0.19.2",
)

#: Megatron-FSDP V2 (megatron-core 0.20 on Megatron-LM main): ``get_grad_norm_fp32`` sums the squared
#: norms over the DTensor gradients' data-parallel group, then again over
#: ``grad_stats_parallel_group``, which holds the same ranks for V2: the norm is sqrt(dp) times DDP's.
V2_GRAD_NORM_OVER_DP = KnownBug(
    "upstream bug (measured on Megatron-LM main d98e8a64dd, 2 ranks: 2.2021 vs DDP's 1.5571): Megatron-FSDP "
    "V2's global grad norm is sqrt(dp) times DDP's, so clip_grad clips with the wrong norm; "
    "get_grad_norm_fp32 reduces the squared norms over the DTensor gradients' data-parallel group and "
    "again over grad_stats_parallel_group (the same ranks for V2); Megatron-LM PR #6489 (open) changes "
    "that path",
    first="0.20",
    fixed_in=None,
)

#: tp > 1 without Transformer Engine: ``_fix_tensor_parallel_attributes`` does
#: ``isinstance(m, (TELinear,))`` with ``TELinear`` None -> TypeError.
TENSOR_PARALLEL_WITHOUT_TE = KnownBug(
    "upstream bug: tp > 1 without Transformer Engine raises TypeError in FullyShardedDataParallel."
    "_fix_tensor_parallel_attributes (isinstance with TELinear=None); fixed in megatron-core 0.18 "
    "(Megatron-LM PR #3191)",
    fixed_in="0.18",
    only_if=lambda: not transformer_engine_available(),
)

#: FSDP2: ``finalize_model_grads`` calls ``finish_grad_sync(force_all_reduce=...)``, which
#: ``TorchFullyShardedDataParallel`` (through ``_BaseDataParallel``) does not take.
FSDP2_FINISH_GRAD_SYNC = KnownBug(
    "upstream bug: TorchFullyShardedDataParallel.finish_grad_sync() takes no force_all_reduce -> "
    "TypeError after the first backward (Megatron-LM issue #4669); fixed in megatron-core 0.19 (PR #4953)",
    fixed_in="0.19",
)

#: ``fully_shard_optimizer`` initialises the optimizer's state eagerly with one ``step()`` on zero
#: gradients: Adam's step count is then 1 ahead, so its bias correction under-applies the first
#: real update (SGD, whose zero-gradient step changes nothing, is unaffected). Megatron-LM PR #5976
#: makes that step inert (lr and weight decay 0 for it, step counters reset to 0 after it); it is in
#: the megatron-fsdp Megatron-LM main vendors (``megatron/core/distributed/fsdp/src``, 0.7.0rc0 on
#: main of 2026-08-22), not in any megatron-fsdp release up to 0.6.1.
FULLY_SHARD_EAGER_OPTIMIZER_STEP = KnownBug(
    "upstream bug: fully_shard_optimizer's eager init step() puts Adam one step ahead, so the first "
    "real update is under-applied (fixed by PR #5976 on Megatron-LM main; Megatron-LM issue #5974)",
    first="0.6",
    fixed_in="0.7.0rc0",
    package="megatron-fsdp",
)

#: Megatron-LM's own fsdp_dtensor preprocessing on a SwiGLU Megatron-FSDP model: megatron-core's
#: ``handle_swiglu_in_state_dict`` finds parameters with ``model.get_parameter(f"module.{key}")``
#: for model keys and ``key[len("module."):]`` for optimizer keys; with Megatron-FSDP's wrapper the
#: optimizer's names carry one ``module.`` per wrapper (``AttributeError: MegatronFSDP has no
#: attribute 'decoder'``), and a bf16 model's Float16Module breaks the model-key lookup too. Seen on
#: 0.16.1 and 0.19.2. The harness calls the handler with a view of the model that resolves names
#: below all wrappers (fsdp/megatron_layout.py).
SWIGLU_HANDLER_LOOKUP = KnownBug(
    "upstream bug: Megatron-LM's preprocess_fsdp_dtensor_state_dict (handle_swiglu_in_state_dict) "
    "cannot find a Megatron-FSDP model's parameters by name (related open reports: Megatron-LM "
    "issue #5265, Megatron-Bridge issue #4236)",
    fixed_in=None,
    first="0.16",
)

#: torch's gloo: with two or more asynchronous coalesced all-gathers in flight on one group (the
#: ``_coalescing_manager(async_ops=True)`` blocks Megatron-FSDP's parameter prefetch issues), the
#: group's two worker threads corrupt the process heap (``malloc(): unaligned tcache chunk detected``,
#: SIGSEGV, SIGABRT). One at a time, plain async all-gathers, or one worker thread per group: clean.
#: The CPU emulation gives every gloo group one worker thread (emulation/cuda.py).
GLOO_CONCURRENT_COALESCED_ALL_GATHERS = KnownBug(
    "upstream bug (measured on torch 2.13.0 and 2.14.1): concurrent asynchronous coalesced "
    "all-gathers on one gloo group corrupt the heap (a rank dies) or stop the ranks for good (a "
    "gloo worker thread spinning in a buffer's destructor); no upstream report found; torch-only "
    "reproduction: tests/reproductions/gloo_concurrent_all_gathers.py",
    fixed_in=None,
    package="torch",
)

#: ``no_shard``: the gradient norm Megatron logs (and clips by) counts every rank's full, replicated
#: gradient once per data-parallel rank: measured on 2 CPU ranks with megatron-core 0.16.1, exactly
#: sqrt(2) times Megatron DDP's norm at every iteration (2.2020867 vs 1.5571105), losses equal (no
#: clipping in the tiny preset). Equal to DDP's on 0.19.2; 0.17 and 0.18 were not measured, so
#: ``fixed_in`` is the first version known to carry the fix (an XPASS on an earlier one says to lower it).
NO_SHARD_GRAD_NORM_OVER_COUNTED = KnownBug(
    "upstream bug (measured on 0.16.1): no_shard's grad norm counts the replicated gradient once per "
    "data-parallel rank (sqrt(2) x DDP's on 2 ranks), so clipping is too strong; no upstream report "
    "found; equal to DDP's from megatron-core 0.19.2 (0.17, 0.18 not measured); reproduction: "
    "tests/functional/test_strategies.py (test_no_shard, compared with DDP's grad norms)",
    fixed_in="0.19.2",
)

#: Megatron-Bridge's fsdp_dtensor load is partial by default (``strict_fsdp_dtensor_load=False``): DCP's
#: ``allow_partial_load`` skips every model weight the checkpoint lacks, which keeps its initial value, and
#: the only word of it is an INFO log of the key differences. Resuming a 2-layer model from a 1-layer
#: model's checkpoint trains on (measured on megatron-bridge 0.6.2 with megatron-core 0.19.2). Bridge main
#: (0.7.0) refuses missing model weights unless fine-tuning, through megatron-core's
#: ``validate_fsdp_dtensor_model_load`` (Megatron-LM PR #6271, megatron-core 0.20.0 on main).
BRIDGE_PARTIAL_FSDP_DTENSOR_LOAD = KnownBug(
    "upstream bug (measured on megatron-bridge 0.6.2): a resume from an fsdp_dtensor checkpoint lacking "
    "model weights loads silently, the missing weights left at their initial values; Bridge main refuses "
    "it with megatron-core's validate_fsdp_dtensor_model_load (Megatron-LM PR #6271)",
    fixed_in="0.7.0",
    package="megatron-bridge",
)

#: Bridge's ``read_train_state`` is an ``lru_cache`` keyed by the file's path that returns the very
#: ``TrainState`` object a run then trains on (``state.train_state = read_train_state(...)``), so its
#: ``step`` moves with the run; a later load of that checkpoint in the same process gets the moved step
BRIDGE_TRAIN_STATE_CACHE_ALIASED = KnownBug(
    "upstream bug (measured on megatron-bridge 0.6.2; main of 2026-08-22 has the same code): a second "
    "pretrain() in one process loading the same checkpoint resumes at the step the first run reached, "
    "not the saved one (read_train_state's cache hands out the live TrainState); no upstream report "
    "found (Megatron-Bridge PR #4758 clears that cache at in-process restarts only); reproduction: "
    "tests/upstream_code/test_bridge_pretrain.py",
    fixed_in=None,
    package="megatron-bridge",
)

MLM_PARTIAL_FSDP_DTENSOR_LOAD = KnownBug(
    "upstream bug (measured on megatron-core 0.19.2): with --no-strict-fsdp-dtensor-load, Megatron-LM's "
    "load_checkpoint resumes from an fsdp_dtensor checkpoint lacking model weights silently, the missing "
    "weights left at their initial values; Megatron-LM main refuses it unless fine-tuning, with "
    "validate_fsdp_dtensor_model_load (Megatron-LM PR #6271)",
    fixed_in="0.20.0",
    first="0.19",
)

#: Megatron-LM's ``load_checkpoint`` (fsdp_dtensor) first reads the checkpoint's ``args``, ``iteration``
#: and ``checkpoint_version`` with DCP's default (strict) planner (``_load_base_checkpoint(rank0=True)``,
#: the format probe), so a checkpoint without ``args`` (Megatron-Bridge writes none) is refused there,
#: whatever ``--no-strict-fsdp-dtensor-load`` says, though the loader goes on to handle a missing
#: ``args`` ("could not find arguments in the checkpoint").
MLM_FSDP_DTENSOR_LOAD_NEEDS_ARGS = KnownBug(
    "upstream bug (measured on megatron-core 0.19.2; Megatron-LM main of 2026-08-22 has the same code): "
    "Megatron-LM's load_checkpoint refuses an fsdp_dtensor checkpoint without args, e.g. one Megatron-Bridge "
    "saved ('Missing key in checkpoint state_dict: args.', its format probe reads args strictly), though it "
    "handles a missing args afterwards; no upstream report found; reproduction: "
    "tests/upstream_code/test_bridge_pretrain.py",
    fixed_in=None,
    first="0.19",
)

MLM_V2_OPTIMIZER_CHECKPOINT = KnownBug(
    "upstream limitation (measured on Megatron-LM main of 2026-08-22, megatron-core 0.20.0): Megatron-LM's "
    "save_checkpoint refuses a Megatron-FSDP V2 run (NotImplementedError: MFSDP v2 optimizer checkpointing "
    "is not yet supported); no release has both V2 and its checkpointing (Megatron-LM issue #5534, PR #6215 "
    "open)",
    fixed_in=None,
    first="0.20",
)

KNOWN_BUGS = {
    "gloo_concurrent_coalesced_all_gathers": GLOO_CONCURRENT_COALESCED_ALL_GATHERS,
    "swiglu_handler_lookup": SWIGLU_HANDLER_LOOKUP,
    "fully_shard_eager_optimizer_step": FULLY_SHARD_EAGER_OPTIMIZER_STEP,
    "no_shard_param_sync": NO_SHARD_PARAM_SYNC,
    "no_shard_grad_norm_over_counted": NO_SHARD_GRAD_NORM_OVER_COUNTED,
    "optim_overlap_double_count": OPTIM_OVERLAP_DOUBLE_COUNT,
    "optim_sync_double_reduce": OPTIM_SYNC_DOUBLE_REDUCE,
    "tensor_parallel_without_te": TENSOR_PARALLEL_WITHOUT_TE,
    "fsdp2_finish_grad_sync": FSDP2_FINISH_GRAD_SYNC,
    "v2_grad_norm_over_dp": V2_GRAD_NORM_OVER_DP,
    "fsdp_grad_norm_doubled_at_dp1": FSDP_GRAD_NORM_DOUBLED_AT_DP1,
    "fsdp_frozen_params_hook": FSDP_FROZEN_PARAMS_HOOK,
    "bridge_partial_fsdp_dtensor_load": BRIDGE_PARTIAL_FSDP_DTENSOR_LOAD,
    "bridge_train_state_cache": BRIDGE_TRAIN_STATE_CACHE_ALIASED,
    "mlm_partial_fsdp_dtensor_load": MLM_PARTIAL_FSDP_DTENSOR_LOAD,
    "mlm_v2_optimizer_checkpoint": MLM_V2_OPTIMIZER_CHECKPOINT,
    "mlm_fsdp_dtensor_load_needs_args": MLM_FSDP_DTENSOR_LOAD_NEEDS_ARGS,
}


@dataclass(frozen=True)
class UpstreamTestBug:
    """A test of Megatron-LM's own suite that fails for a bug of the test itself where it shows:
    written for one world size (upstream's CI runs 8 ranks) with no skip for the others, or reading
    memory nobody wrote (which the emulation fills with NaN, so it fails every time). The
    foreign-suite mode marks it a strict xfail there (``foreign/upstream_test_bugs.py``), so it must
    fail there; it runs as any test where the bug does not show."""

    #: the test's node id, or the start of its parametrized ids, relative to the checkout's root
    test: str
    #: the bug, and the megatron-core versions whose tests have it
    bug: KnownBug
    #: the world sizes where it shows
    shows_at: Callable[[int], bool]
    #: what the test raises there
    raises: type[BaseException]


UPSTREAM_TEST_BUGS = {
    "swiglu_factory_offsets_for_dp4": UpstreamTestBug(
        "tests/unit_tests/distributed/test_torch_fully_sharded_parallel.py::test_fsdp2_swiglu_sharded_tensor_factory",
        KnownBug(
            "upstream test bug: its expected SwiGLU shard offsets are a table for TP2 x DP4 (8 ranks), "
            "with no skip for other world sizes (no upstream report found; at 4 ranks, ranks 1 and 2 "
            "fail, 0 and 3 pass)",
            fixed_in=None,
        ),
        shows_at=lambda world_size: world_size != 8,
        raises=AssertionError,
    ),
    "replicated_embedder_needs_pp4": UpstreamTestBug(
        "tests/unit_tests/distributed/test_grad_reduce_for_replicated_embedder.py::",
        KnownBug(
            "upstream test bug: it initialises pipeline parallel size 4 with no skip where the world "
            "size is not a multiple of 4 (megatron-core: 'world_size (2) is not divisible by 4'; no "
            "upstream report found)",
            fixed_in=None,
        ),
        shows_at=lambda world_size: world_size % 4 != 0,
        raises=RuntimeError,
    ),
    "fp32_accumulation_needs_six_ranks": UpstreamTestBug(
        "tests/unit_tests/distributed/test_reduce_scatter_with_fp32_accumulation.py::"
        "TestReduceScatterWithFP32Accumulation::test_reduce_scatter_with_fp32_accumulation[False-",
        KnownBug(
            "upstream test bug: every rank draws the same bf16 tensor, whose ring sum over up to 5 "
            "ranks rounds to the exact sum, so the bf16 reduce-scatter equals the fp32-accumulated one "
            "it must differ from (no upstream report found)",
            fixed_in=None,
        ),
        shows_at=lambda world_size: world_size < 6,
        raises=AssertionError,
    ),
    "dbuffer_round_trip_compares_padding": UpstreamTestBug(
        "tests/unit_tests/distributed/mfsdp_v2/test_dbuffer.py::test_replicate_scatter_round_trip",
        KnownBug(
            "upstream test bug: it compares a rank's whole local buffer bitwise (assert_close with "
            "rtol=0, atol=0, NaN unequal), padding included, and the padding is memory nobody wrote "
            "(its 40 values lie in a 120-value layout): it fails wherever the leftovers there hold "
            "NaN, on the emulation every time (it fills unwritten memory with NaN, as torch's "
            "fill_uninitialized_memory does); no upstream report found",
            fixed_in=None,
        ),
        shows_at=lambda world_size: True,
        raises=AssertionError,
    ),
}

_CITATION = re.compile(r"(?:Megatron-(?:LM|Bridge) )?(?:PR|issue) #\d+")


def known_bug_name(bug: KnownBug) -> str:
    """``bug``'s name in :data:`KNOWN_BUGS` ("" for a bug not registered there)."""
    return next((key for key, known in KNOWN_BUGS.items() if known is bug), "")


def xfail_reason(bug: KnownBug) -> str:
    """The xfail reason pytest prints per test (``-ra``): which bug (its name in
    :data:`KNOWN_BUGS`, where the whole story is), the upstream reference, and whether a release
    fixes it. The test's docstring says what the test sees."""
    fixed = f"fixed in {bug.package} {bug.fixed_in}" if bug.fixed_in else "no fix released"
    citation = _CITATION.search(bug.reason)
    return f"upstream bug {known_bug_name(bug)} ({citation.group(0) + '; ' if citation else ''}{fixed})"


def no_longer_reproduces(bug: KnownBug) -> str:
    """The one line a strict xfail of ``bug`` fails with when its test passes (XPASS(strict)): the
    bug no longer reproduces with the installed ``package`` (version and source), and the registry
    entry to change. It stays a failure: the registry must say which versions have the bug."""
    name = known_bug_name(bug) or "(unregistered)"
    version = package_version(bug.package)
    parsed = parse_version(version)
    public = parsed.public if parsed is not None else version
    source = package_source(bug.package)
    where = f"{bug.package} {version}" + (f" ({source})" if source else "")
    now = f" (now {bug.fixed_in!r})" if bug.fixed_in else ""
    return (
        f"known bug {name} no longer reproduces with {where}: the test passed where the registry "
        f"expects it to fail; if this {bug.package} has the upstream fix, set fixed_in={public!r}{now} "
        f"for {name} in pytest_megatron_fsdp/fsdp/versions.py"
    )


# -- Megatron-LM checkpoint layout --------------------------------------------------------------


NO_MEGATRON_LM_LAYOUT = (
    "this megatron-core has no megatron/core/transformer/fsdp_dtensor_checkpoint.py (it ships from "
    "0.16 on): Megatron-LM's fsdp_dtensor key layout (SwiGLU split into _w/_v) cannot be produced"
)


class MegatronLMHandlers:
    """megatron-core's fsdp_dtensor state-dict handlers, under names saying what each does."""

    def __init__(self, module: Any) -> None:
        self.drop_extra_state = module.handle_fp8_extra_state_case
        self.split_swiglu = module.handle_swiglu_in_state_dict
        self.globalize_experts = module.handle_experts_in_state_dict


def megatron_lm_fsdp_dtensor_handlers() -> MegatronLMHandlers | None:
    """The handlers Megatron-LM's ``preprocess_fsdp_dtensor_state_dict`` calls, from
    ``megatron.core.transformer.fsdp_dtensor_checkpoint``; None where that module is missing
    (megatron-core before 0.16). Imports megatron: call it inside a rank."""
    try:
        from megatron.core.transformer import fsdp_dtensor_checkpoint
    except ImportError:
        return None
    needed = ("handle_fp8_extra_state_case", "handle_swiglu_in_state_dict", "handle_experts_in_state_dict")
    if not all(hasattr(fsdp_dtensor_checkpoint, name) for name in needed):
        return None
    return MegatronLMHandlers(fsdp_dtensor_checkpoint)


#: the Megatron-Bridge release the newest stack installs, and the megatron-core series it pairs with (Bridge's
#: 0.6.x wheels pin no megatron-core; its Megatron-LM submodule is core_r0.19.0)
BRIDGE_RELEASE = "0.6.2"
BRIDGE_MEGATRON_CORE = Version("0.19")


def megatron_bridge_problem() -> str | None:
    """Why Megatron-Bridge's own config and rules cannot be used here, in one line (None: they can).

    The newest stack installs megatron-bridge (``make``, or ``pip install --no-deps megatron-bridge==0.6.2``
    plus the extra ``bridge``); the floor does not: its megatron-core 0.16.1 predates what Bridge 0.6
    imports (``megatron.training.config``, in the megatron-core wheels from 0.19 on). Reads metadata only."""
    bridge = package_version("megatron-bridge")
    core = megatron_core_version()
    if bridge == "not installed":
        return (
            f"megatron-bridge is not installed (the newest stack installs {BRIDGE_RELEASE}, which needs "
            f"megatron-core >= {BRIDGE_MEGATRON_CORE}; this stack has {package_version('megatron-core')})"
        )
    if core is None or core.release[:2] < BRIDGE_MEGATRON_CORE.release[:2]:
        return (
            f"megatron-bridge {bridge} needs megatron-core >= {BRIDGE_MEGATRON_CORE}, "
            f"found {package_version('megatron-core')}"
        )
    return None


def upstream_code_problem() -> str | None:
    """Why ``tests/upstream_code`` (Megatron-Bridge's loop and checkpoints, Megatron-LM's checkpointing)
    has nothing to run here, in one line; None where either is importable. Reads metadata only."""
    bridge = megatron_bridge_problem()
    if bridge is None or megatron_lm_training_installed():
        return None
    return f"{bridge}; megatron.training (Megatron-LM's checkpointing) is not importable either"


def megatron_lm_training_installed() -> bool:
    """Whether ``megatron.training`` (Megatron-LM's training loop and checkpointing) is importable with
    its ``checkpointing`` module: the megatron-core wheels from 0.19 ship it, 0.16's does not, a
    Megatron-LM checkout installed editable or from its directory has it.

    Asks the import system (``find_spec``), so every finder counts, an editable install's included
    (its finder maps ``megatron.training`` to the checkout; the namespace package ``megatron`` then
    lists no directory). ``find_spec("megatron.training")`` imports only the parent ``megatron``, a
    namespace package without code; importing ``megatron.training`` itself would import all of
    megatron-core (at collection, before any CUDA emulation)."""
    from importlib import util

    try:
        spec = util.find_spec("megatron.training")
    except (ImportError, ValueError):
        return False
    roots = spec.submodule_search_locations if spec is not None else None
    return any(os.path.isfile(os.path.join(root, "checkpointing.py")) for root in roots or ())
