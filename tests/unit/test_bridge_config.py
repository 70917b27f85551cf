"""Megatron-Bridge's own config and rules (pytest_megatron_fsdp/fsdp/bridge_config.py, bridge_parity.py), in
this process as in the one that launches ranks: no rank, no process group, no CUDA. Bridge's recipe,
the seed's override, Bridge's own validation; each refusal in one line; the plugin's rules in parity with
Bridge's, and a rule changed in a shadow copy of Bridge caught."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_megatron_fsdp.fsdp import versions

# the floor (no Bridge): the whole file in one skip line, naming why
if (_problem := versions.megatron_bridge_problem()) is not None:
    pytest.skip(_problem, allow_module_level=True)

DATA = Path(__file__).resolve().parents[1] / "data" / "bridge"

#: what a fresh interpreter runs: the TE stand-in on (as the ranks do), then the parity table
PARITY_SCRIPT = """
import json
from pytest_megatron_fsdp.foreign import bridge as foreign_bridge
foreign_bridge.watch()
import megatron.bridge
from pytest_megatron_fsdp.fsdp import bridge_parity as p
found = p.disagreements([p.verdict(c) for c in p.CASES])
print(json.dumps({"bridge": megatron.bridge.__file__, "disagreements": found}))
"""


@pytest.fixture(scope="module")
def bridge():
    """Bridge imported with the TE stand-in and its validate switched for CPU (foreign/bridge.py), as on
    a CPU rank; all of it undone after the module."""
    from pytest_megatron_fsdp.foreign import bridge as foreign_bridge

    foreign_bridge.watch()
    try:
        from pytest_megatron_fsdp.fsdp import bridge_config

        bridge_config.recipe()  # imports Bridge's recipes and training config while watched
        yield bridge_config
    finally:
        foreign_bridge.unwatch()


def test_the_seed_override_on_bridges_recipe_passes_bridges_validation_in_this_process(bridge):
    import torch

    before = dict(os.environ)
    cfg = bridge.seed_config()
    assert cfg.ddp.use_distributed_optimizer is False  # the recipe's; Bridge turns it on for Megatron-FSDP
    warnings = bridge.validate_bridge_config(cfg)
    assert (cfg.ddp.use_distributed_optimizer, cfg.optimizer.use_distributed_optimizer) == (True, True)
    assert cfg.data_parallel_size == 1  # no process group: Bridge's world size is the environment's
    assert not torch.distributed.is_initialized()
    assert dict(os.environ) == before  # the recipe's env_vars, set by runtime_config_update, undone
    assert any("ddp.use_distributed_optimizer=False" in w for w in warnings)  # the plugin's rule says it too


@pytest.mark.parametrize(
    "name",
    [
        "Megatron-FSDP with torch FSDP2",
        "Megatron-FSDP with use_tp_pp_dp_mapping",
        "torch_dist while saving",
        "torch while loading",
        "CUDA_DEVICE_MAX_CONNECTIONS=1",
        "fsdp_dtensor saved without Megatron-FSDP",
    ],
)
def test_bridge_refuses_in_one_line_naming_the_field_its_value_and_the_fix(bridge, name):
    from pytest_megatron_fsdp.fsdp import bridge_parity
    from pytest_megatron_fsdp.fsdp.config import ConfigError

    case = next(c for c in bridge_parity.CASES if c.name == name)
    cfg = bridge.seed_config()
    for dotted, value in case.changes.items():
        bridge.set_field(cfg, dotted, value)
    with pytest.raises(ConfigError) as raised:
        bridge.validate_bridge_config(cfg, case.environ)
    line = str(raised.value)
    assert "\n" not in line
    assert isinstance(raised.value.__cause__, bridge.REFUSALS)  # Bridge's own validation refused it
    assert f"Megatron-Bridge {versions.BRIDGE_RELEASE}: " in line
    assert raised.value.rule == case.rule  # worded by the plugin's rule for it
    shown = [*case.changes.items(), *case.environ.items()]
    assert any(f"{k}={v!r}" in line for k, v in shown), line  # a field and its value
    assert ": set " in line or "; set " in line or "unset it" in line, line  # the fix


def test_a_refusal_no_plugin_rule_makes_is_worded_from_bridges_message(bridge):
    from pytest_megatron_fsdp.fsdp.config import ConfigError

    cfg = bridge.seed_config()
    cfg.ddp.fsdp_manual_registration = True  # only Bridge checks it: it needs ddp.nccl_ub
    with pytest.raises(ConfigError) as raised:
        bridge.validate_bridge_config(cfg)
    assert raised.value.rule is None
    assert str(raised.value).startswith(f"Megatron-Bridge {versions.BRIDGE_RELEASE} refuses the config: ")
    assert "fsdp_manual_registration" in str(raised.value)
    assert "\n" not in str(raised.value)


def test_a_session_asking_for_bridges_rules_is_refused_by_bridge_in_one_line_before_any_test(pytester):
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    only_bridge_refuses = "--mfsdp-set=ddp.fsdp_manual_registration=true"  # it needs ddp.nccl_ub
    refused = pytester.runpytest_inprocess(
        "-p", "no:randomly", "--mfsdp-bridge-rules=true", only_bridge_refuses
    )
    assert refused.ret == pytest.ExitCode.USAGE_ERROR, refused.stdout.str() + refused.stderr.str()
    lines = [line for line in refused.errlines if "bridge-rules" in line]
    assert len(lines) == 1, refused.errlines
    assert lines[0].startswith(
        f"ERROR: --mfsdp-bridge-rules=true: Megatron-Bridge {versions.BRIDGE_RELEASE} refuses the config: "
    ), lines
    assert "fsdp_manual_registration" in lines[0]
    assert "passed" not in refused.stdout.str()  # no test ran
    # the plugin's own rules accept it: without the option the session runs
    pytester.runpytest_inprocess("-p", "no:randomly", only_bridge_refuses).assert_outcomes(passed=1)
    # a config Bridge accepts (the seed's override on its recipe) runs with the option
    pytester.runpytest_inprocess("-p", "no:randomly", "--mfsdp-bridge-rules=true").assert_outcomes(passed=1)


def test_the_plugins_rules_agree_with_bridges_validation_on_every_case(bridge):
    from pytest_megatron_fsdp.fsdp import bridge_parity

    verdicts = [bridge_parity.verdict(case) for case in bridge_parity.CASES]
    assert bridge_parity.disagreements(verdicts) == []
    assert {v.bridge_refuses for v in verdicts} == {True, False}  # the table has both kinds
    # the declared differences are the table's own cases
    assert set(bridge_parity.KNOWN_DIFFERENCES) <= {c.name for c in bridge_parity.CASES}


def _pythonpath() -> list[str]:
    """This process's own PYTHONPATH (a copy of the package under test, as docs/development.md breaks one)."""
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


