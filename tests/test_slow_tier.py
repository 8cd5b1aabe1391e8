"""The slow tier's list (tests/slow_tests.py) cannot go stale unnoticed: an id that names no test fails a full run."""

from pathlib import Path
from types import SimpleNamespace

import slow_tests

TESTS = Path(__file__).resolve().parent


def _items(*nodeids):
    return set(nodeids)


def _config(*args, keyword=""):
    return SimpleNamespace(args=list(args), option=SimpleNamespace(keyword=keyword))


def test_a_listed_id_missing_from_a_whole_run_is_stale(monkeypatch):
    monkeypatch.setattr(slow_tests, "SLOW", {"tests/test_a.py::old_name": 5.0, "tests/test_b.py::kept": 6.0})
    items = _items("tests/test_a.py::new_name", "tests/test_b.py::kept")
    assert slow_tests.stale(items, _config(str(TESTS))) == ["tests/test_a.py::old_name"]
    assert slow_tests.stale(items, _config(str(TESTS.parent))) == ["tests/test_a.py::old_name"]


def test_a_narrowed_run_judges_nothing(monkeypatch):
    monkeypatch.setattr(slow_tests, "SLOW", {"tests/test_a.py::old_name": 5.0})
    items = _items("tests/test_a.py::new_name")
    assert slow_tests.stale(items, _config(str(TESTS / "test_a.py"))) == []  # one file: ids may be deselected
    assert slow_tests.stale(items, _config(str(TESTS), keyword="new")) == []  # -k narrows the collection
    assert slow_tests.stale(_items("tests/test_c.py::x"), _config(str(TESTS))) == []  # test_a.py not collected



def test_the_list_names_only_tests_that_exist(request):
    """In a run of the whole folder (the README's commands, CI), every listed id is a collected test."""
    gone = slow_tests.stale(slow_tests.COLLECTED, request.config)  # collected before -m "not slow" deselects
    assert not gone, ("tests/slow_tests.py lists tests that no longer exist (renamed or re-parametrized? list them "
                      "under their new ids): " + ", ".join(gone))
