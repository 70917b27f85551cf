"""The package's architecture, held by its imports: rooms by the process their code runs in.

============  ==========================================================================================
room          what runs there
============  ==========================================================================================
``parent/``   the pytest process the user started (plain mode): the controller, the rank sets it
              launches, pytest-xdist's queue, the GPU slices
``rank/``     a rank (launched by the parent, or one of the user's torchrun or srun ranks): its plugin,
              the runner that agrees every test's outcome, its session, watchdog and progress beacon
``emulation/`` CUDA on CPU ranks (torch's CUDA entry points given CPU meanings, the device limits)
``wire/``     what both sides share: the batch and report protocol, the rank directory's paths and
              formats (``wire/rank_dir.py``), the wording of failures, the role decision, the platform
``foreign/``  the foreign-suite mode (upstream's tests, unchanged, on the plugin's ranks)
``fsdp/``     the Megatron-FSDP domain (no pytest)
``reporting/`` the runs table, JSON, JUnit properties, golden values
============  ==========================================================================================

Arrows point down and never across the process boundary: ``parent/`` and ``rank/`` never import
each other, they share ``wire/`` only (and the settings every process reads: ``options``,
``marker``, ``environment``); ``wire/`` and ``emulation/`` import neither side; the domain imports
no pytest and no harness room; the entry module (``plugin``, the one module above both sides) loads
no torch; no module imports one that imports it back; only ``wire/pytest_compat.py`` imports
pytest's private ``_pytest``. Every import counts: module-level, lazy (inside a function) and
``TYPE_CHECKING``-only ones.

A process plays one role (plain-mode parent, launched rank, torchrun-mode rank), decided once: only
the role decision (``wire/role.py``) reads the torchrun environment, an srun step's Slurm variables
or the launched-by-parent flag, and exactly one role plugin is registered per process. A plugin
class inherits no other plugin class, only the interface every role's plugin offers
(``RolePlugin``): what two roles share is held (the rank roles' one plugin holds its kind).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pytest_megatron_fsdp"
HEAVY = ("torch", "megatron", "numpy")


def _module_name(root: Path, path: Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(root: Path) -> dict[str, Path]:
    return {_module_name(root, p): p for p in sorted(root.rglob("*.py"))}


def imports(root: Path, module_level_only: bool = False) -> dict[str, set[str]]:
    """module -> every module name it imports (absolute; package-internal ones resolved)."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        nodes = tree.body if module_level_only else list(ast.walk(tree))
        found: set[str] = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:  # `from . import options` imports a module
                    candidate = f"{target}.{alias.name}"
                    found.add(candidate if candidate in modules else target)
        graph[name] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles among the graph's own modules (each found once, from its first module)."""
    internal = {m: sorted(t for t in targets if t in graph and t != m) for m, targets in graph.items()}
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in internal[module]:
            if state.get(target) == 1:
                found.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(internal):
        if module not in state:
            visit(module)
    return found


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        for target in graph.get(module, ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


#: room -> the rooms it must never import, and why
FORBIDDEN: dict[str, tuple[tuple[str, ...], str]] = {
    "parent": (("rank", "emulation"), "the parent never runs rank code"),
    "rank": (("parent",), "a rank never runs the parent's code"),
    "wire": (
        ("parent", "rank", "emulation", "foreign", "fsdp", "reporting"),
        "the wire is what both sides share",
    ),
    "emulation": (
        ("parent", "rank", "wire", "foreign", "fsdp", "reporting"),
        "the emulation patches torch only",
    ),
    "foreign": (("parent", "rank"), "the foreign-suite mode is held by the rank's plugin"),
    "fsdp": (("parent", "rank", "wire", "emulation", "foreign", "reporting"), "the domain knows no harness"),
    "reporting": (("parent", "rank", "wire", "emulation", "foreign"), "reports are plain data"),
}


def layering_problems(root: Path) -> list[str]:
    graph = imports(root)
    name = root.name
    problems = [" -> ".join(c) for c in cycles(graph)]
    for module, targets in sorted(graph.items()):
        room = module.split(".")[1] if module.count(".") >= 2 else None
        if room == "fsdp":
            problems += [
                f"{module} imports {t}" for t in sorted(targets) if t.split(".")[0] in ("pytest", "_pytest")
            ]
        forbidden, why = FORBIDDEN.get(room or "", ((), ""))
        problems += [
            f"{module} imports {t} ({why})"
            for t in sorted(targets)
            if t.startswith(name + ".") and t.split(".")[1] in forbidden
        ]
        if module != f"{name}.wire.pytest_compat":
            problems += [f"{module} imports {t}" for t in sorted(targets) if t.split(".")[0] == "_pytest"]
    loaded_by_entry = _reach(imports(root, module_level_only=True), f"{name}.plugin")
    problems += [f"{name}.plugin loads {t}" for t in sorted(loaded_by_entry) if t.split(".")[0] in HEAVY]
    return problems + role_problems(root) + inheritance_problems(root)


#: the variables torchrun sets for its ranks (and its agent's TORCHELASTIC_*)
TORCHRUN_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
#: the functions that tell a process's role: torchrun's or Slurm's variables parsed, the parent's flag read
ROLE_READERS = ("from_environ", "launched_by_parent", "step_of", "in_multi_task_step")
#: the modules that may name them, and why
ROLE_MODULES = {
    "wire.role": "decides the role, once",
    "wire.torchrun_env": "parses torchrun's variables (TorchrunEnv.from_environ; the role decision calls it)",
    "wire.protocol": "defines the launched-by-parent flag",
    "parent.launcher": "names torchrun's variables to remove them from the rank sets it launches",
    "rank.entry": "a launched rank's entry point: its rank, before pytest (and the role) exist",
    "wire.slurm": "maps an srun step's Slurm variables to torchrun's (step_of; the role decision calls it)",
}


def role_problems(root: Path) -> list[str]:
    """Modules outside ROLE_MODULES that name a torchrun or Slurm variable or call a role reader."""
    allowed = {f"{root.name}.{m}" for m in ROLE_MODULES}
    problems = []
    for module, path in sorted(_modules(root).items()):
        if module in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value in TORCHRUN_VARIABLES or node.value.startswith("TORCHELASTIC_"):
                    problems.append(f"{module} reads torchrun's {node.value}")
                elif node.value.startswith("SLURM_"):
                    problems.append(f"{module} reads Slurm's {node.value}")
            field = {ast.Attribute: "attr", ast.Name: "id", ast.alias: "name"}.get(type(node))
            name = getattr(node, field) if field else None
            if name in ROLE_READERS:
                problems.append(f"{module} asks which role it plays ({name})")
    return problems


#: the one class a role's class may inherit: what every role's plugin class offers
ROLE_INTERFACE = "RolePlugin"
#: the modules that define the roles' plugin classes and what they hold
ROLE_CLASS_MODULES = (
    "wire.role",
    "parent.plugin",
    "rank.plugin",
    "rank.launched",
    "rank.torchrun",
    "rank.awaiting",
)


def inheritance_problems(root: Path) -> list[str]:
    """Classes of the role modules that inherit another of their classes than :data:`ROLE_INTERFACE`:
    a role holds what it shares with another (as a rank's plugin holds its kind), it does not
    inherit it."""
    trees = {
        m: ast.parse(p.read_text())
        for m, p in _modules(root).items()
        if m.partition(".")[2] in ROLE_CLASS_MODULES
    }
    classes = [node for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    defined = {node.name for node in classes} - {ROLE_INTERFACE}
    problems = []
    for module, tree in sorted(trees.items()):
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
                if name in defined:
                    problems.append(f"{module}: {node.name} inherits {name}")
    return problems


def test_the_package_is_layered_and_acyclic():
    assert set(_modules(PACKAGE)) >= {
        "pytest_megatron_fsdp.plugin",
        "pytest_megatron_fsdp.rank.runner",
        "pytest_megatron_fsdp.fsdp.training",
        "pytest_megatron_fsdp.reporting.report",
    }
    assert layering_problems(PACKAGE) == []


def test_no_file_cites_a_document_outside_the_repository():
    # the design notes the project started from live outside the repository: citing them leaves a
    # reader nothing to follow (the name is split so that this file does not cite it either)
    name = "FIND" + "INGS"
    root = PACKAGE.parent
    files = [*PACKAGE.rglob("*.py"), *(root / "tests").rglob("*.py"), *(root / "bench").glob("*.py")]
    assert [str(p.relative_to(root)) for p in files if name in p.read_text()] == []


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for relative, text in {"__init__.py": "", "plugin.py": "", **files}.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        # a circle through a lazy import and a TYPE_CHECKING one
        (
            {
                "fsdp/__init__.py": "",
                "fsdp/a.py": "def f():\n    from . import b\n",
                "fsdp/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n",
            },
            "pkg.fsdp.a -> pkg.fsdp.b -> pkg.fsdp.a",
        ),
        ({"fsdp/__init__.py": "", "fsdp/c.py": "import pytest\n"}, "pkg.fsdp.c imports pytest"),
        (
            {
                "fsdp/__init__.py": "",
                "wire/__init__.py": "",
                "wire/d.py": "",
                "fsdp/e.py": "from ..wire import d\n",
            },
            "pkg.fsdp.e imports pkg.wire.d (the domain knows no harness)",
        ),
        ({"plugin.py": "from . import heavy\n", "heavy.py": "import torch\n"}, "pkg.plugin loads torch"),
        # the process boundary, both ways, also through a lazy import
        (
            {
                "parent/__init__.py": "",
                "rank/__init__.py": "",
                "rank/runner.py": "",
                "parent/f.py": "from ..rank import runner\n",
            },
            "pkg.parent.f imports pkg.rank.runner (the parent never runs rank code)",
        ),
        (
            {
                "parent/__init__.py": "",
                "rank/__init__.py": "",
                "parent/controller.py": "",
                "rank/j.py": "def f():\n    from ..parent import controller\n",
            },
            "pkg.rank.j imports pkg.parent.controller (a rank never runs the parent's code)",
        ),
        (
            {
                "wire/__init__.py": "",
                "rank/__init__.py": "",
                "rank/progress.py": "",
                "wire/m.py": "from ..rank.progress import x\n",
            },
            "pkg.wire.m imports pkg.rank.progress (the wire is what both sides share)",
        ),
        (
            {
                "emulation/__init__.py": "",
                "wire/__init__.py": "",
                "wire/platform.py": "",
                "emulation/n.py": "from ..wire import platform\n",
            },
            "pkg.emulation.n imports pkg.wire.platform (the emulation patches torch only)",
        ),
        (
            {"wire/__init__.py": "", "wire/k.py": "from _pytest.runner import runtestprotocol\n"},
            "pkg.wire.k imports _pytest.runner",
        ),
        ({"plugin.py": "import os\nrank = os.environ['RANK']\n"}, "pkg.plugin reads torchrun's RANK"),
        (
            {"fixtures.py": "import os\nx = os.environ.get('TORCHELASTIC_RUN_ID')\n"},
            "pkg.fixtures reads torchrun's TORCHELASTIC_RUN_ID",
        ),
        (
            {
                "rank/__init__.py": "",
                "rank/g.py": "from ..wire.torchrun_env import TorchrunEnv\nTorchrunEnv.from_environ()\n",
            },
            "pkg.rank.g asks which role it plays (from_environ)",
        ),
        (
            {"parent/__init__.py": "", "parent/h.py": "from ..wire.protocol import launched_by_parent\n"},
            "pkg.parent.h asks which role it plays (launched_by_parent)",
        ),
        (
            {"fixtures.py": "import os\nx = os.environ['SLURM_PROCID']\n"},
            "pkg.fixtures reads Slurm's SLURM_PROCID",
        ),
        (
            {"rank/__init__.py": "", "rank/i.py": "from ..wire import slurm\nslurm.step_of({})\n"},
            "pkg.rank.i asks which role it plays (step_of)",
        ),
        (
            {
                "wire/__init__.py": "",
                "rank/__init__.py": "",
                "wire/role.py": "class RolePlugin: ...\n",
                "rank/plugin.py": "from ..wire.role import RolePlugin\nclass RankPlugin(RolePlugin): ...\n",
                "rank/launched.py": "from . import plugin\nclass Launched(plugin.RankPlugin): ...\n",
            },
            "pkg.rank.launched: Launched inherits RankPlugin",
        ),
    ],
)
def test_the_check_fails_on_each_kind_of_violation(tmp_path, files, expected):
    assert expected in layering_problems(_package(tmp_path, files))


