"""The pytest plugins users commonly have installed, read where a distributed test must honour them.

A distributed test runs in ranks the controller launches and watches, not in the process whose
pytest-timeout, pytest-rerunfailures or pytest-randomly would act on it, and the controller's
``tryfirst`` runtest hook runs before theirs. So this module reads their settings (their documented
options, ini keys and markers; none of their internals) and the controller applies them:

* pytest-timeout (``--timeout``, ``PYTEST_TIMEOUT``, ini ``timeout``, ``@pytest.mark.timeout``): one
  more source of a distributed test's timeout; its own timer does not run around the controller's
  wait, nor inside the ranks (the plugins' ``pytest_timeout_set_timer`` hooks say so);
* pytest-rerunfailures (``--reruns``, ``--force-reruns``, ini ``reruns``, ``@pytest.mark.flaky``,
  ``--only-rerun``, ``--rerun-except``, ``--rerun-exclude-path``, the delays): reruns of a
  distributed test, each attempt in a fresh rank set;
* pytest-randomly (``--randomly-seed``): the seed every rank uses;
* pytest-cov (``pytest --cov``): its running measurement reaches the launched ranks.

The places their timeout and rerun settings take in this plugin's precedence chains are the
:class:`ForeignLevel` constants here (``PYTEST_TIMEOUT_MARKER`` ...), which ``options.OPTIONS`` puts
in its chains. Plain pytest and the standard library only: nothing here imports the plugins themselves.
"""

from __future__ import annotations

import copy
import hashlib
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from .torchrun_env import TorchrunEnv

#: the names the plugins register under (their pytest11 entry points): ``-p no:<name>`` disables them
TIMEOUT_PLUGIN = "timeout"
RERUNFAILURES_PLUGIN = "rerunfailures"
RANDOMLY_PLUGIN = "randomly"
#: pytest-cov's plugin object (registered at load, measuring once configured with --cov)
PYTEST_COV_PLUGIN = "_cov"


#: where in its own precedence another plugin's setting comes from: a per-test marker, a session
#: option (flag, env, ini), or pytest-rerunfailures' --force-reruns (which overrides every marker)
FORCED, MARKER, OPTION = "forced", "marker", "option"


@dataclass(frozen=True)
class ForeignSetting:
    """A setting another plugin gives a test, read by that plugin's own rules."""

    #: the value, parsed; None where the plugin says "none" (pytest-timeout's 0): it then imposes none
    value: Any
    #: FORCED, MARKER or OPTION: which level of its own precedence gave it
    level: str
    #: where it came from, one of its :class:`ForeignLevel`'s labels (e.g. "pytest-timeout --timeout")
    source: str


@dataclass(frozen=True)
class ForeignLevel:
    """One place in an option's precedence chain (``options.OPTIONS``) for another plugin's setting:
    the plugin's reading of the test, where it comes from ``level`` of the plugin's own precedence.
    The plugin's rules pick one reading (pytest-timeout's marker before its options); the chain
    says where that reading sits among this plugin's own sources."""

    level: str
    #: the sources this place covers, highest first, as a setting from it is labelled
    labels: tuple[str, ...]
    read: Callable[[pytest.Item], ForeignSetting | None]

    def setting(self, item: pytest.Item) -> ForeignSetting | None:
        """The plugin's setting for ``item`` where it comes from this level and imposes a value."""
        found = self.read(item)
        if found is None or found.level != self.level or found.value is None:
            return None
        return found


def _active(config: pytest.Config, name: str) -> bool:
    return config.pluginmanager.has_plugin(name)


# -- pytest-timeout -------------------------------------------------------------------------------


def _seconds(raw: Any, where: str) -> float | None:
    """pytest-timeout's value as seconds; None where it means "no timeout" (absent, 0 or less)."""
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise pytest.UsageError(
            f"{where}: invalid timeout {raw!r}: must be a number of seconds (pytest-timeout's setting)"
        ) from None
    return value if value > 0 else None


