"""Version gates: each known upstream bug is present exactly on the releases that have it, and the
wrapper check survives megatron-core's FullyShardedDataParallel becoming a factory (upstream main)."""

from __future__ import annotations

import sys
import types

import pytest

from pytest_megatron_fsdp.fsdp import versions

# (bug, versions that have it, versions that do not): from the upstream fixes the reasons cite.
EXPECTED = [
    (versions.NO_SHARD_PARAM_SYNC, ["0.16.1", "0.17.0", "0.18.0rc3"], ["0.18.0", "0.19.2"]),
    (versions.OPTIM_OVERLAP_DOUBLE_COUNT, ["0.16.1"], ["0.17.0", "0.19.2"]),
    (
        versions.OPTIM_SYNC_DOUBLE_REDUCE,
        ["0.19.0", "0.19.2", "0.19.2+local", "0.20.0.dev5", "0.20.0rc2"],
        ["0.16.1", "0.18.0", "0.19.0rc1", "0.20.0", "0.20.0+d98e8a6", "0.20.1"],
    ),
    (versions.FSDP2_FINISH_GRAD_SYNC, ["0.16.1", "0.18.0"], ["0.19.0", "0.19.2"]),
    (
        versions.FULLY_SHARD_EAGER_OPTIMIZER_STEP,
        ["0.6.0", "0.6.1", "0.7.0.dev0"],
        ["0.5.9", "0.7.0rc0", "0.7.0rc1", "0.7.0", "0.7.0rc0+gitabc"],
    ),
]


@pytest.mark.parametrize(("bug", "present", "absent"), EXPECTED, ids=lambda v: getattr(v, "reason", "")[:40])
def test_known_bug_ranges(bug, present, absent):
    assert [bug.present(v) for v in present] == [True] * len(present)
    assert [bug.present(v) for v in absent] == [False] * len(absent)
    assert "PR #" in bug.reason or "issue #" in bug.reason  # every reason cites upstream


def test_versions_order_as_pep_440_with_pre_dev_and_local_releases():
    parse = versions.parse_version
    # the hand-written tuple parser this replaced read "0.20.0rc2" as (0, 20, 2)
    assert parse("0.19.2") < parse("0.20.0rc2") < parse("0.20.0")
    assert parse("0.20.0.dev1") < parse("0.20.0a1") < parse("0.20.0rc0") < parse("0.20.0rc10")
    assert parse("0.20.0") < parse("0.20.0+d98e8a6") < parse("0.20.0.post1") < parse("0.20.1rc0")
    assert parse("0.20.0+d98e8a6").public == "0.20.0"
    assert parse("not installed") is None
    assert parse("main") is None
    assert str(versions.megatron_core_version()) == versions.package_version("megatron-core")


# the edges of one range, first="0.19", fixed_in="0.20.0": the first version has the bug, the fixing
# one does not; pre-releases sort below their release (so 0.19.0rc1 predates the bug and 0.20.0rc1
# still has it), a local version sorts with its public one
EDGES = [
    ("0.18.9", False),
    ("0.19.0rc1", False),
    ("0.19", True),
    ("0.19.0", True),
    ("0.19.0+abc", True),
    ("0.19.99", True),
    ("0.20.0.dev0", True),
    ("0.20.0rc1", True),
    ("0.20.0", False),
    ("0.20.0+abc", False),
    ("0.20.0.post1", False),
    ("1.0", False),
]


@pytest.mark.parametrize(("version", "has_it"), EDGES)
def test_a_range_at_its_edges(version, has_it):
    bug = versions.KnownBug("upstream bug (PR #1)", first="0.19", fixed_in="0.20.0")
    assert bug.present(version) is has_it
    assert bug.present(versions.parse_version(version)) is has_it


def test_a_fix_first_seen_in_a_pre_release_covers_the_later_ones():
    bug = versions.KnownBug("upstream bug (PR #1)", first="0.6", fixed_in="0.7.0rc0", package="megatron-fsdp")
    assert [bug.present(v) for v in ("0.6.1", "0.7.0.dev3", "0.7.0rc0", "0.7.0rc1", "0.7.0")] == [
        True,
        True,
        False,
        False,
        False,
    ]


