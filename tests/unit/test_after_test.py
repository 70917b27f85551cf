"""Letting go of a failed test's frames (rank/after_test.py): what they hold must not outlive the
test, also through an exception the failure chains."""

from __future__ import annotations

import gc
import weakref

import pytest

from pytest_megatron_fsdp.rank.after_test import drop_exception_locals


class Model:
    """Stands for a wrapped model a collective's frame holds."""


def _collective(model: Model) -> None:
    raise RuntimeError("Timed out waiting 120000ms for recv operation to complete")


def _failed_in_a_collective_then_interrupted() -> tuple[BaseException, weakref.ref[Model]]:
    model = Model()
    held = weakref.ref(model)
    try:
        try:
            _collective(model)
        except RuntimeError:
            del model
            pytest.fail("MFSDP-TIMEOUT: t hung")  # raised while the collective's error unwinds
    except pytest.fail.Exception as exc:
        return exc, held
    raise AssertionError("not raised")


def test_the_frames_of_a_chained_exception_let_go_of_what_they_hold():
    interruption, held = _failed_in_a_collective_then_interrupted()
    assert interruption.__context__ is not None
    gc.collect()
    assert held() is not None  # the collective's frame, in the chained exception's traceback
    drop_exception_locals(interruption)
    gc.collect()
    assert held() is None
