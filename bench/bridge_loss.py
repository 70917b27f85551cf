"""``make bridge-test``'s last word: the last training loss Megatron-Bridge logged, and whether it is finite.

Bridge's training loop prints one line per ``log_interval`` iterations on the last rank
(``... iteration       10/      10 | ... | lm loss: 1.045000E+01 | ...``); with ``-s`` that rank's output goes
to its log (``<log dir>/torchrun/rank<N>.log``). This reads the last such line and prints it in one line.

    python -m bench.bridge_loss <rank log>

Exit status: 0 with a finite loss, 1 when the last loss is not finite or no loss was logged, 2 when the log is
missing.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

#: how each line this prints begins (``make upstream`` finds it in the bridge run's log)
PREFIX = "make bridge-test: "
#: Bridge's training-log line: its iteration and the value after "lm loss:"
LOSS_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+\s*\|.*?\blm loss:\s*(\S+?)\s*\|")


def last_loss(text: str) -> tuple[int, float] | None:
    """(iteration, loss) of the last training-log line in ``text`` with an ``lm loss``; None without one."""
    found = None
    for match in LOSS_LINE.finditer(text):
        found = (int(match.group(1)), float(match.group(2)))
    return found


def verdict(path: Path) -> tuple[int, str]:
    """The exit status and the line to print for the rank log at ``path``."""
    if not path.is_file():
        return 2, f"{PREFIX}no rank log at {path} (was the test run with -s and --mfsdp-log-dir?)"
    found = last_loss(path.read_text(errors="replace"))
    if found is None:
        return 1, f"{PREFIX}no 'lm loss' logged in {path}"
    iteration, loss = found
    if not math.isfinite(loss):
        return 1, f"{PREFIX}last lm loss {loss} at iteration {iteration} is not finite ({path})"
    return 0, f"{PREFIX}last lm loss {loss:.6g} at iteration {iteration}, finite ({path})"


def reported(text: str) -> str | None:
    """The last line this printed into ``text`` (a log of ``make bridge-test``), without :data:`PREFIX`;
    None when there is none (the run ended before its loss was checked)."""
    lines = [line[len(PREFIX) :] for line in text.splitlines() if line.startswith(PREFIX)]
    return lines[-1] if lines else None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m bench.bridge_loss <rank log>", file=sys.stderr)
        return 2
    status, line = verdict(Path(args[0]))
    print(line, file=sys.stderr if status else sys.stdout)
    return status


if __name__ == "__main__":
    sys.exit(main())
