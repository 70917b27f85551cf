"""The plugin in sessions of their own process: loaded through its pytest11 entry point, and as a
torchrun rank (the torchrun environment set), where a test of another world size is skipped and
--mfsdp-platform=cuda without GPUs is a usage error."""

import pytest


def as_torchrun_rank(monkeypatch, world_size=2, rank=0):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world_size))


def test_plugin_is_registered_through_its_entry_point(pytester):
    result = pytester.runpytest_subprocess("--help")
    result.stdout.fnmatch_lines(["*Megatron-FSDP distributed testing*", "*--mfsdp-platform=*"])


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
