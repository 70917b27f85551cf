"""Shared by the functional suite: known upstream bugs as strict xfails, where they exist."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from pytest_megatron_fsdp.fsdp.versions import KNOWN_BUGS, KnownBug

_CITATION = re.compile(r"(?:Megatron-(?:LM|Bridge) )?(?:PR|issue) #\d+")


def short_reason(bug: KnownBug) -> str:
    """The xfail reason pytest prints per test (``-ra``): which bug (its name in
    ``fsdp/versions.KNOWN_BUGS``, where the whole story is), the upstream reference, and whether a
    release fixes it. The test's docstring says what the test sees."""
    name = next((key for key, known in KNOWN_BUGS.items() if known is bug), "")
    if bug.fixed_in:
        fixed = f"fixed in {bug.package} {'.'.join(map(str, bug.fixed_in))}"
    else:
        fixed = "no fix released"
    citation = _CITATION.search(bug.reason)
    return f"upstream bug {name} ({citation.group(0) + '; ' if citation else ''}{fixed})"


@pytest.fixture
def known_bug(request: pytest.FixtureRequest) -> Callable[..., None]:
    """``known_bug(versions.SOME_BUG, raises=TypeError)``: a strict xfail on the megatron-core
    releases that have the bug (the test must fail there), an ordinary test where it is fixed."""

    def mark(bug: KnownBug, raises: type[BaseException] | None = None) -> None:
        if bug.present():
            request.applymarker(pytest.mark.xfail(strict=True, raises=raises, reason=short_reason(bug)))

    return mark
