"""The Makefile's stack: one variable (MEGATRON_CORE) naming a Megatron-LM checkout gates it whole,
megatron-core and the standalone megatron-fsdp from the same checkout; MEGATRON_FSDP overrides it.
Read from ``make -n venv`` (what make would run), so nothing is installed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _without_outer_make() -> dict[str, str]:
    """The environment without what a ``make`` running this test passes on to its sub-makes: the
    variables of its command line (``make unit STACK=newest`` exports ``STACK=newest`` and lists it
    in MAKEFLAGS after ``--``), which would override the stack each test asks for, and MAKEFLAGS."""
    flags = os.environ.get("MAKEFLAGS", "")
    assigned = flags.split(" -- ", 1)[1].split() if " -- " in flags else []
    outer = {word.split("=", 1)[0] for word in assigned if "=" in word}
    dropped = outer | {"MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES", "MAKELEVEL"}
    return {name: value for name, value in os.environ.items() if name not in dropped}


def _planned(tmp_path: Path, *assignments: str) -> dict[str, str]:
    """The requirement lines ``make venv`` would write for megatron-core and megatron-fsdp, and the
    SPEC it would record (its change rebuilds the venv)."""
    if shutil.which("make") is None:
        pytest.fail("make is not installed")
    venv = tmp_path / "venv"
    done = subprocess.run(
        ["make", "-n", "-C", str(REPO), "venv", "PYTHON=python3", f"VENV={venv}", *assignments],
        capture_output=True,
        text=True,
        timeout=60,
        env=_without_outer_make(),
    )
    assert done.returncode == 0, done.stderr
    lines = {
        name: re.search(rf"echo '([^']*)' > {re.escape(str(venv))}/{name}\.txt", done.stdout).group(1)
        for name in ("megatron-core", "megatron-fsdp")
    }
    lines["spec"] = re.search(rf"echo '([^']*)' > {re.escape(str(venv))}/\.installed", done.stdout).group(1)
    return lines


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A Megatron-LM checkout's layout: the standalone megatron-fsdp with its own pyproject.toml."""
    root = tmp_path / "Megatron-LM"
    src = root / "megatron" / "core" / "distributed" / "fsdp" / "src"
    src.mkdir(parents=True)
    (src / "pyproject.toml").write_text("[project]\nname = 'megatron-fsdp'\n")
    return root


@pytest.mark.parametrize("editable", ["-e ", "--editable ", ""])
def test_a_checkout_brings_its_own_megatron_fsdp(tmp_path, checkout, editable):
    planned = _planned(tmp_path, f"MEGATRON_CORE={editable}{checkout}/")
    fsdp = f"{editable}{checkout}/megatron/core/distributed/fsdp/src"
    assert planned["megatron-core"] == f"{editable}{checkout}/"
    assert planned["megatron-fsdp"] == fsdp
    assert f"megatron-fsdp={fsdp} " in planned["spec"]  # a change of it rebuilds the venv


def test_megatron_fsdp_overrides_the_checkouts_and_takes_any_requirement(tmp_path, checkout):
    planned = _planned(tmp_path, f"MEGATRON_CORE=-e {checkout}", "MEGATRON_FSDP=megatron-fsdp==0.6.1")
    assert planned["megatron-fsdp"] == "megatron-fsdp==0.6.1"
    assert "megatron-fsdp=megatron-fsdp==0.6.1 " in planned["spec"]
    assert _planned(tmp_path, f"MEGATRON_CORE=-e {checkout}", "MEGATRON_FSDP=")["megatron-fsdp"] == ""


def test_a_release_or_a_directory_without_megatron_fsdp_leaves_it_to_the_extras(tmp_path):
    assert _planned(tmp_path, "MEGATRON_CORE=megatron-core==0.19.2")["megatron-fsdp"] == ""
    (tmp_path / "not-a-checkout").mkdir()
    assert _planned(tmp_path, f"MEGATRON_CORE=-e {tmp_path / 'not-a-checkout'}")["megatron-fsdp"] == ""


