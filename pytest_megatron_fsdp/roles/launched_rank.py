"""A rank of a set the plain-mode parent launched: it runs the parent's batch and streams the agreed
reports back; the parent shows and writes everything."""

from __future__ import annotations

import pytest

from ..harness import protocol
from ..harness.rank import RankDuties
from ..harness.session import TorchrunEnv
from .deciding import PLUGINS, Role
from .ranks import _RankRolePlugin


class LaunchedRankPlugin(_RankRolePlugin):
    """A rank of a set the parent launched: the parent shows and writes everything."""

    LAUNCHED = True
    DUTIES = RankDuties(
        reports_itself=False,
        relays_warnings=True,
        when_it_cannot_go_on="this rank set stops; the later tests run in a fresh one",
    )

    @classmethod
    def _set_basetemp(cls, config: pytest.Config, torchrun: TorchrunEnv) -> None:
        # Its own pytest temp dir inside the batch's working dir (two ranks must not share one
        # basetemp; the parent removes the batch dir). Set before pytest_configure, where pytest
        # reads it.
        config.option.basetemp = str(protocol.batch_dir(config) / f"tmp-rank{torchrun.rank}")

    def _shared_root(self, config: pytest.Config) -> str | None:
        # Inside the batch's working dir, which the parent removes even if this rank set is killed.
        given = super()._shared_root(config)
        return str(protocol.batch_dir(config)) if given is None else given


PLUGINS[Role.LAUNCHED_RANK] = LaunchedRankPlugin