def test_an_unfixed_bug_and_a_missing_or_unversioned_package():
    bug = versions.KnownBug("upstream bug (PR #1)", fixed_in=None, first="0.16")
    assert bug.present("0.16.0")
    assert bug.present("99.0")
    assert not bug.present("0.15.9")
    assert not bug.present("not installed")
    assert not bug.present("main")
    missing = versions.KnownBug("upstream bug (PR #1)", fixed_in=None, package="no-such-distribution-here")
    assert not missing.present()


def test_a_registry_entry_with_a_malformed_version_fails_at_import():
    with pytest.raises(ValueError, match=r"KnownBug.fixed_in='0.20-main' is no PEP 440 version"):
        versions.KnownBug("upstream bug (PR #1)", fixed_in="0.20-main")
    with pytest.raises(ValueError, match=r"KnownBug.first='x'"):
        versions.KnownBug("upstream bug (PR #1)", fixed_in=None, first="x")


def test_tensor_parallel_bug_needs_a_missing_transformer_engine(monkeypatch):
    bug = versions.TENSOR_PARALLEL_WITHOUT_TE
    monkeypatch.setattr(versions, "transformer_engine_available", lambda: False)
    assert bug.present("0.16.1")
    assert not bug.present("0.18.0")
    monkeypatch.setattr(versions, "transformer_engine_available", lambda: True)
    assert not bug.present("0.16.1")


def test_wrapper_types_of_a_class_and_of_a_factory(monkeypatch):
    class FullyShardedDataParallel:  # up to 0.19: a class
        pass

    assert versions.megatron_fsdp_wrapper_types(FullyShardedDataParallel) == (FullyShardedDataParallel,)

    # upstream main: a factory beside the classes it returns
    adapter = types.ModuleType("fake_mcore_fsdp_adapter")

    class FullyShardedDataParallelV1:
        pass

    class FullyShardedDataParallelV2:
        pass

    def factory(*args, **kwargs):
        return FullyShardedDataParallelV2()

    factory.__module__ = adapter.__name__
    adapter.FullyShardedDataParallelV1 = FullyShardedDataParallelV1
    adapter.FullyShardedDataParallelV2 = FullyShardedDataParallelV2
    adapter.FullyShardedDataParallel = factory
    monkeypatch.setitem(sys.modules, adapter.__name__, adapter)
    wrappers = versions.megatron_fsdp_wrapper_types(factory)
    assert wrappers == (FullyShardedDataParallelV1, FullyShardedDataParallelV2)
    assert isinstance(factory(), wrappers)

    lonely = types.ModuleType("fake_lonely")
    monkeypatch.setitem(sys.modules, lonely.__name__, lonely)
    factory.__module__ = lonely.__name__
    with pytest.raises(TypeError, match="wrapper layout is unknown"):
        versions.megatron_fsdp_wrapper_types(factory)


# -- Megatron-LM's training package, wherever the import system finds it ----------------------------

#: a finder as pip's editable install of a Megatron-LM checkout writes it (setuptools'
#: ``__editable___megatron_core_*_finder.py``, reduced): it maps ``megatron.training`` to the checkout,
#: and the namespace package ``megatron`` lists no directory, only a placeholder path
EDITABLE_FINDER = """
import sys
from importlib.machinery import ModuleSpec
from importlib.util import spec_from_file_location
from pathlib import Path

MAPPING = {MAPPING!r}
PLACEHOLDER = "__editable__.megatron_core-0.20.0.finder.__path_hook__"


class _EditableFinder:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname == "megatron":
            spec = ModuleSpec(fullname, None, is_package=True)
            spec.submodule_search_locations = [PLACEHOLDER]
            return spec
        for package, location in MAPPING.items():
            if fullname == package or fullname.startswith(package + "."):
                candidate = Path(location, *fullname.split(".")[len(package.split(".")):])
                init = candidate / "__init__.py"
                if init.exists():
                    where = [str(candidate)]
                    return spec_from_file_location(fullname, init, submodule_search_locations=where)
                module = candidate.with_suffix(".py")
                return spec_from_file_location(fullname, module) if module.exists() else None
        return None


def _path_hook(path):
    if path != PLACEHOLDER:
        raise ImportError
    return _EditableFinder


def install():
    sys.meta_path.append(_EditableFinder)
    sys.path_hooks.append(_path_hook)
"""

