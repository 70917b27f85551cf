"""--mfsdp-set and --mfsdp-use-megatron-fsdp as users meet them: one-line usage errors at configure
time, and precedence marker > command line > environment > ini (pytester sessions run in process,
no torch, no rank)."""

import pytest

from pytest_megatron_fsdp.fsdp import versions

SHOW = (
    "import pytest\n"
    "from pytest_megatron_fsdp.options import value_of\n"
    "def pytest_configure(config):\n"
    "    print('SET', list(value_of(config, 'set').value))\n"
    "    print('USE', value_of(config, 'use-megatron-fsdp').value)\n"
)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--mfsdp-set=ddp.overlap_grad_reducee=true"],
            "ERROR: --mfsdp-set: invalid value 'ddp.overlap_grad_reducee=true' for --mfsdp-set: "
            "unknown config field 'ddp.overlap_grad_reducee': *check the spelling",
        ),
        (
            ["--mfsdp-set", "train.train_iters=3", "--mfsdp-set", "train.train_iters=many"],
            "ERROR: --mfsdp-set: invalid value 'train.train_iters=many' for --mfsdp-set: "
            "train.train_iters='many' is not of type int: give int",
        ),
        (
            ["--mfsdp-set=train_iters"],
            "*'train_iters' is not an assignment: write section.field=value",
        ),
        (
            ["--mfsdp-use-megatron-fsdp=maybe"],
            "ERROR: --mfsdp-use-megatron-fsdp: invalid value 'maybe' for --mfsdp-use-megatron-fsdp: "
            "choose true or false",
        ),
    ],
)
def test_bad_config_option_is_one_usage_error_line(pytester, args, message):
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest_inprocess(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert len([line for line in result.stderr.lines if line.strip()]) == 1, result.stderr.lines


def test_bad_env_and_ini_values_name_their_source(pytester, monkeypatch):
    pytester.makepyfile("def test_x(): pass")
    pytester.makeini("[pytest]\nmfsdp_set =\n    train.seed=1\n    model.preset=3x\n")
    monkeypatch.setenv("MFSDP_USE_MEGATRON_FSDP", "perhaps")
    result = pytester.runpytest_inprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*environment variable MFSDP_USE_MEGATRON_FSDP: invalid value 'perhaps'*"])
    monkeypatch.delenv("MFSDP_USE_MEGATRON_FSDP")
    monkeypatch.setenv("MFSDP_SET", "train.seed=2;ddp.nope=1")
    result = pytester.runpytest_inprocess()
    result.stderr.fnmatch_lines(["*environment variable MFSDP_SET: invalid value 'ddp.nope=1'*"])


def test_precedence_cli_over_env_over_ini(pytester, monkeypatch):
    pytester.makeini(
        "[pytest]\nmfsdp_set =\n    train.seed=1\n    train.train_iters=5\nmfsdp_use_megatron_fsdp = false\n"
    )
    pytester.makeconftest(SHOW)
    pytester.makepyfile("def test_x(): pass")
    out = str(pytester.runpytest_inprocess("-s").stdout)
    assert "SET ['train.seed=1', 'train.train_iters=5']" in out
    assert "USE False" in out
    monkeypatch.setenv("MFSDP_SET", "train.seed=2; ddp.overlap_param_gather=false")
    monkeypatch.setenv("MFSDP_USE_MEGATRON_FSDP", "true")
    out = str(pytester.runpytest_inprocess("-s").stdout)
    assert "SET ['train.seed=2', 'ddp.overlap_param_gather=false']" in out
    assert "USE True" in out
    out = str(
        pytester.runpytest_inprocess(
            "-s",
            "--mfsdp-set=train.seed=3",
            "--mfsdp-set",
            "optimizer.lr=0.1",
            "--mfsdp-use-megatron-fsdp=false",
        ).stdout
    )
    assert "SET ['train.seed=3', 'optimizer.lr=0.1']" in out
    assert "USE False" in out


def test_marker_wins_over_the_command_line(pytester):
    pytester.makepyfile(
        "import pytest\n"
        "from pytest_megatron_fsdp.options import Setting, value_of\n"
        "@pytest.mark.mfsdp_config(use_megatron_fsdp=True, set=['train.seed=4'])\n"
        "def test_x(request):\n"
        "    config, item = request.config, request.node\n"
        "    marker = '@pytest.mark.mfsdp_config'\n"
        "    assert value_of(config, 'set', item) == Setting(('train.seed=4',), marker + '(set=...)')\n"
        "    use = value_of(config, 'use-megatron-fsdp', item)\n"
        "    assert use == Setting(True, marker + '(use_megatron_fsdp=...)')\n"
        "    assert value_of(config, 'set') == Setting(('train.seed=3',), '--mfsdp-set')  # the session's\n"
    )
    result = pytester.runpytest_inprocess("--mfsdp-set=train.seed=3", "--mfsdp-use-megatron-fsdp=false")
    result.assert_outcomes(passed=1)


def test_defaults_keep_megatron_fsdp_on_and_set_nothing(pytester):
    pytester.makeconftest(SHOW)
    pytester.makepyfile("def test_x(): pass")
    out = str(pytester.runpytest_inprocess("-s").stdout)
    assert "SET []" in out
    assert "USE True" in out


DISTRIBUTED_TEST = (
    "import pytest\n@pytest.mark.distributed(world_size=2)\ndef test_d(run_config):\n    pass\n"
)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--mfsdp-set", "ddp.data_parallel_sharding_strategy=bogus"],
            "ERROR: --mfsdp-set: ddp.data_parallel_sharding_strategy='bogus' is not a sharding strategy; "
            "choose one of: no_shard, optim, optim_grads, optim_grads_params",
        ),
        (
            ["--mfsdp-set", "checkpoint.ckpt_format=torch_dist"],
            "ERROR: --mfsdp-set: checkpoint.ckpt_format='torch_dist' with Megatron-FSDP: *"
            "set checkpoint.ckpt_format='fsdp_dtensor'*",
        ),
        (
            ["--mfsdp-set", "ddp.overlap_grad_reduce=false"],
            "ERROR: --mfsdp-set: ddp.overlap_param_gather=True with ddp.overlap_grad_reduce=False: *"
            "or ddp.overlap_param_gather=False",
        ),
        (
            ["--mfsdp-set", "scheduler.lr_decay_style=cosine", "--mfsdp-set", "scheduler.lr_warmup_iters=10"],
            "ERROR: --mfsdp-set: scheduler.lr_warmup_iters=10 is not below train.train_iters=10*",
        ),
        (
            ["--mfsdp-platform=cpu", "--mfsdp-preset=bridge-reference", "--mfsdp-set=optimizer.lr=0"],
            "ERROR: --mfsdp-set: optimizer.min_lr=1e-06 (the bridge-reference preset's) is above "
            "optimizer.lr=0.0*",
        ),
    ],
)
def test_bad_config_values_are_refused_at_configure_time(pytester, args, message):
    """One line naming field, value and fix, and no rank set launched (the run ends in configure)."""
    pytester.makepyfile(DISTRIBUTED_TEST)
    result = pytester.runpytest_inprocess(*args, "--mfsdp-log-dir=logs")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert len([line for line in result.stderr.lines if line.strip()]) == 1, result.stderr.lines
    assert not (pytester.path / "logs").exists()  # no rank ever started