def pytest_timeout_setting(item: pytest.Item) -> ForeignSetting | None:
    """pytest-timeout's timeout for ``item`` in seconds, by its own precedence (its marker, then
    ``--timeout``, ``PYTEST_TIMEOUT``, ini ``timeout``); None where it gives none or is not active
    (its marker then means nothing)."""
    config = item.config
    if not _active(config, TIMEOUT_PLUGIN):
        return None
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        raw = marker.kwargs.get("timeout", marker.args[0] if marker.args else None)
        where = f"{item.nodeid}: @pytest.mark.timeout"
        return ForeignSetting(_seconds(raw, where), MARKER, PYTEST_TIMEOUT_MARKER.labels[0])
    flag, env, ini = PYTEST_TIMEOUT_OPTIONS.labels
    for label, where, raw in (
        (flag, "--timeout", config.getoption("timeout", None)),
        (env, "environment variable PYTEST_TIMEOUT", os.environ.get("PYTEST_TIMEOUT") or None),
        (ini, "ini option timeout", config.getini("timeout") or None),
    ):
        if raw is not None:
            return ForeignSetting(_seconds(raw, where), OPTION, label)
    return None


#: pytest-timeout's places in the timeout's chain: its marker among the per-test markers, its
#: session options below this plugin's
PYTEST_TIMEOUT_MARKER = ForeignLevel(MARKER, ("@pytest.mark.timeout",), pytest_timeout_setting)
PYTEST_TIMEOUT_OPTIONS = ForeignLevel(
    OPTION,
    ("pytest-timeout --timeout", "pytest-timeout PYTEST_TIMEOUT", "pytest-timeout ini timeout"),
    pytest_timeout_setting,
)


# -- pytest-rerunfailures -------------------------------------------------------------------------


def _ini_int(config: pytest.Config, ini: str) -> int | None:
    try:
        return int(config.getini(ini))
    except (TypeError, ValueError):
        return None


def _excluded(item: pytest.Item) -> bool:
    """``--rerun-exclude-path``: the test's file lies under one of the paths given."""
    paths = item.config.getoption("rerun_exclude_path", None) or []
    return any(item.path.is_relative_to(item.config.rootpath / path) for path in paths)


def rerunfailures_count(item: pytest.Item) -> ForeignSetting | None:
    """The reruns pytest-rerunfailures gives ``item`` by its own rules (``--force-reruns`` over
    ``@pytest.mark.flaky(reruns=N)`` over ``--reruns`` over ini ``reruns``; ``--reruns-mode=append``
    adds the global count to the marker's), or None where it gives none."""
    config = item.config
    if not _active(config, RERUNFAILURES_PLUGIN) or _excluded(item):
        return None
    forced = config.getoption("force_reruns", None)
    if forced is not None:
        return ForeignSetting(forced, FORCED, RERUNFAILURES_FORCED.labels[0])
    flag, ini = RERUNFAILURES_OPTIONS.labels
    global_count, global_source = config.getoption("reruns", None), flag
    if global_count is None:
        global_count, global_source = _ini_int(config, "reruns"), ini
    flaky = item.get_closest_marker("flaky")
    if flaky is not None:
        count = flaky.kwargs.get("reruns", flaky.args[0] if flaky.args else 1)
        source = RERUNFAILURES_MARKER.labels[0]
        if config.getoption("reruns_mode", None) == "append" and global_count is not None:
            count += global_count
            source += f" + {global_source} (--reruns-mode=append)"
        return ForeignSetting(count, MARKER, source)
    if global_count is not None:
        return ForeignSetting(global_count, OPTION, global_source)
    return None


#: pytest-rerunfailures' places in the reruns' chain: --force-reruns above every marker, its marker
#: among the per-test markers, its session options below this plugin's
RERUNFAILURES_FORCED = ForeignLevel(FORCED, ("pytest-rerunfailures --force-reruns",), rerunfailures_count)
RERUNFAILURES_MARKER = ForeignLevel(MARKER, ("@pytest.mark.flaky",), rerunfailures_count)
RERUNFAILURES_OPTIONS = ForeignLevel(
    OPTION, ("pytest-rerunfailures --reruns", "pytest-rerunfailures ini reruns"), rerunfailures_count
)