@pytest.mark.parametrize(
    ("environ", "args", "expected", "kind"),
    [
        ({}, [], "ParentPlugin", None),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, [], "RankPlugin", "TorchrunRank"),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"},
            ["--mfsdp-report-file={tmp}/events.jsonl", "--mfsdp-batch-file={tmp}/batch.txt"],
            "RankPlugin",
            "LaunchedRank",
        ),
    ],
)
def test_each_process_registers_exactly_one_role_plugin(pytester, monkeypatch, environ, args, expected, kind):
    """A configured session of each role (in process, no rank started) holds one role plugin, of
    its role's class (a rank's holding its kind), and no other controller or rank plugin."""
    from pytest_megatron_fsdp.emulation import cpu_mode
    from pytest_megatron_fsdp.parent.controller import Controller
    from pytest_megatron_fsdp.rank.log import RankLog
    from pytest_megatron_fsdp.rank.plugin import RankPlugin
    from pytest_megatron_fsdp.rank.runner import RankRunner
    from pytest_megatron_fsdp.wire.role import RolePlugin, role_of

    monkeypatch.setattr(cpu_mode, "enable", lambda: None)  # no torch in this process
    monkeypatch.setattr(cpu_mode, "disable", lambda: None)
    monkeypatch.setattr(RankLog, "quiet_terminal", lambda self, config: None)  # keeps this stdout
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    tmp = pytester.path
    (tmp / "batch.txt").write_text("")
    config = pytester.parseconfigure(
        "-p",
        "no:cacheprovider",
        "--mfsdp-platform=cpu",
        f"--mfsdp-log-dir={tmp}/logs",
        *(a.format(tmp=tmp) for a in args),
    )
    plugins = config.pluginmanager.get_plugins()
    role_plugins = [p for p in plugins if isinstance(p, (RolePlugin, Controller, RankRunner))]
    assert [type(p).__name__ for p in role_plugins] == [expected]
    assert type(role_plugins[0]) is role_of(config).plugin_class
    plugin = role_plugins[0]
    assert (type(plugin.kind).__name__ if isinstance(plugin, RankPlugin) else None) == kind
