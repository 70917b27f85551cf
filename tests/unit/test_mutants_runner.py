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


@pytest.mark.skipif(
    _versions() != ("0.19.2", "0.6.1"),
    reason="the catalogue is written for megatron-core 0.19.2 + megatron-fsdp 0.6.1 (newest stack)",
)
def test_every_edit_matches_exactly_once_on_the_stack_it_was_written_for():
    root = run.site_root()
    assert run.check_catalogue(root, list(catalogue.MUTANTS)) == []


def _fake_site(tmp_path: Path) -> Path:
    (tmp_path / "megatron_fsdp").mkdir()
    (tmp_path / "megatron_fsdp" / "f.py").write_text("x = 1 / n\ny = 2\n")
    return tmp_path


def test_an_edit_that_does_not_fit_is_named_with_its_count(tmp_path):
    site = _fake_site(tmp_path)
    missing = catalogue.Mutant("gone", "c", ("megatron_fsdp/f.py",), "z = 3", "z = 4", "d")
    twice = catalogue.Mutant("twice", "c", ("megatron_fsdp/f.py",), " = ", " == ", "d")
    nofile = catalogue.Mutant("nofile", "c", ("megatron_fsdp/g.py",), "a", "b", "d")
    assert run.check_catalogue(site, [missing, twice, nofile]) == [
        "gone: its old text occurs 0 times in megatron_fsdp/f.py (must be once)",
        "twice: its old text occurs 2 times in megatron_fsdp/f.py (must be once)",
        "nofile: megatron_fsdp/g.py is not installed",
    ]


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


def test_every_probe_names_a_test_of_the_functional_suite():
    for m in catalogue.MUTANTS:
        if m.probe is None:
            continue
        path, _, name = m.probe.partition("::")
        source = (run.FUNCTIONAL / path).read_text()
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
    suite_kill = ("killed", "test_z.py::test_w", "later", 10.0)
    verdict = run.judge(probed, ["suite"], runs(("survived", None, None, 3.0), suite_kill))
    assert verdict == ("killed", "test_z.py::test_w", "later", 13.0, False)
    assert calls[1] == ["suite"]
    calls.clear()
    verdict = run.judge(probed, ["suite"], runs(("survived", None, None, 5.0)), use_probe=False)
    assert verdict == ("survived", None, None, 5.0, None)
    assert calls == [["suite"]]
