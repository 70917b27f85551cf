"""Every place the plugin reaches into pytest's private parts, in one module.

The package declares ``pytest>=8``; each touchpoint below exists in every pytest from 8.0 on (the
version it appeared in is noted). Should a pytest move one, this module is the one to change. No
other module of the package imports ``_pytest``.

* :class:`ExceptionChainRepr`, :class:`ReprEntryNative`, :class:`ReprFileLocation`,
  :class:`ReprTraceback` (``_pytest._code.code``, since pytest 3.x; ``ExceptionChainRepr`` since
  4.0): a failure built from text with a headline at the test's own location
  (``explain.headlined_failure``), shown by the terminal, JUnit and pytest-xdist as pytest's own.
* :func:`runtestprotocol` (``_pytest.runner``, since pytest 2.x): a rank runs a test's phases
  without logging them, to log the reports every rank agreed on instead.
* :class:`TerminalReporter` (``_pytest.terminal``; also ``pytest.TerminalReporter`` since 7.0, the
  constructor is not public): a rank's terminal report written to its log, or held.
* :func:`teardown_local_state` (``Session._setupstate.teardown_exact``, since pytest 6.2 / 7.0 in
  this form): the parent moves its setup state on past a distributed test that ran elsewhere.
* :func:`stop_junit_xml` (``_pytest.junitxml.xml_key``, since pytest 7.0 as a stash key): the JUnit
  plugin of a torchrun-mode rank other than 0, already configured, is unregistered.
* :func:`renew_tmp_path_factory` (``_pytest.tmpdir.TempPathFactory.from_config`` and
  ``Config._tmp_path_factory``, since pytest 6.2): a late-started rank's new ``--basetemp``.
"""

from __future__ import annotations

from typing import Any

import pytest
from _pytest._code.code import ExceptionChainRepr, ReprEntryNative, ReprFileLocation, ReprTraceback
from _pytest.runner import runtestprotocol
from _pytest.terminal import TerminalReporter

__all__ = [
    "ExceptionChainRepr",
    "ReprEntryNative",
    "ReprFileLocation",
    "ReprTraceback",
    "TerminalReporter",
    "renew_tmp_path_factory",
    "runtestprotocol",
    "stop_junit_xml",
    "teardown_local_state",
]


def teardown_local_state(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Tear down this process's setup state that ``nextitem`` does not need, as pytest's runner does
    in every test's teardown."""
    item.session._setupstate.teardown_exact(nextitem)


def stop_junit_xml(config: pytest.Config) -> None:
    """No JUnit file from this process, though ``--junitxml`` was given (pytest's plugin for it is
    already configured: it is unregistered before it writes)."""
    config.option.xmlpath = None
    try:
        from _pytest.junitxml import xml_key
    except ImportError:  # a pytest that moved it: every rank writes, as without the plugin
        return
    xml: Any = config.stash.get(xml_key, None)
    if xml is not None:
        del config.stash[xml_key]
        config.pluginmanager.unregister(xml)


def renew_tmp_path_factory(config: pytest.Config) -> None:
    """pytest read ``--basetemp`` at configure; a factory nobody used yet is made again from it."""
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None or getattr(factory, "_basetemp", None) is not None:
        return
    from _pytest.tmpdir import TempPathFactory

    config._tmp_path_factory = TempPathFactory.from_config(config, _ispytest=True)  # type: ignore[attr-defined]
