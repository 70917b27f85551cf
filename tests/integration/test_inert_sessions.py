"""Inert until asked: a session that never uses the plugin behaves as it would without it.

"Foreign" suites (plain torch tests; a torchrun suite that builds its own process group) in plain
mode and under torchrun: no signal handlers, every rank's output on the terminal, no CUDA
emulation, no environment variables, temp trees, log files or header lines of the plugin's. And a
torchrun session that does use it without giving any option still works, the plugin started by
its first distributed test.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest

#: what a foreign test sees of the plugin's side effects (every check fails if the plugin acted)
SIDE_EFFECT_CHECKS = """
import os, signal, sys, tempfile

# What Python starts with: a signal its launcher ignored stays ignored (a job started in the
# background of a script ignores SIGINT), else SIGINT raises KeyboardInterrupt and SIGTERM ends it.
IGNORED = os.environ["CHECKS_IGNORED_SIGNALS"].split()

def assert_untouched():
    sigterm = signal.SIG_IGN if "SIGTERM" in IGNORED else signal.SIG_DFL
    sigint = signal.SIG_IGN if "SIGINT" in IGNORED else signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) == sigterm, signal.getsignal(signal.SIGTERM)
    assert signal.getsignal(signal.SIGINT) == sigint, signal.getsignal(signal.SIGINT)
    assert "pytest_megatron_fsdp.emulation.cuda" not in sys.modules
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    assert "TORCH_DISTRIBUTED_DEBUG" not in os.environ
    leftovers = [n for n in os.listdir(tempfile.gettempdir()) if n.startswith("mfsdp-")]
    assert leftovers == [], leftovers
"""


def _normalised(text: str) -> list[str]:
    """A session's output without what differs between any two runs (times, the plugin list)."""
    lines = []
    for line in text.splitlines():
        if line.startswith(("plugins:", "rootdir:", "platform ")):
            continue
        line = re.sub(r"in \d+\.\d+s( \(\d+:\d\d:\d\d\))?", "in Ns", line)
        # pytest pads a summary line with "=" to the terminal's width: a time of one more digit
        # takes one "=" less
        lines.append(re.sub(r"^=+ (.*) =+$", r"= \1 =", line))
    return lines


def _ignored_signals() -> str:
    """The signals a process started from this one begins with ignored (``SIG_IGN`` is inherited
    across exec; a handler is not): SIGINT where this session runs in the background of a script."""
    return " ".join(
        name for name in ("SIGINT", "SIGTERM") if signal.getsignal(getattr(signal, name)) == signal.SIG_IGN
    )


def test_a_plain_session_without_distributed_tests_is_as_without_the_plugin(pytester, monkeypatch):
    monkeypatch.setenv("CHECKS_IGNORED_SIGNALS", _ignored_signals())
    pytester.makepyfile(
        checks=SIDE_EFFECT_CHECKS,
        test_foreign="""
import torch
from checks import assert_untouched

def test_torch():
    assert torch.ones(2).sum().item() == 2.0
    assert_untouched()

def test_fails():
    assert_untouched()
    print("some output of a failing test")
    assert 1 == 2
""",
    )
    with_plugin = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA")
    with_plugin.assert_outcomes(passed=1, failed=1)
    without = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", "-p", "no:megatron_fsdp")
    without.assert_outcomes(passed=1, failed=1)
    assert _normalised(with_plugin.stdout.str()) == _normalised(without.stdout.str())
    assert "megatron-fsdp:" not in with_plugin.stdout.str()  # no header or summary line of its own


def test_a_plain_session_installs_its_signal_handlers_with_its_first_rank_set(pytester, monkeypatch):
    """The deferral moves the handlers, it does not drop them: they come with the first rank set the
    controller launches, and go at unconfigure. In process, the launch itself faked (no ranks)."""
    from pytest_megatron_fsdp.parent.controller import Controller
    from pytest_megatron_fsdp.parent.plugin import ParentPlugin

    launched = []
    monkeypatch.setattr(Controller, "_launch", lambda self, world_size: launched.append(world_size))
    pytester.makepyfile(
        test_d="""
import signal
import pytest

@pytest.mark.distributed(world_size=2)
def test_d(dist_env):
    pass

def test_plain():
    pass
"""
    )
    config = pytester.parseconfigure("-p", "no:cacheprovider")
    plugin = config.pluginmanager.get_plugin(ParentPlugin.NAME)
    import signal

    before = signal.getsignal(signal.SIGTERM)
    try:
        assert signal.getsignal(signal.SIGTERM) == before  # registered, nothing installed yet
        assert plugin._restore_signals is None
        plugin.prestart(2)
        assert launched == [2]
        assert signal.getsignal(signal.SIGTERM) != before
    finally:
        config._ensure_unconfigure()
    assert signal.getsignal(signal.SIGTERM) == before  # and put back at unconfigure


