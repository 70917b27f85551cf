"""The ``Run`` protocol (``fsdp/run.py``): every kind of run provides it, checkpointing uses nothing else.

In-process, no rank set: the run classes are read as source (importing them would import
megatron-core), the layouts are imported (torch only), and :class:`RunBase` is exercised on a
plain torch module.
"""

from __future__ import annotations

import ast
import gc
import inspect
import weakref
from pathlib import Path

import pytest

from pytest_megatron_fsdp.fsdp import run as run_protocol

PACKAGE = Path(__file__).resolve().parents[2] / "pytest_megatron_fsdp"
#: the modules that save and load checkpoints: they must never ask what kind of run they got
CHECKPOINTING = ("fsdp/checkpoint.py", "fsdp/checkpoint_v2.py", "checkpoint.py")
#: module -> the run class it defines
RUN_CLASSES = {
    "fsdp/training.py": "TrainingRun",
    "fsdp/fully_shard.py": "FullyShardRun",
    "fsdp/fully_shard_v2.py": "FullyShardV2Run",
}
#: the classes a run class may build on -> the module defining each
RUN_BASES = {"RunBase": "fsdp/run.py", "StandaloneRun": "fsdp/fully_shard.py"}
SNIFFERS = ("hasattr", "getattr", "isinstance")


def _tree(relative: str, root: Path = PACKAGE) -> ast.Module:
    return ast.parse((root / relative).read_text())


def _mentions_run(node: ast.AST) -> bool:
    """Whether ``node`` is ``run`` or an attribute chain on it (``run.model``, ``run.cfg.ddp``)."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id == "run"


def sniffing(relative: str, root: Path = PACKAGE) -> list[str]:
    """``hasattr``/``getattr``/``isinstance`` applied to the run or a part of it."""
    found = []
    for node in ast.walk(_tree(relative, root)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in SNIFFERS
            and node.args
            and _mentions_run(node.args[0])
        ):
            found.append(f"{relative}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_checkpointing_never_asks_what_kind_of_run_it_got():
    assert [problem for module in CHECKPOINTING for problem in sniffing(module)] == []


def test_the_sniffing_check_finds_sniffing(tmp_path):
    """The check above can fail: what checkpoint.py did before the protocol is found."""
    before = (
        "def save(run):\n"
        "    cfg = getattr(run, 'cfg', None)\n"
        "    if hasattr(run, 'cfg'):\n"
        "        pass\n"
        "    isinstance(run.model, object)\n"
        "    getattr(saved, 'size', ())\n"  # not the run: allowed
    )
    (tmp_path / "old.py").write_text(before)
    assert [line.split(": ", 1)[1] for line in sniffing("old.py", tmp_path)] == [
        "getattr(run, 'cfg', None)",
        "hasattr(run, 'cfg')",
        "isinstance(run.model, object)",
    ]


def _protocol_members(protocol: type) -> set[str]:
    """The names a protocol (and the protocols it extends) declares: attributes and methods."""
    names: set[str] = set()
    for klass in protocol.__mro__:
        if klass in (object,) or not getattr(klass, "_is_protocol", False):
            continue
        names |= set(vars(klass).get("__annotations__", {}))
        names |= {n for n, v in vars(klass).items() if inspect.isfunction(v) and not n.startswith("_")}
    return names


def _class_provides(relative: str, class_name: str) -> set[str]:
    """What a class defines by its source: its body's methods and attributes, and ``self.x = ...``."""
    (cls,) = [n for n in _tree(relative).body if isinstance(n, ast.ClassDef) and n.name == class_name]
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(cls):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    names.add(target.attr)
    return names


def _lineage(relative: str, class_name: str) -> list[tuple[str, str]]:
    """The class and the package's classes it builds on, nearest first: (module, class) each.
    Only :data:`RUN_BASES` may be built on, and every lineage ends at ``RunBase``."""
    (cls,) = [n for n in _tree(relative).body if isinstance(n, ast.ClassDef) and n.name == class_name]
    bases = [ast.unparse(b) for b in cls.bases]
    if class_name == "RunBase":
        assert bases == [], bases
        return [(relative, class_name)]
    (base,) = bases
    assert base in RUN_BASES, f"{class_name} builds on {base}"
    return [(relative, class_name), *_lineage(RUN_BASES[base], base)]


