"""The plugin's options: one registry, one prefix, one precedence rule.

Every option can be given as a command-line flag (``--mfsdp-<name>``), an environment variable
(``MFSDP_<NAME>``) or an ini key (``mfsdp_<name>``); per-test ones also as a marker kwarg. Precedence,
as in pytest-timeout: marker > command line > environment > ini > default. Values are checked
here, at configure time, so a typo ends the session with one line before any rank starts.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .fsdp.config import ConfigError, RunConfig, parse_value, starting_config, validate
from .fsdp.presets import PRESETS
from .harness.protocol import add_internal_options

PREFIX = "mfsdp"
PLATFORMS = ("auto", "cpu", "cuda")
#: the kinds of failure --mfsdp-only-rerun chooses from (see harness.controller.failure_kind)
RERUN_KINDS = ("timeout", "rank-death", "failure")


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be a positive number of seconds")
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
        return parse_value(text, (bool,))
    except ValueError:
        raise ValueError("choose true or false") from None


@dataclass(frozen=True)
class Option:
    name: str  # e.g. "platform": --mfsdp-platform, MFSDP_PLATFORM, mfsdp_platform
    help: str
    parse: Callable[[str], Any]
    default: Any = None
    metavar: str | None = None
    #: repeatable (``--flag a --flag b``; env: ``;``-separated; ini: one per line); resolves to a tuple
    multiple: bool = False

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
            f"model preset: {', '.join(sorted(PRESETS))} (default: tiny on cpu, bridge-reference on cuda)",
            _choice(tuple(sorted(PRESETS))),
        ),
        Option(
            "timeout",
            "seconds one distributed test may take before its ranks' stacks are dumped and the rank set "
            "is killed (default 300; the marker's timeout= wins over it)",
            _positive_float,
            300.0,
            "SECONDS",
        ),
        Option(
            "reruns",
            "rerun a failed distributed test up to N times, each attempt in a fresh rank set; passed on a "
            "rerun is reported as flaky (plain mode only; the marker's reruns= wins; default 0)",
            _non_negative_int,
            0,
            "N",
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
        ),
        Option(
            "use-megatron-fsdp",
            "Bridge's performance harness's --use_megatron_fsdp: true (default) wraps with Megatron-FSDP "
            "(enable_megatron_fsdp), false with Megatron DDP",
            _boolean,
            True,
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


class OptionError(pytest.UsageError):
    pass


@dataclass(frozen=True)
class ResolvedOptions:
    """Every option's value for the session, resolved once at configure time (command line >
    environment > ini > default) and checked; one attribute per option of :data:`OPTIONS`
    (``golden-mode`` -> ``golden_mode``). A test's marker may still win over some of them:
    :func:`resolve` with the marker's value."""

    platform: str
    preset: str | None
    timeout: float
    reruns: int
    #: the kinds of failure that are rerun (empty: every kind)
    only_rerun: tuple[str, ...]
    log_dir: str | None
    shared_dir: str | None
    pg_timeout: float
    set: tuple[str, ...]
    use_megatron_fsdp: bool
    distributed_logs: bool
    debug_collectives: bool
    report_json: str | None
    #: absolute (relative ones are taken from the invocation directory)
    golden: str | None
    golden_mode: str
    plot: str | None

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> ResolvedOptions:
        """From ``{option name: value}``, every option of :data:`OPTIONS` (and no other) given."""
        return cls(**{name.replace("-", "_"): value for name, value in values.items()})


#: the session's resolved options (stashed at configure time; :func:`resolved` reads them)
OPTION_VALUES = pytest.StashKey[ResolvedOptions]()


def resolved(config: pytest.Config) -> ResolvedOptions:
    """The session's options, as resolved at configure time."""
    return config.stash[OPTION_VALUES]


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
        parser.addini(
            option.ini,
            f"default for {option.flag} (env {option.env} wins over it)",
            type="linelist" if option.multiple else None,
        )
    # Internal: how a rank set launched by the plugin (plain-pytest mode) talks to its parent.
    add_internal_options(group)


