"""Warnings relayed from ranks: merged once across ranks, categories kept, handed back to the recorder."""

import warnings

from pytest_megatron_fsdp.wire import warnings_relay


def test_merge_counts_a_warning_raised_alike_on_every_rank_once():
    def one(message, lineno=3):
        return {
            "module": "builtins",
            "category": "UserWarning",
            "message": message,
            "filename": "t.py",
            "lineno": lineno,
        }

    merged = warnings_relay.merge(
        {0: [one("a"), one("b"), one("b")], 1: [one("a"), one("c")], 2: [one("b"), one("a", lineno=4)]}
    )
    assert [(d["message"], d["lineno"]) for d in merged] == [("a", 3), ("b", 3), ("b", 3), ("c", 3), ("a", 4)]


def test_a_category_the_parent_cannot_import_keeps_its_name_in_the_message():
    data = {
        "module": "nowhere_to_be_found",
        "category": "OddWarning",
        "message": "m",
        "filename": "f.py",
        "lineno": 1,
    }
    message = warnings_relay.warning_message(data)
    assert message.category is warnings_relay.RankWarning
    assert str(message.message) == "OddWarning: m"
    known = warnings_relay.warning_message({**data, "module": "builtins", "category": "DeprecationWarning"})
    assert known.category is DeprecationWarning
    assert isinstance(known.message, DeprecationWarning)


def test_capture_hands_the_warnings_back_to_the_enclosing_recorder():
    with warnings.catch_warnings(record=True) as outer:
        warnings.simplefilter("default")
        with warnings_relay.capture() as inner:
            warnings.warn("once here", UserWarning, stacklevel=1)
    assert [str(m.message) for m in inner] == ["once here"]
    assert [str(m.message) for m in outer] == ["once here"]
