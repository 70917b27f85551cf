"""The plugin's options: one registry, each option's precedence chain declared beside it, one lookup.

Every option can be given as a command-line flag (``--mfsdp-<name>``), an environment variable
(``MFSDP_<NAME>``) or an ini key (``mfsdp_<name>``); per-test ones also as a marker kwarg, and some
take another plugin's setting as a source (pytest-timeout's, pytest-rerunfailures'). Each
:class:`Option` lists its sources, highest first, in ``chain``; :func:`value_of` walks that chain and
returns the value with the label of the source it came from, as pytest-timeout labels each setting
(``--mfsdp-timeout``, ``MFSDP_TIMEOUT``, ``ini mfsdp_timeout``, ``@pytest.mark.timeout``, ``default``).
docs/options.md's precedence table states the chains in prose (tests/unit/test_docs.py holds it to
this data). Values are checked at configure time, so a typo ends the session with one line before
any rank starts. What is read of other plugins lives in ``wire.coexist``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import pytest

from .environment import DEFAULT_WORLD_SIZE
from .fsdp.config import ConfigError, RunConfig, parse_value, starting_config, validate
from .fsdp.presets import PRESETS
from .wire import coexist
from .wire.cpu_probe import CPU_SPEEDS
from .wire.protocol import MARKER, add_internal_options
from .wire.torchrun_env import TorchrunEnv

PREFIX = "mfsdp"
PLATFORMS = ("auto", "cpu", "cuda")
#: the kinds of failure --mfsdp-only-rerun chooses from (see parent.controller.failure_kind)
RERUN_KINDS = ("timeout", "rank-death", "failure")
#: the per-test marker of run_config's choices (``@pytest.mark.mfsdp_config(set=..., ...)``)
CONFIG_MARKER = "mfsdp_config"


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be a positive number of seconds")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError("must be a number of seconds, 0 or more")
    return value


def _existing_dir(text: str) -> str:
    if not os.path.isdir(text):
        raise ValueError("no such directory (it must exist, and on multi-node runs be shared by all nodes)")
    return text


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError("must be a whole number, 0 or more") from None
    if value < 0:
        raise ValueError("must be a whole number, 0 or more")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError("must be a whole number, 1 or more") from None
    if value < 1:
        raise ValueError("must be a whole number, 1 or more")
    return value


def _choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"choose one of: {', '.join(choices)}")
        return text

    return parse


def _assignment(text: str) -> str:
    """``section.field=value``: the field must exist and the value fit its type (checked on a scratch
    config; cross-field rules run when the run is built, on every rank, before the model)."""
    try:
        RunConfig().assign(text)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    return text


def _boolean(text: str) -> bool:
    try:
        # parse_value returns one of the types it is given: here a bool
        return cast(bool, parse_value(text, (bool,)))
    except ValueError:
        raise ValueError("choose true or false") from None


# -- the sources an option's value can come from ---------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """An option's value and where it came from: the label of the source in its chain that gave it."""

    value: Any
    source: str


class _Own:
    """A source of this plugin's own: it gives raw text (a string, or a list for a repeatable
    option), which the option's ``parse`` checks."""

    per_test = False

    def label(self, option: Option) -> str:
        raise NotImplementedError

    def where(self, option: Option) -> str:
        """How an error message names this source."""
        return self.label(option)

    def raw(self, config: pytest.Config, option: Option, item: pytest.Item | None) -> Any:
        """What this source gives (None: nothing)."""
        raise NotImplementedError


#: the distributed marker's arguments, in order, with their defaults: its one declaration (the
#: marker's help, its usage error and its parser, :mod:`.marker`, are made from it). ``timeout``,
#: ``reruns`` and ``only_rerun`` are the first sources of their options' chains (:class:`MarkerKwarg`).
MARKER_KEYWORDS: dict[str, Any] = {
    "world_size": DEFAULT_WORLD_SIZE,
    "tp": 1,
    "pp": 1,
    "cp": 1,
    "timeout": None,
    "reruns": None,
    "only_rerun": None,
}
MARKER_SIGNATURE = f"{MARKER}({', '.join(f'{name}={value!r}' for name, value in MARKER_KEYWORDS.items())})"


