"""Showing the recorded runs: the terminal summary, the JSON report, JUnit properties, a PNG plot.

Plain Python (no torch): it runs in the plain-pytest parent as well as in torchrun's rank 0.
Non-finite numbers are never hidden: the table prints ``NaN``/``inf``, the sparkline a ``×``,
and the JSON report (strict JSON, which has no NaN) the strings ``"NaN"``, ``"Infinity"``,
``"-Infinity"``.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.resources
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from .record import RunRecord

if TYPE_CHECKING:
    from matplotlib.ticker import MaxNLocator

SCHEMA_VERSION = 1
#: the JSON report's schema (JSON Schema 2020-12), package data next to this module
SCHEMA_FILE = "mfsdp-report.schema.json"
BARS = "▁▂▃▄▅▆▇█"
#: what the sparkline shows for NaN, +inf and -inf
NAN_MARK, POS_INF_MARK, NEG_INF_MARK = "×", "↑", "↓"
SPARK_WIDTH = 30


def fmt_number(value: Any, spec: str = "") -> str:
    """``format(value, spec)``, but NaN and infinities spelt so they stand out."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return format(value, spec)


def _mark(value: float) -> str | None:
    if math.isnan(value):
        return NAN_MARK
    if math.isinf(value):
        return POS_INF_MARK if value > 0 else NEG_INF_MARK
    return None


