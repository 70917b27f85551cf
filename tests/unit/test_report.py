"""The report side on its own (no ranks): sparkline, table, JSON report and schema, JUnit, plot."""

import json
import math
import sys

import jsonschema
import pytest
from run_records import run_record as record

from pytest_megatron_fsdp.reporting.report import (
    BARS,
    NAN_MARK,
    junit_properties,
    plot_figure,
    plot_label,
    report_document,
    report_schema,
    sparkline,
    summary_lines,
    table_lines,
    wrap_id,
    write_json,
    write_plot,
)

SCHEMA = report_schema()  # the package data file, as an installed wheel ships it
NAN = float("nan")


def validate(document):
    jsonschema.validate(document, SCHEMA, cls=jsonschema.Draft202012Validator)


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
    assert line.count(NAN_MARK) == 1
    assert line.index(NAN_MARK) == 57 * 20 // 100


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
    assert "4.9000 → NaN" in bad_row
    assert NAN_MARK * 2 in bad_row
    assert " NaN " in bad_row
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
    assert nan_run["losses"] == [4.9, "NaN"]
    assert nan_run["last_loss"] == "NaN"
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


# -- how much the summary says: -q one line per test, default a table per test, -v the details


def test_quiet_summary_is_one_line_per_test():
    runs = [
        record([4.9, 4.5, 4.2], nodeid="t.py::test_one"),
        record([4.9, 4.4], nodeid="t.py::test_two_with_a_longer_name", strategy="ddp"),
        record([4.9, NAN], nodeid="t.py::test_two_with_a_longer_name", last_loss=NAN),
    ]
    lines = summary_lines(runs, verbosity=-1)
    assert len(lines) == 2
    assert lines[0].startswith("4.9000 → 4.2000  █▄▁")
    assert lines[0].endswith("  t.py::test_one")
    assert lines[1].endswith("  t.py::test_two_with_a_longer_name")
    assert "optim_grads_params +1 run" in lines[1]
    assert "4.9000 → NaN" in lines[1]
    assert NAN_MARK in lines[1]
    assert lines[0].index("ms/step") == lines[1].index("ms/step")  # figures aligned, ids last
    assert "max RSS" not in "\n".join(lines)  # details stay in the tables


def test_default_summary_is_the_table_and_verbose_adds_grad_norms():
    runs = [record([4.9, 4.5, 4.2], grad_norms=[2.0, 1.0, 0.5])]
    assert summary_lines(runs, verbosity=0) == table_lines(runs)
    plain, verbose = table_lines(runs), summary_lines(runs, verbosity=1)
    assert "grad norm" not in "\n".join(plain)
    assert "grad norm first → last" in verbose[1]
    assert "2.000 → 0.500" in verbose[2]
    assert sparkline([2.0, 1.0, 0.5]) in verbose[2].split("2.000 → 0.500")[1]  # the norm's own curve
    assert "2/2" in verbose[2]


def test_plot_names_every_run_in_a_panel_per_test_file():
    pytest.importorskip("matplotlib")
    runs = [
        record([4.9, 4.5], nodeid=f"{'a' if i % 3 else 'b'}/test_f.py::test_x[{i}]", strategy="ddp")
        for i in range(50)
    ]
    runs[7] = record([4.9, NAN], nodeid="a/test_f.py::test_nan")
    fig, single = plot_figure(runs), plot_figure(runs[:1])
    try:
        panels = fig.axes
        assert [ax.get_title(loc="left") for ax in panels] == [  # in the order the files first ran
            "b/test_f.py (17 runs)",
            "a/test_f.py (33 runs)",
        ]
        labels = [t.get_text() for ax in panels for t in ax.get_legend().get_texts()]
        assert sorted(labels) == sorted(plot_label(r) for r in runs)  # every run named, once

        def squeezed(text):
            return "".join(text.split())

        # ... in full: its test (parameters included), strategy and preset, whatever the wrapping
        named = sorted(squeezed(label) for label in labels)
        assert named == sorted(
            squeezed(f"{r.nodeid.split('::', 1)[1]} ({r.strategy}, {r.preset})") for r in runs
        )
        curves = [line for ax in panels for line in ax.get_lines() if not line.get_label().startswith("_")]
        assert len(curves) == 50
        in_a = [line for line in panels[1].get_lines() if not line.get_label().startswith("_")]
        assert len({(line.get_color(), line.get_linestyle()) for line in in_a}) == 33  # no two alike
        # every panel's axes are as wide, however long its legend; a panel is as tall as its legend
        widths = {round(ax.get_position().width * fig.get_size_inches()[0], 6) for ax in panels}
        assert widths == {round(single.axes[0].get_position().width * single.get_size_inches()[0], 6)}
        heights = [ax.get_position().height * fig.get_size_inches()[1] for ax in panels]
        assert heights[1] > heights[0] >= single.axes[0].get_position().height * single.get_size_inches()[1]
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
        plt.close(single)


def test_long_test_ids_wrap_at_separators_and_lose_nothing():
    name = "test_bad_checkpoint_is_refused[directory missing-checkpoint directory does not exist] (ddp, tiny)"
    wrapped = wrap_id(name, 40)
    lines = wrapped.split("\n")
    assert all(len(line) <= 40 for line in lines)
    assert "".join(line.strip() for line in lines).replace(" ", "") == name.replace(" ", "")
    assert lines[0] == "test_bad_checkpoint_is_refused["  # broken after a separator, not mid-word
    assert wrap_id("short (ddp, tiny)", 40) == "short (ddp, tiny)"


def test_plot_png_holds_every_legend_label(tmp_path):
    """Saved with a tight box: the PNG extends to the widest legend label, so none is cut."""
    pytest.importorskip("matplotlib")
    from matplotlib import image

    assert "".join(plot_label(record([4.9], nodeid="t.py::test_" + "x" * 120 + "[param]")).split()).endswith(
        "x[param](optim_grads_params,tiny)"
    )  # the label keeps all of the id

    long_name = "test_" + "x" * 120 + "[param]"
    path = tmp_path / "loss.png"
    write_plot(path, [record([4.9, 4.5], nodeid=f"t.py::{long_name}")])
    fig = plot_figure([record([4.9, 4.5], nodeid=f"t.py::{long_name}")])
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        (text,) = fig.axes[0].get_legend().get_texts()
        label_right = text.get_window_extent(renderer).x1 / fig.dpi  # inches from the figure's left
        tight = fig.get_tightbbox(renderer)
        assert label_right <= tight.x1 + 1e-6
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    _height, width = image.imread(path).shape[:2]
    assert width / 100 >= label_right - tight.x0 - 0.05  # the saved PNG (dpi 100) reaches the label's end
