"""Older releases of the plugins the harness reads: a setting their release lacks means "not given"."""

from __future__ import annotations

from pytest_megatron_fsdp.wire import coexist


def test_a_pytest_rerunfailures_without_the_filters_ini_keys_filters_nothing(pytester):
    # pytest-rerunfailures before 16.7 has --only-rerun and --rerun-except but registers no ini keys
    # for them, and pytest refuses to read an unknown key: every distributed test in plain mode then
    # ended in an INTERNALERROR. Here the plugin is "active" with none of its options registered.
    module = pytester.getmodulecol("def test_x(): pass\n", configargs=("-p", "no:rerunfailures"))
    plugins = module.config.pluginmanager
    plugins.unblock(coexist.RERUNFAILURES_PLUGIN)  # the name -p no: blocked, for the stand-in
    plugins.register(object(), coexist.RERUNFAILURES_PLUGIN)
    (item,) = pytester.genitems([module])
    filters = coexist.rerun_filters(item)
    assert filters.only == ()
    assert filters.exclude == ()
    assert filters.delay_s == 0.0
