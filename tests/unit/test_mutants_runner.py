"""bench/mutants: the catalogue applies to the stack it was written for, an edit is undone exactly,
and a catalogue that no longer fits says which mutant and why (no torch, no ranks)."""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

import pytest

from bench.mutants import catalogue, run


def _versions() -> tuple[str, str]:
    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return version("megatron-core"), version("megatron-fsdp")


def test_the_catalogue_is_large_and_covers_every_category():
    assert len(catalogue.MUTANTS) >= 25
    assert {m.category for m in catalogue.MUTANTS} == set(catalogue.CATEGORIES)
    assert all(m.doc.strip() and m.files for m in catalogue.MUTANTS)
    assert len({m.name for m in catalogue.MUTANTS}) == len(catalogue.MUTANTS)
    # both entry points: megatron-core's files and both copies of Megatron-FSDP
    files = {f for m in catalogue.MUTANTS for f in m.files}
    assert any(f.startswith(catalogue.STANDALONE) for f in files)
    assert any(f.startswith(catalogue.VENDORED) for f in files)
    assert any(f.startswith(catalogue.MCORE) and not f.startswith(catalogue.VENDORED) for f in files)


def _has_v2() -> bool:
    from pytest_megatron_fsdp.fsdp import versions

    return versions.megatron_fsdp_v2_problem() is None


@pytest.mark.skipif(
    _versions() != ("0.19.2", "0.6.1") and not _has_v2(),
    reason="the catalogue is written for megatron-core 0.19.2 + megatron-fsdp 0.6.1 and for Megatron-LM main "
    "(megatron-core with V2); megatron-fsdp 0.6.1 cannot run beside megatron-core 0.16.1",
)
def test_every_applicable_edit_matches_exactly_once_on_the_installed_stack(tmp_path):
    """On whatever stack runs the unit tests (0.19.2 / 0.6.1, or a Megatron-LM main checkout): no
    mutant whose code exists there is left without an edit that fits, in the runner's own copy."""
    root = run.site_root()
    shadow = run.make_shadow(root, tmp_path)
    assert run.check_catalogue(shadow, list(catalogue.MUTANTS)) == []


@pytest.mark.skipif(
    _versions() != ("0.19.2", "0.6.1"),
    reason="the stack without V2: megatron-core 0.19.2 + megatron-fsdp 0.6.1 (newest stack)",
)
def test_on_0_19_2_the_v2_mutants_are_not_applicable_and_the_others_are(tmp_path):
    shadow = run.make_shadow(run.site_root(), tmp_path)
    not_applicable = {m.name: run.resolve(shadow, m).not_applicable for m in catalogue.MUTANTS}
    v2 = {m.name for m in catalogue.MUTANTS if m.needs is catalogue.V2}
    assert len(v2) >= 8
    assert {name for name, why in not_applicable.items() if why} >= v2
    assert all(not_applicable[name] == catalogue.V2.why for name in v2)
    # the first 37 (written for this stack) all apply
    assert not any(not_applicable[m.name] for m in catalogue.MUTANTS[:37])


@pytest.mark.skipif(not _has_v2(), reason="megatron-core without Megatron-FSDP V2 (0.19.2 and older)")
def test_with_v2_installed_every_mutant_applies(tmp_path):
    """Megatron-LM main (d98e8a64dd or later, V2 in megatron-core): the V2 mutants, the replays of
    fixes on main and the first 37 (through their per-stack variants) all apply; Megatron-Bridge's only
    where Bridge is installed."""
    shadow = run.make_shadow(run.site_root(), tmp_path)
    has_bridge = (shadow / catalogue.BRIDGE).is_dir()
    expected = {
        m.name: None if has_bridge or not m.files[0].startswith(catalogue.BRIDGE) else "bridge"
        for m in catalogue.MUTANTS
    }
    found = {m.name: run.resolve(shadow, m).not_applicable for m in catalogue.MUTANTS}
    assert {name: why and "bridge" for name, why in found.items()} == expected


def _fake_site(tmp_path: Path) -> Path:
    (tmp_path / "megatron_fsdp").mkdir()
    (tmp_path / "megatron_fsdp" / "f.py").write_text("x = 1 / n\ny = 2\n")
    return tmp_path