@dataclass(frozen=True)
class MarkerKwarg(_Own):
    """A kwarg of this plugin's per-test marker: ``@pytest.mark.<marker>(<kwarg>=...)``."""

    marker: str
    kwarg: str
    per_test = True

    def label(self, option: Option) -> str:
        return f"@pytest.mark.{self.marker}({self.kwarg}=...)"

    def raw(self, config: pytest.Config, option: Option, item: pytest.Item | None) -> Any:
        found = item.get_closest_marker(self.marker) if item is not None else None
        return None if found is None else found.kwargs.get(self.kwarg)


class _CommandLine(_Own):
    def label(self, option: Option) -> str:
        return option.flag

    def raw(self, config: pytest.Config, option: Option, item: pytest.Item | None) -> Any:
        value = getattr(config.option, option.dest, None)
        if value is None:  # before pytest_configure only the early parse holds the flags
            value = getattr(config.known_args_namespace, option.dest, None)
        return (value or None) if option.multiple else value


class _Environment(_Own):
    def label(self, option: Option) -> str:
        return option.env

    def where(self, option: Option) -> str:
        return f"environment variable {option.env}"

    def raw(self, config: pytest.Config, option: Option, item: pytest.Item | None) -> Any:
        text = os.environ.get(option.env) or None
        if text is None or not option.multiple:
            return text
        return [one for one in text.split(";") if one.strip()] or None


class _IniFile(_Own):
    def label(self, option: Option) -> str:
        return f"ini {option.ini}"

    def where(self, option: Option) -> str:
        return f"ini option {option.ini}"

    def raw(self, config: pytest.Config, option: Option, item: pytest.Item | None) -> Any:
        value = config.getini(option.ini)
        if option.multiple:
            return [one for one in value if one.strip()] or None
        return value or None


class _Default(_Own):
    def label(self, option: Option) -> str:
        return "default"


COMMAND_LINE, ENVIRONMENT, INI_FILE, DEFAULT = _CommandLine(), _Environment(), _IniFile(), _Default()
#: one place in a chain: a source of this plugin's own, or another plugin's setting
Level = _Own | coexist.ForeignLevel
#: the chain of an option with no per-test source: command line > environment > ini > default
SESSION_CHAIN: tuple[Level, ...] = (COMMAND_LINE, ENVIRONMENT, INI_FILE, DEFAULT)


@dataclass(frozen=True)
class Option:
    name: str  # e.g. "platform": --mfsdp-platform, MFSDP_PLATFORM, mfsdp_platform
    help: str
    parse: Callable[[str], Any]
    default: Any = None
    metavar: str | None = None
    #: repeatable (``--flag a --flag b``; env: ``;``-separated; ini: one per line); a tuple of values,
    #: all from the highest source that gives any
    multiple: bool = False
    #: where the value comes from, highest first (docs/options.md's precedence table states it)
    chain: tuple[Level, ...] = SESSION_CHAIN
    #: why only the plain-mode parent acts on it (it launches the rank sets): given for the run
    #: (flag, environment) under torchrun it is refused; the ini key is a standing setting, unused there
    plain_mode_only: str | None = None

    @property
    def flag(self) -> str:
        return f"--{PREFIX}-{self.name}"

    @property
    def dest(self) -> str:
        return f"{PREFIX}_{self.name.replace('-', '_')}"

    @property
    def env(self) -> str:
        return self.dest.upper()

    @property
    def ini(self) -> str:
        return self.dest

    def chain_labels(self) -> list[str]:
        """Its sources' labels, highest first: the precedence docs/options.md's table states (a
        foreign level covers several sources of its plugin's)."""
        return [
            label
            for level in self.chain
            for label in (level.labels if isinstance(level, coexist.ForeignLevel) else (level.label(self),))
        ]

    def where(self, source: str) -> str:
        """How an error message names the source labelled ``source``."""
        for level in self.chain:
            if isinstance(level, _Own) and level.label(self) == source:
                return level.where(self)
        return source


