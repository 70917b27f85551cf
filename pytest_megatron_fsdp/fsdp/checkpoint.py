"""fsdp_dtensor checkpoints of a Megatron-FSDP run: save, verify, load, resume, at any world size.

Layout (Megatron-Bridge's, what its ``verify_checkpoint_files`` checks; see :mod:`.layout`)::

    <dir>/latest_checkpointed_iteration.txt   the last complete iteration, e.g. "5"
    <dir>/latest_train_state.pt               the train state of that iteration (plain data)
    <dir>/iter_0000005/.metadata              torch.distributed.checkpoint (DCP) metadata
    <dir>/iter_0000005/__<rank>_0.distcp      the shards
    <dir>/iter_0000005/train_state.pt         the train state, inside the iteration it belongs to
    <dir>/iter_0000005/digests.json           SHA-256 of every other file of the iteration

What goes into the DCP state dict and comes back out of it is the run's checkpoint layout
(``run.checkpoint_layout``, :class:`.run.CheckpointLayout`): Megatron-LM's for
``ckpt_format=fsdp_dtensor`` for a megatron-core run (:mod:`.megatron_layout`), the wrapper's own
state dicts for a ``fully_shard`` run (:mod:`.fully_shard_layout`). This module never asks which.

Atomic: every rank writes into ``iter_XXXXXXX.tmp-<uuid>``; only when all ranks report success
(a collective every rank reaches) does rank 0 write the train state and the digests, rename the
directory to ``iter_XXXXXXX`` and then replace the train-state file and the tracker (write-temp +
``os.replace``). A failure anywhere, on any rank, leaves the previous checkpoint the latest and
raises :class:`CheckpointError` on every rank; a killed save leaves a ``.tmp-`` directory that is
never loaded (the next completed save removes it).

Verified: before a load changes anything, every rank checks the checkpoint (directory, tracker,
``digests.json``, the digests of ``.metadata`` and ``train_state.pt`` before unpickling them, every
byte range ``.metadata`` names against the file holding it, the train state), then the keys and
global shapes this run would load, then the digest of every shard file its own read plan touches;
the ranks agree on the problems through collectives, so every rank raises the same error, names
the file, and none waits for another. Nothing depends on the world size the checkpoint was saved
at: DCP reads the byte ranges ``.metadata`` names, so a checkpoint saved at N ranks loads at M.

Trust: DCP's ``.metadata`` and non-tensor values are pickles. Load only checkpoints you (or your CI)
wrote; the digests detect damage, not a forger (who would rewrite ``digests.json`` too).

megatron is imported where it is used, so the file checks work (and are unit-tested) with torch only.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, BinaryIO, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

from .collectives import gather_objects, gather_problems
from .config import ConfigError
from .integrity import (
    FileDigest,
    HashingStream,
    ManifestError,
    file_digest,
    manifest_text,
    read_manifest,
    verify_files,
)
from .layout import (
    BRIDGE_RUN_CONFIG_FILE,
    BRIDGE_TRAIN_STATE_KEYS,
    DIGESTS_FILE,
    FORMAT,
    LATEST_TRAIN_STATE_FILE,
    METADATA_FILE,
    TRACKER_FILE,
    TRAIN_STATE_FILE,
    CheckpointError,
    CheckpointWarning,
    checkpoint_size_bytes,
    is_partial_save_dir,
    iteration_dir_name,
    partial_save_dir_name,
)
from .megatron_layout import OPTIMIZER_METADATA, model_state_dict
from .run import LOAD, SAVE

if TYPE_CHECKING:
    from .run import Run

__all__ = [
    "OPTIMIZER_METADATA",
    "CheckpointError",
    "CheckpointWarning",
    "SavedCheckpoint",
    "checkpoint_problems",
    "flatten_state",
    "load_checkpoint",
    "model_state_dict",
    "read_tracker",
    "save_checkpoint",
]

#: what a rank catches to report to the others (DCP's CheckpointException is a BaseException)
_FAILURES = (Exception, CheckpointException)
#: test-only: ``<rank>@<iteration>`` makes that rank SIGKILL itself half-way through writing its
#: shard of that iteration (what a node failure or an OOM kill does to a save)
KILL_DURING_SAVE_ENV = "MFSDP_TEST_KILL_DURING_SAVE"


@dataclass(frozen=True)
class SavedCheckpoint:
    """Where :func:`save_checkpoint` put a checkpoint."""

    root: Path
    iteration: int

    @property
    def path(self) -> Path:
        return self.root / iteration_dir_name(self.iteration)


# --------------------------------------------------------------------------------------------
# helpers


def _describe(exc: BaseException, limit: int = 1500) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[:limit] + " [...]"


def _raise_if_any(problems: list[str], what: str) -> None:
    if problems:
        raise CheckpointError(f"{what}: " + "; ".join(problems))


def flatten_state(state: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    # DCP's own key scheme: nested dict keys joined with ".".
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from flatten_state(value, f"{name}.")
        else:
            yield name, value


# --------------------------------------------------------------------------------------------
# files


def _write_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_tracker(root: str | os.PathLike[str]) -> int:
    """The iteration ``latest_checkpointed_iteration.txt`` names; CheckpointError when unusable."""
    tracker = Path(root) / TRACKER_FILE
    try:
        text = tracker.read_text().strip()
    except FileNotFoundError:
        raise CheckpointError(f"{tracker} does not exist: {root} holds no completed checkpoint") from None
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{tracker} holds {text[:40]!r}, not an iteration number") from None


def _seal(tmp_dir: Path, train_state: dict[str, Any], written: dict[str, FileDigest | None]) -> None:
    """Rank 0, after every rank wrote its shards: the train state, then the digest of every file.

    ``written``: what the ranks hashed while writing (None: written out of order, hashed here).
    """
    _write_atomically(tmp_dir / TRAIN_STATE_FILE, lambda f: torch.save(train_state, f))
    metadata = FileSystemReader(tmp_dir).read_metadata()
    files: dict[str, FileDigest] = {}
    for path in sorted(tmp_dir.iterdir()):
        if path.is_file() and path.name != DIGESTS_FILE:
            digest = written.get(path.name)
            files[path.name] = digest if digest is not None else file_digest(path)
    named = {info.relative_path for info in (metadata.storage_data or {}).values()}
    missing = sorted(named - files.keys())
    if missing:
        raise CheckpointError(f"{tmp_dir / METADATA_FILE} names files that were not written: {missing}")
    _write_atomically(tmp_dir / DIGESTS_FILE, lambda f: f.write(manifest_text(files).encode()))


def _publish(root: Path, tmp_dir: Path, iteration: int, train_state: dict[str, Any]) -> None:
    """Rank 0, once the iteration is sealed: make it visible, tracker last."""
    final = root / iteration_dir_name(iteration)
    old = None
    if final.exists():  # saving the same iteration again: swap, then drop the old one
        old = root / f"{final.name}.old-{uuid.uuid4().hex}"
        os.rename(final, old)
    os.rename(tmp_dir, final)
    _fsync_dir(root)
    _write_atomically(root / LATEST_TRAIN_STATE_FILE, lambda f: torch.save(train_state, f))
    _write_atomically(root / TRACKER_FILE, lambda f: f.write(f"{iteration}\n".encode()))
    _fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    # What killed saves left behind (never loadable, see layout.is_partial_save_dir).
    for leftover in root.iterdir():
        if leftover.is_dir() and is_partial_save_dir(leftover.name):
            shutil.rmtree(leftover, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# save


def _kill_during_save(rank: int, iteration: int) -> bool:
    return os.environ.get(KILL_DURING_SAVE_ENV, "") == f"{rank}@{iteration}"


class _DigestingWriter(FileSystemWriter):
    """DCP's FileSystemWriter, hashing every file as it writes it (no read-back at save)."""

    def __init__(self, path: Path, *, die_while_writing: bool = False) -> None:
        super().__init__(path)
        #: file name -> what was written (None: not written sequentially; hash it from disk)
        self.digests: dict[str, FileDigest | None] = {}
        create_stream = self.fs.create_stream

        @contextmanager
        def hashing_stream(path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
            if "w" not in mode:
                with create_stream(path, mode) as stream:
                    yield stream
                return
            with create_stream(path, mode) as stream:
                hashing = HashingStream(cast("IO[bytes]", stream))  # opened for writing: a binary file
                yield _DyingStream(hashing) if die_while_writing else hashing
            self.digests[Path(path).name] = hashing.result()

        # this writer's own file system object: its method wrapped on the instance, on purpose
        self.fs.create_stream = hashing_stream  # type: ignore[method-assign]


class _DyingStream:
    """Test hook: writes half of the first write, makes it durable, then SIGKILLs this process."""

    def __init__(self, stream: HashingStream) -> None:
        self._stream = stream

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._stream.write(view[: max(1, len(view) // 2)])
        self._stream.flush()
        os.fsync(self._stream.fileno())
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable: SIGKILL cannot be caught")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def save_checkpoint(run: Run, save_dir: str | os.PathLike[str] | None = None) -> SavedCheckpoint:
    """Save ``run`` at its current iteration into ``save_dir`` (default: the layout's,
    ``run.cfg.checkpoint.save`` for a megatron-core run; a ``fully_shard`` run has none).

    Every rank calls it. Returns where the checkpoint is; raises :class:`ConfigError` (before
    touching the disk) for a config upstream rejects, and :class:`CheckpointError` on every rank
    when any rank failed, in which case the previous checkpoint stays the latest.
    """
    layout = run.checkpoint_layout
    target = save_dir if save_dir is not None else layout.checkpoint_dir(run, SAVE)
    if target is None:
        raise ConfigError("no checkpoint directory: pass save_dir or set checkpoint.save")
    layout.check(run, SAVE)
    started = time.perf_counter()
    root = Path(target)
    iteration = int(run.iteration)
    rank0 = run.env.rank == 0

    # Phase 1, local: the directories and this rank's state (no collectives yet, so a failure here
    # cannot leave another rank waiting inside one).
    tokens: list[str] = [uuid.uuid4().hex]
    dist.broadcast_object_list(tokens, src=0)  # one temp dir for all ranks: rank 0's name
    tmp_dir = root / partial_save_dir_name(iteration, tokens[0])
    problem = None
    local = None
    try:
        if rank0:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp_dir.mkdir(mode=0o700)
        local = layout.local_save_state(run)
    except _FAILURES as exc:
        problem = f"rank {run.env.rank}: preparing the save failed: {_describe(exc)}"
    problems = gather_problems(problem)

    # Phase 2, collective: Megatron-LM's layout, then DCP writes the shards (hashing them) and
    # (rank 0) the metadata. DCP gathers every rank's write result, so a failure on one rank
    # raises on all of them.
    written: dict[str, FileDigest | None] = {}
    if not problems:
        try:
            state_dict = layout.save_state_dict(run, local)
            writer = _DigestingWriter(tmp_dir, die_while_writing=_kill_during_save(run.env.rank, iteration))
            state_dict_saver.save(state_dict, storage_writer=writer)
            written = writer.digests
        except CheckpointException as exc:  # DCP's: it gathered every rank's, all raise it
            problem = f"rank {run.env.rank}: writing the shards failed: {_describe(exc)}"
        except Exception as exc:
            # Anything else came from this rank alone, inside a sequence of collectives (the
            # handlers', the uneven-DTensor pass, DCP's): the peers may wait in one of them, and
            # an outcome exchange now would meet them in the wrong collective. Fail here; the
            # harness releases the peers. The temp directory stays (a peer may still be writing
            # into it): never loadable, and removed by the next completed save.
            raise CheckpointError(
                f"saving iteration {iteration} to {root} failed (previous checkpoint kept): rank "
                f"{run.env.rank} failed while the ranks were writing it: {_describe(exc)}"
            ) from exc
        outcomes = gather_objects((problem, written))
        problems = list(dict.fromkeys(p for p, _ in outcomes if p is not None))
        written = {name: digest for _, theirs in outcomes for name, digest in theirs.items()}

    # Phase 3, rank 0: seal (train state, digests) and publish (rename, pointers, tracker last).
    if not problems and rank0:
        try:
            train_state = layout.train_state(run)
            _seal(tmp_dir, train_state, written)
            _publish(root, tmp_dir, iteration, train_state)
        except _FAILURES as exc:
            problem = f"rank 0: publishing the checkpoint failed: {_describe(exc)}"
    if not problems:
        problems = gather_problems(problem)
    if problems:
        if rank0:
            shutil.rmtree(tmp_dir, ignore_errors=True)  # never visible; nothing a load would accept
        _raise_if_any(problems, f"saving iteration {iteration} to {root} failed (previous checkpoint kept)")
    saved = SavedCheckpoint(root, iteration)
    run.notify_checkpoint(
        bytes=checkpoint_size_bytes(root / iteration_dir_name(iteration)),
        save_s=time.perf_counter() - started,
    )
    return saved


# --------------------------------------------------------------------------------------------
# checks


@dataclass
class _Inspection:
    """What the local checks of one iteration found (and read, for the load to use)."""

    iteration: int | None
    problems: list[str] = field(default_factory=list)
    iter_dir: Path | None = None
    metadata: Metadata | None = None
    train_state: dict[str, Any] | None = None
    #: None: saved before digests existed
    manifest: dict[str, FileDigest] | None = None


def _unverified_warning(iter_dir: Path) -> CheckpointWarning:
    return CheckpointWarning(
        f"{iter_dir} has no {DIGESTS_FILE} (written by Megatron-LM or Megatron-Bridge, or by this plugin "
        "before checkpoint digests existed): its contents were not verified"
    )


#: the train state of a checkpoint with no ``train_state.pt`` (``CheckpointLayout.train_state_without_file``)
TrainStateWithoutFile = Callable[[Path, Metadata], "dict[str, Any] | None"]


def _no_train_state(iter_dir: Path, metadata: Metadata) -> None:
    return None


def _inspect(
    root: Path,
    iteration: int | None,
    *,
    verify_all: bool,
    without_file: TrainStateWithoutFile = _no_train_state,
) -> _Inspection:
    """Local (no collectives), reads only. ``verify_all``: every file's digest; otherwise those of
    ``.metadata`` and ``train_state.pt`` only (a load verifies the shards it reads, later). A
    checkpoint without digests or ``train_state.pt`` (Megatron-LM's) gets its train state from
    ``without_file``."""
    if not root.is_dir():
        return _Inspection(iteration, [f"checkpoint directory {root} does not exist"])
    if iteration is None:
        try:
            iteration = read_tracker(root)
        except CheckpointError as exc:
            return _Inspection(None, [str(exc)])
    iter_dir = root / iteration_dir_name(iteration)
    found = _Inspection(iteration, iter_dir=iter_dir)
    if not iter_dir.is_dir():
        found.problems.append(
            f"{root / TRACKER_FILE} names iteration {iteration} but {iter_dir} does not exist"
        )
        return found
    metadata_path = iter_dir / METADATA_FILE
    if not metadata_path.is_file():
        found.problems.append(f"{metadata_path} is missing: {iter_dir} is not a complete DCP checkpoint")
        return found
    try:
        found.manifest = read_manifest(iter_dir)
    except ManifestError as exc:
        found.problems.append(str(exc))
        return found
    if found.manifest is not None:
        # Before anything unpickles them.
        found.problems += verify_files(iter_dir, found.manifest, [METADATA_FILE, TRAIN_STATE_FILE])
        if found.problems:
            return found
    try:
        found.metadata = FileSystemReader(iter_dir).read_metadata()
    except _FAILURES as exc:
        found.problems.append(f"{metadata_path} cannot be read ({_describe(exc)})")
        return found
    # Driven by the metadata, not by file names: whichever world size saved it, every byte range
    # it names must lie inside an existing file.
    needed: dict[str, int] = {}
    for info in (found.metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        shard = iter_dir / name
        if not shard.is_file():
            found.problems.append(f"{shard} is missing (named in {metadata_path})")
        elif shard.stat().st_size < end:
            found.problems.append(
                f"{shard} is truncated: {shard.stat().st_size} bytes, {metadata_path} needs at least {end}"
            )
    train_state_path = iter_dir / TRAIN_STATE_FILE
    # Unverified (no digests): read here once, to tell Bridge's own train state from this plugin's.
    unverified: Any = None
    if found.manifest is None and train_state_path.exists():
        try:
            unverified = torch.load(train_state_path, weights_only=True)
        except _FAILURES as exc:
            found.problems.append(f"{train_state_path} cannot be read ({_describe(exc)})")
            return found
    bridges_step = int(unverified["step"]) if _is_bridges_train_state(unverified) else None
    if found.manifest is None and (bridges_step is not None or not train_state_path.exists()):
        try:
            found.train_state = without_file(iter_dir, found.metadata)
        except _FAILURES as exc:
            why = _describe(exc)
            found.problems.append(f"the train state among {iter_dir}'s entries cannot be read ({why})")
            return found
        if found.train_state is not None:
            saved = found.train_state["iteration"]
            if bridges_step is not None and bridges_step != saved:
                found.problems.append(
                    f"{train_state_path} says step {bridges_step}, {iter_dir}'s entries {saved}"
                )
            elif saved != iteration:
                found.problems.append(f"{iter_dir} says iteration {saved!r}; expected {iteration}")
            return found
        if bridges_step is not None:
            found.problems.append(
                f"{train_state_path} is Megatron-Bridge's train state (step {bridges_step}): {iter_dir} is a "
                f"Megatron-Bridge checkpoint, which this loader reads only into a megatron-core run and "
                f"with Bridge's {BRIDGE_RUN_CONFIG_FILE} beside it; resume it with Megatron-Bridge "
                "(checkpoint.load)"
            )
            return found
    try:
        found.train_state = (
            unverified if unverified is not None else torch.load(train_state_path, weights_only=True)
        )
        if found.train_state.get("iteration") != iteration or found.train_state.get("ckpt_format") != FORMAT:
            found.problems.append(
                f"{train_state_path} says iteration {found.train_state.get('iteration')!r}, "
                f"format {found.train_state.get('ckpt_format')!r}; expected {iteration}, {FORMAT!r}"
            )
    except _FAILURES as exc:
        found.problems.append(f"{train_state_path} cannot be read ({_describe(exc)})")
    if verify_all and found.manifest is not None and not found.problems:
        found.problems += verify_files(iter_dir, found.manifest, set(needed) | set(found.manifest))
    return found


def _is_bridges_train_state(state: Any) -> bool:
    """Whether ``state`` is Megatron-Bridge's own ``train_state.pt`` (Bridge's counters and nothing of
    this plugin's), not one this plugin wrote (Bridge's entries beside its own)."""
    return isinstance(state, dict) and state.keys() >= BRIDGE_TRAIN_STATE_KEYS and "ckpt_format" not in state


def checkpoint_problems(
    root: str | os.PathLike[str], iteration: int | None = None
) -> tuple[int | None, list[str]]:
    """What is wrong with the checkpoint in ``root`` (at ``iteration``, default: the tracker's).

    Local (no collectives), reads only, every file: Bridge's ``verify_checkpoint_files`` and more
    (every byte range ``.metadata`` names lies inside its file; every file matches its digest).
    Returns the iteration and a list of problems, each naming the path. A checkpoint saved before
    digests existed, or one Megatron-LM wrote, has no problem for that, but a :class:`CheckpointWarning`
    says it was not verified.
    """
    from .megatron_layout import train_state_without_file

    found = _inspect(Path(root), iteration, verify_all=True, without_file=train_state_without_file)
    if not found.problems and found.manifest is None and found.iter_dir is not None:
        warnings.warn(_unverified_warning(found.iter_dir), stacklevel=2)
    return found.iteration, found.problems


def _key_problems(iter_dir: Path, metadata: Metadata, state_dict: dict[str, Any]) -> list[str]:
    """Keys this run would load that the checkpoint lacks, and global shapes that differ."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    saved = metadata.state_dict_metadata
    problems: list[str] = []
    flat, _ = flatten_state_dict(state_dict)  # DCP's own keys (lists, e.g. param_groups, included)
    for key, value in flat.items():
        if key not in saved:
            problems.append(f"{key} is not in the checkpoint")
            continue
        if not isinstance(value, torch.Tensor):
            continue
        have = tuple(getattr(saved[key], "size", ()))
        want = tuple(value.shape)  # a DTensor's shape is the global one
        if have != want:
            problems.append(f"{key} has shape {list(have)} in the checkpoint, this model has {list(want)}")
    if problems:
        shown = problems[:5] + ([f"... {len(problems) - 5} more"] if len(problems) > 5 else [])
        return [f"{iter_dir} does not match this model: " + "; ".join(shown)]
    return []


def files_read_by(state_dict: dict[str, Any], metadata: Metadata) -> set[str]:
    """The files of a checkpoint that loading ``state_dict`` on this rank reads: DCP's own local
    read plan (local; ``state_dict`` preprocessed as for the load)."""
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state_dict, metadata, False)
    plan = planner.create_local_plan()
    return {metadata.storage_data[item.storage_index].relative_path for item in plan.items}


# --------------------------------------------------------------------------------------------
# load


def load_checkpoint(
    run: Run, load_dir: str | os.PathLike[str] | None = None, iteration: int | None = None
) -> int:
    """Load the checkpoint in ``load_dir`` (default: the layout's, ``run.cfg.checkpoint.load`` for a
    megatron-core run; a ``fully_shard`` run has none) into ``run``.

    Every rank calls it, at any world size and sharding strategy. Loads the model weights (made
    live at once, not at the next step), the optimizer state, the RNGs and data-stream position
    (see ``megatron_layout.restore_run_state`` for a change of data-parallel size), and the
    iteration; returns the iteration. Raises :class:`ConfigError` (before touching the disk) or
    :class:`CheckpointError` on every rank, with the path and the problem; a checkpoint refused by
    the checks (damaged, incomplete, another model) leaves ``run`` unchanged.
    """
    layout = run.checkpoint_layout
    source = load_dir if load_dir is not None else layout.checkpoint_dir(run, LOAD)
    if source is None:
        raise ConfigError("no checkpoint directory: pass load_dir or set checkpoint.load")
    layout.check(run, LOAD)
    started = time.perf_counter()
    root = Path(source)

    # 1. Every rank checks the files it will read anyway (reads only), then one collective: the
    #    same verdict everywhere.
    try:
        found = _inspect(root, iteration, verify_all=False, without_file=layout.train_state_without_file)
        problem = "; ".join(found.problems) or None
    except _FAILURES as exc:
        found, problem = None, f"checking {root} failed: {_describe(exc)}"
    _raise_if_any(gather_problems(problem), f"cannot load a checkpoint from {root}")
    assert found is not None
    assert found.iter_dir is not None
    assert found.metadata is not None
    iter_dir, metadata, train_state = found.iter_dir, found.metadata, found.train_state
    assert train_state is not None
    assert found.iteration is not None

    # 2. What this run loads into, built without changing it (collectives: Megatron-LM's
    #    handlers and the uneven-DTensor metadata); its keys and shapes against the checkpoint's,
    #    and the digest of every file this rank's read plan touches. Nothing changed on refusal.
    problem = None
    try:
        loaded = layout.load_state_dict(run, metadata)
        problems = _key_problems(iter_dir, metadata, loaded.state_dict)
        if not problems and found.manifest is not None:
            problems = verify_files(iter_dir, found.manifest, files_read_by(loaded.state_dict, metadata))
        problem = "; ".join(problems) or None
    except _FAILURES as exc:
        problem = f"rank {run.env.rank}: checking what to load failed: {_describe(exc)}"
    _raise_if_any(gather_problems(problem), f"cannot load a checkpoint from {root}")
    if found.manifest is None:
        warnings.warn(_unverified_warning(iter_dir), stacklevel=2)

    # 3. The collective load, into the dicts just checked.
    problem = None
    try:
        state_dict_loader.load(loaded.state_dict, storage_reader=FileSystemReader(iter_dir))
        layout.apply_loaded(run, loaded, metadata, train_state)
    except _FAILURES as exc:
        problem = f"rank {run.env.rank}: {_describe(exc)}"
    _raise_if_any(gather_problems(problem), f"loading {iter_dir} failed")
    run.notify_checkpoint(load_s=time.perf_counter() - started)
    return found.iteration