def test_an_edit_that_does_not_fit_is_named_with_its_count(tmp_path):
    site = _fake_site(tmp_path)
    missing = catalogue.Mutant("gone", "c", ("megatron_fsdp/f.py",), "z = 3", "z = 4", "d")
    twice = catalogue.Mutant("twice", "c", ("megatron_fsdp/f.py",), " = ", " == ", "d")
    assert run.check_catalogue(site, [missing, twice]) == [
        "gone: no edit matches exactly once in every file (old text occurs 0 times in megatron_fsdp/f.py)",
        "twice: no edit matches exactly once in every file (old text occurs 2 times in megatron_fsdp/f.py)",
    ]


def test_a_mutant_whose_code_is_not_in_the_stack_is_not_applicable_with_the_reason(tmp_path):
    """A file the stack does not have, or a ``needs`` text it does not contain (V2 on 0.19.2, a fix
    a release predates): not applicable, which is not a problem of the catalogue."""
    site = _fake_site(tmp_path)
    nofile = catalogue.Mutant("nofile", "c", ("megatron_fsdp/g.py",), "a", "b", "d")
    needs = catalogue.Needs("megatron_fsdp/f.py", "class V2(", "no V2 here")
    v2 = catalogue.Mutant("v2", "c", ("megatron_fsdp/f.py",), "z = 3", "z = 4", "d", needs=needs)
    assert run.resolve(site, nofile).not_applicable == "not in this stack: megatron_fsdp/g.py"
    assert run.resolve(site, v2).not_applicable == "no V2 here"
    assert run.check_catalogue(site, [nofile, v2]) == []
    # where the needed code exists, the edit must fit
    (site / "megatron_fsdp" / "f.py").write_text("class V2(\n")
    assert run.resolve(site, v2).not_applicable is None
    assert run.check_catalogue(site, [v2]) == [
        "v2: no edit matches exactly once in every file (old text occurs 0 times in megatron_fsdp/f.py)"
    ]


def test_a_per_stack_variant_is_used_where_the_text_moved(tmp_path):
    site = _fake_site(tmp_path)
    moved = catalogue.Mutant(
        "moved",
        "c",
        ("megatron_fsdp/f.py",),
        "x = 1 / m",
        "x = 1.0",
        "d",
        variants=(("x = 1 / n", "x = 2.0"),),
    )
    assert run.resolve(site, moved).edit == ("x = 1 / n", "x = 2.0")
    assert run.check_catalogue(site, [moved]) == []
    with run.Applied(site, moved):
        assert (site / "megatron_fsdp" / "f.py").read_text() == "x = 2.0\ny = 2\n"


def test_not_applicable_mutants_are_left_out_of_the_kill_rate():
    def outcome(name: str, status: str) -> run.Outcome:
        return run.Outcome(name, "c", status, None, None, 0.0)

    outcomes = [outcome("a", "killed"), outcome("b", "survived"), outcome("c", run.NOT_APPLICABLE)]
    assert run.kill_rate(outcomes) == (1, 2, 0.5)
    assert run.kill_rate([outcome("c", run.NOT_APPLICABLE)]) == (0, 0, 0.0)


def test_an_editable_checkouts_standalone_package_is_the_vendored_copy_edited_once(tmp_path, monkeypatch):
    """Megatron-LM main installed editable: ``megatron_fsdp`` is megatron-core's vendored directory. The
    copy keeps it so (a link), and a mutant of both copies edits that one file once."""
    root = tmp_path / "site"
    vendored = root / catalogue.VENDORED
    vendored.mkdir(parents=True)
    (vendored / "f.py").write_text("x = 1 / n\n")
    monkeypatch.setattr(run, "standalone_dir", lambda _root: vendored.resolve())
    shadow = run.make_shadow(root, tmp_path / "scratch")
    assert (shadow / "megatron_fsdp").is_symlink()
    assert (shadow / "megatron_fsdp" / "f.py").resolve() == (shadow / catalogue.VENDORED / "f.py").resolve()
    mutant = catalogue.Mutant("m", "c", catalogue.both("f.py"), "1 / n", "1.0", "d")
    assert run.check_catalogue(shadow, [mutant]) == []
    with run.Applied(shadow, mutant):
        assert (shadow / "megatron_fsdp" / "f.py").read_text() == "x = 1.0\n"
    assert (shadow / catalogue.VENDORED / "f.py").read_text() == "x = 1 / n\n"
    assert (vendored / "f.py").read_text() == "x = 1 / n\n"  # the installed file is never edited