#: run in a Python without site-packages (-S): only the repo, ``packaging`` and the stand-in tree
DETECT = """
import sys
sys.path[:0] = {paths!r}
if {editable!r}:
    import standin_editable_finder
    standin_editable_finder.install()
from pytest_megatron_fsdp.fsdp import versions
fields = versions.megatron_config_fields("DistributedDataParallelConfig")
print(versions.megatron_lm_training_installed(), "megatron.training" in sys.modules, sorted(fields or ()))
"""


def _stand_in_checkout(root, with_checkpointing: bool = True):
    """A Megatron-LM checkout's layout: ``megatron`` without ``__init__.py`` (a namespace package),
    ``megatron/core`` and ``megatron/training``, whose ``__init__`` must never run at detection."""
    (root / "megatron" / "core").mkdir(parents=True)
    (root / "megatron" / "core" / "__init__.py").write_text("raise RuntimeError('megatron.core imported')\n")
    (root / "megatron" / "core" / "distributed").mkdir()
    (root / "megatron" / "core" / "distributed" / "distributed_data_parallel_config.py").write_text(
        "class DistributedDataParallelConfig:\n    use_megatron_fsdp: bool = False\n"
    )
    training = root / "megatron" / "training"
    training.mkdir()
    (training / "__init__.py").write_text("raise RuntimeError('megatron.training imported')\n")
    if with_checkpointing:
        (training / "checkpointing.py").write_text("raise RuntimeError('checkpointing imported')\n")
    return root


