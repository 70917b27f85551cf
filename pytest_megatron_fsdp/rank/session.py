"""The rank session: one process group per pytest session, brought up inside a torchrun rank.

Order matters and lives here: choose the platform, enable the CUDA-on-CPU emulation (CPU ranks
only, before anything imports megatron), init the process group with a short timeout, agree on a
directory every rank sees. :meth:`RankSession.close` undoes all of it, also after failures.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import inspect
import os
import shutil
import threading
import time
import weakref
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

import pytest

from ..environment import DistEnv
from ..fsdp.dtensor_caches import forget_dtensor_shardings
from ..wire import cpu_probe, flight_recorder
from ..wire.platform import PlatformChoice
from ..wire.torchrun_env import TorchrunEnv
from . import owned_temp
from .progress import ProgressBeacon

#: this rank's session (None until a collected test needs one, and after it closed)
RANK_SESSION = pytest.StashKey["RankSession | None"]()


class RendezvousError(pytest.UsageError):  # type: ignore[misc]
    """The ranks did not all reach the rendezvous store in time (one line, no traceback)."""


#: seconds without a sign of life after which a peer that owes an outcome counts as gone
PEER_SILENCE_S = 20.0


class SessionCannotGoOn(Exception):
    """This rank cannot run another test with its peers: the current test fails with the reason,
    and this rank's session stops."""


class PeersGone(SessionCannotGoOn):
    """Peers that this rank waits for are gone (killed, their node lost): the session cannot go on."""


