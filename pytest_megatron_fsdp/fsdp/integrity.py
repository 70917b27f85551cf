"""Content digests of a checkpoint's files: recorded at save, checked before a load reads a byte.

torch.distributed.checkpoint (DCP) checks no content: a flipped byte inside a shard loads silently.
Every file of an iteration (the shards, ``.metadata``, ``train_state.pt``) gets a SHA-256 digest at
save; they are recorded in the iteration's ``digests.json``::

    {"algorithm": "sha256",
     "files": {"__0_0.distcp": {"bytes": 1187234, "digest": "9f86d0..."}, ...}}

SHA-256 because it is the fastest digest hashlib offers on current CPUs (SHA-NI on x86, the crypto
extensions on ARMv8; measured in the README), 256 bits leave no room for accidental collisions,
and hashlib releases the GIL while it hashes. A shard's digest is computed while DCP writes it
(:class:`HashingStream`), so a save reads nothing back.

Plain Python (hashlib, json): no torch, no collectives.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .layout import DIGESTS_FILE

ALGORITHM = "sha256"
#: bytes read at a time when a file is hashed from disk
_READ_CHUNK = 8 << 20


@dataclass(frozen=True)
class FileDigest:
    """What a file held when it was saved: its size and its content digest (hex)."""

    bytes: int
    digest: str


def new_hash() -> Any:
    return hashlib.new(ALGORITHM)


def file_digest(path: str | os.PathLike[str]) -> FileDigest:
    """The file's size and digest, read from disk."""
    h = new_hash()
    size = 0
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(_READ_CHUNK)
        view = memoryview(buffer)
        while True:
            n = f.readinto(buffer)
            if not n:
                break
            h.update(view[:n])
            size += n
    return FileDigest(size, h.hexdigest())


class HashingStream:
    """A binary file being written, hashed as it is written (sequential writes only).

    Anything that moves the write position (``seek``, ``truncate``) makes the running digest
    meaningless: :attr:`sequential` turns False and the caller hashes the file from disk instead.
    Every other attribute is the wrapped file's.
    """

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self._hash = new_hash()
        self.bytes = 0
        self.sequential = True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self._stream.write(view)
        written = len(view) if written is None else written
        self._hash.update(view[:written])
        self.bytes += written
        return written

    def writelines(self, lines: Iterable[Any]) -> None:
        for line in lines:
            self.write(line)

    def seek(self, *args: Any) -> int:
        self.sequential = False
        return self._stream.seek(*args)

    def truncate(self, *args: Any) -> int:
        self.sequential = False
        return self._stream.truncate(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def result(self) -> FileDigest | None:
        """The digest of what was written; None if the writes were not sequential."""
        return FileDigest(self.bytes, self._hash.hexdigest()) if self.sequential else None


def manifest_text(files: dict[str, FileDigest]) -> str:
    """``digests.json``'s content for ``files`` (name -> digest), keys sorted."""
    return (
        json.dumps(
            {
                "algorithm": ALGORITHM,
                "files": {name: {"bytes": d.bytes, "digest": d.digest} for name, d in sorted(files.items())},
            },
            indent=1,
        )
        + "\n"
    )


class ManifestError(ValueError):
    """``digests.json`` exists but cannot be used; the message names the file and the problem."""


def read_manifest(iter_dir: str | os.PathLike[str]) -> dict[str, FileDigest] | None:
    """The digests recorded in ``<iter_dir>/digests.json``; None when the iteration has none
    (saved before digests existed). Raises :class:`ManifestError` for an unusable file."""
    path = Path(iter_dir) / DIGESTS_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path} cannot be read ({exc})") from None
    try:
        data = json.loads(text)
        if data["algorithm"] != ALGORITHM:
            raise ManifestError(
                f"{path} uses digest algorithm {data['algorithm']!r}; this version verifies {ALGORITHM!r}"
            )
        return {
            str(name): FileDigest(int(entry["bytes"]), str(entry["digest"]))
            for name, entry in data["files"].items()
        }
    except ManifestError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ManifestError(f"{path} is not a valid digest manifest ({type(exc).__name__}: {exc})") from None


def verify_files(
    iter_dir: str | os.PathLike[str], manifest: dict[str, FileDigest], names: Iterable[str]
) -> list[str]:
    """Problems with the named files of ``iter_dir`` against ``manifest``, one line per file."""
    iter_dir = Path(iter_dir)
    manifest_path = iter_dir / DIGESTS_FILE
    problems = []
    for name in sorted(set(names)):
        path = iter_dir / name
        expected = manifest.get(name)
        if expected is None:
            problems.append(f"{path} has no digest in {manifest_path}: its content cannot be verified")
            continue
        try:
            actual = file_digest(path)
        except OSError as exc:
            problems.append(f"{path} cannot be read to verify it ({exc})")
            continue
        if actual.bytes != expected.bytes:
            problems.append(f"{path} has {actual.bytes} bytes, {manifest_path} recorded {expected.bytes}")
        elif actual.digest != expected.digest:
            problems.append(
                f"{path} does not match its {ALGORITHM} digest in {manifest_path} "
                f"({actual.digest[:16]}... now, {expected.digest[:16]}... when saved): "
                "its content changed after the save"
            )
    return problems