def test_an_applied_mutant_is_undone_to_the_byte_and_the_mtime(tmp_path):
    site = _fake_site(tmp_path)
    path = site / "megatron_fsdp" / "f.py"
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    before = path.read_bytes(), path.stat().st_mtime_ns
    mutant = catalogue.Mutant("m", "c", ("megatron_fsdp/f.py",), "1 / n", "1.0", "d")
    with run.Applied(site, mutant):
        assert path.read_text() == "x = 1.0\ny = 2\n"
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before  # the copied bytecode stays valid


def test_the_first_failure_of_a_junit_report_names_the_killer(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase classname="tests.functional.test_a" name="test_ok"/>'
        '<testcase classname="tests.functional.test_a" name="test_bad[x]">'
        '<failure message="AssertionError: iteration 2 loss 1.0 != 2.0&#10;more">tb</failure>'
        "</testcase></testsuite></testsuites>"
    )
    assert run.first_failure(junit) == (
        "tests/functional/test_a.py::test_bad[x]",
        "AssertionError: iteration 2 loss 1.0 != 2.0",
    )


def test_a_rank_set_failure_is_reported_with_the_tracebacks_error_line(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase classname="tests.functional.test_a" name="test_bad">'
        '<failure message="failed on ranks 0, 1 (same error)">x = 1&#10;E   ValueError: boom&#10;y</failure>'
        "</testcase></testsuite></testsuites>"
    )
    assert run.first_failure(junit)[1] == "failed on ranks 0, 1 (same error): ValueError: boom"


def test_every_probe_names_a_test_of_its_suite():
    for m in catalogue.MUTANTS:
        if m.probe is None:
            continue
        path, _, name = m.probe.partition("::")
        source = (run.REPO / m.suite / path).read_text()
        assert f"def {name.split('[')[0]}(" in source, f"{m.name}: probe {m.probe} names no test"


def test_a_probe_that_kills_decides_and_one_that_passes_leaves_the_verdict_to_the_suite():
    probed = catalogue.Mutant("m", "c", ("f.py",), "a", "b", "d", probe="test_x.py::test_y")
    calls: list[list[str]] = []

    def runs(*verdicts: run.Verdict):
        queue = list(verdicts)

        def fake(paths: list[str]) -> run.Verdict:
            calls.append(paths)
            return queue.pop(0)

        return fake

    killed = ("killed", "test_x.py::test_y", "boom", 3.0)
    assert run.judge(probed, ["suite"], runs(killed)) == ("killed", "test_x.py::test_y", "boom", 3.0, True)
    assert calls == [[str(Path("tests/functional/test_x.py::test_y"))]]
    calls.clear()
    upstream = catalogue.Mutant(
        "u", "c", ("f.py",), "a", "b", "d", suite=catalogue.UPSTREAM_CODE_SUITE, probe="test_x.py::test_y"
    )
    run.judge(upstream, ["suite"], runs(killed))
    assert calls == [[str(Path("tests/upstream_code/test_x.py::test_y"))]]
    calls.clear()
    suite_kill = ("killed", "test_z.py::test_w", "later", 10.0)
    verdict = run.judge(probed, ["suite"], runs(("survived", None, None, 3.0), suite_kill))
    assert verdict == ("killed", "test_z.py::test_w", "later", 13.0, False)
    assert calls[1] == ["suite"]
    calls.clear()
    verdict = run.judge(probed, ["suite"], runs(("survived", None, None, 5.0)), use_probe=False)
    assert verdict == ("survived", None, None, 5.0, None)
    assert calls == [["suite"]]
