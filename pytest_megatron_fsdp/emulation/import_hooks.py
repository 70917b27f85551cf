"""One module's import, wrapped: the spec the other finders on ``sys.meta_path`` give for it, its
loader wrapped so that a function runs before the module's code and one after. CPU ranks change
megatron-core's optimizer module this way (:mod:`.fused_adam`), a foreign suite two Bridge modules
(``foreign/bridge.py``). Imports nothing heavy."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any


class WrappingLoader(importlib.abc.Loader):
    """The real loader of a module, with what runs before and after its code."""

    def __init__(
        self,
        real: importlib.abc.Loader,
        before: Callable[[ModuleType], None],
        after: Callable[[ModuleType], None],
    ) -> None:
        self.real = real
        self.before = before
        self.after = after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.before(module)
        self.real.exec_module(module)
        self.after(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... as the real loader answers
        return getattr(self.real, name)


def nothing(module: ModuleType) -> None:
    """The step of a wrapped import with nothing to do (a module changed only before, or only
    after, its code runs)."""


def wrapped_spec(
    hook: object,
    fullname: str,
    path: Sequence[str] | None,
    target: ModuleType | None,
    before: Callable[[ModuleType], None],
    after: Callable[[ModuleType], None],
) -> importlib.machinery.ModuleSpec | None:
    """``fullname``'s spec as the finders on ``sys.meta_path`` other than ``hook`` find it, its
    loader wrapped (:class:`WrappingLoader`); None where none finds it."""
    for finder in sys.meta_path:
        if finder is hook or not hasattr(finder, "find_spec"):
            continue
        spec: importlib.machinery.ModuleSpec | None = finder.find_spec(fullname, path, target)
        if spec is not None:
            if spec.loader is not None:
                spec.loader = WrappingLoader(spec.loader, before, after)
            return spec
    return None
