"""What a checkout's own tests need: its PEP 735 ``test`` dependency group, installed into the
upstream venv before ``make upstream`` runs them, each package left out said with its reason.

Megatron-LM's ``tests/unit_tests/conftest.py`` imports ``click`` (through its dataset helper), which
its ``test`` group brings (``nltk`` requires it); a fresh venv with only megatron-core and this plugin
could not even load the conftest, and ran 0 tests. The group is read from the checkout's
``pyproject.toml`` (``[dependency-groups]``, ``{include-group = ...}`` entries resolved), so a
checkout that adds a test dependency brings it along; the packages that need a GPU to build or run
(:data:`GPU_ONLY`) are left out, each in one line. A stamp in the venv holds what was installed, so
a second run installs nothing.

    python -m bench.upstream_deps --checkout /path/to/Megatron-LM [--group test] [--dry-run]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import tomllib
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

#: packages a test group may name that build or run only with a GPU (CUDA kernels, NVIDIA
#: libraries): left out on CPU ranks, where megatron-core runs without them (behind its HAVE_*
#: checks; a test that needs one is a GPU-only skip)
_TE = "Transformer Engine: CUDA kernels (its build needs nccl.h and the CUDA runtime)"
GPU_ONLY: dict[str, str] = {
    "transformer-engine": _TE,
    "transformer-engine-torch": _TE,
    "mamba-ssm": "CUDA kernels (its build downloads a CUDA wheel or compiles CUDA)",
    "causal-conv1d": "CUDA kernels (its build downloads a CUDA wheel or compiles CUDA)",
    "fast-hadamard-transform": "CUDA kernels (its build downloads a CUDA wheel or compiles CUDA)",
    "flash-attn": "CUDA kernels (its build compiles CUDA)",
    "nv-grouped-gemm": "CUDA kernels (its build asks torch.cuda for the device's capability)",
    "flashinfer-python": "CUDA kernels compiled at run time",
}
STAMP = "upstream-test-deps.txt"


class GroupError(Exception):
    """One line naming the file, the group and what is wrong."""


def dependency_group(pyproject: Path, group: str = "test") -> list[str]:
    """The requirements of ``group`` in ``pyproject`` (PEP 735), include-groups resolved in order."""
    try:
        groups: dict[str, Any] = tomllib.loads(pyproject.read_text()).get("dependency-groups", {})
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise GroupError(f"{pyproject}: cannot read [dependency-groups] ({exc})") from None

    def resolve(name: str, seen: tuple[str, ...]) -> list[str]:
        if name in seen:
            raise GroupError(f"{pyproject}: dependency group {name!r} includes itself")
        if name not in groups:
            raise GroupError(
                f"{pyproject}: no dependency group {name!r} (groups: {', '.join(groups) or 'none'})"
            )
        found: list[str] = []
        for entry in groups[name]:
            if isinstance(entry, dict) and "include-group" in entry:
                found += resolve(entry["include-group"], (*seen, name))
            elif isinstance(entry, str):
                found.append(entry)
            else:
                raise GroupError(f"{pyproject}: dependency group {name!r} holds {entry!r}")
        return found

    return resolve(group, ())


def split(requirements: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """(what to install, [(requirement, why it is left out)]), each requirement once."""
    install: list[str] = []
    left_out: list[tuple[str, str]] = []
    for text in dict.fromkeys(requirements):
        try:
            requirement = Requirement(text)
        except InvalidRequirement as exc:
            left_out.append((text, f"not a requirement pip reads ({exc})"))
            continue
        if requirement.marker is not None and not requirement.marker.evaluate():
            left_out.append((text, "its environment marker excludes this Python or platform"))
            continue
        why = GPU_ONLY.get(canonicalize_name(requirement.name))
        if why is not None:
            left_out.append((text, f"GPU-only: {why}"))
        else:
            install.append(text)
    return install, left_out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.upstream_deps", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--checkout", required=True, help="the checkout whose tests run (MEGATRON_LM)")
    parser.add_argument("--group", default="test", help="the PEP 735 dependency group (default: test)")
    parser.add_argument("--dry-run", action="store_true", help="say what would be installed, install nothing")
    args = parser.parse_args(argv)
    pyproject = Path(args.checkout) / "pyproject.toml"
    try:
        install, left_out = split(dependency_group(pyproject, args.group))
    except GroupError as problem:
        print(f"make upstream: {problem}", file=sys.stderr)
        return 2
    for text, why in left_out:
        print(f"make upstream: left out of {pyproject}'s {args.group!r} group: {text} ({why})")
    stamp = Path(sys.prefix) / STAMP
    wanted = "\n".join(install) + "\n"
    if not install or (stamp.is_file() and stamp.read_text() == wanted):
        return 0
    print(f"make upstream: installing {pyproject}'s {args.group!r} group: {' '.join(install)}", flush=True)
    if args.dry_run:
        return 0
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", *install], check=False)
    if done.returncode != 0:
        print(
            f"make upstream: pip could not install the {args.group!r} group (exit {done.returncode})",
            file=sys.stderr,
        )
        return 1
    stamp.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