OPTIONS: dict[str, Option] = {
    o.name: o
    for o in (
        Option(
            "platform",
            "where ranks run: 'cuda' (NCCL, one GPU per rank), 'cpu' (gloo, CUDA-emulated CPU "
            "ranks) or 'auto' (cuda when every local rank has a GPU, else cpu)",
            _choice(PLATFORMS),
            "auto",
        ),
        Option(
            "preset",
            "model preset (default: tiny on cpu, bridge-reference on cuda): "
            + "; ".join(f"{name} ({PRESETS[name].description})" for name in sorted(PRESETS)),
            _choice(tuple(sorted(PRESETS))),
        ),
        Option(
            "cpu-speed",
            "how big a bf16 step tests take on CPU ranks: 'auto' (decided from the CPU's flags: "
            "avx512_bf16, amx_bf16 or Arm's bf16 run bf16 natively), 'native-bf16' (the presets' own "
            "sizes) or 'slow-bf16' (a preset's bf16 step shrunk where it has a smaller one, as on a "
            "CPU with AVX2 only); the header line shows the flags, the measured speeds and the choice",
            _choice(CPU_SPEEDS),
            "auto",
            "auto|native-bf16|slow-bf16",
        ),
        Option(
            "timeout",
            "seconds one distributed test may take before its ranks' stacks are dumped and the rank set "
            "is killed (default 300; the marker's timeout= wins over it)",
            _positive_float,
            300.0,
            "SECONDS",
            chain=(
                MarkerKwarg(MARKER, "timeout"),
                coexist.PYTEST_TIMEOUT_MARKER,
                *SESSION_CHAIN[:3],
                coexist.PYTEST_TIMEOUT_OPTIONS,
                DEFAULT,
            ),
        ),
        Option(
            "hang-after",
            "seconds without progress on any rank (no collective completed, no move in Python, on CPU "
            "ranks no computing) after which a distributed test is reported hung before its timeout; "
            "the timeout stays the last net and says 'too slow' for a test still getting somewhere "
            "(default 60; 0: off, only the timeout ends a test)",
            _non_negative_float,
            60.0,
            "SECONDS",
        ),
        Option(
            "reruns",
            "rerun a failed distributed test up to N times, each attempt in a fresh rank set; passed on a "
            "rerun is reported as flaky (plain mode only; the marker's reruns= wins; default 0)",
            _non_negative_int,
            0,
            "N",
            chain=(
                coexist.RERUNFAILURES_FORCED,
                MarkerKwarg(MARKER, "reruns"),
                coexist.RERUNFAILURES_MARKER,
                *SESSION_CHAIN[:3],
                coexist.RERUNFAILURES_OPTIONS,
                DEFAULT,
            ),
            plain_mode_only="each attempt needs a fresh rank set, which only plain mode (pytest, not "
            "torchrun) launches; a torchrun rank cannot restart its own process group; run plain pytest "
            "to rerun failed tests",
        ),
        Option(
            "only-rerun",
            "rerun a failed distributed test (--mfsdp-reruns, the marker's reruns=, pytest-rerunfailures) "
            "only for these kinds of failure: 'timeout' (the test exceeded its timeout), 'rank-death' "
            "(a rank died or the rank set ended before the test did), 'failure' (the test failed or "
            "errored in its ranks: an assertion, an exception); repeatable; default: every kind "
            "(plain mode only; the marker's only_rerun= wins)",
            _choice(RERUN_KINDS),
            (),
            "KIND",
            multiple=True,
            chain=(MarkerKwarg(MARKER, "only_rerun"), *SESSION_CHAIN),
            plain_mode_only="it chooses which failures are rerun, and only plain mode (pytest, not "
            "torchrun) reruns; run plain pytest to rerun failed tests",
        ),
        Option(
            "log-dir",
            "directory for the per-rank log files (default: .pytest_cache/d/mfsdp-logs, else a temp dir)",
            str,
            None,
            "DIR",
        ),
        Option(
            "shared-dir",
            "existing directory that every rank (on every node) sees; the session makes a private "
            "subdirectory in it (default: a private temp dir made by rank 0, fine on one node)",
            _existing_dir,
            None,
            "DIR",
        ),
        Option(
            "pg-timeout",
            "seconds a collective may wait before the process group gives up; caps every process "
            "group the ranks create, Megatron's model-parallel groups included (default 120)",
            _positive_float,
            120.0,
            "SECONDS",
        ),
        Option(
            "set",
            "set a run-config field for every test, Bridge's names: section.field=value, e.g. "
            "ddp.data_parallel_sharding_strategy=optim_grads (repeatable; env: ';'-separated; "
            "ini: one per line). Applied to the run_config fixture before the test body runs",
            _assignment,
            (),
            "SECTION.FIELD=VALUE",
            multiple=True,
            chain=(MarkerKwarg(CONFIG_MARKER, "set"), *SESSION_CHAIN),
        ),
        Option(
            "use-megatron-fsdp",
            "Bridge's performance harness's --use_megatron_fsdp: true (default) wraps with Megatron-FSDP "
            "(enable_megatron_fsdp), false with Megatron DDP",
            _boolean,
            True,
            "true|false",
            chain=(MarkerKwarg(CONFIG_MARKER, "use_megatron_fsdp"), *SESSION_CHAIN),
        ),
        Option(
            "bridge-rules",
            "check the session's starting config with Megatron-Bridge's own validate() too, before any "
            "rank starts: Bridge's vanilla GPT recipe, the Megatron-FSDP override (enable_megatron_fsdp) "
            "and the --mfsdp-set assignments, as a rank of 2 (needs megatron-bridge; a fresh interpreter "
            "imports it, about 20 s; default false)",
            _boolean,
            False,
            "true|false",
        ),
        Option(
            "distributed-logs",
            "keep torch.distributed's own DEBUG/INFO log records (DCP's per-call event log, c10d's) in "
            "captured logs; default false: only their warnings and errors, the rest is noise in reports",
            _boolean,
            False,
            "true|false",
        ),
        Option(
            "debug-collectives",
            "run the ranks with TORCH_DISTRIBUTED_DEBUG=DETAIL: before each collective the ranks "
            "compare its op, shapes and dtypes, so a mismatch fails at once on every rank with torch's "
            "message instead of hanging until the timeout (slower: one extra exchange per collective; "
            "setting TORCH_DISTRIBUTED_DEBUG=DETAIL yourself before the ranks start does the same)",
            _boolean,
            False,
            "true|false",
        ),
        Option(
            "foreign-suite",
            "run a test suite written for GPUs that knows nothing of this plugin (Megatron-LM's own "
            "unit tests) on CPU ranks, each test on every rank (under torchrun: the session's; plain "
            "pytest: rank sets of --mfsdp-foreign-world-size): over the CUDA emulation, NCCL groups "
            "become gloo, each local rank gets a device of its own and torch.cuda.is_available() "
            "answers True (torch-wide; docs/upstream-suites.md lists every change)",
            _boolean,
            False,
            "true|false",
        ),
        Option(
            "foreign-world-size",
            "plain mode: how many ranks each rank set has that runs a foreign suite's tests "
            "(--mfsdp-foreign-suite; default 2)",
            _positive_int,
            2,
            "N",
            plain_mode_only="under torchrun a foreign suite's tests run on the session's own ranks "
            "(--nproc_per_node)",
        ),
        Option(
            "report-json",
            "write every distributed test's training metrics (loss, grad norm, step time, tokens/s, "
            "peak memory, checkpoint figures) as JSON to this file "
            "(schema: pytest_megatron_fsdp/reporting/mfsdp-report.schema.json)",
            str,
            None,
            "PATH",
        ),
        Option(
            "golden",
            "golden values in Megatron-LM's format: every distributed test's training runs (lm loss, "
            "num-zeros, mem-allocated-bytes, iteration-time per step) recorded into, or compared with, "
            "one file per test under DIR/<stack>/<platform>/ (see --mfsdp-golden-mode)",
            str,
            None,
            "DIR",
        ),
        Option(
            "golden-mode",
            "what --mfsdp-golden does: 'compare' (default; a test whose runs differ fails, one line per "
            "metric and step: exact on CPU ranks, Megatron-LM's tolerances on GPUs) or 'record' (write "
            "the files, replacing earlier ones)",
            _choice(("compare", "record")),
            "compare",
            "compare|record",
        ),
        Option(
            "plot",
            "write a PNG of the loss curves to this file (needs matplotlib; without it a note says so)",
            str,
            None,
            "PATH",
        ),
    )
}