def refuse_flaky_condition(item: pytest.Item) -> None:
    """``@pytest.mark.flaky(condition=...)`` on a distributed test: a bool is honoured; a string or a
    callable may look at the exception, which lives in the ranks, so it is refused in one line."""
    flaky = item.get_closest_marker("flaky")
    if flaky is None or "condition" not in flaky.kwargs or isinstance(flaky.kwargs["condition"], bool):
        return
    raise pytest.UsageError(
        f"{item.nodeid}: @pytest.mark.flaky(condition={flaky.kwargs['condition']!r}) on a distributed "
        "test: only a bool condition is supported (the exception is raised in the ranks, not here); "
        "use condition=<bool>, or --only-rerun / --rerun-except (or flaky(only_rerun=...)) to choose "
        "which failures are rerun"
    )


def refuse_rerunfailures_under_torchrun(items: list[pytest.Item], refuse_flaky_marks: bool = True) -> None:
    """A torchrun-mode rank session runs every test under its watchdog, where pytest-rerunfailures
    never gets to rerun one (and a rerun would need a fresh process group): ``--reruns`` or
    ``--force-reruns`` given, or a collected test marked ``@pytest.mark.flaky``, is refused in one
    line. Its ini ``reruns``, a standing setting, is not (it does not act there), nor, with
    ``refuse_flaky_marks`` False, a ``flaky`` mark (a foreign suite's own: the test runs once)."""
    if not items or not _active(items[0].config, RERUNFAILURES_PLUGIN):
        return
    config = items[0].config
    given = [
        f"{flag}={value}"
        for flag, value in (
            ("--reruns", config.getoption("reruns", None)),
            ("--force-reruns", config.getoption("force_reruns", None)),
        )
        if value
    ]
    flaky = next((i for i in items if refuse_flaky_marks and i.get_closest_marker("flaky") is not None), None)
    if flaky is not None:
        given.append(f"@pytest.mark.flaky on {flaky.nodeid}")
    if given:
        raise pytest.UsageError(
            f"pytest-rerunfailures' {given[0]}: not under torchrun: each attempt needs a fresh rank set, "
            "which only plain mode (pytest, not torchrun) launches, and a torchrun rank cannot restart its "
            "own process group; run plain pytest to rerun failed tests (or drop the option: "
            "-p no:rerunfailures)"
        )


@dataclass(frozen=True)
class RerunFilters:
    """pytest-rerunfailures' choice of failures to rerun, and its delay between attempts."""

    only: tuple[Any, ...] = ()
    exclude: tuple[Any, ...] = ()
    condition: bool = True
    delay_s: float = 0.0
    backoff: float = 1.0
    max_suite_reruns: int | None = None
    source: dict[str, str] = field(default_factory=dict)

    def declines(self, texts: list[str]) -> str | None:
        """Why a failure whose exception lines are ``texts`` is not rerun (None: it is)."""
        if not self.condition:
            return "@pytest.mark.flaky(condition=False)"
        if self.only and not _matches(self.only, texts):
            return f"{self.source['only']}: no pattern matches the failure"
        if self.exclude and _matches(self.exclude, texts):
            return f"{self.source['exclude']}: a pattern matches the failure"
        return None

    def delay(self, attempt: int) -> float:
        """Seconds to wait before the attempt after ``attempt`` (pytest-rerunfailures' formula)."""
        return max(self.delay_s, 0.0) * max(self.backoff, 0.0) ** (attempt - 1)


def _listed(value: Any) -> tuple[Any, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, type)):
        return (value,)
    return tuple(value)


