"""--mfsdp-reruns and the marker's reruns=: a bad value is one usage-error line (pytest sessions run in
process: the run ends at configure or collection, no rank starts)."""

import pytest


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--mfsdp-reruns=-1"],
            "--mfsdp-reruns: invalid value '-1' for --mfsdp-reruns: must be a whole number",
        ),
        (
            ["--mfsdp-reruns=two"],
            "--mfsdp-reruns: invalid value 'two' for --mfsdp-reruns: must be a whole number",
        ),
    ],
)
def test_a_bad_reruns_value_is_one_line(pytester, args, message):
    pytester.makepyfile("def test_nothing(): pass\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert result.stderr.lines[0].startswith(f"ERROR: {message}"), result.stderr.lines


def test_a_bad_marker_reruns_is_one_line(pytester):
    pytester.makepyfile(
        "import pytest\n@pytest.mark.distributed(world_size=2, reruns=True)\ndef test_x(): pass\n"
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--mfsdp-platform=cpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "reruns=True must be a whole number, 0 or more" in result.stderr.str()