def test_configure_time_checks_accept_what_the_session_can_run(pytester):
    """The whole config is checked as the tests start from it: what fixes a rule passes."""
    pytester.makepyfile("def test_x(): pass")
    accepted = [
        ["--mfsdp-set=ddp.overlap_grad_reduce=false", "--mfsdp-set=ddp.overlap_param_gather=false"],
        ["--mfsdp-set=checkpoint.ckpt_format=torch_dist", "--mfsdp-use-megatron-fsdp=false"],
        ["--mfsdp-set=scheduler.lr_warmup_iters=10", "--mfsdp-set=train.train_iters=20"],
        # the platform is decided later (auto): tiny, the CPU default, takes lr 0
        ["--mfsdp-set=optimizer.lr=0"],
        ["--mfsdp-platform=cpu", "--mfsdp-set=optimizer.lr=0"],
    ]
    for args in accepted:
        result = pytester.runpytest_inprocess(*args)
        assert result.ret == pytest.ExitCode.OK, (args, result.stderr.lines)


def test_a_configure_time_refusal_names_the_environment_as_its_source(pytester, monkeypatch):
    pytester.makepyfile("def test_x(): pass")
    monkeypatch.setenv("MFSDP_SET", "train.seed=2;checkpoint.ckpt_format=zarr")
    result = pytester.runpytest_inprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: environment variable MFSDP_SET: checkpoint.ckpt_format='zarr' with*"]
    )


def test_hybrid_preset_is_checked_at_configure_time(pytester):
    """--mfsdp-preset alone is validated before any rank: where megatron-core has no HybridModel,
    one usage-error line naming the option, the field and the fix; where it has one, the run goes on."""
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest_inprocess("--mfsdp-preset=tiny-hybrid")
    problem = versions.hybrid_model_problem()
    if problem is None:
        assert result.ret == pytest.ExitCode.OK
        return
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    lines = [line for line in result.stderr.lines if line.strip()]
    assert lines == [
        f"ERROR: --mfsdp-preset: model.hybrid_layer_pattern='*-*-': {problem}; set "
        "model.hybrid_layer_pattern=None (a GPTModel)"
    ]


def test_v2_on_a_megatron_core_without_it_is_one_usage_error_line(pytester):
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest_inprocess("--mfsdp-set=ddp.megatron_fsdp_version=2")
    problem = versions.megatron_fsdp_v2_problem()
    if problem is None:
        assert result.ret == pytest.ExitCode.OK
        return
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    lines = [line for line in result.stderr.lines if line.strip()]
    assert lines == [
        f"ERROR: --mfsdp-set: ddp.megatron_fsdp_version=2: {problem}; set ddp.megatron_fsdp_version=1"
    ]