def sparkline(values: Sequence[float], width: int = SPARK_WIDTH) -> str:
    """A unicode sparkline of ``values`` (min to max over the finite ones), at most ``width`` wide.

    Longer series are averaged in buckets; a bucket holding a non-finite value shows a mark, so
    downsampling never hides a NaN.
    """
    if not values:
        return ""
    if len(values) > width:
        buckets = [values[i * len(values) // width : (i + 1) * len(values) // width] for i in range(width)]
    else:
        buckets = [[v] for v in values]
    # A NaN or infinity in a bucket carries into its mean, so it is never averaged away.
    points = [sum(bucket) / len(bucket) for bucket in buckets]
    finite = [p for p in points if math.isfinite(p)]
    low, high = (min(finite), max(finite)) if finite else (0.0, 0.0)
    chars = []
    for p in points:
        mark = _mark(p)
        if mark is not None:
            chars.append(mark)
        elif high == low:
            chars.append(BARS[len(BARS) // 2])
        else:
            chars.append(BARS[round((p - low) / (high - low) * (len(BARS) - 1))])
    return "".join(chars)


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


_MEMORY_KIND = {"max_rss": "max RSS", "cuda_max_allocated": "CUDA max allocated"}


def summary_lines(records: Sequence[RunRecord], verbosity: int = 0) -> list[str]:
    """The runs table at pytest's verbosity: ``-q`` one line per test, the default one small table
    per test, ``-v`` that table with the gradient norms and sizes too."""
    if verbosity < 0:
        return compact_lines(records)
    return table_lines(records, details=verbosity > 0)


def compact_lines(records: Sequence[RunRecord]) -> list[str]:
    """One line per test, figures first (aligned) and the test id last: its last run's loss
    (first → last, the curve), speed and what ran; earlier runs of the test are counted, not
    shown (``-v`` shows each)."""
    by_test: dict[str, list[RunRecord]] = {}
    for r in records:
        by_test.setdefault(r.nodeid, []).append(r)
    rows = []
    for nodeid, runs in by_test.items():
        r = runs[-1]
        more = f" +{len(runs) - 1} run{'s' if len(runs) > 2 else ''}" if len(runs) > 1 else ""
        rows.append(
            (
                f"{fmt_number(r.first_loss, '.4f')} → {fmt_number(r.last_loss, '.4f')}",
                sparkline(r.losses, width=12),
                f"{fmt_number(r.ms_per_step, '.1f')} ms/step",
                f"{r.platform}/{r.preset} {r.strategy}{more}",
                nodeid,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))] if rows else []
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def table_lines(records: Sequence[RunRecord], details: bool = False) -> list[str]:
    """One small table per test (a row per training run in it); ``details`` adds the gradient
    norm (first → last, its curve) and the world / data-parallel sizes."""
    header: tuple[str, ...] = (
        "platform",
        "strategy",
        "iters",
        "loss first → last",
        "loss curve",
        "ms/step",
        "tokens/s",
        "peak mem",
    )
    if details:
        header += ("grad norm first → last", "grad norm curve", "world/dp", "tokens/step")
    by_test: dict[str, list[RunRecord]] = {}
    for r in records:
        by_test.setdefault(r.nodeid, []).append(r)
    lines: list[str] = []
    for nodeid, runs in by_test.items():
        rows = [header]
        notes: list[str] = []
        for r in runs:
            memory = fmt_bytes(r.peak_memory_bytes)
            if r.peak_memory_bytes is not None and r.peak_memory_kind:
                memory += f" ({_MEMORY_KIND.get(r.peak_memory_kind, r.peak_memory_kind)})"
            row: tuple[str, ...] = (
                f"{r.platform}/{r.preset}",
                r.strategy,
                str(r.iterations),
                f"{fmt_number(r.first_loss, '.4f')} → {fmt_number(r.last_loss, '.4f')}",
                sparkline(r.losses),
                fmt_number(r.ms_per_step, ".1f"),
                fmt_number(r.tokens_per_s, ".0f"),
                memory,
            )
            if details:
                norms = r.grad_norms or [float("nan")]
                row += (
                    f"{fmt_number(norms[0], '.3f')} → {fmt_number(norms[-1], '.3f')}",
                    sparkline(r.grad_norms),
                    f"{r.world_size}/{r.data_parallel_size}",
                    str(r.tokens_per_step),
                )
            rows.append(row)
            if (
                r.checkpoint_bytes is not None
                or r.checkpoint_save_s is not None
                or r.checkpoint_load_s is not None
            ):
                notes.append(
                    f"checkpoint: {fmt_bytes(r.checkpoint_bytes)}, "
                    f"save {_seconds(r.checkpoint_save_s)}, load {_seconds(r.checkpoint_load_s)}"
                )
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        numeric = {2, 5, 6, 11}
        lines.append(nodeid)
        for row in rows:
            cells = [
                c.rjust(w) if i in numeric else c.ljust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            ]
            lines.append("  " + "  ".join(cells).rstrip())
        lines.extend("  " + note for note in notes)
    return lines


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{fmt_number(value, '.3f')} s"


def _strict(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as strings, visibly, rather than drop them."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, list):
        return [_strict(v) for v in value]
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    return value


def report_schema() -> dict[str, Any]:
    """The JSON report's schema, read from the installed package (wheel, sdist or checkout)."""
    schema: dict[str, Any] = json.loads(
        importlib.resources.files(__package__).joinpath(SCHEMA_FILE).read_text(encoding="utf-8")
    )
    return schema


def report_document(records: Sequence[RunRecord], mode: str) -> dict[str, Any]:
    """The machine-readable report (``report_schema()`` describes it)."""
    runs = []
    for r in records:
        data = dataclasses.asdict(r)
        data["checkpoint"] = {k: data.pop(f"checkpoint_{k}") for k in ("bytes", "save_s", "load_s")}
        runs.append(_strict(data))
    return {
        "schema_version": SCHEMA_VERSION,
        "generated_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": mode,
        "runs": runs,
    }


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")
    tmp.replace(path)  # a reader never sees half a report


def junit_properties(record: RunRecord, index: int = 0) -> list[tuple[str, str]]:
    """Key figures of one run as JUnit ``<property>`` pairs (``mfsdp.runN.`` for a test's later runs)."""
    prefix = "mfsdp." if index == 0 else f"mfsdp.run{index + 1}."
    figures: dict[str, Any] = {
        "platform": record.platform,
        "preset": record.preset,
        "strategy": record.strategy,
        "iterations": record.iterations,
        "first_loss": record.first_loss,
        "last_loss": record.last_loss,
        "ms_per_step": record.ms_per_step,
        "tokens_per_s": record.tokens_per_s,
        "peak_memory_bytes": record.peak_memory_bytes,
    }
    return [(prefix + k, fmt_number(v)) for k, v in figures.items() if v is not None]


#: plot geometry, in inches: the axes of a panel, a legend line, the width of a legend character
PLOT_AXES_WIDTH, PLOT_MIN_AXES_HEIGHT, PLOT_LINE_HEIGHT, PLOT_CHAR_WIDTH = 6.5, 2.6, 0.155, 0.058
#: legend labels wrap at this many characters (continuation lines indented), so none is cut or huge
PLOT_LABEL_WIDTH = 72
#: legend lines per column before a second column opens
PLOT_LINES_PER_COLUMN = 40


def plot_groups(records: Sequence[RunRecord]) -> dict[str, list[RunRecord]]:
    """Runs by test file, in the order they ran: one panel each."""
    groups: dict[str, list[RunRecord]] = {}
    for r in records:
        groups.setdefault(r.nodeid.split("::", 1)[0], []).append(r)
    return groups


def plot_label(record: RunRecord) -> str:
    """A run's legend entry: the test (class and parameters included) and what it ran, never
    shortened; lines longer than :data:`PLOT_LABEL_WIDTH` characters wrap (see :func:`wrap_id`)."""
    test = record.nodeid.split("::", 1)[-1]
    return wrap_id(f"{test} ({record.strategy}, {record.preset})", PLOT_LABEL_WIDTH)


#: where a long test id may break, best first: between words, between parameters, within a name
_BREAKS = (" ", "[]-,(", "_/:.")


def wrap_id(text: str, width: int) -> str:
    """``text`` in lines of at most ``width`` characters, continuation lines indented; each break
    falls after the best separator in the line's second half (a space, then ``[``, ``-``, ...,
    then ``_``), else at the width."""
    lines = []
    while len(text) > width:
        cut = width
        for separators in _BREAKS:
            found = [i + 1 for i, ch in enumerate(text[:width]) if ch in separators and i + 1 > width // 2]
            if found:
                cut = found[-1]
                break
        lines.append(text[:cut].rstrip())
        text = "  " + text[cut:].lstrip()
    return "\n".join([*lines, text])


def write_plot(path: Path, records: Sequence[RunRecord]) -> str:
    """A PNG of every run's loss curve; returns the line to show (a note when matplotlib is absent).

    One panel per test file, each with its own legend beside it, so any number of runs stays
    readable: every curve is drawn and named, and the figure grows to hold the legends (saved
    with a tight bounding box, so no label is cut). Colours and line styles combine so that
    neighbouring curves differ; non-finite losses are marked x on the panel's x axis.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on runners
        import matplotlib.pyplot as plt
    except ImportError:
        return f"no loss plot written to {path}: matplotlib is not installed (pip install matplotlib)"
    fig = plot_figure(records)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return f"loss plot: {path}"


def plot_figure(records: Sequence[RunRecord]) -> Any:
    """The loss plot's matplotlib figure (see :func:`write_plot`); needs matplotlib.

    Laid out in inches, panel by panel: every panel's axes are equally wide, each at least
    :data:`PLOT_MIN_AXES_HEIGHT` and as tall as its legend, and the figure as wide as the widest
    legend needs.
    """
    import matplotlib.pyplot as plt

    groups = plot_groups(records)
    panels = []  # (file, runs, labels, legend columns, panel height)
    for file, runs in groups.items():
        labels = [plot_label(r) for r in runs]
        lines = sum(label.count("\n") + 1 for label in labels)
        columns = -(-lines // PLOT_LINES_PER_COLUMN)
        height = max(PLOT_MIN_AXES_HEIGHT, PLOT_LINE_HEIGHT * -(-lines // columns) + 0.2)
        panels.append((file, runs, labels, columns, height))
    widest = max(max(len(line) for label in p[2] for line in label.split("\n")) for p in panels)
    legend_width = max(p[3] for p in panels) * (widest * PLOT_CHAR_WIDTH + 0.6)
    left, gap, top, space = 0.8, 0.25, 0.85, 0.75  # margins; space: below each panel (x label, title)
    width = left + PLOT_AXES_WIDTH + gap + legend_width
    height = top + sum(p[4] + space for p in panels)
    fig = plt.figure(figsize=(width, height))
    # tab10 is a ListedColormap, whose .colors (a list of RGB triples) the Colormap hints lack
    colors: Sequence[Any] = plt.get_cmap("tab10").colors  # type: ignore[attr-defined]
    styles = ("-", "--", ":", "-.")
    y = height - top
    for file, runs, labels, columns, panel_height in panels:
        y -= panel_height
        ax = fig.add_axes((left / width, y / height, PLOT_AXES_WIDTH / width, panel_height / height))
        y -= space
        for i, (r, label) in enumerate(zip(runs, labels, strict=True)):
            # NaN points leave gaps in the line; mark them on the x axis so they are not hidden.
            xs = list(range(1, len(r.losses) + 1))
            style = styles[(i // len(colors)) % len(styles)]
            (line,) = ax.plot(xs, r.losses, style, marker=".", color=colors[i % len(colors)], label=label)
            bad = [x for x, v in zip(xs, r.losses, strict=True) if not math.isfinite(v)]
            if bad:
                # x in data units, y at the bottom of the axes: visible whatever the finite losses' scale
                ax.plot(
                    bad,
                    [0.0] * len(bad),
                    "x",
                    color=line.get_color(),
                    transform=ax.get_xaxis_transform(),
                    clip_on=False,
                    label="_nolegend_",
                )
        ax.set_title(f"{file} ({len(runs)} run{'s' if len(runs) != 1 else ''})", fontsize=10, loc="left")
        ax.set_xlabel("iteration", fontsize=9)
        ax.set_ylabel("lm loss", fontsize=9)
        # a line plot's default locator is an AutoLocator, a MaxNLocator: it takes integer=
        cast("MaxNLocator", ax.xaxis.get_major_locator()).set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend(
            fontsize=7.5,
            loc="upper left",
            bbox_to_anchor=(1.0 + gap / PLOT_AXES_WIDTH, 1.0),
            borderaxespad=0.0,
            ncol=columns,
            frameon=False,
        )
    fig.suptitle(
        f"megatron-fsdp training runs: {len(records)} run{'s' if len(records) != 1 else ''} "
        "(x on the axis: non-finite loss)",
        fontsize=11,
        x=left / width,
        y=1 - 0.2 / height,
        ha="left",
    )
    return fig


def terminal_summary(
    terminalreporter: Any,
    records: Sequence[RunRecord],
    mode: str,
    json_path: Path | None = None,
    plot_path: Path | None = None,
) -> None:
    """The end-of-session section, and the report files asked for (paths already resolved)."""
    if json_path:
        write_json(json_path, report_document(records, mode))
    if not records and not json_path:
        return
    terminalreporter.section("megatron-fsdp training runs")
    for line in summary_lines(records, getattr(terminalreporter, "verbosity", 0)):
        terminalreporter.write_line(line)
    if not records:
        terminalreporter.write_line("no training runs recorded")
    if json_path:
        terminalreporter.write_line(f"JSON report: {json_path}")
    if plot_path and records:
        terminalreporter.write_line(write_plot(plot_path, records))