def _upstream_plan(tmp_path: Path, *assignments: str) -> str:
    """What ``make -n upstream`` would run (the venv's sub-make dry-runs too)."""
    done = subprocess.run(
        ["make", "-n", "--no-print-directory", "-C", str(REPO), "upstream", "PYTHON=python3", *assignments],
        capture_output=True,
        text=True,
        timeout=60,
        env=_without_outer_make(),
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_make_upstream_runs_the_checkouts_tests_against_its_own_megatron_core(tmp_path, checkout):
    """MEGATRON_LM alone: megatron-core and megatron-fsdp from that checkout, in a venv of its own (the
    stack's usual venv is not rebuilt); the input is checked before that venv is built."""
    plan = _upstream_plan(tmp_path, "STACK=newest", f"MEGATRON_LM={checkout}/")
    spec = re.search(r"echo '([^']*)' > \.venv-newest-upstream/\.installed", plan)
    assert spec is not None, plan
    assert (
        f"megatron-core=-e {checkout} megatron-fsdp=-e {checkout}/megatron/core/distributed/fsdp/src"
        in spec[1]
    )
    # no registry Megatron-Bridge beside a checkout's megatron-core (MEGATRON_BRIDGE's run has its own venv)
    assert "extras=dev,fully-shard " in spec[1]
    assert "megatron-bridge" not in spec[1]
    check = plan.index(f"python3 -m bench.upstream --check --megatron-lm='{checkout}/'")
    assert check < plan.index(".venv-newest-upstream/.installed")
    run = plan.index(f".venv-newest-upstream/bin/python -m bench.upstream --megatron-lm='{checkout}/'")
    # the checkout's own test group goes into the venv after it is built, before the runs
    deps = plan.index(f".venv-newest-upstream/bin/python -m bench.upstream_deps --checkout='{checkout}/'")
    assert plan.index(".venv-newest-upstream/.installed") < deps < run


def test_make_upstream_keeps_a_given_venv_and_megatron_core(tmp_path, checkout):
    venv = tmp_path / "venv"
    plan = _upstream_plan(
        tmp_path, f"MEGATRON_LM={checkout}", f"VENV={venv}", "MEGATRON_CORE=megatron-core==0.19.2"
    )
    assert "megatron-core=megatron-core==0.19.2 " in plan
    assert f"{venv}/bin/python -m bench.upstream" in plan
    # and the other targets ignore MEGATRON_LM: `make smoke` keeps the stack's pins and venv
    smoke = _planned(tmp_path, "STACK=newest", f"MEGATRON_LM={checkout}")
    assert smoke["megatron-core"] == "megatron-core==0.19.2"


@pytest.fixture
def bridge_checkout(tmp_path: Path) -> Path:
    """A Megatron-Bridge checkout's layout, its Megatron-LM submodule not checked out."""
    root = tmp_path / "Megatron-Bridge"
    (root / "src" / "megatron" / "bridge").mkdir(parents=True)
    (root / "src" / "megatron" / "bridge" / "__init__.py").write_text("")
    (root / "3rdparty" / "Megatron-LM").mkdir(parents=True)
    return root


def _make_n(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "-n", "--no-print-directory", "-C", str(REPO), "PYTHON=python3", *arguments],
        capture_output=True,
        text=True,
        timeout=60,
        env=_without_outer_make(),
    )


@pytest.mark.parametrize(
    ("assignments", "says"),
    [
        ((), "STACK=bridge needs MEGATRON_BRIDGE: set MEGATRON_BRIDGE=/path/to/Megatron-Bridge"),
        (("MEGATRON_BRIDGE={tmp}",), "MEGATRON_BRIDGE={tmp} holds no src/megatron/bridge: set it to a"),
        (
            ("MEGATRON_BRIDGE={bridge}",),
            "MEGATRON_CORE: {bridge}/3rdparty/Megatron-LM is empty: run git submodule",
        ),
    ],
)
def test_the_bridge_stack_refuses_a_missing_input_in_one_line(tmp_path, bridge_checkout, assignments, says):
    values = {"tmp": tmp_path, "bridge": bridge_checkout}
    done = _make_n("bridge-test", *(a.format(**values) for a in assignments))
    assert done.returncode == 2
    assert says.format(**values) in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_the_bridge_stack_installs_bridge_without_its_dependencies_then_what_its_test_imports(
    tmp_path, checkout, bridge_checkout
):
    (bridge_checkout / "3rdparty" / "Megatron-LM" / "megatron" / "core").mkdir(parents=True)
    planned = _planned(tmp_path, "STACK=bridge", f"MEGATRON_BRIDGE={bridge_checkout}")
    assert planned["megatron-core"] == f"-e {bridge_checkout}/3rdparty/Megatron-LM"  # Bridge's own pin
    assert f"megatron-bridge={bridge_checkout} bridge-deps=transformers>=5.8,<=5.12.1 " in planned["spec"]
    plan = _make_n("venv", "STACK=bridge", f"VENV={tmp_path / 'venv'}", f"MEGATRON_BRIDGE={bridge_checkout}")
    assert f"pip install -q --no-deps -e '{bridge_checkout}'" in plan.stdout
    assert "'nvidia-resiliency-ext==0.6.0'" in plan.stdout
    assert "transformer-engine" not in plan.stdout.lower()
    assert "transformer_engine" not in plan.stdout
    given = _planned(
        tmp_path, "STACK=bridge", f"MEGATRON_BRIDGE={bridge_checkout}", f"MEGATRON_CORE=-e {checkout}"
    )
    assert given["megatron-core"] == f"-e {checkout}"


