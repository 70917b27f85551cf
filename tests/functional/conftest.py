"""Shared by the functional suite: known upstream bugs as strict xfails, where they exist."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pytest_megatron_fsdp.fsdp.versions import KnownBug


@pytest.fixture
def known_bug(request: pytest.FixtureRequest) -> Callable[..., None]:
    """``known_bug(versions.SOME_BUG, raises=TypeError)``: a strict xfail on the megatron-core
    releases that have the bug (the test must fail there), an ordinary test where it is fixed."""

    def mark(bug: KnownBug, raises: type[BaseException] | None = None) -> None:
        if bug.present():
            request.applymarker(pytest.mark.xfail(strict=True, raises=raises, reason=bug.reason))

    return mark