# pytest marks UsageError @final in its hints, yet a subclass is what keeps pytest's usage-error exit
class OptionError(pytest.UsageError):  # type: ignore[misc]
    pass


def value_of(
    config: pytest.Config, name: str, item: pytest.Item | None = None, chain: tuple[Level, ...] | None = None
) -> Setting:
    """The option's value, parsed and checked, from the first source of its chain that gives one,
    labelled with that source. Without ``item`` the per-test sources (markers, other plugins'
    settings) are passed over: the session's value. ``chain``: only these sources (by default the
    option's whole chain)."""
    option = OPTIONS[name]
    for level in option.chain if chain is None else chain:
        if isinstance(level, coexist.ForeignLevel):
            found = level.setting(item) if item is not None else None
            if found is not None:
                return Setting(found.value, found.source)
            continue
        if level is DEFAULT:
            return Setting(option.default, level.label(option))
        if level.per_test and item is None:
            continue
        raw = level.raw(config, option, item)
        if raw is not None:
            return Setting(_parse(option, raw, level.where(option)), level.label(option))
    return Setting(option.default, DEFAULT.label(option))


def _parse(option: Option, raw: Any, where: str) -> Any:
    if option.multiple:
        items = [raw] if isinstance(raw, str) else list(raw)
        return tuple(_parse_one(option, one, where) for one in items)
    return _parse_one(option, raw, where)


