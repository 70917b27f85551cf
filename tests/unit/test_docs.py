"""The docs cannot silently drift from the code: links resolve, options and fixtures are documented,
and docs/known-bugs.md is what the generator writes from the known-bug registry.

In-process and fast: no rank sets, no subprocesses, no torch import.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *DOCS.glob("*.md")])
#: words of a development log that user docs must not use (the checklist greps the first four)
DATED_LANGUAGE = re.compile(
    r"earlier rounds?|this round|today's tree|this 2-core machine|\btoday\b|this machine|\bthe seed\b|"
    r"\bthe seed's\b|development session",
    re.IGNORECASE,
)

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t#]*$", re.MULTILINE)


def _without_code_blocks(text: str) -> str:
    return _FENCE.sub("", text)


def _prose(text: str) -> str:
    """The text with code blocks removed and code spans reduced to their content's letters, so a
    link target inside a code span is not taken for a link."""
    return _CODE_SPAN.sub(lambda m: "code", _without_code_blocks(text))


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: its text without markup, lower case, punctuation dropped
    (letters, digits, ``_``, ``-`` and spaces kept), spaces turned into hyphens."""
    text = _CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a page's headings give, duplicates numbered as GitHub numbers them (-1, -2, ...)."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for match in _HEADING.finditer(_without_code_blocks(path.read_text(encoding="utf-8"))):
        base = github_anchor(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(path: Path) -> list[str]:
    """The relative links and anchors of a page that lead nowhere, each as ``target: why``."""
    problems = []
    for target in _LINK.findall(_prose(path.read_text(encoding="utf-8"))):
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            continue  # an absolute URL (https:, mailto:): not checked offline
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            problems.append(f"{target}: no such file {linked}")
            continue
        if anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            problems.append(f"{target}: no heading of {linked.name} gives #{anchor}")
    return problems


def test_the_pages_exist() -> None:
    expected = {
        "README.md", "how-it-works.md", "test-api.md", "options.md", "checkpoints.md",
        "metrics-and-reports.md", "cpu-mode-vs-gpus.md", "gpu-runners.md", "troubleshooting.md",
        "known-bugs.md", "development.md", "measurements.md", "upstream-suites.md", "gpu-only-causes.md",
    }  # fmt: skip
    assert expected <= {page.name for page in DOCS.glob("*.md")}
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    unlisted = sorted(name for name in expected - {"README.md"} if f"]({name})" not in index)
    assert not unlisted, f"docs/README.md does not link {unlisted}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    assert not broken_links(page), f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(
        broken_links(page)
    )