def resolve(config: pytest.Config, name: str, marker_value: Any = None) -> Any:
    """The option's value by precedence marker > CLI > env > ini > default, parsed and checked."""
    option = OPTIONS[name]
    if option.multiple:
        return _resolve_multiple(config, option, marker_value)
    if marker_value is not None:
        return _parse(option, marker_value, "marker kwarg")
    # Before pytest_configure only the early parse (known_args_namespace) holds the flags.
    cli = getattr(config.option, option.dest, None)
    if cli is None:
        cli = getattr(config.known_args_namespace, option.dest, None)
    for source, raw in (
        (option.flag, cli),
        (f"environment variable {option.env}", os.environ.get(option.env) or None),
        (f"ini option {option.ini}", config.getini(option.ini) or None),
    ):
        if raw is not None:
            return _parse(option, raw, source)
    return option.default


def any_given(config: pytest.Config) -> list[str]:
    """Where the user gave any of the plugin's options (flag, environment variable, ini key): a
    session with none, and no test that uses the plugin, is left as it would be without it."""
    found = []
    for option in OPTIONS.values():
        cli = getattr(config.option, option.dest, None)
        if cli is None:
            cli = getattr(config.known_args_namespace, option.dest, None)
        if cli not in (None, []):
            found.append(option.flag)
        if os.environ.get(option.env):
            found.append(f"environment variable {option.env}")
        if config.getini(option.ini):
            found.append(f"ini option {option.ini}")
    return found


def _resolve_multiple(config: pytest.Config, option: Option, marker_value: Any) -> tuple[Any, ...]:
    """A repeatable option: the highest-precedence source that gives any value gives all of them."""
    if marker_value is not None:
        items = [marker_value] if isinstance(marker_value, str) else list(marker_value)
        return tuple(_parse(option, item, "marker kwarg") for item in items)
    source, items = _multiple_source(config, option)
    return tuple(_parse(option, item, source) for item in items) if items else tuple(option.default or ())


def _multiple_source(config: pytest.Config, option: Option) -> tuple[str, list[str]]:
    """(where a repeatable option's values come from, the raw values); ("", []) when none given."""
    cli = getattr(config.option, option.dest, None)
    if cli is None:
        cli = getattr(config.known_args_namespace, option.dest, None)
    env = [item for item in os.environ.get(option.env, "").split(";") if item.strip()]
    ini = [item for item in config.getini(option.ini) if item.strip()]
    for source, items in (
        (option.flag, cli or []),
        (f"environment variable {option.env}", env),
        (f"ini option {option.ini}", ini),
    ):
        if items:
            return source, list(items)
    return "", []


def given(config: pytest.Config, name: str) -> bool:
    """Whether the command line, the environment or the ini file gives the option a value (its
    default then does not apply: a lower-precedence source, such as another plugin's setting, may)."""
    option = OPTIONS[name]
    if option.multiple:
        return bool(_multiple_source(config, option)[1])
    cli = getattr(config.option, option.dest, None)
    if cli is None:
        cli = getattr(config.known_args_namespace, option.dest, None)
    return cli is not None or bool(os.environ.get(option.env)) or bool(config.getini(option.ini))


def _parse(option: Option, raw: Any, source: str) -> Any:
    if not isinstance(raw, str):
        raw = str(raw)
    try:
        return option.parse(raw.strip())
    except ValueError as exc:
        raise OptionError(f"{source}: invalid value {raw!r} for {option.flag}: {exc}") from None


def check_all(config: pytest.Config) -> ResolvedOptions:
    """Resolve every option once, so a bad value anywhere fails at configure time."""
    values = {name: resolve(config, name) for name in OPTIONS}
    if values["golden"] is not None:
        values["golden"] = str(_golden_root(config, values))
    resolved_values = ResolvedOptions.from_values(values)
    if values["set"] or values["preset"]:
        _check_run_config(config, resolved_values)
    return resolved_values


