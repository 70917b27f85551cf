"""Every megatron-core / torch version difference the harness cares about, in one place.

Reads package metadata only: importing this module imports neither torch nor megatron.
"""

from __future__ import annotations

from importlib import metadata


def _version_tuple(text: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def megatron_core_version() -> tuple[int, ...]:
    return _version_tuple(package_version("megatron-core"))


def tensor_parallel_fsdp_needs_te() -> bool:
    """megatron-core < 0.17 without Transformer Engine: FullyShardedDataParallel's
    ``_fix_tensor_parallel_attributes`` does ``isinstance(m, (TELinear,))`` with ``TELinear`` None,
    a TypeError for any tp > 1 (upstream bug, fixed by 0.19; FINDINGS §2)."""
    if megatron_core_version() >= (0, 17):
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return True
    return False