def _parse_one(option: Option, raw: Any, where: str) -> Any:
    if not isinstance(raw, str):
        raw = str(raw)
    try:
        return option.parse(raw.strip())
    except ValueError as exc:
        raise OptionError(f"{where}: invalid value {raw!r} for {option.flag}: {exc}") from None


def options_given(config: pytest.Config) -> list[str]:
    """The sources of the plugin's own session options that the user gave (flag, environment
    variable, ini key), unchecked: a session with none, and no test that uses the plugin, is left
    as it would be without it."""
    return [
        level.label(option)
        for option in OPTIONS.values()
        for level in (COMMAND_LINE, ENVIRONMENT, INI_FILE)
        if level.raw(config, option, None) is not None
    ]


# -- the session's values -------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionValues:
    """Every option's session value, looked up once at configure time (:func:`check_at_configure`)
    and checked: one attribute per option of :data:`OPTIONS` (``golden-mode`` -> ``golden_mode``),
    and where each came from. A test's own sources may still win over some of them: :func:`value_of`
    with the test."""

    platform: str
    preset: str | None
    cpu_speed: str
    timeout: float
    hang_after: float
    reruns: int
    #: the kinds of failure that are rerun (empty: every kind)
    only_rerun: tuple[str, ...]
    log_dir: str | None
    shared_dir: str | None
    pg_timeout: float
    set: tuple[str, ...]
    use_megatron_fsdp: bool
    bridge_rules: bool
    distributed_logs: bool
    debug_collectives: bool
    foreign_suite: bool
    foreign_world_size: int
    report_json: str | None
    #: absolute (relative ones are taken from the invocation directory)
    golden: str | None
    golden_mode: str
    plot: str | None
    #: option name -> the label of the source its value came from (``"--mfsdp-set"``, ``"default"``)
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Setting]) -> SessionValues:
        """From ``{option name: setting}``, every option of :data:`OPTIONS` (and no other) given."""
        values = {name.replace("-", "_"): setting.value for name, setting in settings.items()}
        return cls(**values, sources={name: setting.source for name, setting in settings.items()})

    def source_of(self, name: str) -> str:
        """Where option ``name``'s session value came from."""
        return self.sources[name]