def rerun_filters(item: pytest.Item) -> RerunFilters:
    """pytest-rerunfailures' filters for ``item`` (nothing filtered where it is not active)."""
    config = item.config
    if not _active(config, RERUNFAILURES_PLUGIN):
        return RerunFilters()
    flaky = item.get_closest_marker("flaky")
    kwargs = flaky.kwargs if flaky is not None else {}
    found: dict[str, tuple[Any, ...]] = {}
    sources: dict[str, str] = {}
    for key, name, flag in (
        ("only", "only_rerun", "--only-rerun"),
        ("exclude", "rerun_except", "--rerun-except"),
    ):
        if name in kwargs:
            found[key], sources[key] = _listed(kwargs[name]), f"@pytest.mark.flaky({name}=...)"
        else:
            cli = config.getoption(name, None)
            found[key] = tuple(cli) if cli is not None else tuple(_ini(config, name) or ())
            sources[key] = flag if cli is not None else f"ini option {name}"
    if flaky is not None:
        args = flaky.args
        delay = kwargs.get("reruns_delay", args[1] if len(args) > 1 else 0)
        backoff = kwargs.get("reruns_delay_backoff_factor", args[2] if len(args) > 2 else 1.0)
    else:
        delay = config.getoption("reruns_delay", None)
        if delay is None:
            delay = _float_ini(config, "reruns_delay", 0.0)
        backoff = config.getoption("reruns_delay_backoff_factor", None)
        if backoff is None:
            backoff = _float_ini(config, "reruns_delay_backoff_factor", 1.0)
    return RerunFilters(
        only=found["only"],
        exclude=found["exclude"],
        condition=bool(kwargs.get("condition", True)),
        delay_s=float(delay),
        backoff=float(backoff),
        max_suite_reruns=config.getoption("max_suite_reruns", None),
        source=sources,
    )


def _ini(config: pytest.Config, name: str) -> Any:
    """pytest-rerunfailures' ini key, None where its release registers none: the ini keys came after
    their options (``only_rerun`` and ``rerun_except`` in 16.7), and pytest refuses an unknown key."""
    try:
        return config.getini(name)
    except ValueError:
        return None


def _float_ini(config: pytest.Config, name: str, default: float) -> float:
    try:
        return float(config.getini(name))
    except (TypeError, ValueError):
        return default


def _matches(patterns: tuple[Any, ...], texts: list[str]) -> bool:
    """Whether any pattern matches any exception line (``Type: message``), as pytest-rerunfailures
    matches regular expressions with ``re.search``; an exception class matches its name."""
    for pattern in patterns:
        for text in texts:
            if isinstance(pattern, type):
                if re.match(rf"{re.escape(pattern.__name__)}\b", text):
                    return True
            elif re.search(pattern, text):
                return True
    return False


#: ``E   ValueError: boom`` in pytest's long tracebacks; ``mod.sub.Error: ...`` loses its module
_E_LINE = re.compile(r"^E {3}(.*)$", re.MULTILINE)
_QUALIFIED = re.compile(r"^(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*(?::|$))")


def exception_texts(report: pytest.TestReport) -> list[str]:
    """What pytest-rerunfailures' patterns are matched against for a failure the ranks reported:
    each exception line (``Type: message``, the type without its module) of its long traceback;
    where none is marked (``--tb=native``), the whole text. A failure the controller made itself
    (a timeout, a rank death) is matched by its headline (``timed out: ...``, ``rank 1 died ...``)."""
    text = report.longreprtext
    made = getattr(report, "mfsdp_failure", None)
    if made is not None:
        return [text.split("\n", 1)[0], *text.split("\n")[1:3]]
    lines = [_QUALIFIED.sub(r"\1", line.strip()) for line in _E_LINE.findall(text)]
    return [line for line in lines if line] or [text]


# -- pytest-randomly ------------------------------------------------------------------------------


def randomly_seed(config: pytest.Config) -> int | None:
    """The seed pytest-randomly uses in this session (after its configure), None where it is not
    active."""
    if not _active(config, RANDOMLY_PLUGIN):
        return None
    seed = getattr(config.option, "randomly_seed", None)
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def randomly_args(config: pytest.Config) -> list[str]:
    """For a launched rank set's pytest: the parent's pytest-randomly seed (the one it was given or
    chose), so every rank reseeds each test as the parent would; and its no-reset choice."""
    seed = randomly_seed(config)
    if seed is None:
        return []
    args = [f"--randomly-seed={seed}"]
    if getattr(config.option, "randomly_reset_seed", True) is False:
        args.append("--randomly-dont-reset-seed")
    return args


