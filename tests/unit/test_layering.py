"""The package's architecture, held by its imports.

Three concerns, arrows only pointing down: ``harness/`` (launching and watching ranks) imports
nothing from ``fsdp/`` (the Megatron-FSDP domain), ``reporting/`` or the Megatron-specific CPU mode
(``cpu_mode``); the domain imports no pytest; the entry module loads no torch; and no module
imports one that imports it back; only ``harness/pytest_compat.py`` imports pytest's private
``_pytest``. Every import counts: module-level, lazy (inside a function) and
``TYPE_CHECKING``-only ones.

A process plays one role (plain-mode parent, launched rank, torchrun-mode rank; ``roles/``, one
module per role), decided once: only the role decision (``roles/deciding.py``) reads the torchrun
environment, an srun step's Slurm variables or the launched-by-parent flag, and exactly one role
plugin is registered per process. ``roles/`` is a room of its own above the harness: a role holds
its harness objects and imports them; ``harness/`` never imports a role. A role's class inherits no
other role's class, only the interface every role's plugin offers (``RolePlugin``): what two roles
share is held (the rank roles' one plugin holds its kind).
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


def layering_problems(root: Path) -> list[str]:
    graph = imports(root)
    name = root.name
    problems = [" -> ".join(c) for c in cycles(graph)]
    for module, targets in sorted(graph.items()):
        if module.startswith(f"{name}.fsdp"):
            problems += [
                f"{module} imports {t}" for t in sorted(targets) if t.split(".")[0] in ("pytest", "_pytest")
            ]
        if module.startswith(f"{name}.harness"):
            problems += [
                f"{module} imports {t}"
                for t in sorted(targets)
                if t.startswith((f"{name}.fsdp", f"{name}.reporting", f"{name}.cpu_mode", f"{name}.roles"))
            ]
        if module != f"{name}.harness.pytest_compat":
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
    "roles.deciding": "decides the role, once",
    "harness.session": "TorchrunEnv.from_environ parses torchrun's variables (called by roles only)",
    "harness.protocol": "defines the launched-by-parent flag",
    "harness.launcher": "names torchrun's variables to remove them from the rank sets it launches",
    "harness.rank_entry": "a launched rank's entry point: its rank, before pytest (and the role) exist",
    "harness.slurm": "maps an srun step's Slurm variables to torchrun's (step_of, called by roles only)",
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


#: the one class in ``roles/`` a role's class may inherit: what every role's plugin class offers
ROLE_INTERFACE = "RolePlugin"


def inheritance_problems(root: Path) -> list[str]:
    """Classes in ``roles/`` that inherit another class of ``roles/`` than :data:`ROLE_INTERFACE`:
    a role holds what it shares with another (as a rank's plugin holds its kind), it does not
    inherit it."""
    trees = {
        m: ast.parse(p.read_text()) for m, p in _modules(root).items() if m.startswith(f"{root.name}.roles")
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
        "pytest_megatron_fsdp.harness.rank",
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
                "harness/__init__.py": "",
                "fsdp/__init__.py": "",
                "fsdp/d.py": "",
                "harness/e.py": "from ..fsdp import d\n",
            },
            "pkg.harness.e imports pkg.fsdp.d",
        ),
        ({"plugin.py": "from . import heavy\n", "heavy.py": "import torch\n"}, "pkg.plugin loads torch"),
        (
            {"harness/__init__.py": "", "cpu_mode.py": "", "harness/f.py": "from .. import cpu_mode\n"},
            "pkg.harness.f imports pkg.cpu_mode",
        ),
        (
            {
                "harness/__init__.py": "",
                "roles/__init__.py": "",
                "roles/parent.py": "",
                "harness/j.py": "def f():\n    from ..roles import parent\n",
            },
            "pkg.harness.j imports pkg.roles.parent",
        ),
        (
            {"harness/__init__.py": "", "harness/k.py": "from _pytest.runner import runtestprotocol\n"},
            "pkg.harness.k imports _pytest.runner",
        ),
        ({"plugin.py": "import os\nrank = os.environ['RANK']\n"}, "pkg.plugin reads torchrun's RANK"),
        (
            {"fixtures.py": "import os\nx = os.environ.get('TORCHELASTIC_RUN_ID')\n"},
            "pkg.fixtures reads torchrun's TORCHELASTIC_RUN_ID",
        ),
        (
            {
                "harness/__init__.py": "",
                "harness/g.py": "from .session import TorchrunEnv\nTorchrunEnv.from_environ()\n",
            },
            "pkg.harness.g asks which role it plays (from_environ)",
        ),
        (
            {"harness/__init__.py": "", "harness/h.py": "from .protocol import launched_by_parent\n"},
            "pkg.harness.h asks which role it plays (launched_by_parent)",
        ),
        (
            {"fixtures.py": "import os\nx = os.environ['SLURM_PROCID']\n"},
            "pkg.fixtures reads Slurm's SLURM_PROCID",
        ),
        (
            {"harness/__init__.py": "", "harness/i.py": "from . import slurm\nslurm.step_of({})\n"},
            "pkg.harness.i asks which role it plays (step_of)",
        ),
        (
            {
                "roles/__init__.py": "",
                "roles/deciding.py": "class RolePlugin: ...\n",
                "roles/ranks.py": "from .deciding import RolePlugin\nclass RankPlugin(RolePlugin): ...\n",
                "roles/launched.py": "from . import ranks\nclass LaunchedRankPlugin(ranks.RankPlugin): ...\n",
            },
            "pkg.roles.launched: LaunchedRankPlugin inherits RankPlugin",
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
    from pytest_megatron_fsdp import cpu_mode, roles
    from pytest_megatron_fsdp.harness.controller import Controller
    from pytest_megatron_fsdp.harness.rank import RankRunner

    monkeypatch.setattr(cpu_mode, "enable", lambda: None)  # no torch in this process
    monkeypatch.setattr(cpu_mode, "disable", lambda: None)
    monkeypatch.setattr(RankRunner, "_quiet_terminal", lambda self, config: None)  # keeps this stdout
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
    role_plugins = [p for p in plugins if isinstance(p, (roles.RolePlugin, Controller, RankRunner))]
    assert [type(p).__name__ for p in role_plugins] == [expected]
    assert type(role_plugins[0]) is roles.role_of(config).plugin_class
    plugin = role_plugins[0]
    assert (type(plugin.kind).__name__ if isinstance(plugin, roles.RankPlugin) else None) == kind
