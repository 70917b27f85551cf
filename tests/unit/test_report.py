"""The report side on its own (no ranks): sparkline, table, JSON report and schema, JUnit, plot."""

import json
import math
import sys
from pathlib import Path

import jsonschema
import pytest

from pytest_megatron_fsdp.reporting.record import RunRecord
from pytest_megatron_fsdp.reporting.report import (
    BARS,
    NAN_MARK,
    junit_properties,
    report_document,
    sparkline,
    table_lines,
    write_json,
    write_plot,
)

SCHEMA = json.loads((Path(__file__).parents[2] / "schemas" / "mfsdp-report.schema.json").read_text())
NAN = float("nan")


def validate(document):
    jsonschema.validate(document, SCHEMA, cls=jsonschema.Draft202012Validator)


def record(losses, nodeid="t.py::test_a", **changes):
    fields = dict(
        nodeid=nodeid,
        platform="cpu",
        preset="tiny",
        strategy="optim_grads_params",
        iterations=len(losses),
        first_loss=losses[0],
        last_loss=losses[-1],
        ms_per_step=40.0,
        world_size=2,
        data_parallel_size=2,
        tokens_per_step=128,
        tokens_per_s=3200.0,
        losses=list(losses),
        grad_norms=[1.5] * len(losses),
        step_times_s=[0.04] * len(losses),
        peak_memory_bytes=400 * 2**20,
        peak_memory_kind="max_rss",
    )
    fields.update(changes)
    return RunRecord(**fields)


def test_sparkline_follows_the_curve():
    assert sparkline([5.0, 4.0, 3.0, 2.0, 1.0]) == "█▆▅▃▁"
    assert sparkline([1.0, 3.0, 2.0]) == BARS[0] + BARS[-1] + "▅"


def test_sparkline_marks_nan_and_infinities_in_place():
    assert sparkline([4.0, 3.0, NAN, 2.0]) == "█▅" + NAN_MARK + "▁"
    assert sparkline([1.0, float("inf"), float("-inf")]) == "▅↑↓"  # a lone finite value sits mid-height
    assert sparkline([NAN, NAN]) == NAN_MARK * 2


def test_downsampled_sparkline_keeps_a_lone_nan_visible():
    values = [10.0 - i / 10 for i in range(100)]
    values[57] = NAN
    line = sparkline(values, width=20)
    assert len(line) == 20
    assert line.count(NAN_MARK) == 1 and line.index(NAN_MARK) == 57 * 20 // 100


def test_table_shows_each_test_with_its_figures_and_nan_visibly():
    good = record([4.9, 4.5, 4.2], nodeid="t.py::test_good", ms_per_step=36.64, tokens_per_s=3493.4)
    bad = record([4.9, NAN, NAN], nodeid="t.py::test_bad", tokens_per_s=NAN)
    lines = table_lines([good, bad])
    text = "\n".join(lines)
    assert lines[0] == "t.py::test_good"
    row = lines[2]
    cells = ("cpu/tiny", "optim_grads_params", " 3 ", "4.9000 → 4.2000", "█▄▁", "36.6", "3493", "400.0 MiB")
    for cell in cells:
        assert cell in row, (cell, row)
    assert "max RSS" in row
    bad_row = lines[lines.index("t.py::test_bad") + 2]
    assert "4.9000 → NaN" in bad_row and NAN_MARK * 2 in bad_row and " NaN " in bad_row
    assert "checkpoint" not in text


def test_table_shows_checkpoint_figures_when_recorded():
    r = record([4.0, 3.0], checkpoint_bytes=3 * 2**20, checkpoint_save_s=0.25, checkpoint_load_s=None)
    assert table_lines([r])[-1] == "  checkpoint: 3.0 MiB, save 0.250 s, load -"


def test_json_report_is_strict_json_with_nan_spelt_out_and_valid(tmp_path):
    runs = [record([4.9, 4.5]), record([4.9, NAN], nodeid="t.py::test_nan", last_loss=NAN)]
    path = tmp_path / "sub" / "report.json"
    write_json(path, report_document(runs, "plain"))

    def no_bare_constants(name):
        raise AssertionError(f"bare {name} in the JSON report")

    document = json.loads(path.read_text(), parse_constant=no_bare_constants)
    validate(document)
    nan_run = document["runs"][1]
    assert nan_run["losses"] == [4.9, "NaN"] and nan_run["last_loss"] == "NaN"
    assert document["runs"][0]["checkpoint"] == {"bytes": None, "save_s": None, "load_s": None}
    assert document["mode"] == "plain"


@pytest.mark.parametrize(
    "breakage",
    [
        lambda run: run.pop("losses"),
        lambda run: run.update(last_loss="nan"),  # only the exact spellings count
        lambda run: run.update(iterations=0),
        lambda run: run.update(step_times_s=[-1.0]),
        lambda run: run.update(peak_memory_bytes="400MB"),
        lambda run: run["checkpoint"].update(bytes=1.5),
        lambda run: run.update(surprise=1),
    ],
)
def test_schema_rejects_broken_reports(breakage):
    document = report_document([record([4.9, 4.5])], "torchrun")
    validate(document)  # valid before the breakage
    breakage(document["runs"][0])
    with pytest.raises(jsonschema.ValidationError):
        validate(document)


def test_junit_properties_name_later_runs_and_spell_nan():
    props = dict(junit_properties(record([4.9, NAN], last_loss=NAN), index=1))
    assert props["mfsdp.run2.last_loss"] == "NaN"
    assert props["mfsdp.run2.iterations"] == "2"
    assert dict(junit_properties(record([4.9, 4.1])))["mfsdp.last_loss"] == "4.1"


def test_plot_is_a_png_when_matplotlib_is_there(tmp_path):
    pytest.importorskip("matplotlib")  # in the dev extra; this test is about the installed case
    path = tmp_path / "loss.png"
    note = write_plot(path, [record([4.9, 4.5, NAN, 4.0])])
    assert note == f"loss plot: {path}"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_note_not_an_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    path = tmp_path / "loss.png"
    note = write_plot(path, [record([4.9, 4.5])])
    assert "matplotlib is not installed" in note
    assert not path.exists()


def test_non_finite_helpers_do_not_hide_values():
    assert math.isnan(record([NAN]).first_loss)
    assert (
        report_document([record([float("inf")], first_loss=float("inf"))], "plain")["runs"][0]["first_loss"]
        == "Infinity"
    )


def test_report_and_metrics_modules_load_without_torch():
    # The plain-pytest parent imports them for the summary; it must stay free of torch and megatron.
    import subprocess

    code = (
        "import sys, pytest_megatron_fsdp.reporting.report, pytest_megatron_fsdp.metrics\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'numpy')]\n"
        "assert not heavy, heavy\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
