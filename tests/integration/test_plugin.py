"""The plugin as users meet it: options, errors on bad input and markers (its light entry module:
tests/unit/test_plugin_imports.py)."""

import pytest


def as_torchrun_rank(monkeypatch, world_size=2, rank=0):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world_size))


def test_plugin_is_registered_through_its_entry_point(pytester):
    result = pytester.runpytest_subprocess("--help")
    result.stdout.fnmatch_lines(["*Megatron-FSDP distributed testing*", "*--mfsdp-platform=*"])


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--mfsdp-preset=huge"],
            "*--mfsdp-preset: invalid value 'huge' for --mfsdp-preset: "
            "choose one of: bridge-reference, tiny*",
        ),
        (
            ["--mfsdp-platform=gpu"],
            "*invalid value 'gpu' for --mfsdp-platform: choose one of: auto, cpu, cuda*",
        ),
        (
            ["--mfsdp-pg-timeout=-3"],
            "*invalid value '-3' for --mfsdp-pg-timeout: must be a positive number*",
        ),
    ],
)
def test_bad_option_value_is_one_clear_line(pytester, args, message):
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest_subprocess(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_bad_environment_value_names_the_variable(pytester, monkeypatch):
    monkeypatch.setenv("MFSDP_PRESET", "gpt5")
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*environment variable MFSDP_PRESET: invalid value 'gpt5'*choose one of: bridge-reference, tiny*"]
    )


def test_bad_ini_value_names_the_key(pytester):
    pytester.makeini("[pytest]\nmfsdp_platform = tpu\n")
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*ini option mfsdp_platform: invalid value 'tpu'*"])


def test_option_typo_is_rejected(pytester):
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest_subprocess("--mfsdp-platfrom=cpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unrecognized arguments: --mfsdp-platfrom=cpu*"])


def test_precedence_cli_over_env_over_ini(pytester, monkeypatch):
    pytester.makeini("[pytest]\nmfsdp_pg_timeout = 11\n")
    pytester.makeconftest(
        "from pytest_megatron_fsdp.options import resolve\n"
        "def pytest_configure(config):\n"
        "    print('PG_TIMEOUT', resolve(config, 'pg-timeout'))\n"
    )
    pytester.makepyfile("def test_x(): pass")
    assert "PG_TIMEOUT 11.0" in str(pytester.runpytest_subprocess("-s").stdout)
    monkeypatch.setenv("MFSDP_PG_TIMEOUT", "22")
    assert "PG_TIMEOUT 22.0" in str(pytester.runpytest_subprocess("-s").stdout)
    assert "PG_TIMEOUT 33.0" in str(pytester.runpytest_subprocess("-s", "--mfsdp-pg-timeout=33").stdout)


def test_bad_marker_arguments_are_a_usage_error(pytester):
    pytester.makepyfile("import pytest\n@pytest.mark.distributed(world=2)\ndef test_x(): pass\n")
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*bad @pytest.mark.distributed arguments*world*"])


def test_marker_world_size_must_be_positive(pytester):
    pytester.makepyfile("import pytest\n@pytest.mark.distributed(world_size=0)\ndef test_x(): pass\n")
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*world_size=0 must be a positive integer*"])


def test_other_world_size_under_torchrun_is_skipped_with_reason(pytester, monkeypatch):
    as_torchrun_rank(monkeypatch, world_size=1)
    pytester.makepyfile(
        "import pytest\n"
        "@pytest.mark.distributed(world_size=2)\ndef test_two(): pass\n"
        "def test_plain(): pass\n"
    )
    result = pytester.runpytest_subprocess("-rs", "--mfsdp-platform=cpu")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*needs world_size=2; this torchrun session has 1 ranks*"])


def test_cuda_platform_without_gpus_is_an_error_not_a_fallback(pytester, monkeypatch):
    as_torchrun_rank(monkeypatch, world_size=2)
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest_subprocess("--mfsdp-platform=cuda")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "*--mfsdp-platform=cuda needs one GPU per local rank: "
            "2 ranks on this node but 0 CUDA device(s) visible*"
        ]
    )


def test_dist_env_without_marker_fails_with_instructions(pytester):
    pytester.makepyfile("def test_x(dist_env): pass")
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*mark the test @pytest.mark.distributed(world_size=N)*"])
