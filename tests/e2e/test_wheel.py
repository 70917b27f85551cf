"""The wheel a release would publish: what it ships, what its metadata says, and that it works on its own.

The wheel is built from a copy of the source (pip, without build isolation: nothing is downloaded) and
installed into a fresh venv that sees only what the wheel's metadata asks for: the distributions its
requirements name, followed through their own requirements, are linked in from the venv running this
test (torch alone is gigabytes; it is not installed twice). An example suite then runs there from a
directory outside the checkout, with no PYTHONPATH: the plugin loads through its pytest11 entry point,
from the wheel, and runs a 2-rank test. pytest-xdist is not among the requirements, so that run also
shows the plugin works without it.
"""

from __future__ import annotations

import ast
import email.parser
import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from email.message import Message
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "pytest_megatron_fsdp"
DIST_INFO_LICENSE = "licenses/LICENSE"
SCHEMA = "pytest_megatron_fsdp/reporting/mfsdp-report.schema.json"


def source_version() -> str:
    """``__version__`` as setuptools reads it for the wheel: a string literal in the package's
    ``__init__.py``, read with ``ast`` (setuptools then needs no import, so no torch, to build)."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
        ):
            assert isinstance(node.value, ast.Constant), (
                "pytest_megatron_fsdp.__version__ must be a string literal (setuptools reads the source)"
            )
            assert isinstance(node.value.value, str), (
                "pytest_megatron_fsdp.__version__ must be a string literal (setuptools reads the source)"
            )
            return node.value.value
    raise AssertionError("pytest_megatron_fsdp/__init__.py assigns no __version__")


def outside_env() -> dict[str, str]:
    """This environment without what would put the checkout on ``sys.path`` (PYTHONPATH: its
    ``*.egg-info`` would even pass for an installed pytest-megatron-fsdp) or steer pytest."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PYTEST_", "VIRTUAL_ENV"))}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy of the source (the build leaves build/ and *.egg-info behind)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(PACKAGE, src / PACKAGE.name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "--check-build-dependencies",
            "--wheel-dir",
            str(out),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=outside_env(),
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (built,) = out.glob("*.whl")
    return built


def wheel_metadata(wheel: Path) -> Message:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(z.read(name).decode())


def test_the_wheel_ships_the_package_its_data_and_the_license(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (dist_info,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        # every module of the source (a subpackage missing from [tool.setuptools] packages is missing here)
        modules = {
            p.relative_to(REPO).as_posix() for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts
        }
        assert modules - names == set()
        assert "pytest_megatron_fsdp/py.typed" in names  # PEP 561: the type hints count for type checkers
        assert z.read(SCHEMA) == (REPO / SCHEMA).read_bytes()
        license_text = z.read(f"{dist_info}/{DIST_INFO_LICENSE}")
        assert license_text == (REPO / "LICENSE").read_bytes()
        assert license_text.decode().split()[:3] == ["Apache", "License", "Version"]
        entry_points = z.read(f"{dist_info}/entry_points.txt").decode()
    assert "[pytest11]\nmegatron_fsdp = pytest_megatron_fsdp.plugin" in entry_points


def test_the_wheel_metadata(wheel: Path) -> None:
    meta = wheel_metadata(wheel)
    assert meta["Name"] == "pytest-megatron-fsdp"
    assert meta["Version"] == source_version()
    assert wheel.name.startswith(f"pytest_megatron_fsdp-{source_version()}-py3-none-any")
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    classifiers = meta.get_all("Classifier")
    assert "Framework :: Pytest" in classifiers
    assert "Typing :: Typed" in classifiers
    assert not [c for c in classifiers if c.startswith("License ::")]  # the SPDX expression says it
    requires = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    unconditional = {r.name for r in requires if r.marker is None}
    assert {"torch", "megatron-core", "pytest"} <= unconditional
    assert "pytest-xdist" not in unconditional  # an extra: the plugin runs without it
    assert "xdist" in meta.get_all("Provides-Extra")


def _requirement_closure(requirements: list[Requirement]) -> list[importlib.metadata.Distribution]:
    """The installed distributions ``requirements`` need, followed through their own requirements
    (markers evaluated for this interpreter, extras followed where requested)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    followed: set[tuple[str, frozenset[str]]] = set()
    todo = [(r, "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        try:
            dist = importlib.metadata.distribution(req.name)
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here: `pip check` in the new venv names it
        key = canonicalize_name(dist.metadata["Name"])
        if (key, frozenset(req.extras)) in followed:
            continue
        followed.add((key, frozenset(req.extras)))
        found[key] = dist
        own = [Requirement(r) for r in dist.requires or []]
        todo += [(r, e) for r in own for e in ("", *sorted(req.extras))]
    return list(found.values())


def _link_requirements(wheel: Path, farm: Path) -> list[str]:
    """Links the top-level files of every distribution the wheel requires into ``farm``; returns the
    lines of their ``.pth`` files (an editable install's finder), their relative paths made absolute."""
    requirements = [Requirement(r) for r in wheel_metadata(wheel).get_all("Requires-Dist")]
    pth_lines: list[str] = []
    for dist in _requirement_closure(requirements):
        assert dist.files is not None, f"{dist.metadata['Name']}: no RECORD, its files are unknown"
        for top in sorted({f.parts[0] for f in dist.files if f.parts[0] not in ("..", "__pycache__")}):
            path = Path(dist.locate_file(top))
            if top.endswith(".pth"):
                for line in path.read_text().splitlines():
                    if line.startswith(("import ", "import\t")) or not line.strip() or line.startswith("#"):
                        pth_lines.append(line)
                    else:
                        pth_lines.append(str((path.parent / line).resolve()))
            elif not (farm / top).exists() and path.exists():
                (farm / top).symlink_to(path)
    return pth_lines


@pytest.fixture(scope="module")
def wheel_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed and, beside it, only what the wheel's metadata requires."""
    root = tmp_path_factory.mktemp("wheel-venv")
    venv, farm = root / "venv", root / "requirements"
    farm.mkdir()
    env = outside_env()
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120, env=env
    )
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        ).stdout.strip()
    )
    (site / "wheel-requirements.pth").write_text(
        "\n".join([str(farm), *_link_requirements(wheel, farm)]) + "\n"
    )
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    install = subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    assert (site / f"pytest_megatron_fsdp-{source_version()}.dist-info").is_dir(), install.stdout
    # every requirement of every distribution the venv sees is met: the wheel's metadata is enough
    check = subprocess.run([*pip, "check"], capture_output=True, text=True, timeout=300, env=env)
    assert check.returncode == 0, check.stdout + check.stderr
    return venv


EXAMPLE = """
import importlib.metadata
import importlib.util
import os
import sys

import pytest

VENV = os.path.realpath(os.environ["WHEEL_VENV"])


def inside_venv(path):
    return os.path.realpath(path).startswith(VENV + os.sep)


def test_the_plugin_comes_from_the_wheel(request):
    plugin = request.config.pluginmanager.get_plugin("megatron_fsdp")  # its pytest11 entry point's name
    assert plugin is not None and inside_venv(plugin.__file__), plugin
    assert os.path.realpath(sys.prefix) == VENV
    import pytest_megatron_fsdp
    from pytest_megatron_fsdp.reporting.report import report_schema

    assert importlib.metadata.version("pytest-megatron-fsdp") == pytest_megatron_fsdp.__version__
    assert report_schema()["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert importlib.util.find_spec("xdist") is None  # not required, not there


@pytest.mark.distributed(world_size=2, timeout=240)
def test_trains_on_two_ranks(megatron_fsdp_run, run_config):
    import pytest_megatron_fsdp

    assert inside_venv(pytest_megatron_fsdp.__file__) and os.environ["RANK"] in ("0", "1")
    megatron_fsdp_run(run_config).train(2)
"""


def test_the_installed_wheel_runs_an_example_suite(wheel_venv: Path, tmp_path: Path) -> None:
    (tmp_path / "test_example.py").write_text(EXAMPLE)
    env = outside_env()
    env["WHEEL_VENV"] = str(wheel_venv)
    result = subprocess.run(
        [
            str(wheel_venv / "bin" / "python"),
            "-m",
            "pytest",
            "-v",
            "-p",
            "no:cacheprovider",
            "--mfsdp-platform=cpu",
            "test_example.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert "2 passed" in result.stdout
    assert str(REPO) not in result.stdout  # nothing ran from the checkout
