"""The plugin's options: one registry, one prefix, one precedence rule.

Every option can be given as a command-line flag (``--mfsdp-<name>``), an environment variable
(``MFSDP_<NAME>``) or an ini key (``mfsdp_<name>``); per-test ones also as a marker kwarg. Precedence,
as in pytest-timeout: marker > command line > environment > ini > default. Values are checked
here, at configure time, so a typo ends the session with one line before any rank starts.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from .presets import PRESETS

PREFIX = "mfsdp"
PLATFORMS = ("auto", "cpu", "cuda")


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be a positive number of seconds")
    return value


def _existing_dir(text: str) -> str:
    if not os.path.isdir(text):
        raise ValueError("no such directory (it must exist, and on multi-node runs be shared by all nodes)")
    return text


def _choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"choose one of: {', '.join(choices)}")
        return text

    return parse


@dataclass(frozen=True)
class Option:
    name: str  # e.g. "platform": --mfsdp-platform, MFSDP_PLATFORM, mfsdp_platform
    help: str
    parse: Callable[[str], Any]
    default: Any = None
    metavar: str | None = None

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
            "seconds a collective may wait before the process group gives up (default 120)",
            _positive_float,
            120.0,
            "SECONDS",
        ),
        Option(
            "report-json",
            "write every distributed test's training metrics (loss, grad norm, step time, tokens/s, "
            "peak memory, checkpoint figures) as JSON to this file (schemas/mfsdp-report.schema.json)",
            str,
            None,
            "PATH",
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


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("megatron-fsdp", "Megatron-FSDP distributed testing")
    for option in OPTIONS.values():
        group.addoption(option.flag, dest=option.dest, default=None, metavar=option.metavar, help=option.help)
        parser.addini(option.ini, f"default for {option.flag} (env {option.env} wins over it)")
    # Internal: how a rank set launched by the plugin (plain-pytest mode) talks to its parent.
    group.addoption("--mfsdp-report-file", dest="mfsdp_report_file", default=None, help=argparse.SUPPRESS)
    group.addoption("--mfsdp-batch-file", dest="mfsdp_batch_file", default=None, help=argparse.SUPPRESS)


def resolve(config: pytest.Config, name: str, marker_value: Any = None) -> Any:
    """The option's value by precedence marker > CLI > env > ini > default, parsed and checked."""
    option = OPTIONS[name]
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


def _parse(option: Option, raw: Any, source: str) -> Any:
    if not isinstance(raw, str):
        raw = str(raw)
    try:
        return option.parse(raw.strip())
    except ValueError as exc:
        raise OptionError(f"{source}: invalid value {raw!r} for {option.flag}: {exc}") from None


def check_all(config: pytest.Config) -> dict[str, Any]:
    """Resolve every option once, so a bad value anywhere fails at configure time."""
    return {name: resolve(config, name) for name in OPTIONS}
