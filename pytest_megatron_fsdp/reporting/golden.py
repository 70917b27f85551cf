"""Golden values in Megatron-LM's format: record a test's training runs, compare a later run with them.

A golden file is what Megatron-LM's functional tests keep beside each test case
(``golden_values_*.json``): one entry per metric, ``{metric: {"start_step", "end_step",
"step_interval", "values": {step: value}}}``, for ``lm loss``, ``num-zeros``, ``mem-allocated-bytes``
and ``iteration-time``. Here there is one file per test (:func:`file_name` turns the node id into its
name) under ``<DIR>/<stack>/<platform>/`` (:func:`golden_path`; the stack is named from the installed
versions, ``fsdp.versions.golden_stack``). A test's first training run gives the metrics their plain
names; its later runs (a DDP baseline built with ``megatron_fsdp_run``, a resumed run, a second
``train()``) are ``run2/lm loss``, ``run3/lm loss`` ... Steps are the run's iteration numbers (a
second ``train()`` of the same run continues its count). Non-finite values are written as the
strings ``"nan"``, ``"inf"``, ``"-inf"`` (strict JSON); as in Megatron-LM, a string compares as
infinity.

How values are compared (:func:`compare`):

* **CPU ranks: exact** on the deterministic metrics, ``lm loss`` and ``num-zeros``: every step must
  be equal to the last bit (Megatron-LM's ``DeterministicTest``; on CPU ranks a run is bitwise
  reproducible for a given stack and thread settings, which torchrun fixes at one thread per rank).
  ``iteration-time`` and ``mem-allocated-bytes`` are recorded but **not compared on CPU ranks**: a
  step's time depends on the machine's load, and the resident set on the allocator and on what ran
  before in the process; no tolerance would make them a fair gate there.
* **GPUs: approximate**, Megatron-LM's ``ApproximateTest`` rules (``np.isclose(actual, golden,
  rtol, atol=0)``): ``lm loss`` rtol 0.05, ``num-zeros`` 0.20, ``mem-allocated-bytes`` 0.05, every
  step; up to ``min(max(N // 100, 1), 50)`` of a metric's N steps may be off. ``iteration-time`` is
  one comparison, of the medians over steps 5-20 (30-45 when the golden run is longer than 25
  steps; failing those, its first 4 steps from the window's start). Megatron-LM errors when no
  step is left; the runs here are short (often under 5 steps), so such a run compares the medians
  of its steps after the first (the warm-up), or of its only step.
* Either way, a metric (or a run) that one side has and the other lacks is an error, as are steps
  the golden file has and the run lacks, or the other way round.

Every failure is one line naming the metric, the step, the expected and the actual value.

Plain Python (numpy for ``isclose`` and ``median``, as Megatron-LM); no pytest, no torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .record import RunRecord

#: the metrics recorded, in Megatron-LM's names, in file order
METRICS = ("lm loss", "num-zeros", "mem-allocated-bytes", "iteration-time")
#: the metrics compared exactly on CPU ranks (deterministic there)
DETERMINISTIC = ("lm loss", "num-zeros")
#: Megatron-LM's approximate rules (tests/functional_tests/python_test_utils/
#: test_pretraining_regular_pipeline.py): rtol per metric, atol 0
APPROXIMATE_RTOL = {"lm loss": 0.05, "num-zeros": 0.20, "mem-allocated-bytes": 0.05, "iteration-time": 0.05}
#: ``iteration-time``: the steady-state window whose medians are compared, and the longer runs' one
STEADY_WINDOW, LONG_RUN_WINDOW, LONG_RUN_STEPS = range(5, 21), range(30, 46), 25
#: the record/compare modes of ``--mfsdp-golden-mode``
MODES = ("compare", "record")
#: a metric of a test's later runs: ``run2/lm loss``
RUN_PREFIX = re.compile(r"^run(\d+)/(.+)$")
#: golden file names are cut to this many characters (plus a hash of the node id)
MAX_NAME = 120

Number = float | int | str


class GoldenFileError(ValueError):
    """A golden file that is not Megatron-LM's format (the message names the file and the field)."""


