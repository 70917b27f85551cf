"""The training assertions name what they take when a test passes something else (the run itself,
a common slip), before any collective: every rank raises the same line."""

from __future__ import annotations

import pytest

from pytest_megatron_fsdp import assert_last_loss_finite, assert_loss_decreased


class _NotAResult:
    """Stands for the run object: it has train(), not the result's fields."""

    def train(self) -> None:
        raise AssertionError("not called")


@pytest.mark.parametrize("assertion", [assert_last_loss_finite, assert_loss_decreased])
def test_an_assertion_given_the_run_says_to_pass_what_train_returns(assertion) -> None:
    with pytest.raises(TypeError) as info:
        assertion(_NotAResult())
    assert str(info.value) == (
        f"{assertion.__name__} takes the TrainResult that train() returns, not _NotAResult: "
        f"result = run.train(); {assertion.__name__}(result)"
    )