class PeerStuck(SessionCannotGoOn):
    """A peer's watchdog said that its main thread never came back from a test's timeout: that peer
    stays alive until the session is reported, then ends; no later test can have every rank."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        #: the (lowest) rank that is stuck
        self.rank = rank


def _client_of_store(torchrun: TorchrunEnv, timeout: datetime.timedelta) -> Any:
    """A further client connection to the rendezvous store (for a thread that must not wait behind
    the main connection's waits)."""
    import torch.distributed as dist

    return dist.TCPStore(  # type: ignore[attr-defined]
        host_name=torchrun.master_addr,
        port=torchrun.master_port,  # type: ignore[arg-type]
        is_master=False,
        timeout=timeout,
        wait_for_workers=False,
        multi_tenant=True,
    )


def first_line(exc: BaseException) -> str:
    """The first non-blank line of ``exc``'s message (its type's name when it has none)."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


def _connect_store(torchrun: TorchrunEnv, timeout: datetime.timedelta) -> Any:
    """The c10d store torchrun's env:// rendezvous would use, kept so the harness can use it too.

    Under torchrun the agent hosts it (TORCHELASTIC_USE_AGENT_STORE); otherwise rank 0 does.
    """
    import torch.distributed as dist

    if torchrun.master_port is None:
        raise RuntimeError("MASTER_PORT is not set: start the ranks with torchrun")
    try:
        return dist.TCPStore(  # type: ignore[attr-defined]
            host_name=torchrun.master_addr,
            port=torchrun.master_port,
            world_size=torchrun.world_size,
            is_master=torchrun.rank == 0 and not torchrun.agent_store,
            timeout=timeout,
            multi_tenant=True,
        )
    except (RuntimeError, OSError) as exc:  # torch's DistStoreError / DistNetworkError among them
        first = first_line(exc)
        raise RendezvousError(
            f"megatron-fsdp: rank {torchrun.rank} of {torchrun.world_size} could not meet the other ranks "
            f"at {torchrun.master_addr}:{torchrun.master_port} within {timeout.total_seconds():g} s "
            f"(--mfsdp-pg-timeout): {first}" + (f"; {torchrun.launched_by}" if torchrun.launched_by else "")
        ) from None


def check_collectives(environ: MutableMapping[str, str]) -> None:
    """``TORCH_DISTRIBUTED_DEBUG=DETAIL`` for this rank, before its first process group.

    torch reads the variable when ``torch.distributed`` is imported, which a launched rank has done
    already (it imports torch while the parent collects): so it is set and torch told to read it
    again. Groups created from now on are wrapped (``ProcessGroupWrapper``): before each collective
    the ranks compare op, shapes and dtypes, and a mismatch raises on every rank.
    """
    environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    import torch.distributed as dist

    dist.set_debug_level_from_env()  # type: ignore[attr-defined]


def bound_group_timeouts(limit: datetime.timedelta) -> Callable[[], None]:
    """Every process group created from now on waits at most ``limit`` in a collective.

    ``--mfsdp-pg-timeout`` is the harness's bound on a collective whose peer is gone; the default
    group gets it at init, but libraries create their own groups with their own, longer timeouts
    (Megatron's model-parallel groups: 30 minutes). A rank that fails while its peers wait in one of
    those (Megatron-FSDP's coalesced reduce-scatter or all-gather on the data-parallel group) would
    hold them there for that long: destroying or aborting the group on the failing rank does not
    close gloo's connections while the model still references the group (measured, torch 2.14).
    So every group's timeout is capped, through the helper that ``new_group`` and
    ``init_process_group`` share. Returns the function that puts the helper back.
    """
    from torch.distributed import distributed_c10d as c10d

    original = c10d._new_process_group_helper
    signature = inspect.signature(original)
    if "timeout" not in signature.parameters:  # a torch that changed its internals: keep its own
        return lambda: None

    @functools.wraps(original)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        call = signature.bind(*args, **kwargs)
        timeout = call.arguments.get("timeout")
        if timeout is None or timeout > limit:
            call.arguments["timeout"] = limit
        return original(*call.args, **call.kwargs)

    c10d._new_process_group_helper = bounded

    def restore() -> None:
        if c10d._new_process_group_helper is bounded:
            c10d._new_process_group_helper = original

    return restore


class RankSession:
    """This rank's part of the distributed session."""

    def __init__(
        self,
        env: DistEnv,
        choice: PlatformChoice,
        rendezvous_store: Any,
        harness_store: Any,
        pg_timeout: datetime.timedelta,
    ) -> None:
        self.env = env
        self.choice = choice
        self._rendezvous_store = rendezvous_store
        self._pg_timeout = pg_timeout
        #: bumped each time the process group is re-created (identically on every rank)
        self.generation = 0
        #: the rendezvous store, for the harness's own bounded-wait agreements (not collectives)
        self.store = harness_store
        self._on_release: list[Callable[[], None]] = []
        self._after_test: list[Callable[[], str | None]] = []
        self._after_agreement: list[Callable[[], str | None]] = []
        #: the default group this session made (weakly: a reference would keep its connections)
        self._default_group: weakref.ref[Any] | None = None
        #: puts torch's group-creation helper back (see bound_group_timeouts)
        self._unbound_group_timeouts = bound_group_timeouts(pg_timeout)
        #: this rank's progress and sign of life in the store, every rank's read back (a hang is
        #: told from slowness by it); None until the session has started
        self.beacon: ProgressBeacon | None = None
        #: whether this rank watches its peers' signs of life itself (an srun step: torchrun's agent
        #: or the plain-mode parent end a rank set when a rank dies, srun waits for the rest)
        self.counts_on_heartbeats = False
        #: the last sign of life seen of each peer, and when it was first seen (monotonic)
        self._signs_of_life: dict[int, tuple[bytes | None, float]] = {}
        #: set once peers are known to be gone: nobody waits for them any more
        self.peers_gone = False
        #: what the CPU ranks run on and how big a bf16 step they take (None on GPUs)
        self.cpu: cpu_probe.CpuReport | None = None
        self._release_lock = threading.RLock()

    def on_release(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (once per registration) each time the process group is about to go.

        State built on the group's subgroups (e.g. Megatron's model-parallel state, kept across
        tests) must be dropped first, so the next test builds it afresh on the new group.
        """
        if callback not in self._on_release:
            self._on_release.append(callback)

    def after_test(self, check: Callable[[], str | None]) -> None:
        """Run ``check`` once the current test is over: after its teardown, when pytest has dropped
        its fixture values too (a fixture's own teardown runs while the test's other fixture values
        are still held). A message it returns is reported as an error of the test, on every rank.
        """
        self._after_test.append(check)

    def run_after_test_checks(self) -> list[str]:
        """The problems the current test's checks found (each check runs once)."""
        checks, self._after_test = self._after_test, []
        return [problem for check in checks if (problem := check())]

    def after_agreement(self, callback: Callable[[], str | None]) -> None:
        """Call ``callback`` after every test, once the ranks agreed on its outcome (and renewed the
        process group where they had to): on every rank alike, no collective in flight. A line it
        returns goes to the rank's log."""
        self._after_agreement.append(callback)

    def run_after_agreement(self) -> list[str]:
        """The lines of the :meth:`after_agreement` callbacks for the test just agreed."""
        return [line for callback in self._after_agreement if (line := callback())]

    def holds_default_group(self) -> bool:
        """Whether the default process group is still the one this session made (a test may have
        destroyed it, or destroyed it and made one of its own)."""
        import torch.distributed as dist

        made = self._default_group() if self._default_group is not None else None
        return made is not None and dist.is_initialized() and dist.group.WORLD is made

    def _release_dependents(self) -> None:
        for callback in reversed(self._on_release):
            callback()

    def _init_process_group(self) -> None:
        import torch
        import torch.distributed as dist

        kwargs: dict[str, Any] = {}
        if self.env.platform == "cuda":
            kwargs["device_id"] = torch.device(self.env.device)
        dist.init_process_group(
            backend=self.env.backend,
            store=dist.PrefixStore(f"default_pg/{self.generation}", self._rendezvous_store),  # type: ignore[attr-defined]
            rank=self.env.rank,
            world_size=self.env.world_size,
            timeout=self._pg_timeout,
            **kwargs,
        )
        self._default_group = weakref.ref(dist.group.WORLD)

    def release_peers(self) -> None:
        """Tear this rank's process group down now, after a local failure.

        Peers blocked in a collective of the default group then fail at once (gloo sees the
        connection close). A group something still references (a model's data-parallel group) keeps
        its connections: a peer waiting in one fails at that group's timeout, capped at the
        session's (:func:`bound_group_timeouts`). :meth:`renew` rebuilds the groups.
        """
        import torch.distributed as dist

        # a rank's watchdog releases the group too, from its own thread, when the test's main
        # thread does not come back from a timeout
        with self._release_lock:
            self._release_dependents()
            if dist.is_initialized():
                # Tell the peers before the group goes (the store outlives it): a collective they
                # are in, or enter, now fails, and collectives_released() lets their teardowns know.
                with contextlib.suppress(Exception):  # a store that is gone: the peers are gone too
                    self.store.set(f"released/{self.generation}", str(self.env.rank))
                dist.destroy_process_group()

    def peers_still_in_the_test(self, prefix: str, wait_s: float) -> list[int]:
        """After this rank failed a test outside a collective: the peers still in that test after
        ``wait_s`` (neither their outcome under ``<prefix>/<rank>`` in the store nor, like this rank,
        a failure of their own under ``<prefix>/failing/<rank>``), in rank order; [] as soon as
        every peer is accounted for. A peer still in the test may wait in a collective of the
        default group this rank never enters (upstream's tests end with a barrier after their
        asserts): :meth:`abort_default_group` brings it back."""
        self.store.set(f"{prefix}/failing/{self.env.rank}", "1")
        peers = [rank for rank in range(self.env.world_size) if rank != self.env.rank]
        until = time.monotonic() + wait_s
        while True:
            still = [
                r
                for r in peers
                if not self.store.check([f"{prefix}/{r}"]) and not self.store.check([f"{prefix}/failing/{r}"])
            ]
            if not still or time.monotonic() >= until:
                return still
            time.sleep(0.1)

    def abort_default_group(self) -> None:
        """Abort this rank's process groups: torch's ``_abort_process_group`` of the default group
        aborts every group, without waiting for work in flight, and a peer blocked in a collective
        with this rank (upstream's barrier of the default group) fails at once ("Connection closed
        by peer"). The peers learn of it as of a release (:meth:`collectives_released`); the
        caller has the default group renewed after the test."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        with self._release_lock:
            if not dist.is_initialized():
                return
            with contextlib.suppress(Exception):  # a store that is gone: the peers are gone too
                self.store.set(f"released/{self.generation}", str(self.env.rank))
            distributed_c10d._abort_process_group(dist.group.WORLD)

    @property
    def pg_timeout_s(self) -> float:
        """How long a collective of the session's groups waits before it fails."""
        return self._pg_timeout.total_seconds()

    def collectives_released(self) -> bool:
        """Whether a failure released this process group (on this rank, or on another one, as told
        through the store): a collective now fails at once or never completes, until the group is
        renewed after the test. Fixture teardowns that need a collective check this first."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return True
        try:
            return bool(self.store.check([f"released/{self.generation}"]))
        except Exception:  # noqa: BLE001 - no store: nothing to learn from it
            return False

    def renew(self) -> None:
        """A fresh process group on every rank after a failed test.

        A collective that one rank entered and another never did leaves the old group's sequence
        out of step; the next test must not inherit that. Called by all ranks (the agreed outcome
        is the same everywhere), so the generation stays in step too. Returns once every rank has
        its new group; raises :class:`SessionCannotGoOn` when this rank cannot have it.
        """
        self.release_peers()
        forget_dtensor_shardings()
        self.generation += 1
        try:
            self._init_process_group()
            # gloo's init is no synchronization point (pytorch#61396): a rank whose init returned
            # first went on to its next test, failed it at once and destroyed the new group while
            # its peer was still connecting, and the peer's init failed ("Connection closed by peer";
            # measured in docs/troubleshooting.md). No rank leaves until every rank's init has returned.
            self.exchange(
                f"rebuilt/{self.generation}", "1", self._pg_timeout, "the other ranks' rebuilt process group"
            )
        except SessionCannotGoOn:
            raise
        except Exception as exc:  # whatever the backend raised, no test can run now
            # The peers wait in the rendezvous above for this rank, which never comes: stopping here
            # (torchrun, or the peers' own bounded wait, then ends them) is the end that cannot hang.
            raise SessionCannotGoOn(
                f"the process group could not be rebuilt after the test (generation {self.generation}): "
                f"{type(exc).__name__}: {first_line(exc)}"
            ) from exc

    @classmethod
    def start(
        cls,
        torchrun: TorchrunEnv,
        choice: PlatformChoice,
        pg_timeout_s: float,
        shared_root: str | None = None,
        cpu_speed: tuple[str, str] = ("auto", "default"),
    ) -> RankSession:
        """Bring up the process group on ``choice``'s platform (CPU emulation already enabled).
        ``cpu_speed``: ``--mfsdp-cpu-speed``'s value and the label of its source (CPU ranks only)."""
        # Before the first process group: torch's flight recorder then records every collective
        # (a hang report names who is missing from which one).
        flight_recorder.enable(os.environ)
        import torch
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=pg_timeout_s)
        store = _connect_store(torchrun, timeout)
        if choice.platform == "cuda":
            torch.cuda.set_device(torchrun.local_rank)
            device = f"cuda:{torchrun.local_rank}"
        else:
            device = "cpu"
        harness_store = dist.PrefixStore("mfsdp", store)  # type: ignore[attr-defined]
        # Rank 0 makes a private (0700) directory under `shared_root` (every node must see it on
        # multi-node runs; the system temp dir on one node) and tells the others through the store.
        if torchrun.rank == 0:
            shared_dir = owned_temp.make("mfsdp-session-", dir=shared_root)
            harness_store.set("shared_dir", shared_dir)
        else:
            shared_dir = harness_store.get("shared_dir").decode()
        env = DistEnv(
            rank=torchrun.rank,
            world_size=torchrun.world_size,
            local_rank=torchrun.local_rank,
            device=device,
            backend=choice.backend,
            platform=choice.platform,
            shared_dir=Path(shared_dir),
        )
        session = cls(env, choice, store, harness_store, timeout)
        if choice.platform == "cpu":  # never on GPUs: their bf16 is the GPU's, not the CPU's
            session.cpu = cpu_probe.agreed_cpu_report(torchrun.rank, harness_store, *cpu_speed)
        session._init_process_group()
        session.beacon = ProgressBeacon(
            functools.partial(_client_of_store, torchrun, timeout),
            torchrun.rank,
            torchrun.world_size,
            threading.main_thread().ident or 0,
            counts_cpu=choice.platform == "cpu",
        )
        session.counts_on_heartbeats = bool(torchrun.launched_by)  # srun: nobody else watches these ranks
        return session

    def exchange(
        self, prefix: str, value: str, timeout: datetime.timedelta, what: str | None = None
    ) -> list[bytes]:
        """One round trip through the store: this rank's ``value`` under ``<prefix>/<rank>``, then
        every rank's, in rank order, once all are there. ``what``: what the ranks wait for, where a
        silent peer ends the wait early (:meth:`wait_for_peers`); None waits on the store alone."""
        keys = [f"{prefix}/{rank}" for rank in range(self.env.world_size)]
        self.store.set(keys[self.env.rank], value)
        if what is None:
            self.store.wait(keys, timeout)
        else:
            self.wait_for_peers(keys, timeout, what)
        return [self.store.get(key) for key in keys]

    def wait_for_peers(self, keys: list[str], timeout: datetime.timedelta, what: str) -> None:
        """``store.wait(keys, timeout)``, in slices: a peer whose key is missing and whose watchdog
        said it is stuck (:meth:`mark_stuck`) raises :class:`PeerStuck`; where this rank counts on
        heartbeats (an srun step), one that has given no sign of life for :data:`PEER_SILENCE_S`
        raises :class:`PeersGone`, and so does a store that is gone."""
        import torch.distributed as dist

        until = time.monotonic() + timeout.total_seconds()
        while True:
            remaining = until - time.monotonic()
            try:
                self.store.wait(keys, datetime.timedelta(seconds=max(min(remaining, 1.0), 0.1)))
                return
            except dist.DistNetworkError as exc:
                if not self.counts_on_heartbeats:
                    raise
                raise self._store_gone(what, exc) from None
            except dist.DistStoreError:
                if remaining <= 0:
                    raise  # the caller's timeout
            try:
                missing = [int(key.rsplit("/", 1)[-1]) for key in keys if not self.store.check([key])]
                stuck = {
                    rank: self.store.get(f"stuck/{rank}").decode()
                    for rank in missing
                    if self.store.check([f"stuck/{rank}"])
                }
                silent = self._silent(missing) if self.counts_on_heartbeats else []
            except (dist.DistError, RuntimeError) as exc:
                if not self.counts_on_heartbeats:
                    raise
                raise self._store_gone(what, exc) from None
            if stuck:
                first = min(stuck)
                raise PeerStuck(f"{stuck[first]} while this rank waited for {what}", first)
            if silent:
                self.peers_gone = True
                names = ", ".join(map(str, silent))
                raise PeersGone(
                    f"rank{'s' if len(silent) > 1 else ''} {names} gave no sign of life for "
                    f"{PEER_SILENCE_S:g} s while this rank waited for {what} (killed, out of memory, "
                    "or its node lost?)"
                )

    def mark_stuck(self, why: str) -> None:
        """Tell the peers that this rank's main thread will not come back (its watchdog calls this):
        a peer waiting for this rank's outcome then stops waiting (:class:`PeerStuck`)."""
        with contextlib.suppress(Exception):  # a store that is gone: nobody waits any more
            self.store.set(f"stuck/{self.env.rank}", why)

    def mark_closing(self) -> None:
        """What :meth:`close` tells the peers first, for a rank that ends without closing (its
        watchdog ends it): a peer's close does not wait for it then."""
        with contextlib.suppress(Exception):
            self.store.set(f"closing/{self.env.rank}", "1")

    def mark_reported(self) -> None:
        """Rank 0: the session's JUnit file and summary are written; a stuck peer may end now (its
        end would make torchrun stop rank 0)."""
        with contextlib.suppress(Exception):
            self.store.set("reported", "1")

    def wait_reported(self, until: float) -> None:
        """Until rank 0 has reported the session (:meth:`mark_reported`), its store is gone, or the
        monotonic time ``until``."""
        while time.monotonic() < until:
            try:
                if self.store.check(["reported"]):
                    return
            except Exception:  # noqa: BLE001 - the store is gone: rank 0 has ended
                return
            time.sleep(0.2)

    def _store_gone(self, what: str, exc: BaseException) -> PeersGone:
        self.peers_gone = True
        return PeersGone(
            f"the rendezvous store (hosted by rank 0) is gone while this rank waited for {what}: "
            f"rank 0 ended ({first_line(exc)})"
        )

    def _silent(self, ranks: list[int]) -> list[int]:
        now = time.monotonic()
        silent = []
        for rank in ranks:
            key = f"mfsdp-alive/{rank}"
            value = self._rendezvous_store.get(key) if self._rendezvous_store.check([key]) else None
            seen, since = self._signs_of_life.get(rank, (None, now))
            if value != seen or rank not in self._signs_of_life:
                self._signs_of_life[rank] = (value, now)
            elif now - since > PEER_SILENCE_S:
                silent.append(rank)
        return silent

    def header(self, stack: str) -> str:
        """The session's header line; ``stack`` names the package versions under test."""
        line = (
            f"megatron-fsdp: platform={self.env.platform} ({self.choice.reason}), "
            f"backend={self.env.backend}, world_size={self.env.world_size}, {stack}"
        )
        return line if self.cpu is None else f"{line}; {self.cpu.describe()}"

    def close(self) -> None:
        """Leave together (bounded: a dead rank is not waited for), then tear down."""
        import torch.distributed as dist

        rank, world = self.env.rank, self.env.world_size
        if self.beacon is not None:
            self.beacon.close()  # first: rank 0's store may go as soon as every rank is closing
        try:
            self.store.set(f"closing/{rank}", "1")
            # nobody removes the shared dir while another rank may still use it
            if not self.peers_gone:
                self.store.wait([f"closing/{r}" for r in range(world)], datetime.timedelta(seconds=30))
        except Exception:  # noqa: BLE001 - a rank that is gone has nothing left to wait for
            pass
        self._release_dependents()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._unbound_group_timeouts()
        if rank == 0:
            shutil.rmtree(self.env.shared_dir, ignore_errors=True)