def _golden_root(config: pytest.Config, values: dict[str, Any]) -> Path:
    """``--mfsdp-golden``'s directory, absolute (relative: to the invocation directory). Compare
    mode needs it to exist; record mode makes it."""
    root = Path(values["golden"]).expanduser()
    if not root.is_absolute():
        root = Path(config.invocation_params.dir) / root
    if values["golden-mode"] == "compare" and not root.is_dir():
        source = _single_source(config, OPTIONS["golden"])
        raise OptionError(
            f"{source}={values['golden']}: no such directory; record golden values first "
            "(--mfsdp-golden-mode=record, or make golden) or point it at the directory that holds them"
        )
    return root


def _single_source(config: pytest.Config, option: Option) -> str:
    """Where a single-valued option's value came from (for messages)."""
    if getattr(config.option, option.dest, None) is not None:
        return option.flag
    if os.environ.get(option.env):
        return f"environment variable {option.env}"
    return f"ini option {option.ini}"


def checked_starting_config(values: ResolvedOptions, platform: str) -> RunConfig:
    """The config every test on ``platform`` starts from as the session's options make it (preset,
    ``--mfsdp-use-megatron-fsdp``, ``--mfsdp-set``), checked by every rule of ``validate()`` that
    needs no rank; raises ConfigError. The ``run_config`` fixture builds the same config
    (``fixtures.build_run_config``) for a test with no marker of its own."""
    cfg = starting_config(
        platform, preset=values.preset, use_megatron_fsdp=values.use_megatron_fsdp, assignments=values.set
    )
    validate(cfg, platform=platform)
    return cfg


def _check_run_config(config: pytest.Config, values: ResolvedOptions) -> None:
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
    source, _ = _multiple_source(config, OPTIONS["set"])
    # no --mfsdp-set: the preset alone is refused (e.g. a HybridModel preset without HybridModel)
    raise OptionError(f"{source or OPTIONS['preset'].flag}: {problems[0]}")


#: options only the plain-mode parent acts on (it launches the rank sets): refused under torchrun
#: when given for the run (flag, environment); the ini key is a standing setting, unused there
PLAIN_MODE_ONLY = {
    "reruns": "each attempt needs a fresh rank set, which only plain mode (pytest, not torchrun) launches; "
    "a torchrun rank cannot restart its own process group",
    "only-rerun": "it chooses which failures are rerun, and only plain mode (pytest, not torchrun) reruns",
}


def refuse_plain_mode_only(config: pytest.Config) -> None:
    """Under torchrun: one usage line for a plain-mode-only option given a value that acts."""
    for name, why in PLAIN_MODE_ONLY.items():
        option = OPTIONS[name]
        for source, raw in (
            (option.flag, getattr(config.option, option.dest, None)),
            (f"environment variable {option.env}", os.environ.get(option.env) or None),
        ):
            if raw is not None and option.multiple:
                raw = ";".join(raw) if isinstance(raw, list) else raw
                acts = any(_parse(option, one, source) for one in raw.split(";") if one.strip())
            else:
                acts = raw is not None and _parse(option, raw, source)
            if acts:
                raise OptionError(
                    f"{source}={raw}: not under torchrun: {why}; run plain pytest to rerun failed tests"
                )


def forwarded_args(
    config: pytest.Config, skip: tuple[str, ...] = ("platform", "log-dir", *PLAIN_MODE_ONLY)
) -> list[str]:
    """The options given on this command line, as flags for a launched rank set's pytest."""
    args = []
    for option in OPTIONS.values():
        value = getattr(config.option, option.dest, None)
        if value is None or option.name in skip:
            continue
        for one in value if option.multiple else [value]:
            args.append(f"{option.flag}={one}")
    return args