FOREIGN_TORCHRUN_SUITE = """
import os
import pytest
import torch
import torch.distributed as dist
from checks import assert_untouched

@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo")  # torchrun's env:// variables
    yield
    dist.destroy_process_group()

def test_all_reduce(group):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size() == 2
    print(f"FOREIGN rank {dist.get_rank()} reduced {t.item():g}", flush=True)

def test_untouched():
    assert_untouched()
    with pytest.raises((RuntimeError, AssertionError)):  # no GPU here: CUDA is not emulated
        torch.cuda.current_device()
"""


def test_a_foreign_torchrun_suite_keeps_every_ranks_output(
    pytester, isolated_tmp, leftover_processes, torchrun_pytest
):
    """Its own process group, every rank printing (-s): both ranks' lines and both ranks' session
    summaries reach the terminal, as without the plugin, and nothing of the plugin's is done."""
    pytester.makepyfile(checks=SIDE_EFFECT_CHECKS, test_foreign=FOREIGN_TORCHRUN_SUITE)
    # torchrun's agent handles SIGINT and SIGTERM (TORCHELASTIC_SIGNALS_TO_HANDLE), so its ranks
    # start with neither ignored, whatever the agent was started with
    env = dict(os.environ, CHECKS_IGNORED_SIGNALS="")
    out = subprocess.run(
        torchrun_pytest("-p", "no:cacheprovider", "-s", "-q"),
        cwd=pytester.path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "FOREIGN rank 0 reduced 2" in text, text
    assert "FOREIGN rank 1 reduced 2" in text, text
    assert text.count("2 passed in ") == 2, text  # each rank's own summary (the lines may interleave)
    assert "megatron-fsdp:" not in text
    # no log dir ($TMPDIR/mfsdp-logs without the cache plugin), no rank temp tree, no session dir
    assert [n for n in os.listdir(isolated_tmp) if n.startswith("mfsdp")] == []
    assert leftover_processes(pytester.path) == []


def test_a_torchrun_session_that_uses_the_plugin_needs_no_option(
    pytester, isolated_tmp, leftover_processes, torchrun_pytest, leftover_files
):
    """No --mfsdp-* option, ini key or variable: the first distributed test collected starts the
    plugin (CPU emulation, rank session, rank 1's report into its log): one report, rank 0's."""
    pytester.makepyfile(
        test_uses="""
import torch
import torch.distributed as dist
import pytest

def test_plain_first():
    print("PLAIN TEST OUTPUT", flush=True)

@pytest.mark.distributed(world_size=2)
def test_all_reduce(dist_env):
    import sys
    assert "pytest_megatron_fsdp.emulation.cuda" in sys.modules  # CPU ranks: emulated
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
"""
    )
    out = subprocess.run(
        torchrun_pytest("-rA"),  # rank logs in .pytest_cache
        cwd=pytester.path,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=240,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert text.count("2 passed in ") == 1, text  # rank 0's report only
    assert text.count("test session starts") == 1, text  # rank 1's header went to its log
    assert text.count("megatron-fsdp: platform=cpu") == 1, text
    logs = list((pytester.path / ".pytest_cache").rglob("rank1.log"))
    assert len(logs) == 1
    assert "test session starts" in logs[0].read_text()
    # the ranks' private temp trees are gone (torchrun's own torchelastic_* dir stays: it never removes it)
    assert leftover_files(isolated_tmp, ignore=("torchelastic_",)) == []
    assert leftover_processes(pytester.path) == []


def test_megatron_imported_before_a_late_start_is_one_clear_line(pytester, monkeypatch, isolated_tmp):
    """Without options the CUDA emulation starts with the first distributed test collected; a test
    module that imported megatron at its top is too early for it: one line says what to do."""
    pytest.importorskip("megatron.core")
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    pytester.makepyfile(
        test_early="""
import megatron.core.tensor_parallel
import pytest

@pytest.mark.distributed(world_size=1)
def test_x(dist_env):
    pass
"""
    )
    # given an option, the emulation starts before any test module is imported: collection is fine
    early = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--mfsdp-platform=cpu", "--collect-only")
    assert early.ret == pytest.ExitCode.OK, early.stdout.str() + early.stderr.str()
    late = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--collect-only")
    assert late.ret == pytest.ExitCode.USAGE_ERROR, late.stdout.str() + late.stderr.str()
    hint = "import megatron inside the tests, or give an option (e.g. --mfsdp-platform=cpu)"
    late.stderr.fnmatch_lines([f"ERROR: megatron-fsdp: *{hint}*"])
    # the rank's private temp tree, made just before the emulation was refused, is gone with it
    assert [n for n in os.listdir(isolated_tmp) if n.startswith("mfsdp-rank")] == []
