"""Temp dirs named after the process that owns them, so that another can remove a dead owner's.

A rank removes its private temp tree (and rank 0 the session's shared dir) when it ends; a rank
killed with SIGKILL cannot. Its dir's name says whose it was: ``<prefix><host>_<pid namespace>_<pid>-``
and a random tail. Any rank that ends later on the same host removes the dirs of owners that are no
longer running (:func:`sweep`): only its own host's and pid namespace's, where the pid means the
same process, and never a live owner's.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterable
from pathlib import Path

#: the names of the dirs the harness makes this way, before the owner: a rank's, the session's, and
#: the one the ranks of one launch share (:func:`shared_with_siblings`, owned by their launcher)
PREFIXES = (r"mfsdp-rank\d+-", r"mfsdp-session-", r"mfsdp-run-")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def owner_tag(pid: int | None = None) -> str:
    host = socket.gethostname().split(".")[0].replace("_", "-") or "host"
    return f"{host}_{_pid_namespace()}_{os.getpid() if pid is None else pid}"


def make(prefix: str, dir: str | os.PathLike[str] | None = None) -> str:
    """``tempfile.mkdtemp`` (private, 0700) with the owner in the name."""
    return tempfile.mkdtemp(prefix=f"{prefix}{owner_tag()}-", dir=dir)


def shared_with_siblings(prefix: str, launch: str) -> Path:
    """A dir in ``$TMPDIR`` that every child of this process's parent names alike, made by whichever
    comes first (0700): ``<prefix><the parent's owner tag>-<launch>`` (``launch``: what tells two
    launches by one parent apart, e.g. torchrun's run id; only letters, digits and ``-`` are kept).
    Its owner is the parent: :func:`sweep` removes it once the parent has ended."""
    tail = re.sub(r"[^A-Za-z0-9-]", "", launch) or "run"
    path = Path(tempfile.gettempdir()) / f"{prefix}{owner_tag(os.getppid())}-{tail}"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's: running
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: os.kill said it exists
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def sweep(roots: Iterable[str | os.PathLike[str] | None]) -> list[str]:
    """Remove the dirs in ``roots`` (None: the system temp dir) that a process of this host and pid
    namespace made with :func:`make` and that has ended; returns the removed paths."""
    host, namespace, _ = owner_tag().split("_")
    pattern = re.compile(rf"^(?:{'|'.join(PREFIXES)})([^_/]+)_(\d+)_(\d+)-")
    removed = []
    for root in {str(r) if r is not None else tempfile.gettempdir() for r in roots}:
        try:
            names = os.listdir(root)
        except OSError:
            continue
        for name in names:
            match = pattern.match(name)
            if match is None or (match[1], match[2]) != (host, namespace):
                continue
            pid = int(match[3])
            if pid == os.getpid() or running(pid):
                continue
            path = os.path.join(root, name)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