def allowed_failing_steps(steps: int) -> int:
    """Megatron-LM's allowance for an approximate metric of ``steps`` steps."""
    return min(max(steps // 100, 1), 50)


def file_name(nodeid: str) -> str:
    """The golden file of a test: its node id with every character outside ``[A-Za-z0-9._-]`` as ``_``
    (``tests/functional/test_x.py::test_y[a]`` -> ``tests_functional_test_x.py__test_y_a_.json``); a
    name longer than :data:`MAX_NAME` is cut and ends with a hash of the whole node id."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", nodeid)
    if len(name) > MAX_NAME:
        name = name[:MAX_NAME] + "-" + hashlib.sha1(nodeid.encode()).hexdigest()[:10]
    return name + ".json"


def golden_path(root: Path, stack: str, platform: str, nodeid: str) -> Path:
    """Where a test's golden file lies: ``<root>/<stack>/<platform>/<file_name(nodeid)>``."""
    return root / stack / platform / file_name(nodeid)


def _strict(value: float) -> Number:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _series(record: RunRecord) -> dict[str, list[float]]:
    return {
        "lm loss": [float(v) for v in record.losses],
        "num-zeros": [float(v) for v in record.num_zeros],
        "mem-allocated-bytes": [float(v) for v in record.memory_bytes],
        "iteration-time": [float(v) for v in record.step_times_s],
    }


def metric_name(metric: str, run_index: int) -> str:
    """``metric`` of a test's ``run_index``-th run (0-based): the plain name for the first."""
    return metric if run_index == 0 else f"run{run_index + 1}/{metric}"


def golden_values(records: Sequence[RunRecord]) -> dict[str, dict[str, Any]]:
    """A test's runs as a golden document (Megatron-LM's format). A metric a run did not measure
    (an empty series) is left out, so comparing with it is an error."""
    document: dict[str, dict[str, Any]] = {}
    for index, record in enumerate(records):
        for metric, values in _series(record).items():
            if not values:
                continue
            first = record.first_iteration
            document[metric_name(metric, index)] = {
                "start_step": first,
                "end_step": first + len(values) - 1,
                "step_interval": 1,
                "values": {str(first + i): _strict(v) for i, v in enumerate(values)},
            }
    return document


def dumps(document: Mapping[str, Any]) -> str:
    """The file's text: strict JSON (non-finite values are strings already), one value a line."""
    return json.dumps(document, indent=2, allow_nan=False) + "\n"


def load(path: Path) -> dict[str, dict[str, Any]]:
    """Read and check a golden file; :class:`GoldenFileError` names the file and what is wrong."""
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise GoldenFileError(f"{path}: not a readable JSON file ({exc})") from None
    return check(document, str(path))


def check(document: Any, where: str = "golden values") -> dict[str, dict[str, Any]]:
    """``document`` if it is Megatron-LM's format, else :class:`GoldenFileError`."""
    if not isinstance(document, dict):
        raise GoldenFileError(f"{where}: expected an object of metrics, got {type(document).__name__}")
    for metric, entry in document.items():
        if not isinstance(entry, dict):
            raise GoldenFileError(f"{where}: {metric!r} is not an object")
        for key in ("start_step", "end_step", "step_interval", "values"):
            if key not in entry:
                raise GoldenFileError(f"{where}: {metric!r} has no {key!r}")
        values = entry["values"]
        if not isinstance(values, dict) or not values:
            raise GoldenFileError(f"{where}: {metric!r}: 'values' must be a non-empty object of step: value")
        for step, value in values.items():
            if not str(step).lstrip("-").isdigit():
                raise GoldenFileError(f"{where}: {metric!r}: step {step!r} is not a whole number")
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise GoldenFileError(f"{where}: {metric!r} step {step}: {value!r} is not a number")
    return document


def _number(value: Number | None) -> float:
    """As Megatron-LM: a string ("nan", "inf") and a missing step compare as infinity."""
    return math.inf if value is None or isinstance(value, str) else float(value)


def _show(value: Number | None) -> str:
    return "missing" if value is None else repr(value)


def _steps(entry: Mapping[str, Any]) -> dict[int, Number]:
    return {int(step): value for step, value in entry["values"].items()}


def _run_and_base(name: str) -> tuple[int, str]:
    found = RUN_PREFIX.match(name)
    return (int(found.group(1)), found.group(2)) if found else (1, name)


def compared_metrics(exact: bool) -> tuple[str, ...]:
    """The metrics :func:`compare` checks: the deterministic ones exactly, or all approximately."""
    return DETERMINISTIC if exact else METRICS


def compare(
    golden: Mapping[str, Mapping[str, Any]], actual: Mapping[str, Mapping[str, Any]], exact: bool
) -> list[str]:
    """One line per failure (empty: the run matches). ``exact``: CPU ranks' rule, else the GPUs'.

    Every run either side has is checked for all of :data:`METRICS` being present on both sides
    (a missing metric is an error in both modes); :func:`compared_metrics` are compared.
    """
    failures: list[str] = []
    runs = sorted({_run_and_base(name)[0] for name in (*golden, *actual)})
    for run in runs:
        for metric in METRICS:
            name = metric if run == 1 else f"run{run}/{metric}"
            if name not in actual and name not in golden:
                failures.append(f"{name}: missing from both the golden file and the run")
                continue
            if name not in actual:
                failures.append(f"{name}: missing from the run (the golden file has it)")
                continue
            if name not in golden:
                failures.append(f"{name}: not in the golden file (the run has it; record it again)")
                continue
            if metric not in compared_metrics(exact):
                continue
            if metric == "iteration-time":
                failures.extend(_compare_median(name, _steps(golden[name]), _steps(actual[name])))
            else:
                failures.extend(
                    _compare_steps(name, metric, _steps(golden[name]), _steps(actual[name]), exact)
                )
    unknown = sorted(n for n in {*golden, *actual} if _run_and_base(n)[1] not in METRICS)
    failures.extend(f"{name}: not a metric golden values know ({', '.join(METRICS)})" for name in unknown)
    return failures


def _compare_steps(
    name: str, metric: str, golden: dict[int, Number], actual: dict[int, Number], exact: bool
) -> list[str]:
    steps = sorted(golden)
    rtol = 0.0 if exact else APPROXIMATE_RTOL[metric]
    expected = np.array([_number(golden[s]) for s in steps])
    got = np.array([_number(actual.get(s)) for s in steps])
    close = np.isclose(got, expected, rtol=rtol, atol=0)
    off = [s for s, ok in zip(steps, close, strict=True) if not ok]
    failures: list[str] = []
    if exact:
        rule = "exact"
        failing = off
    else:
        allowed = allowed_failing_steps(len(steps))
        rule = f"rtol {rtol:g}; {len(off)} of {len(steps)} steps off, {allowed} allowed"
        failing = off if len(off) > allowed else []
    failures.extend(
        f"{name} step {s}: expected {_show(golden[s])}, actual {_show(actual.get(s))} ({rule})"
        for s in failing
    )
    extra = sorted(set(actual) - set(golden))
    if extra:
        failures.append(
            f"{name} steps {_span(extra)}: expected none (the golden file has steps {_span(steps)}), "
            f"actual {len(extra)} more"
        )
    return failures


def _span(steps: Sequence[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0])


def median_steps(golden: Mapping[int, Number]) -> list[int]:
    """The steps whose ``iteration-time`` medians are compared (see the module's docstring)."""
    finite = [s for s, v in sorted(golden.items()) if not isinstance(v, str) and math.isfinite(v)]
    if not finite:
        return []
    window = STEADY_WINDOW if finite[-1] <= LONG_RUN_STEPS else LONG_RUN_WINDOW
    chosen = [s for s in finite if s in window] or [s for s in finite if s >= window.start][:4]
    return chosen or finite[1:] or finite


def _compare_median(name: str, golden: dict[int, Number], actual: dict[int, Number]) -> list[str]:
    steps = median_steps(golden)
    if not steps:
        return [f"{name}: the golden file has no finite value"]
    expected = float(np.median([_number(golden[s]) for s in steps]))
    got = float(np.median([_number(actual.get(s)) for s in steps]))
    rtol = APPROXIMATE_RTOL["iteration-time"]
    if bool(np.isclose(got, expected, rtol=rtol, atol=0)):
        return []
    return [f"{name} median of steps {_span(steps)}: expected {expected!r}, actual {got!r} (rtol {rtol:g})"]


def describe_mode(exact: bool) -> str:
    compared = ", ".join(compared_metrics(exact))
    if exact:
        return f"exact on CPU ranks: {compared}; iteration-time and mem-allocated-bytes not compared"
    return f"approximate (Megatron-LM's rtol per metric): {compared}"


def record_or_compare(
    root: Path, stack: str, nodeid: str, records: Sequence[RunRecord], mode: str, write: bool = True
) -> list[str]:
    """What ``--mfsdp-golden`` does after a test passed: ``record`` writes its golden file (when
    ``write``: one rank writes), ``compare`` reads it and returns the failures, a heading first
    (empty: nothing to report). A test that recorded no training run has no golden file; in
    compare mode, one that has a golden file must record runs."""
    if mode not in MODES:
        raise ValueError(f"golden mode {mode!r}: choose one of {', '.join(MODES)}")
    platform = records[0].platform if records else "cpu"
    path = golden_path(root, stack, platform, nodeid)
    if mode == "record":
        if records and write:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(path.name + ".partial")
            partial.write_text(dumps(golden_values(records)))
            partial.replace(path)
        return []
    if not records:
        if path.exists():
            return [f"golden values: {path} holds this test's runs, but it recorded none this time"]
        return []
    if not path.exists():
        return [
            f"golden values: no file for this test: {path} (record it with --mfsdp-golden-mode=record, "
            "or make golden)"
        ]
    try:
        expected = load(path)
    except GoldenFileError as exc:
        return [f"golden values: {exc}"]
    exact = platform == "cpu"
    failures = compare(expected, golden_values(records), exact)
    if not failures:
        return []
    return [f"golden values differ from {path} ({describe_mode(exact)}):", *failures]
