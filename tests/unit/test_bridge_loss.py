"""``make bridge-test``'s last word (bench/bridge_loss.py): the last loss Megatron-Bridge's training loop
logged on the last rank, required finite."""

from __future__ import annotations

import pytest

from bench import bridge_loss


def _log_line(iteration: int, loss: str) -> str:
    """A training-log line as Bridge's train_utils.training_log writes it (fields abridged)."""
    return (
        f" [2026-12-04 19:40:01] iteration {iteration:8d}/{10:8d} | consumed samples: {8 * iteration:12d} |"
        f" learning rate: 2.999000E-03 | global batch size:     8 | lm loss: {loss} | loss scale: 1.0 |"
        " grad norm: 1.234 | number of skipped iterations:   0 |"
    )


def test_the_last_logged_loss_with_its_iteration():
    text = "\n".join(
        ["setup ...", _log_line(5, "9.210000E+00"), "[Rank 1] memory", _log_line(10, "8.125000E+00")]
    )
    assert bridge_loss.last_loss(text) == (10, 8.125)
    assert bridge_loss.last_loss("no training here") is None


@pytest.mark.parametrize(
    ("lines", "status", "says"),
    [
        (
            [_log_line(5, "9.210000E+00"), _log_line(10, "8.125000E+00")],
            0,
            "last lm loss 8.125 at iteration 10, finite",
        ),
        (
            [_log_line(5, "9.210000E+00"), _log_line(10, "NAN")],
            1,
            "last lm loss nan at iteration 10 is not finite",
        ),
        ([_log_line(10, "INF")], 1, "is not finite"),
        (["collected 1 item", "1 passed"], 1, "no 'lm loss' logged"),
    ],
)
def test_the_verdict_on_a_rank_log(tmp_path, capsys, lines, status, says):
    log = tmp_path / "rank1.log"
    log.write_text("\n".join(lines) + "\n")
    assert bridge_loss.main([str(log)]) == status
    out, err = capsys.readouterr()
    assert says in (out if status == 0 else err)
    assert len((out + err).splitlines()) == 1


def test_a_missing_rank_log_is_bad_input(tmp_path, capsys):
    assert bridge_loss.main([str(tmp_path / "rank1.log")]) == 2
    assert "no rank log at" in capsys.readouterr().err


def test_make_upstream_finds_the_last_line_printed_in_a_make_log(tmp_path, capsys):
    """``make upstream`` reads the bridge run's verdict back from that run's log (make's output)."""
    log = tmp_path / "rank1.log"
    log.write_text(_log_line(10, "8.125000E+00") + "\n")
    assert bridge_loss.main([str(log)]) == 0
    printed = capsys.readouterr().out
    earlier = bridge_loss.PREFIX + "no rank log at /old/rank1.log"  # the last line is the verdict
    make_log = "\n".join([earlier, "collected 1 item", "1 passed in 61.0s", printed, "make: *** Error 1"])
    assert bridge_loss.reported(make_log) == f"last lm loss 8.125 at iteration 10, finite ({log})"
    assert bridge_loss.reported("collected 1 item\nKeyboardInterrupt\n") is None