#: rules of Bridge's validate() changed in the shadow copy, all in one copy (one interpreter's import of
#: Bridge, ~15 s, for all): (file, Bridge's text, the change, the case the parity table must then report;
#: each change its own case, so each is seen apart)
DRIFTS = {
    # Bridge drops a refusal: the plugin refuses alone
    "the FSDP2 exclusion dropped": (
        "training/config.py",
        "if self.dist.use_megatron_fsdp and self.dist.use_torch_fsdp2:",
        "if False:",
        "Megatron-FSDP with torch FSDP2",
    ),
    # Bridge refuses more: a declared difference no longer shows
    "the checkpoint format checked when nothing is saved": (
        "training/config.py",
        "if self.checkpoint.save is not None or self.checkpoint.load is not None:\n"
        "            # only check if saving or loading\n"
        '            assert self.checkpoint.ckpt_format == "fsdp_dtensor"',
        'if True:\n            assert self.checkpoint.ckpt_format == "fsdp_dtensor"',
        "torch_dist, nothing saved or loaded",
    ),
}


def test_rules_changed_in_a_shadow_copy_of_bridge_make_the_parity_table_fail(tmp_path):
    """Bridge's package copied, rules changed in the copy, the copy first on the path of a fresh
    interpreter (the installed package is never edited): the table reports each changed rule's case,
    and only those."""
    import importlib.util

    spec = importlib.util.find_spec("megatron.bridge")
    assert spec is not None
    assert spec.submodule_search_locations
    installed = Path(next(iter(spec.submodule_search_locations)))
    shadow = tmp_path / "shadow" / "megatron" / "bridge"
    shutil.copytree(installed, shadow, ignore=shutil.ignore_patterns("__pycache__"))
    for relative, old, new, _case in DRIFTS.values():
        source = (shadow / relative).read_text()
        count = source.count(old)
        assert count == 1, f"Bridge's {relative} has {count} of {old!r}, not 1: update DRIFTS"
        (shadow / relative).write_text(source.replace(old, new))
    done = subprocess.run(
        [sys.executable, "-c", PARITY_SCRIPT],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "shadow"), *_pythonpath()])},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["bridge"].startswith(str(shadow))
    reported = [line.partition(":")[0] for line in found["disagreements"]]
    assert sorted(reported) == sorted(case for *_, case in DRIFTS.values()), found["disagreements"]