def test_the_link_check_sees_a_broken_link_and_a_broken_anchor(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text(
        "# Other page\n\n## A `code` heading (with parens)\n", encoding="utf-8"
    )
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n[ok](other.md#a-code-heading-with-parens) [ok](#title) [gone](missing.md) "
        "[bad](other.md#nope) [bad](#nope) `[in code](missing-too.md)` [web](https://example.com/x#y)\n"
        "```\n[in a block](missing-three.md)\n```\n",
        encoding="utf-8",
    )
    problems = broken_links(page)
    assert [problem.split(":")[0] for problem in problems] == ["missing.md", "other.md#nope", "#nope"]


def test_github_anchors() -> None:
    assert (
        github_anchor("Several rank sets at once on one node (`-n K`)")
        == "several-rank-sets-at-once-on-one-node--n-k"
    )
    assert github_anchor("`--mfsdp-set` is checked whole, before any rank starts") == (
        "--mfsdp-set-is-checked-whole-before-any-rank-starts"
    )
    assert github_anchor("The standalone Megatron-FSDP: `fully_shard_run`") == (
        "the-standalone-megatron-fsdp-fully_shard_run"
    )


def test_every_option_is_documented() -> None:
    from pytest_megatron_fsdp.options import OPTIONS

    page = (DOCS / "options.md").read_text(encoding="utf-8")
    missing = [
        f"{option.name}: {spelling}"
        for option in OPTIONS.values()
        for spelling in (option.flag, option.env, option.ini)
        if f"`{spelling}`" not in page
    ]
    assert not missing, f"docs/options.md does not document: {missing}"


def test_every_documented_option_exists() -> None:
    from pytest_megatron_fsdp.options import OPTIONS

    flags = {option.flag for option in OPTIONS.values()}
    stale = sorted(
        {
            f"{page.name}: {flag}"
            for page in PAGES
            for flag in re.findall(r"(?<![#\w-])--mfsdp-[a-z-]*[a-z]", page.read_text())
        }
        - {f"{page.name}: {flag}" for page in PAGES for flag in flags}
    )
    assert not stale, f"options the docs name but the registry does not have: {stale}"


def _precedence_rows() -> dict[str, str]:
    """docs/options.md's precedence table: first cell -> the chain it states (header and rule left out)."""
    page = (DOCS / "options.md").read_text(encoding="utf-8")
    start = page.index("## Precedence\n")
    section = page[start : page.index("\n## ", start)]
    rows = re.findall(r"^\| (.+?) \| (.+?) \|$", section, re.MULTILINE)
    return {first: chain for first, chain in rows if first != "option" and set(first) != {"-"}}


def _stated(labels: list[str]) -> str:
    return " > ".join(f"`{label}`" for label in labels)


def test_the_precedence_table_states_each_options_chain() -> None:
    """The table is the one place the chains are stated in prose: each option whose chain is not the
    session default has its row, the same sources in the same order as the data beside the option
    (options.OPTIONS, which value_of walks), and the row for every other option states that default."""
    from pytest_megatron_fsdp.options import OPTIONS, SESSION_CHAIN, Option

    rows = _precedence_rows()
    assert rows.pop("every other option") == _stated(Option("<name>", "", str).chain_labels())
    expected = {
        f"`{option.flag}`": _stated(option.chain_labels())
        for option in OPTIONS.values()
        if option.chain != SESSION_CHAIN
    }
    assert expected, "no option has a chain of its own: the table would state nothing"
    assert rows == expected


def _is_fixture(value: object) -> bool:
    fixture_type = getattr(importlib.import_module("_pytest.fixtures"), "FixtureFunctionDefinition", None)
    if fixture_type is not None:
        return isinstance(value, fixture_type)
    return hasattr(value, "_pytestfixturefunction")  # pytest before 8.4


def plugin_fixtures(config: pytest.Config) -> set[str]:
    """The public fixtures the plugin registers: every fixture definition on a plugin object (module or
    instance) of this package that pytest holds, the entry module included even where it is not loaded."""
    objects: list[object] = [importlib.import_module("pytest_megatron_fsdp.plugin")]
    objects += config.pluginmanager.get_plugins()
    names = set()
    for plugin in objects:
        owner = plugin.__name__ if isinstance(plugin, types.ModuleType) else type(plugin).__module__
        if not owner.startswith("pytest_megatron_fsdp"):
            continue
        namespace = vars(plugin) if isinstance(plugin, types.ModuleType) else vars(type(plugin))
        for attribute, value in namespace.items():
            if _is_fixture(value):
                name = getattr(value, "name", None) or attribute
                if not name.startswith("_"):
                    names.add(name)
    return names


def test_every_fixture_is_documented(request: pytest.FixtureRequest) -> None:
    fixtures = plugin_fixtures(request.config)
    assert {"dist_env", "megatron_fsdp_run", "checkpoint_dir"} <= fixtures, fixtures  # the scan finds them
    page = (DOCS / "test-api.md").read_text(encoding="utf-8")
    missing = sorted(
        name for name in fixtures if not re.search(rf"^\| `{re.escape(name)}` \|", page, re.MULTILINE)
    )
    assert not missing, f"docs/test-api.md has no row in its fixtures table for: {missing}"


def _generator() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("generate_known_bugs", DOCS / "generate_known_bugs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_known_bugs_page_is_generated_from_the_registry() -> None:
    expected = _generator().render(ROOT)
    actual = (DOCS / "known-bugs.md").read_text(encoding="utf-8")
    assert actual == expected, (
        "docs/known-bugs.md disagrees with KNOWN_BUGS in fsdp/versions.py: run `make docs`"
    )


def test_every_known_bug_has_a_section_and_a_test() -> None:
    from pytest_megatron_fsdp.fsdp import versions

    generator = _generator()
    constants = {id(value): name for name, value in vars(versions).items() if name.isupper()}
    assert set(versions.KNOWN_BUGS) <= anchors(DOCS / "known-bugs.md")
    untested = [
        key
        for key, bug in versions.KNOWN_BUGS.items()
        if not generator.tests_showing(ROOT, constants.get(id(bug), key.upper()), key)
    ]
    assert not untested, f"known bugs no test refers to: {untested}"


def _causes_generator() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(
        "generate_gpu_only_causes", DOCS / "generate_gpu_only_causes.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_only_causes_page_is_generated_from_the_causes_and_the_recorded_run() -> None:
    expected = _causes_generator().render(ROOT)
    actual = (DOCS / "gpu-only-causes.md").read_text(encoding="utf-8")
    assert actual == expected, (
        "docs/gpu-only-causes.md disagrees with CAUSES in foreign/gpu_only.py or docs/gpu-only-tests.json: "
        "run `make docs`"
    )


def test_the_recorded_run_names_only_maintained_causes() -> None:
    """A cause renamed or dropped in CAUSES leaves its recorded tests under no section of the page:
    record a run again (`make upstream`, `make upstream-record`) or rename the key in the data file."""
    from pytest_megatron_fsdp.foreign.gpu_only import CAUSES

    data = json.loads((DOCS / "gpu-only-tests.json").read_text(encoding="utf-8"))
    assert data["recorded"][:4].isdigit()
    assert data["stack"]["packages"]["torch"]
    assert set(data["causes"]) <= {cause.name for cause in CAUSES}


def test_a_recorded_summary_lists_each_gpu_only_test_under_its_cause() -> None:
    generator = _causes_generator()
    run = {
        "world_size": 2, "tests_given": ["tests/a"], "finished": True, "stopped": None, "wall_s": 12.5,
        "totals": {"passed": 1, "gpu-only": 2, "skipped": 1, "xfailed": 0, "failed": 0, "error": 0},
        "tests": {
            "tests/a/test_x.py::test_te": {"outcome": "gpu-only", "cause": "Transformer Engine"},
            "tests/a/test_y.py": {"outcome": "gpu-only", "cause": "Transformer Engine"},
            "tests/a/test_x.py::test_ok": {"outcome": "passed"},
            "tests/a/test_x.py::test_8": {"outcome": "skipped", "reason": "needs 8 GPUs"},
        },
    }  # fmt: skip
    stopped = run | {"world_size": 4, "finished": False, "stopped": "wall limit 9 s reached"}
    git = {"commit": "d98e8a64dd12", "date": "2026-08-22"}
    summary = {
        "recorded": "2026-12-04T10:00:00+00:00",
        "stack": {
            "checkouts": {"MEGATRON_LM": {"path": "/m", "git": git}},
            "python": "3.12.1", "packages": {"torch": "2.14.1"},
            "cpu": {"model": "Intel Xeon", "cores": 2, "flags": ["avx512_bf16"]},
        },
        "runs": {"ws2": run, "ws4": stopped},
    }  # fmt: skip
    data = generator.record(summary)
    assert data["causes"] == {
        "Transformer Engine": {
            "tests/a/test_x.py::test_te": ["ws2", "ws4"],
            "tests/a/test_y.py": ["ws2", "ws4"],
        }
    }
    page = generator.render(ROOT, data)
    assert (
        "The recorded run (2026-12-04): the MEGATRON_LM checkout (d98e8a64dd of 2026-08-22), Python 3.12.1, "
        "torch 2.14.1, 2-core Intel Xeon (avx512_bf16)." in page
    )
    assert "- `ws4`: world size 4, `tests/a`: did not finish (wall limit 9 s reached); 1 passed" in page
    assert "| `GPU-only: Transformer Engine` | `transformer_engine` cannot be imported; " in page
    section = page[page.index("## Transformer Engine") :]
    assert "covered in the recorded run: 2:\n\n- `tests/a/test_x.py::test_te` (ws2, ws4)\n" in section
    assert "test_ok" not in page
    assert "test_8" not in page
    assert "## mamba_ssm (CUDA kernels)" in page  # a cause no test showed still has its section
    assert "Upstream tests it covered in the recorded run: 0." in page[page.index("## mamba_ssm") :]


#: a merge left unresolved: git's opening and closing markers, each at the start of a line with the
#: side's name (the middle one, seven "=", could be a heading's underline)
CONFLICT_MARKER = re.compile(r"^(<{7}|>{7}) \S", re.MULTILINE)


@pytest.mark.parametrize(
    "path",
    [*PAGES, ROOT / "Makefile", ROOT / "pyproject.toml", ROOT / ".ci" / "run"],
    ids=lambda path: path.relative_to(ROOT).as_posix(),
)
def test_no_unresolved_merge(path: Path) -> None:
    # a conflict once sat in README.md through a CI run: Markdown renders it without complaint
    hits = [match.group(0) for match in CONFLICT_MARKER.finditer(path.read_text(encoding="utf-8"))]
    assert not hits, f"{path.relative_to(ROOT)} holds an unresolved merge: {hits}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_no_dated_language(page: Path) -> None:
    hits = [
        f"{number}: {line.strip()}"
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1)
        if DATED_LANGUAGE.search(line)
    ]
    assert not hits, (
        f"{page.relative_to(ROOT)} speaks of its own development (date the fact instead):\n" + "\n".join(hits)
    )


def test_readme_front_door() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail into docs/"
    first_block = lines[lines.index("```bash") + 1 : lines.index("```")]
    assert lines.index("```bash") <= 2, "the set-up commands come right after the title"
    assert [line.split()[:2] for line in first_block] == [["make", "smoke"], ["make", "test"]]
    first_screen = "\n".join(lines[:55])
    for needle in (
        "pip install",
        "@pytest.mark.distributed",
        "pytest tests/",
        "pytest -n auto",
        "torch.distributed.run",
        "TORCH_SPEC=",
    ):
        assert needle in first_screen, f"{needle!r} is not in README.md's first 55 lines"


def test_the_test_api_page_shows_the_markers_declared_signature() -> None:
    """The distributed marker's arguments are declared once (options.MARKER_KEYWORDS); the page
    that documents the marker shows that declaration, not a copy that can drift."""
    from pytest_megatron_fsdp.options import MARKER_SIGNATURE

    assert f"`@pytest.mark.{MARKER_SIGNATURE}`" in (DOCS / "test-api.md").read_text(encoding="utf-8")
