"""Which role this process plays, decided once; what every role's plugin class offers.

:func:`decide` is the only place that reads the torchrun environment, an srun step's Slurm
variables (mapped to torchrun's by :mod:`..wire.slurm`: every task of a multi-task srun step is a
torchrun-mode rank) and the launched-by-parent flag (``tests/unit/test_layering.py`` holds that).
Each role's module registers its plugin class in :data:`PLUGINS`; the package imports them all.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import pytest

from .. import options
from . import protocol, slurm
from .platform import PlatformChoice
from .torchrun_env import TorchrunEnv


class Role(enum.Enum):
    PARENT = "plain-mode parent"
    LAUNCHED_RANK = "launched rank"
    TORCHRUN_RANK = "torchrun-mode rank"


@dataclass(frozen=True)
class ProcessRole:
    """This process's role, and what torchrun told it (None in the parent)."""

    role: Role
    torchrun: TorchrunEnv | None
    #: the srun step this process is a task of, where srun (not torchrun) started the ranks
    srun: slurm.SlurmStep | None = None

    @property
    def plugin_class(self) -> type[RolePlugin]:
        return PLUGINS[self.role]


#: this process's role, decided once (see role_of)
ROLE = pytest.StashKey[ProcessRole]()
#: a rank's platform, decided before any conftest or test module is imported
PLATFORM = pytest.StashKey[PlatformChoice]()


def decide(config: pytest.Config, environ: Mapping[str, str] | None = None) -> ProcessRole:
    """Which role this process plays: torchrun's variables make it a rank, the parent's internal
    options a launched one; a task of a multi-task srun step is a torchrun-mode rank, its Slurm
    variables read as torchrun's (:func:`..wire.slurm.step_of`)."""
    environ = dict(os.environ if environ is None else environ)
    try:
        step = slurm.step_of(environ)
    except slurm.SlurmError as exc:
        raise pytest.UsageError(f"megatron-fsdp: an srun task's Slurm variables: {exc}") from None
    if step is not None:
        environ.update(step.torchrun_variables())
    torchrun = TorchrunEnv.from_environ(environ)
    if torchrun is None:
        return ProcessRole(Role.PARENT, None)
    if step is not None:
        torchrun = dataclasses.replace(torchrun, launched_by=slurm.rendezvous_hint(step))
        return ProcessRole(Role.TORCHRUN_RANK, torchrun, step)
    if protocol.launched_by_parent(config):
        return ProcessRole(Role.LAUNCHED_RANK, torchrun)
    return ProcessRole(Role.TORCHRUN_RANK, torchrun)


def asks_for_plugin(item: pytest.Item) -> bool:
    """Whether a collected test uses the plugin: its markers, or a fixture of it (every one
    builds on ``dist_env``)."""
    if item.get_closest_marker(protocol.MARKER) is not None or item.get_closest_marker("mfsdp_config"):
        return True
    return "dist_env" in getattr(item, "fixturenames", ())


def role_of(config: pytest.Config) -> ProcessRole:
    """The role decided for this process (decided now if no hook did yet)."""
    if ROLE not in config.stash:
        config.stash[ROLE] = decide(config)
    return config.stash[ROLE]


class RolePlugin:
    """What every role's plugin class offers the entry module."""

    #: the name the plugin object is registered under
    NAME: ClassVar[str]

    @classmethod
    def prepare(cls, config: pytest.Config, role: ProcessRole) -> None:
        """At ``pytest_load_initial_conftests``: before any conftest or test module is imported."""

    @classmethod
    def before_configure(cls, config: pytest.Config, role: ProcessRole) -> None:
        """At ``pytest_cmdline_main``: command-line settings pytest reads at configure."""

    @classmethod
    def create(cls, config: pytest.Config, role: ProcessRole, values: options.SessionValues) -> RolePlugin:
        """The plugin object registered for this role; every role class defines its own."""
        raise NotImplementedError

    def registered(self) -> None:
        """Called once the plugin object is registered."""


#: each role's plugin class, filled in by the role's module (the entry module imports every one)
PLUGINS: dict[Role, type[RolePlugin]] = {}
