"""torch alone, its own gloo groups: concurrent asynchronous coalesced all-gathers on one group corrupt
the heap and a rank dies (an upstream bug in the known-bug registry: a strict xfail where the torch
release has it).

torch gives a gloo group two worker threads; with two asynchronous coalesced all-gathers in flight
on one group (Megatron-FSDP's parameter prefetch) they run at once. The CPU emulation builds gloo
groups with one worker thread (``InOrderProcessGroupGloo``); that the plugin's CPU ranks run the
same loop clean is checked in tests/integration/test_cpu_ranks.py. The reproduction itself is
``gloo_concurrent_all_gathers.py``, next to this file.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from pytest_megatron_fsdp.fsdp.versions import GLOO_CONCURRENT_COALESCED_ALL_GATHERS
from pytest_megatron_fsdp.harness.launcher import torchrun_command

REPRODUCTION = Path(__file__).with_name("gloo_concurrent_all_gathers.py")


class RankCrashed(AssertionError):
    """A rank of the reproduction died of a signal (the heap corruption), not of a Python error."""


def _signal_deaths(output: str) -> list[str]:
    # torchrun's failure summary: "exitcode  : -6 (pid: 123)  (SIGABRT)"; SIGTERM is torchrun
    # stopping the other rank
    found = re.findall(r"exitcode\s*:\s*-\d+ \(pid: \d+\)\s*\((SIG[A-Z]+)\)", output)
    return [name for name in found if name != "SIGTERM"]


@pytest.mark.xfail(
    GLOO_CONCURRENT_COALESCED_ALL_GATHERS.present(),
    strict=True,
    raises=RankCrashed,
    reason="upstream bug gloo_concurrent_coalesced_all_gathers (no fix released)",
)
def test_torch_gloo_survives_concurrent_coalesced_all_gathers():
    """torch alone, its own gloo groups: the upstream bug. Where a torch release fixes it this
    passes, the strict xfail fails loudly, and the registry's ``fixed_in`` wants its version.

    The crash needs the two worker threads to run at once: on an idle 2-core machine it came within
    seconds in every run, on a loaded one it can take longer, so up to 3 runs (a crash ends them)."""
    for _ in range(3):
        done = subprocess.run(
            torchrun_command(2, str(REPRODUCTION), "20000"),
            capture_output=True,
            text=True,
            timeout=600,  # 20000 clean iterations: about a minute on an idle 2-core machine
        )
        output = done.stdout + done.stderr
        deaths = _signal_deaths(output)
        if deaths:
            raise RankCrashed(f"a rank died of {', '.join(deaths)}:\n{output[-3000:]}")
        assert done.returncode == 0, output[-3000:]
        assert output.count("ok rank") == 2, output[-3000:]
