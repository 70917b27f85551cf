"""The roles a pytest process plays with this plugin: decided once, one plugin object each.

* :attr:`Role.PARENT`: a plain pytest session (also a pytest-xdist controller or worker). Its
  plugin (:class:`.parent.ParentPlugin`) holds the controller: it runs each distributed test in a
  rank set it launches through torchrun and reports it here like any other test.
* :attr:`Role.LAUNCHED_RANK`: a rank of a set the parent launched (:class:`.ranks.RankPlugin`
  holding a :class:`.launched_rank.LaunchedRank`): it runs the parent's batch and streams the agreed
  reports back.
* :attr:`Role.TORCHRUN_RANK`: a rank of a torchrun session the user started
  (:class:`.ranks.RankPlugin` holding a :class:`.torchrun_rank.TorchrunRank`): it runs its tests with
  the other ranks and, on rank 0, reports them to the terminal; :class:`.awaiting.AwaitingUse` until
  its session asks for the plugin.

One module per role (both rank roles register :class:`.ranks.RankPlugin`, the one rank plugin
class, each module with its :class:`.ranks.RankKind`, what differs between them);
:mod:`.deciding` decides the role (:func:`decide` is the only place that reads the torchrun
environment, an srun step's Slurm variables and the launched-by-parent flag). The entry module
(:mod:`..plugin`) decides the role before any conftest is loaded, asks the role's class to prepare
the process (a CPU rank's CUDA emulation, a rank's temp dirs), and registers the role's one plugin
object at configure. Roles import the harness; the harness never imports a role.

Inert until asked: a session that never uses the plugin behaves as without it. The plugin is
*asked* by any of its options (a ``--mfsdp-*`` flag, an ``MFSDP_*`` environment variable, an
``mfsdp_*`` ini key), or by a collected test that carries ``@pytest.mark.distributed`` or
``@pytest.mark.mfsdp_config`` or uses one of its fixtures (all of which build on ``dist_env``);
a launched rank is asked by its parent. Until then: no signal handlers (the parent installs its
SIGTERM/SIGINT handlers with its first rank set), and in a torchrun-mode rank no CUDA emulation, no
environment variables set, no temp tree, basetemp or JUnit path changed, no log file or fault
handler, no logging filters, and a rank other than 0 holds its terminal report until collection
shows whether the session is asked (:mod:`..harness.held_terminal`): released to the terminal when
it is not, to the rank's log when it is.
"""

from __future__ import annotations

from .awaiting import AwaitingUse
from .deciding import PLATFORM, ROLE, ProcessRole, Role, RolePlugin, asks_for_plugin, decide, role_of
from .launched_rank import LaunchedRank
from .parent import ParentPlugin
from .ranks import RankKind, RankPlugin
from .torchrun_rank import TorchrunRank

__all__ = [
    "PLATFORM",
    "ROLE",
    "AwaitingUse",
    "LaunchedRank",
    "ParentPlugin",
    "ProcessRole",
    "RankKind",
    "RankPlugin",
    "Role",
    "RolePlugin",
    "TorchrunRank",
    "asks_for_plugin",
    "decide",
    "role_of",
]
