"""The two kinds of rank, in process: both rank roles register the one rank plugin class
(``rank.plugin.RankPlugin``), and what differs between a rank of a set the parent launched and a
rank of a torchrun session the user started is its kind (``LaunchedRank``, ``TorchrunRank``), each
fact stated once there. The real sessions are the end-to-end tier's (test_faults.py and
test_torchrun_timeouts.py among others)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from pytest_megatron_fsdp.rank import owned_temp
from pytest_megatron_fsdp.rank.awaiting import AwaitingUse
from pytest_megatron_fsdp.rank.launched import LaunchedRank
from pytest_megatron_fsdp.rank.plugin import KINDS, RANK_TEMP, RUN_TEMP, RankPlugin
from pytest_megatron_fsdp.rank.timeouts import EndAtTimeout, SurviveTimeouts
from pytest_megatron_fsdp.rank.torchrun import TorchrunRank
from pytest_megatron_fsdp.wire import protocol
from pytest_megatron_fsdp.wire.role import PLUGINS, ProcessRole, Role
from pytest_megatron_fsdp.wire.torchrun_env import TorchrunEnv

RANK1 = TorchrunEnv(rank=1, world_size=2, local_rank=1, local_world_size=2)


def test_both_rank_roles_register_the_one_rank_plugin_with_their_kind():
    assert PLUGINS[Role.LAUNCHED_RANK] is RankPlugin
    assert PLUGINS[Role.TORCHRUN_RANK] is RankPlugin
    assert type(KINDS[Role.LAUNCHED_RANK]) is LaunchedRank
    assert type(KINDS[Role.TORCHRUN_RANK]) is TorchrunRank


def test_what_a_rank_does_depends_on_who_reports_its_session():
    launched, torchrun = LaunchedRank(), TorchrunRank()
    # a launched rank set: the parent reports, chose the log dir, and runs later tests in a fresh set
    assert (launched.reports_itself, launched.relays_warnings) == (False, True)
    assert type(launched.timeouts) is EndAtTimeout  # the rank ends at a test's timeout
    assert launched.log_dir_chosen_by_parent
    # the user's torchrun: rank 0 reports, and the session outlives a test's timeout
    assert (torchrun.reports_itself, torchrun.relays_warnings) == (True, False)
    assert type(torchrun.timeouts) is SurviveTimeouts  # the test fails, the session goes on
    assert not torchrun.log_dir_chosen_by_parent


def _launched_config(batch: Path, basetemp: str | None = None) -> SimpleNamespace:
    report_file = str(batch / "events.jsonl")
    return SimpleNamespace(
        getoption=lambda name, default=None: report_file if name == protocol.REPORT_FILE_DEST else default,
        option=SimpleNamespace(basetemp=basetemp),
        stash=pytest.Stash(),
    )


def test_a_launched_rank_keeps_its_temp_dirs_in_the_batch_dir_its_parent_removes(tmp_path):
    kind, config = LaunchedRank(), _launched_config(tmp_path / "batch")
    assert kind.make_own_temp(RANK1) is None
    assert kind.basetemp(config, RANK1) == str(tmp_path / "batch" / "tmp-rank1")
    assert kind.shared_root(config, None) == str(tmp_path / "batch")
    assert kind.shared_root(config, "/given") == "/given"


def test_a_torchrun_rank_has_a_temp_tree_of_its_own_that_holds_its_basetemp(pytester, tmp_path, monkeypatch):
    kind = TorchrunRank()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")  # restored as unset after the test
    private = kind.make_own_temp(RANK1)
    assert private is not None
    assert private.parent == tmp_path
    assert private.name.startswith("mfsdp-rank1-")
    assert private.is_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(private / "torchinductor")

    config = pytester.parseconfig("-p", "no:randomly")
    config.option.basetemp = None
    config.stash[RANK_TEMP] = private
    assert kind.basetemp(config, RANK1) == str(private / "basetemp")
    # an explicit --basetemp is split per rank (its parents made) and kept
    config.option.basetemp = str(tmp_path / "given" / "deeper")
    assert kind.basetemp(config, RANK1) == str(tmp_path / "given" / "deeper" / "rank1")
    assert (tmp_path / "given" / "deeper").is_dir()
    assert kind.shared_root(config, None) is None
    assert kind.shared_root(config, "/given") == "/given"


def test_a_torchrun_rank_without_options_awaits_use_a_launched_one_never_does(pytester):
    config = pytester.parseconfig("-p", "no:randomly")
    role = ProcessRole(Role.TORCHRUN_RANK, RANK1)
    torchrun = TorchrunRank()
    assert torchrun.too_late_hint(config) == ""
    assert not torchrun.prepare(config, role)  # no option given: awaits a test that uses the plugin
    assert not torchrun.before_configure(config, RANK1)
    assert isinstance(torchrun.configure(config, role), AwaitingUse)
    assert "--mfsdp-platform=cpu" in torchrun.too_late_hint(config)
    assert torchrun.prepare(config, role)  # asked again when a test uses the plugin: starts

    launched = LaunchedRank()
    config = pytester.parseconfig("-p", "no:randomly")
    role = ProcessRole(Role.LAUNCHED_RANK, RANK1)
    assert launched.prepare(config, role)
    assert launched.before_configure(config, RANK1)
    assert launched.configure(config, role) is None
    assert launched.too_late_hint(config) == ""


def test_only_a_torchrun_rank_refuses_pytest_rerunfailures(pytester):
    items = pytester.getitems("import pytest\n@pytest.mark.flaky(reruns=1)\ndef test_x(): pass\n")
    LaunchedRank().before_ranks_connect(items)  # its parent reruns the test in a fresh rank set
    with pytest.raises(pytest.UsageError, match="not under torchrun"):
        TorchrunRank().before_ranks_connect(items)


def test_a_rank_of_torchrun_or_srun_ends_its_session_on_sigterm_a_launched_rank_leaves_it_to_its_parent():
    step = TorchrunEnv(rank=1, world_size=2, local_rank=1, local_world_size=2, launched_by="an srun step")
    before = signal.getsignal(signal.SIGTERM)
    assert LaunchedRank().install_signal_handlers(step, lambda: True, print) is None  # the parent's handlers
    for env in (RANK1, step):  # your own torchrun's rank, an srun step's
        restore = TorchrunRank().install_signal_handlers(env, lambda: True, print)
        assert restore is not None
        try:
            assert signal.getsignal(signal.SIGTERM) is not before
        finally:
            restore()
        assert signal.getsignal(signal.SIGTERM) is before


def test_a_foreign_suites_ranks_share_their_basetemps_parent(pytester, tmp_path, monkeypatch):
    # Megatron-LM's tmp_path_dist_ckpt shares a checkpoint dir through basetemp's parent:
    # tmp_path_factory.mktemp("ignored", numbered=False).parent.parent / "tmp_dist_ckpt"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    kind = TorchrunRank()
    launch = [
        TorchrunEnv(rank=r, world_size=2, local_rank=r, local_world_size=2, run_id="5c1d-x/y") for r in (0, 1)
    ]
    configs = [pytester.parseconfig("-p", "no:randomly", "--mfsdp-foreign-suite=true") for _ in launch]
    for config in configs:
        config.option.basetemp = None  # pytester gives one: torchrun's ranks are given none
    basetemps = [Path(kind.basetemp(config, rank)) for config, rank in zip(configs, launch, strict=True)]
    assert [b.name for b in basetemps] == ["rank0", "rank1"]
    shared = basetemps[0].parent
    assert basetemps[1].parent == shared  # what upstream's mktemp(...).parent.parent finds
    assert shared.parent == tmp_path
    assert shared.name.startswith(f"mfsdp-run-{owned_temp.owner_tag(os.getppid())}-5c1d-xy")
    assert all(config.stash[RUN_TEMP] == shared for config in configs)
    # its owner is the launcher (here: this process's parent): swept only once that has ended
    assert owned_temp.sweep([tmp_path]) == []
    # the plugin's own tests keep one private basetemp per rank
    plain = pytester.parseconfig("-p", "no:randomly")
    plain.option.basetemp = None
    plain.stash[RANK_TEMP] = tmp_path / "private"
    assert kind.basetemp(plain, launch[1]) == str(tmp_path / "private" / "basetemp")


def test_sigterm_interrupts_a_torchrun_rank_only_while_its_tests_run() -> None:
    """While tests run, the signal is Ctrl-C (the session reports what ran and names the rest);
    outside (torchrun stopping the other ranks after one exited non-zero, at a session's normal
    end) its default action ends the process as before. SIGUSR1 stands in for SIGTERM in process."""
    from pytest_megatron_fsdp.rank.torchrun import _interrupt_on

    restore = _interrupt_on(signal.SIGUSR1, only_while=lambda: True)
    try:
        with pytest.raises(KeyboardInterrupt, match="signal SIGUSR1"):
            signal.raise_signal(signal.SIGUSR1)
    finally:
        restore()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    # outside the test loop the default action ends the process: in a fresh interpreter
    code = (
        "import signal\n"
        "from pytest_megatron_fsdp.rank.torchrun import _interrupt_on\n"
        "_interrupt_on(signal.SIGTERM, only_while=lambda: False)\n"
        "signal.raise_signal(signal.SIGTERM)\n"
        "print('survived')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stdout, done.stderr)
    assert "survived" not in done.stdout


SHIPPED_TESTS = """
import pytest