#: the seed's llama3 8B recipe in a fresh interpreter (the hub's settings are read at import): the seed's
#: config accepted, then refused with torch FSDP2
LLAMA_SCRIPT = """
import json
from pytest_megatron_fsdp.foreign import bridge as foreign_bridge
foreign_bridge.watch()
from pytest_megatron_fsdp.fsdp import bridge_config as b
from pytest_megatron_fsdp.fsdp.config import ConfigError
cfg = b.seed_config(b.LLAMA3_8B)
facts = {"rotary_base": cfg.model.rotary_base, "vocab_size": cfg.model.vocab_size}
facts["warnings"] = b.validate_bridge_config(cfg)
cfg = b.seed_config(b.LLAMA3_8B)
cfg.dist.use_torch_fsdp2 = True
try:
    b.validate_bridge_config(cfg)
except ConfigError as exc:
    facts["refusal"] = str(exc)
print(json.dumps(facts))
"""


def test_the_seeds_llama3_8b_recipe_reads_its_hf_config_offline_and_passes_bridges_validation(tmp_path):
    """Bridge's llama3_8b_pretrain_config unchanged; its HF config (meta-llama/Meta-Llama-3-8B's public
    config.json, tests/data/bridge) from a hub cache written here, the hub offline: nothing downloaded,
    Bridge's config lock file in this test's directory, not in ~/.cache."""
    supplied = DATA / "Meta-Llama-3-8B" / "config.json"
    repo = tmp_path / "hf" / "hub" / "models--meta-llama--Meta-Llama-3-8B"
    revision = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    (repo / "snapshots" / revision).mkdir(parents=True)
    shutil.copy(supplied, repo / "snapshots" / revision / "config.json")
    locks = tmp_path / "locks"
    environ = {
        **os.environ,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "MEGATRON_CONFIG_LOCK_DIR": str(locks),
    }
    done = subprocess.run(
        [sys.executable, "-c", LLAMA_SCRIPT],
        env=environ,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    hf = json.loads(supplied.read_text())
    assert (facts["rotary_base"], facts["vocab_size"]) == (hf["rope_theta"], hf["vocab_size"])
    assert "refusal" in facts
    assert "dist.use_torch_fsdp2=True" in facts["refusal"]
    assert "\n" not in facts["refusal"]
    assert any(locks.iterdir())  # the lock went where it was told


def test_bridges_train_state_has_the_entries_the_plugin_writes_and_recognises(bridge):
    """The plugin's checkpoints carry Bridge's ``train_state.pt`` entries (Bridge's loader reads them),
    and its loader tells Bridge's own file by them: Bridge's TrainState must write exactly these, and
    load what the plugin writes."""
    from megatron.bridge.training.state import TrainState

    from pytest_megatron_fsdp.fsdp.layout import BRIDGE_TRAIN_STATE_KEYS
    from pytest_megatron_fsdp.fsdp.megatron_layout import bridge_train_state

    assert set(TrainState().state_dict()) == BRIDGE_TRAIN_STATE_KEYS
    written = bridge_train_state(step=7, consumed_train_samples=28)
    assert set(written) == BRIDGE_TRAIN_STATE_KEYS
    loaded = TrainState()
    loaded.load_state_dict({**written, "iteration": 7, "ckpt_format": "fsdp_dtensor"})
    assert (loaded.step, loaded.consumed_train_samples, loaded.do_train) == (7, 28, True)
