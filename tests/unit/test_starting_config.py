"""One starting config: the config checked at configure time (``options.checked_starting_config``)
is the config the ``run_config`` fixture gives a test with no marker of its own
(``fixtures.build_run_config``), both built by ``fsdp.config.starting_config``; ``ddp_baseline``
switches to Megatron DDP as the builder does. In process: configured sessions (pytester), no rank.
"""

from __future__ import annotations

import itertools

import pytest

from pytest_megatron_fsdp import marker, options
from pytest_megatron_fsdp.environment import DistributedSpec
from pytest_megatron_fsdp.fixtures import build_run_config
from pytest_megatron_fsdp.fsdp.config import RunConfig, ddp_baseline, starting_config
from pytest_megatron_fsdp.fsdp.presets import DEFAULT_PRESET

_MODULES = itertools.count()


def _item(pytester: pytest.Pytester, source: str, *args: str) -> pytest.Item:
    path = pytester.makepyfile(**{f"test_starting_{next(_MODULES)}": source})
    config = pytester.parseconfigure(path, "-p", "no:cacheprovider", *args)
    (item,) = pytester.genitems([pytester.getnode(config, path)])
    return item


UNMARKED = "import pytest\n@pytest.mark.distributed(world_size=2)\ndef test_it(): pass\n"


@pytest.mark.parametrize(
    ("platform", "args", "env"),
    [
        ("cpu", [], {}),
        ("cuda", [], {}),
        ("cpu", ["--mfsdp-preset=bridge-reference"], {}),
        (
            "cpu",
            ["--mfsdp-set=train.train_iters=3", "--mfsdp-set=ddp.data_parallel_sharding_strategy=optim"],
            {},
        ),
        ("cpu", ["--mfsdp-use-megatron-fsdp=false"], {"MFSDP_SET": "train.seed=7"}),
        ("cuda", ["--mfsdp-use-megatron-fsdp=false", "--mfsdp-preset=tiny"], {}),
    ],
)
def test_the_configure_time_check_and_the_fixture_build_one_config(
    pytester, monkeypatch, platform, args, env
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    item = _item(pytester, UNMARKED, f"--mfsdp-platform={platform}", *args)
    checked = options.checked_starting_config(options.session_values(item.config), platform)
    spec = marker.parse(item)
    assert spec is not None
    assert build_run_config(item, platform, spec) == checked
    # and what the options say is in it (the comparison is not of two untouched defaults)
    values = options.session_values(item.config)
    assert checked.model.preset == (values.preset or DEFAULT_PRESET[platform])
    assert checked.uses_megatron_fsdp is values.use_megatron_fsdp
    for assignment in values.set:
        dotted, _, text = assignment.partition("=")
        section, _, name = dotted.partition(".")
        assert str(getattr(getattr(checked, section), name)) == text


def test_the_fixture_adds_the_tests_own_choices(pytester):
    """The marker's tp and mfsdp_config(set=) change the fixture's config only, on top of the same start."""
    source = (
        "import pytest\n"
        "@pytest.mark.distributed(world_size=2, tp=2)\n"
        "@pytest.mark.mfsdp_config(set=['train.seed=9'])\n"
        "def test_it(): pass\n"
    )
    item = _item(pytester, source, "--mfsdp-platform=cpu", "--mfsdp-set=train.train_iters=3")
    built = build_run_config(item, "cpu", marker.parse(item) or DistributedSpec())
    expected = starting_config("cpu", assignments=["train.seed=9"], tp=2)
    assert built == expected
    assert built.train.train_iters == RunConfig().train.train_iters  # the marker's set= wins whole


def test_megatron_ddp_on_cpu_ranks_goes_without_the_distributed_optimizer():
    cpu = starting_config("cpu", use_megatron_fsdp=False)
    cuda = starting_config("cuda", use_megatron_fsdp=False)
    assert not cpu.uses_megatron_fsdp
    assert not cuda.uses_megatron_fsdp
    assert (cpu.ddp.use_distributed_optimizer, cpu.ddp.overlap_param_gather) == (False, False)
    assert cuda.ddp.use_distributed_optimizer is RunConfig().ddp.use_distributed_optimizer is True
    # the baseline goes without it on every platform
    assert ddp_baseline(starting_config("cuda")).ddp.use_distributed_optimizer is False
