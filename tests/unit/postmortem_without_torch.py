"""``python -m pytest_megatron_fsdp`` in an interpreter where torch cannot be imported.

    python tests/unit/postmortem_without_torch.py collectives DIR

Importing torch, megatron, numpy, pytest or matplotlib raises ImportError here (a meta-path
blocker installed before anything else); the post-mortem CLI must still run.
``python tests/unit/postmortem_without_torch.py --check-blocker`` imports torch and fails, which
shows the blocker works.
"""

from __future__ import annotations

import runpy
import sys

BLOCKED = ("torch", "megatron", "numpy", "pytest", "_pytest", "matplotlib")


class Blocker:
    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked in this test")


if __name__ == "__main__":
    sys.meta_path.insert(0, Blocker())
    if sys.argv[1:] == ["--check-blocker"]:
        import torch  # noqa: F401  (raises)
    sys.argv = ["pytest_megatron_fsdp", *sys.argv[1:]]
    runpy.run_module("pytest_megatron_fsdp", run_name="__main__", alter_sys=True)