#: the session's values (stashed at configure time; :func:`session_values` reads them)
SESSION_VALUES = pytest.StashKey[SessionValues]()


def session_values(config: pytest.Config) -> SessionValues:
    """The session's option values, as looked up and checked at configure time."""
    return config.stash[SESSION_VALUES]


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("megatron-fsdp", "Megatron-FSDP distributed testing")
    for option in OPTIONS.values():
        group.addoption(
            option.flag,
            dest=option.dest,
            default=None,
            metavar=option.metavar,
            help=option.help,
            action="append" if option.multiple else "store",
        )
        ini_type: Literal["linelist"] | None = "linelist" if option.multiple else None
        parser.addini(option.ini, f"default for {option.flag} (env {option.env} wins over it)", type=ini_type)
    # Internal: how a rank set launched by the plugin (plain-pytest mode) talks to its parent.
    add_internal_options(group)


def check_at_configure(config: pytest.Config, *, parent_checked: bool = False) -> SessionValues:
    """Every option's session value, looked up once, so that a bad value anywhere fails at
    configure time; the config every test starts from is checked too where options shape it.
    ``parent_checked``: a rank its parent launched, which checked that config before any rank
    started (each rank of a set would otherwise start Bridge's interpreter again)."""
    settings = {name: value_of(config, name) for name in OPTIONS}
    golden = settings["golden"]
    if golden.value is not None:
        root = _golden_root(config, golden, settings["golden-mode"].value)
        settings["golden"] = Setting(str(root), golden.source)
    values = SessionValues.from_settings(settings)
    if values.set or values.preset:
        _check_starting_config(values)
    if values.bridge_rules and not parent_checked:
        _check_with_bridge(values)
    return values


def _golden_root(config: pytest.Config, golden: Setting, mode: str) -> Path:
    """``--mfsdp-golden``'s directory, absolute (relative: to the invocation directory). Compare
    mode needs it to exist; record mode makes it."""
    root = Path(golden.value).expanduser()
    if not root.is_absolute():
        root = Path(config.invocation_params.dir) / root
    if mode == "compare" and not root.is_dir():
        raise OptionError(
            f"{OPTIONS['golden'].where(golden.source)}={golden.value}: no such directory; record golden "
            "values first (--mfsdp-golden-mode=record, or make golden) or point it at the directory "
            "that holds them"
        )
    return root


def checked_starting_config(values: SessionValues, platform: str) -> RunConfig:
    """The config every test on ``platform`` starts from as the session's options make it (preset,
    ``--mfsdp-use-megatron-fsdp``, ``--mfsdp-set``), checked by every rule of ``validate()`` that
    needs no rank; raises ConfigError. The ``run_config`` fixture builds the same config
    (``fixtures.build_run_config``) for a test with no marker of its own."""
    cfg = starting_config(
        platform, preset=values.preset, use_megatron_fsdp=values.use_megatron_fsdp, assignments=values.set
    )
    validate(cfg, platform=platform)
    return cfg