def _detect(tmp_path, checkout, editable: bool) -> str:
    import subprocess
    from pathlib import Path

    import packaging

    deps = tmp_path / "deps"
    deps.mkdir(exist_ok=True)
    if not (deps / "packaging").exists():
        (deps / "packaging").symlink_to(Path(packaging.__file__).parent)
    paths = [str(Path(__file__).resolve().parents[2]), str(deps)]
    if editable:
        finders = tmp_path / "finders"
        finders.mkdir(exist_ok=True)
        mapping = {"megatron.core": str(checkout / "megatron" / "core")}
        if (checkout / "megatron" / "training").exists():
            mapping["megatron.training"] = str(checkout / "megatron" / "training")
        (finders / "standin_editable_finder.py").write_text(
            EDITABLE_FINDER.replace("{MAPPING!r}", repr(mapping))
        )
        paths.append(str(finders))
    else:
        paths.append(str(checkout))
    done = subprocess.run(
        [sys.executable, "-S", "-c", DETECT.format(paths=paths, editable=editable)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("editable", [True, False], ids=["editable", "directory-on-path"])
def test_megatron_lm_training_is_found_where_it_is_importable(tmp_path, editable):
    checkout = _stand_in_checkout(tmp_path / "Megatron-LM")
    # found, megatron.training not imported (its __init__ raises), and megatron-core's config
    # fields read from the same checkout (the --mfsdp-set check)
    assert _detect(tmp_path, checkout, editable) == "True False ['use_megatron_fsdp']"


@pytest.mark.parametrize("editable", [True, False], ids=["editable", "directory-on-path"])
def test_megatron_lm_training_is_not_found_where_it_is_missing(tmp_path, editable):
    without_checkpointing = _stand_in_checkout(tmp_path / "a", with_checkpointing=False)
    assert _detect(tmp_path, without_checkpointing, editable) == "False False ['use_megatron_fsdp']"
    core_only = tmp_path / "b"
    (core_only / "megatron" / "core").mkdir(parents=True)
    (core_only / "megatron" / "core" / "__init__.py").write_text("")
    assert _detect(tmp_path, core_only, editable) == "False False []"


# -- a strict xfail that passes: what the failure says -------------------------------------------


def test_a_known_bug_that_no_longer_reproduces_says_so_and_what_to_change(monkeypatch):
    monkeypatch.setattr(versions, "package_version", lambda name: "0.20.0rc2+d98e8a6")
    monkeypatch.setattr(versions, "package_source", lambda name: "-e /src/Megatron-LM@d98e8a6")
    line = versions.no_longer_reproduces(versions.OPTIM_SYNC_DOUBLE_REDUCE)
    assert line == (
        "known bug optim_sync_double_reduce no longer reproduces with megatron-core 0.20.0rc2+d98e8a6 "
        "(-e /src/Megatron-LM@d98e8a6): the test passed where the registry expects it to fail; if this "
        "megatron-core has the upstream fix, set fixed_in='0.20.0rc2' (now '0.20.0') for "
        "optim_sync_double_reduce in pytest_megatron_fsdp/fsdp/versions.py"
    )
    monkeypatch.setattr(versions, "package_version", lambda name: "0.6.1")
    monkeypatch.setattr(versions, "package_source", lambda name: None)  # a registry release
    line = versions.no_longer_reproduces(versions.SWIGLU_HANDLER_LOOKUP)
    assert line.startswith("known bug swiglu_handler_lookup no longer reproduces with megatron-core 0.6.1: ")
    assert "set fixed_in='0.6.1' for swiglu_handler_lookup" in line
    assert "(now" not in line
    assert "\n" not in line


def test_package_source_reads_pep_610_records(monkeypatch, tmp_path):
    from importlib import metadata

    class Distribution:
        record: str | None = None

        def read_text(self, name):
            assert name == "direct_url.json"
            return self.record

    dist = Distribution()
    monkeypatch.setattr(metadata, "distribution", lambda name: dist)
    assert versions.package_source("megatron-core") is None  # from an index: no record
    dist.record = '{"url": "file:///wheels/megatron_core-0.20.0-py3-none-any.whl", "archive_info": {}}'
    assert versions.package_source("megatron-core") == "/wheels/megatron_core-0.20.0-py3-none-any.whl"
    snapshot = tmp_path / "Megatron LM"  # no git work tree (an exported snapshot)
    snapshot.mkdir()
    dist.record = (
        f'{{"url": "file://{snapshot.as_posix().replace(" ", "%20")}", "dir_info": {{"editable": true}}}}'
    )
    assert versions.package_source("megatron-core") == f"-e {snapshot}, no git commit"
    dist.record = (
        '{"url": "https://github.com/NVIDIA/Megatron-LM", '
        '"vcs_info": {"vcs": "git", "commit_id": "d98e8a6f00"}}'
    )
    assert versions.package_source("megatron-core") == "git+https://github.com/NVIDIA/Megatron-LM@d98e8a6f0"


def test_package_source_names_the_commit_of_a_git_checkout(monkeypatch, tmp_path):
    import shutil
    import subprocess
    from importlib import metadata

    if shutil.which("git") is None:
        pytest.fail("git is needed to build the stand-in checkout")
    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (checkout / "setup.py").write_text("")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    commit = subprocess.run(
        [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()

    class Distribution:
        def read_text(self, name):
            return f'{{"url": "file://{checkout}", "dir_info": {{}}}}'

    monkeypatch.setattr(metadata, "distribution", lambda name: Distribution())
    assert versions.package_source("megatron-core") == f"{checkout}@{commit}"
    # megatron-fsdp's source: a subdirectory of the checkout
    src = checkout / "megatron" / "core" / "distributed" / "fsdp" / "src"
    src.mkdir(parents=True)
    Distribution.read_text = lambda self, name: f'{{"url": "file://{src}", "dir_info": {{"editable": true}}}}'
    assert versions.package_source("megatron-fsdp") == f"-e {src}@{commit}"


@pytest.mark.parametrize(
    ("installed", "problem"),
    [
        ({"megatron-bridge": "0.6.2", "megatron-core": "0.19.2"}, None),
        ({"megatron-core": "0.16.1"}, "megatron-bridge is not installed"),  # the floor
        ({"megatron-bridge": "0.6.2", "megatron-core": "0.18.0"}, "needs megatron-core >= 0.19, found 0.18"),
        ({"megatron-bridge": "0.6.2", "megatron-core": "0.20.0rc2+d98e8a6"}, None),  # a Megatron-LM main
    ],
)
def test_megatron_bridge_problem_says_in_one_line_why_bridge_is_not_used(monkeypatch, installed, problem):
    monkeypatch.setattr(versions, "package_version", lambda name: installed.get(name, "not installed"))
    found = versions.megatron_bridge_problem()
    if problem is None:
        assert found is None
    else:
        assert found is not None
        assert problem in found
        assert "\n" not in found