@pytest.mark.distributed(world_size=2, timeout=99)
def test_shipped():
    pass

@pytest.mark.distributed(world_size=2, timeout=99)
def test_not_in_the_batch():
    pass
"""


def test_a_launched_rank_uses_the_settings_its_parent_shipped_and_resolves_none(pytester, monkeypatch):
    """The parent resolves a test's settings once (spec, timeout, hang bound, reruns, with their
    sources) and ships them in the batch; a launched rank takes them as sent. The rank's own sources
    say otherwise here (the marker's timeout=99, MFSDP_TIMEOUT, MFSDP_HANG_AFTER), and any lookup
    through an option's chain fails the test."""
    from pytest_megatron_fsdp import options
    from pytest_megatron_fsdp import plugin as entry
    from pytest_megatron_fsdp.emulation import cpu_mode
    from pytest_megatron_fsdp.environment import DistributedSpec
    from pytest_megatron_fsdp.rank.log import RankLog

    monkeypatch.setattr(cpu_mode, "enable", lambda: None)  # no torch in this process
    monkeypatch.setattr(cpu_mode, "disable", lambda: None)
    monkeypatch.setattr(RankLog, "quiet_terminal", lambda self, config: None)
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MFSDP_TIMEOUT", "123")
    monkeypatch.setenv("MFSDP_HANG_AFTER", "45")
    path = pytester.makepyfile(test_shipped=SHIPPED_TESTS)
    shipped = DistributedSpec(
        world_size=2,
        timeout_s=7.5,
        reruns=1,
        only_rerun=("timeout",),
        timeout_source="the parent's --mfsdp-timeout",
        hang_after_s=11.0,
        hang_after_source="the parent's --mfsdp-hang-after",
    )
    protocol.write_batch(pytester.path / "batch.txt", [(f"{path.name}::test_shipped", shipped)])
    config = pytester.parseconfigure(
        "-p",
        "no:cacheprovider",
        "-p",
        "no:terminal",
        "--mfsdp-platform=cpu",
        f"--mfsdp-log-dir={pytester.path}/logs",
        f"--mfsdp-report-file={pytester.path}/events.jsonl",
        f"--mfsdp-batch-file={pytester.path}/batch.txt",
    )
    plugin = config.pluginmanager.get_plugin(RankPlugin.NAME)
    items, _ = pytester.inline_genitems(path)  # collected (by a plain session) as the rank collects them
    for item in items:  # what the collecting session stashed: the rank must put the parent's there
        if protocol.SPEC in item.stash:
            del item.stash[protocol.SPEC]

    def no_lookup(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a launched rank resolved an option itself: {args[1:2]}")

    monkeypatch.setattr(options, "value_of", no_lookup)
    entry.pytest_collection_modifyitems(config, items)
    plugin.pytest_collection_modifyitems(config, items)
    assert [item.name for item in items] == ["test_shipped"]
    assert protocol.spec_of(items[0]) == shipped
    assert plugin.runner.settings_for(items[0]) == shipped


def test_the_batch_file_carries_every_setting_with_its_source(tmp_path):
    from pytest_megatron_fsdp.environment import DistributedSpec

    tests = [
        ("a.py::test_x", DistributedSpec(4, tp=2, timeout_s=12.0, timeout_source="--mfsdp-timeout")),
        ("a.py::test_y", DistributedSpec(2, reruns=2, only_rerun=("timeout", "failure"), hang_after_s=0.0)),
    ]
    protocol.write_batch(tmp_path / "batch.txt", tests)
    assert protocol.read_batch(tmp_path / "batch.txt") == tests