@pytest.mark.parametrize("relative", sorted(RUN_CLASSES))
def test_each_run_class_provides_the_run_protocol(relative):
    class_name = RUN_CLASSES[relative]
    provided = set().union(*(_class_provides(m, n) for m, n in _lineage(relative, class_name)))
    missing = _protocol_members(run_protocol.Run) - provided
    assert not missing, f"{class_name} lacks {sorted(missing)}"
    assert "checkpoint_layout" in _class_provides(relative, class_name)


def test_training_run_provides_what_megatron_layout_needs():
    provided = set().union(*(_class_provides(m, n) for m, n in _lineage("fsdp/training.py", "TrainingRun")))
    assert _protocol_members(run_protocol.MegatronCoreRun) - provided == set()


@pytest.mark.parametrize("layout_name", ["megatron_layout", "fully_shard_layout", "fully_shard_v2_layout"])
def test_each_layout_implements_the_checkpoint_layout_protocol(layout_name):
    import importlib

    layout = importlib.import_module(f"pytest_megatron_fsdp.fsdp.{layout_name}")
    for name in _protocol_members(run_protocol.CheckpointLayout):
        wanted = list(inspect.signature(getattr(run_protocol.CheckpointLayout, name)).parameters)[1:]
        assert callable(getattr(layout, name, None)), f"{layout_name} has no {name}"
        assert list(inspect.signature(getattr(layout, name)).parameters) == wanted, (layout_name, name)


def _implementations(tree: ast.Module) -> list[str]:
    """The functions a module implements: its own and its classes' (a protocol's declarations aside)."""
    names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        if not any("Protocol" in ast.unparse(base) for base in cls.bases):
            names += [n.name for n in cls.body if isinstance(n, ast.FunctionDef)]
    return names


def test_close_and_the_data_parallel_mean_are_written_once():
    defined: dict[str, list[str]] = {}
    for path in sorted((PACKAGE / "fsdp").glob("*.py")):
        for name in _implementations(ast.parse(path.read_text())):
            if name.lstrip("_") in ("close", "data_parallel_mean"):
                defined.setdefault(name.lstrip("_"), []).append(path.name)
    assert defined == {"close": ["run.py"], "data_parallel_mean": ["collectives.py"]}


class _Observer:
    def __init__(self) -> None:
        self.checkpoints: list[dict[str, float]] = []

    def on_result(self, run, result) -> None:
        raise AssertionError("not trained here")

    def on_checkpoint(self, run, figures) -> None:
        self.checkpoints.append(figures)


class _Run(run_protocol.RunBase):
    released = ("model", "optimizer", "scheduler")

    def __init__(self, observer=None) -> None:
        import torch

        self.observer = observer
        self.model = torch.nn.Linear(4, 4)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, 1)
        model = self.model
        # what Megatron-FSDP does: a grad hook whose closure holds the wrapper, out of the GC's reach
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(lambda p: model)


def test_close_releases_every_reference_it_names_and_frees_the_model():
    run = _Run()
    model, optimizer = weakref.ref(run.model), weakref.ref(run.optimizer)
    assert set(run.parts()) == {"model", "optimizer"}
    run.close()
    assert (run.model, run.optimizer, run.scheduler) == (None, None, None)
    gc.collect()
    assert model() is None
    assert optimizer() is None  # the hooks' cycle is broken
    run.close()  # again: a no-op


def test_without_close_the_hooked_model_outlives_its_run():
    """The test above can fail: the same run, never closed, keeps its model alive."""
    run = _Run()
    model = weakref.ref(run.model)
    del run
    gc.collect()
    assert model() is not None


def test_checkpoint_figures_reach_the_observer_if_any():
    observer = _Observer()
    _Run(observer).notify_checkpoint(bytes=10.0, save_s=0.5)
    _Run().notify_checkpoint(load_s=1.0)  # no observer: nothing to tell
    assert observer.checkpoints == [{"bytes": 10.0, "save_s": 0.5}]
