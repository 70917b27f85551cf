"""When each phase of a run happens, in every process of it: the benchmarks' per-phase breakdown.

Standard library only, so that any process can load it at start (the benches put a
``sitecustomize.py`` that calls :func:`install` on ``PYTHONPATH``). Each process appends JSON lines
``{"pid", "role", "event", "t"}`` (``t``: wall-clock seconds) to the file named by
``MFSDP_TIMELINE``; nothing happens when it is unset. Events recorded here:

* ``process-start``: when the kernel started the process (``/proc``, 10 ms resolution);
* ``import-start:<name>`` / ``import-end:<name>``: the first import of ``torch`` and of
  ``megatron.core`` (their package loader is timed, so everything they import counts);
* ``exit`` (at interpreter exit), and whatever the caller records (:func:`record`).

``bench/mfsdp_timeline.py`` adds pytest's milestones. Roles: ``rank<R>`` under torchrun,
``torchrun`` for torchrun's agent, else ``parent``. Measuring costs one extra meta-path lookup per
imported module.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from typing import Any

TIMED_IMPORTS = ("torch", "megatron.core")


def _path() -> str | None:
    return os.environ.get("MFSDP_TIMELINE") or None


def role() -> str:
    if "RANK" in os.environ:
        return f"rank{os.environ['RANK']}"
    try:
        with open("/proc/self/cmdline", "rb") as f:
            if b"torch.distributed.run" in f.read():
                return "torchrun"
    except OSError:
        pass
    return "parent"


def record(event: str, t: float | None = None) -> None:
    path = _path()
    if path is None:
        return
    entry = {"pid": os.getpid(), "role": role(), "event": event, "t": time.time() if t is None else t}
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (json.dumps(entry) + "\n").encode())
    finally:
        os.close(fd)


def process_start_time() -> float:
    """Wall-clock time at which this process started: now minus its age (Linux ``/proc``)."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


class _TimedImports:
    """A meta-path finder that times the first import of the packages in TIMED_IMPORTS."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in TIMED_IMPORTS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _TimedLoader(spec.loader, fullname)
                return spec
        return None


class _TimedLoader:
    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        record(f"import-start:{self._name}")
        try:
            self._loader.exec_module(module)
        finally:
            record(f"import-end:{self._name}")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


_installed = False


def install() -> None:
    """Record this process's start and time its imports (idempotent; a no-op when not measuring)."""
    global _installed
    if _installed or _path() is None:
        return
    _installed = True
    record("process-start", process_start_time())
    sys.meta_path.insert(0, _TimedImports())
    atexit.register(record, "exit")
