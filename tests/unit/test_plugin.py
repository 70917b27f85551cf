"""The plugin as users meet it: options, errors on bad input and markers, each in a pytest session run
in process (pytester's ``runpytest_inprocess``: no rank starts, the run ends at configure or
collection). Its light entry module: tests/unit/test_plugin_imports.py; sessions of their own process
(the entry point, a torchrun rank's environment): tests/integration/test_plugin_sessions.py."""

import pytest


@pytest.mark.parametrize(
    ("args", "message"),
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
    result = pytester.runpytest_inprocess(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_bad_environment_value_names_the_variable(pytester, monkeypatch):
    monkeypatch.setenv("MFSDP_PRESET", "gpt5")
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest_inprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*environment variable MFSDP_PRESET: invalid value 'gpt5'*choose one of: bridge-reference, tiny*"]
    )


def test_bad_ini_value_names_the_key(pytester):
    pytester.makeini("[pytest]\nmfsdp_platform = tpu\n")
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest_inprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*ini option mfsdp_platform: invalid value 'tpu'*"])


def test_option_typo_is_rejected(pytester):
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest_inprocess("--mfsdp-platfrom=cpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unrecognized arguments: --mfsdp-platfrom=cpu*"])


def test_precedence_cli_over_env_over_ini(pytester, monkeypatch):
    pytester.makeini("[pytest]\nmfsdp_pg_timeout = 11\n")
    pytester.makeconftest(
        "from pytest_megatron_fsdp.options import value_of\n"
        "def pytest_configure(config):\n"
        "    print('PG_TIMEOUT', value_of(config, 'pg-timeout').value)\n"
    )
    pytester.makepyfile("def test_x(): pass")
    assert "PG_TIMEOUT 11.0" in str(pytester.runpytest_inprocess("-s").stdout)
    monkeypatch.setenv("MFSDP_PG_TIMEOUT", "22")
    assert "PG_TIMEOUT 22.0" in str(pytester.runpytest_inprocess("-s").stdout)
    assert "PG_TIMEOUT 33.0" in str(pytester.runpytest_inprocess("-s", "--mfsdp-pg-timeout=33").stdout)


def test_bad_marker_arguments_are_a_usage_error(pytester):
    pytester.makepyfile("import pytest\n@pytest.mark.distributed(world=2)\ndef test_x(): pass\n")
    result = pytester.runpytest_inprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*bad @pytest.mark.distributed arguments*world*"])


def test_marker_world_size_must_be_positive(pytester):
    pytester.makepyfile("import pytest\n@pytest.mark.distributed(world_size=0)\ndef test_x(): pass\n")
    result = pytester.runpytest_inprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*world_size=0 must be a positive integer*"])


def test_dist_env_without_marker_fails_with_instructions(pytester):
    pytester.makepyfile("def test_x(dist_env): pass")
    result = pytester.runpytest_inprocess()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*mark the test @pytest.mark.distributed(world_size=N)*"])


def test_timeout_precedence_marker_cli_env_ini(pytester, monkeypatch):
    pytester.makeini("[pytest]\nmfsdp_timeout = 40\n")
    pytester.makeconftest(
        "import pytest\n"
        "from pytest_megatron_fsdp.wire.protocol import spec_of\n"
        "@pytest.hookimpl(trylast=True)\n"
        "def pytest_collection_modifyitems(items):\n"
        "    for item in items:\n"
        "        print('TIMEOUT', item.name, spec_of(item).timeout_s)\n"
    )
    pytester.makepyfile(
        "import pytest\n"
        "@pytest.mark.distributed(world_size=2, timeout=7)\n"
        "def test_marked(): pass\n"
        "@pytest.mark.distributed(world_size=2)\n"
        "def test_unmarked(): pass\n"
    )

    def timeouts(*args):
        out = pytester.runpytest_inprocess("--collect-only", "-s", *args).stdout.str()
        return [line.split()[1:] for line in out.splitlines() if line.startswith("TIMEOUT")]

    assert timeouts() == [["test_marked", "7.0"], ["test_unmarked", "40.0"]]
    monkeypatch.setenv("MFSDP_TIMEOUT", "30")
    assert timeouts() == [["test_marked", "7.0"], ["test_unmarked", "30.0"]]
    assert timeouts("--mfsdp-timeout=20") == [["test_marked", "7.0"], ["test_unmarked", "20.0"]]


def _sees_gpus(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """The session (run in this process) sees ``n`` GPUs; no rank is launched in these tests."""
    from pytest_megatron_fsdp.wire import platform

    monkeypatch.setattr(platform, "visible_gpu_count", lambda fast=False: n)


def test_too_few_gpus_skips_with_what_is_missing(pytester, monkeypatch):
    _sees_gpus(monkeypatch, 1)  # this parent sees one GPU
    pytester.makepyfile(
        "import pytest\n@pytest.mark.distributed(world_size=2)\ndef test_two(dist_env): pass\n"
    )
    result = pytester.runpytest_inprocess("-rs", "-p", "no:cacheprovider", "--mfsdp-platform=cuda")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*needs 2 GPUs (world_size=2, --mfsdp-platform=cuda); 1 visible*"])


def test_auto_platform_with_too_few_gpus_says_why_it_uses_cpu(pytester, monkeypatch):
    _sees_gpus(monkeypatch, 1)
    pytester.makepyfile(
        "import pytest\n@pytest.mark.distributed(world_size=2)\ndef test_two(dist_env): pass\n"
    )
    result = pytester.runpytest_inprocess("--collect-only", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(
        [
            "*world_size=2 -> platform=cpu, backend=gloo "
            "(auto: only 1 GPU(s) for 2 local ranks, so CPU ranks; "
            "--mfsdp-platform=cuda makes that an error)*"
        ]
    )
