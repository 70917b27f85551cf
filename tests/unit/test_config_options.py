"""--mfsdp-set and --mfsdp-use-megatron-fsdp as users meet them: one-line usage errors at configure
time, and precedence marker > command line > environment > ini (pytester, no torch)."""

import pytest

SHOW = (
    "import pytest\n"
    "from pytest_megatron_fsdp.options import resolve\n"
    "def pytest_configure(config):\n"
    "    print('SET', list(resolve(config, 'set')))\n"
    "    print('USE', resolve(config, 'use-megatron-fsdp'))\n"
)


@pytest.mark.parametrize(
    "args, message",
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
    result = pytester.runpytest_subprocess(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert len([line for line in result.stderr.lines if line.strip()]) == 1, result.stderr.lines


def test_bad_env_and_ini_values_name_their_source(pytester, monkeypatch):
    pytester.makepyfile("def test_x(): pass")
    pytester.makeini("[pytest]\nmfsdp_set =\n    train.seed=1\n    model.preset=3x\n")
    monkeypatch.setenv("MFSDP_USE_MEGATRON_FSDP", "perhaps")
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*environment variable MFSDP_USE_MEGATRON_FSDP: invalid value 'perhaps'*"])
    monkeypatch.delenv("MFSDP_USE_MEGATRON_FSDP")
    monkeypatch.setenv("MFSDP_SET", "train.seed=2;ddp.nope=1")
    result = pytester.runpytest_subprocess()
    result.stderr.fnmatch_lines(["*environment variable MFSDP_SET: invalid value 'ddp.nope=1'*"])


def test_precedence_cli_over_env_over_ini(pytester, monkeypatch):
    pytester.makeini(
        "[pytest]\nmfsdp_set =\n    train.seed=1\n    train.train_iters=5\nmfsdp_use_megatron_fsdp = false\n"
    )
    pytester.makeconftest(SHOW)
    pytester.makepyfile("def test_x(): pass")
    out = str(pytester.runpytest_subprocess("-s").stdout)
    assert "SET ['train.seed=1', 'train.train_iters=5']" in out and "USE False" in out
    monkeypatch.setenv("MFSDP_SET", "train.seed=2; ddp.overlap_grad_reduce=false")
    monkeypatch.setenv("MFSDP_USE_MEGATRON_FSDP", "true")
    out = str(pytester.runpytest_subprocess("-s").stdout)
    assert "SET ['train.seed=2', 'ddp.overlap_grad_reduce=false']" in out and "USE True" in out
    out = str(
        pytester.runpytest_subprocess(
            "-s",
            "--mfsdp-set=train.seed=3",
            "--mfsdp-set",
            "optimizer.lr=0.1",
            "--mfsdp-use-megatron-fsdp=false",
        ).stdout
    )
    assert "SET ['train.seed=3', 'optimizer.lr=0.1']" in out and "USE False" in out


def test_marker_wins_over_the_command_line(pytester):
    pytester.makepyfile(
        "import pytest\n"
        "from pytest_megatron_fsdp.options import resolve\n"
        "@pytest.mark.mfsdp_config(use_megatron_fsdp=True, set=['train.seed=4'])\n"
        "def test_x(request):\n"
        "    kwargs = request.node.get_closest_marker('mfsdp_config').kwargs\n"
        "    assert resolve(request.config, 'set', kwargs['set']) == ('train.seed=4',)\n"
        "    assert resolve(request.config, 'use-megatron-fsdp', kwargs['use_megatron_fsdp']) is True\n"
        "    assert resolve(request.config, 'set') == ('train.seed=3',)\n"
    )
    result = pytester.runpytest_subprocess("--mfsdp-set=train.seed=3", "--mfsdp-use-megatron-fsdp=false")
    result.assert_outcomes(passed=1)


def test_defaults_keep_megatron_fsdp_on_and_set_nothing(pytester):
    pytester.makeconftest(SHOW)
    pytester.makepyfile("def test_x(): pass")
    out = str(pytester.runpytest_subprocess("-s").stdout)
    assert "SET []" in out and "USE True" in out