def _check_starting_config(values: SessionValues) -> None:
    """The ``--mfsdp-set`` assignments together (or the chosen preset alone), on the config every
    test starts from: choices, ranges, fields that must agree, so a bad value is one line now
    instead of a failure inside every rank.

    The platform, and with it the default preset, may only be decided later (``auto``): then the
    config is checked as each candidate platform would build it, and refused only when every one
    refuses it (the ranks check the rest before they build anything).
    """
    platforms = PLATFORMS[1:] if values.platform == "auto" else (values.platform,)
    problems = []
    for platform in platforms:
        try:
            checked_starting_config(values, platform)
        except ConfigError as exc:
            problems.append(str(exc))
            continue
        return
    # no --mfsdp-set: the preset alone is refused (e.g. a HybridModel preset without HybridModel)
    name = "set" if values.set else "preset"
    raise OptionError(f"{OPTIONS[name].where(values.source_of(name))}: {problems[0]}")


#: what a fresh interpreter runs for --mfsdp-bridge-rules: Bridge imported with the TE stand-in and its
#: validate switched for CPU, as on a CPU rank (a process of its own: the session's own process imports
#: no megatron before its ranks' CUDA emulation, and keeps the stand-in out of its modules)
_BRIDGE_CHECK = """
import json, sys
from pytest_megatron_fsdp.foreign import bridge
bridge.watch()
from pytest_megatron_fsdp.fsdp import bridge_config
print(json.dumps({"refusal": bridge_config.session_refusal(**json.loads(sys.argv[1]))}))
"""
#: how long Bridge's check may take (its imports take about 20 s on a 2-core box)
BRIDGE_CHECK_TIMEOUT_S = 300.0


def _check_with_bridge(values: SessionValues) -> None:
    """``--mfsdp-bridge-rules``: the session's starting config refused by Megatron-Bridge's own
    validation is one usage line, before any rank starts."""
    import json
    import subprocess
    import sys

    from .fsdp import versions

    where = f"{OPTIONS['bridge-rules'].where(values.source_of('bridge-rules'))}=true"
    problem = versions.megatron_bridge_problem()
    if problem is not None:
        raise OptionError(f"{where}: {problem}; leave it off on this stack")
    rank = TorchrunEnv(
        rank=0, world_size=DEFAULT_WORLD_SIZE, local_rank=0, local_world_size=DEFAULT_WORLD_SIZE
    )
    arguments = {
        "assignments": list(values.set),
        "use_megatron_fsdp": values.use_megatron_fsdp,
        "environ": rank.environ(),
    }
    try:
        done = subprocess.run(
            [sys.executable, "-c", _BRIDGE_CHECK, json.dumps(arguments)],
            capture_output=True,
            text=True,
            timeout=BRIDGE_CHECK_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise OptionError(
            f"{where}: Megatron-Bridge's check took over {BRIDGE_CHECK_TIMEOUT_S:g} s"
        ) from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise OptionError(f"{where}: Megatron-Bridge's check failed (exit {done.returncode}): {last}")
    refusal = json.loads(lines[-1])["refusal"]
    if refusal is not None:
        raise OptionError(f"{where}: {refusal}")


# -- torchrun mode, launched rank sets --------------------------------------------------------------


def refuse_plain_mode_only(config: pytest.Config) -> None:
    """Under torchrun: one usage line for a plain-mode-only option whose value, given for this run
    (flag or environment variable), would act."""
    for option in OPTIONS.values():
        if option.plain_mode_only is None:
            continue
        setting = value_of(config, option.name, chain=(COMMAND_LINE, ENVIRONMENT, DEFAULT))
        if not setting.value or setting.source == DEFAULT.label(option):
            continue
        shown = ";".join(setting.value) if option.multiple else setting.value
        raise OptionError(
            f"{option.where(setting.source)}={shown}: not under torchrun: {option.plain_mode_only}"
        )


def forwarded_args(config: pytest.Config, skip: tuple[str, ...] = ("platform", "log-dir")) -> list[str]:
    """The options given on this command line, as flags for a launched rank set's pytest (not the
    plain-mode-only ones, which the parent acts on)."""
    args = []
    for option in OPTIONS.values():
        value = COMMAND_LINE.raw(config, option, None)
        if value is None or option.name in skip or option.plain_mode_only is not None:
            continue
        for one in value if option.multiple else [value]:
            args.append(f"{option.flag}={one}")
    return args