def agree_randomly_seed(config: pytest.Config, torchrun: TorchrunEnv) -> int | None:
    """A torchrun-mode rank, before pytest-randomly's configure: where no seed was given, one seed
    every rank of this torchrun run shares (:func:`_seed_of_the_run`), so all ranks shuffle their
    tests into the same order and reseed each test alike; returns it (None where it set nothing: a
    seed given, ``last``, or pytest-randomly not active). Whether or not the session uses this
    plugin: ranks that shuffle apart cannot run a distributed test, and nothing else changes."""
    if not _active(config, RANDOMLY_PLUGIN) or getattr(config.option, "randomly_seed", None) != "default":
        return None
    seed = _seed_of_the_run(torchrun)
    config.option.randomly_seed = seed
    return seed


#: seconds a rank waits to reach torchrun's agent store for pytest-randomly's seed
SEED_STORE_TIMEOUT_S = 30


def _seed_of_the_run(torchrun: TorchrunEnv) -> int:
    """A new seed per run, as pytest-randomly's own default, the same on every rank.

    Where torchrun's agent hosts the rendezvous store (it does from the start, so no rank waits for
    another): the first rank to reach it proposes a random seed and every rank takes the stored
    one. A run id and port alone would not do: ``torchrun --nproc_per_node=N`` without
    ``--standalone`` has the run id ``none`` and port 29500 on every run, so every run would get
    one order. Elsewhere (an srun step: rank 0 hosts its store only later) the seed is derived
    from the run's id and rendezvous address (in srun, a port derived from the job id: one order
    per job)."""
    if torchrun.agent_store and torchrun.master_port is not None:
        import datetime

        import torch.distributed as dist

        proposed = random.Random().getrandbits(32)  # what pytest-randomly's configure would draw
        try:
            store = dist.TCPStore(  # type: ignore[attr-defined]
                torchrun.master_addr,
                torchrun.master_port,
                is_master=False,
                timeout=datetime.timedelta(seconds=SEED_STORE_TIMEOUT_S),
            )
            agreed = store.compare_set(f"mfsdp/randomly-seed/{torchrun.run_id}", "", str(proposed))
            return int(agreed.decode())
        except RuntimeError:  # torch's DistStoreError, DistNetworkError: derived below, as in srun
            pass
    run = f"{torchrun.run_id}|{torchrun.master_addr}|{torchrun.master_port}|{torchrun.world_size}"
    return int.from_bytes(hashlib.sha256(run.encode()).digest()[:4], "big")


# -- coverage (pytest-cov, coverage run) ----------------------------------------------------------


def coverage_env(config: pytest.Config) -> dict[str, str]:
    """The environment that makes a launched rank set measure itself into pytest-cov's running
    measurement (``pytest --cov``): coverage's own hand-over to a new Python process (its ``.pth``
    file starts a measurement wherever ``COVERAGE_PROCESS_CONFIG`` is set), as its
    ``patch = ["subprocess"]`` would set it, with one data file per process, which pytest-cov
    combines with its own. Empty where pytest-cov measures nothing, where that patch already hands
    the measurement on, or on coverage < 7.10 (nothing to pass on). Not for ``coverage run``, which
    combines nothing by itself: there the project's own ``patch``/``parallel`` settings decide."""
    if os.environ.get("COVERAGE_PROCESS_CONFIG") or os.environ.get("COVERAGE_PROCESS_START"):
        return {}  # the measurement's own subprocess patch already reaches the ranks
    plugin = config.pluginmanager.get_plugin(PYTEST_COV_PLUGIN)
    measurement = getattr(getattr(plugin, "cov_controller", None), "cov", None)
    settings = getattr(measurement, "config", None)
    if settings is None or not callable(getattr(settings, "serialize", None)):
        return {}
    handed = copy.copy(settings)
    handed.parallel = True  # one data file per process (serialize makes data_file absolute)
    return {"COVERAGE_PROCESS_CONFIG": handed.serialize()}