def test_the_newest_stack_installs_the_registrys_bridge_without_its_dependencies_and_the_floor_none(tmp_path):
    planned = _planned(tmp_path, "STACK=newest")
    assert "extras=dev,fully-shard,bridge " in planned["spec"]  # what Bridge imports, from pyproject.toml
    assert "megatron-bridge=megatron-bridge==0.6.2 " in planned["spec"]  # a change rebuilds the venv
    plan = _make_n("venv", "STACK=newest", f"VENV={tmp_path / 'venv'}").stdout
    assert "pip install -q --no-deps 'megatron-bridge==0.6.2'" in plan
    assert "'nvidia-resiliency-ext==0.6.0'" in plan
    assert "transformer-engine" not in plan.lower()
    without = _make_n("venv", "STACK=newest", "BRIDGE_REQ=", f"VENV={tmp_path / 'venv'}").stdout
    floor = _make_n("venv", "STACK=floor", f"VENV={tmp_path / 'venv'}").stdout
    for other in (without, floor):
        assert "megatron-bridge" not in other
        assert "nvidia-resiliency-ext" not in other


def test_make_bridge_test_runs_the_test_from_the_checkout_in_the_bridge_venv(tmp_path, bridge_checkout):
    (bridge_checkout / "3rdparty" / "Megatron-LM" / "megatron" / "core").mkdir(parents=True)
    junit = tmp_path / "bridge.xml"
    plan = _make_n("bridge-test", f"MEGATRON_BRIDGE={bridge_checkout}", f"JUNIT={junit}").stdout
    assert f"cd '{bridge_checkout}'" in plan
    assert ".venv-bridge/bin/python -c" in plan  # the venv's stack line names this stack
    assert "print('stack: bridge ('" in plan
    assert (
        f"'{REPO}/.venv-bridge/bin/python' -m torch.distributed.run --standalone --nproc_per_node=2" in plan
    )
    for argument in (
        "--mfsdp-platform=cpu",
        "--mfsdp-foreign-suite=true",
        "-p no:randomly",
        f"--junitxml='{junit}'",
        "'tests/functional_tests/test_groups/megatron_fsdp'",  # the whole Megatron-FSDP group
        "-m bench.bridge_loss",
    ):
        assert argument in plan, plan
    without = _make_n("bridge-test", f"MEGATRON_BRIDGE={bridge_checkout}").stdout
    assert "--junitxml" not in without


def test_make_upstream_with_megatron_bridge_builds_its_venv_first_on_the_same_megatron_core(
    tmp_path, checkout, bridge_checkout
):
    """MEGATRON_BRIDGE: the bridge venv (STACK=bridge, BRIDGE_VENV) is built before any run starts, with the
    Megatron-LM runs' megatron-core, and bench/upstream.py is told the test, venv and megatron-core that
    its `make bridge-test` run then uses."""
    (bridge_checkout / "tests").mkdir()
    plan = _upstream_plan(
        tmp_path, "STACK=newest", f"MEGATRON_LM={checkout}", f"MEGATRON_BRIDGE={bridge_checkout}",
        f"BRIDGE_VENV={tmp_path / 'bv'}",
    )  # fmt: skip
    bridge_spec = plan.index(f"> {tmp_path / 'bv'}/.installed")
    assert f"megatron-core=-e {checkout} " in plan[plan.rindex("echo '", 0, bridge_spec) : bridge_spec]
    assert f"megatron-bridge={bridge_checkout} " in plan[plan.rindex("echo '", 0, bridge_spec) : bridge_spec]
    run = plan.index(".venv-newest-upstream/bin/python -m bench.upstream --")
    assert plan.index(".venv-newest-upstream/.installed") < bridge_spec < run
    flags = plan[run:].splitlines()[0]
    for flag in (
        f"--megatron-bridge='{bridge_checkout}'",
        "--bridge-test='tests/functional_tests/test_groups/megatron_fsdp'",
        f"--bridge-venv='{tmp_path / 'bv'}'",
        f"--bridge-megatron-core='-e {checkout}'",
    ):
        assert flag in flags, flags
    assert "--markers" not in flags  # bench/upstream.py's default: upstream's dev-CI selection
    without = _upstream_plan(tmp_path, "STACK=newest", f"MEGATRON_LM={checkout}")
    assert "STACK=bridge" not in without
    assert "--bridge-" not in without


@pytest.mark.parametrize(
    ("assignment", "flag"),
    [("UPSTREAM_MARKERS=", "--markers=''"), ("UPSTREAM_MARKERS=not slow", "--markers='not slow'")],
)
def test_upstream_markers_given_even_empty_reach_the_runs(tmp_path, checkout, assignment, flag):
    plan = _upstream_plan(tmp_path, "STACK=newest", f"MEGATRON_LM={checkout}", assignment)
    run = plan.index(".venv-newest-upstream/bin/python -m bench.upstream --")
    assert flag in plan[run:].splitlines()[0]
