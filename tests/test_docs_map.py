"""docs/architecture.md stays true: every module it names exists, and every module of ``distattn/`` and ``kernels/``
has its line there (issue 40: the map beside the code)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "architecture.md"
MAPPED = ("distattn", "kernels")
_NAMED = re.compile(r"`((?:distattn|kernels)/[\w/]+\.py)`")


def _named() -> set[str]:
    return set(_NAMED.findall(MAP.read_text()))


def test_every_module_it_names_exists():
    stale = sorted(path for path in _named() if not (ROOT / path).is_file())
    assert not stale, f"{MAP.relative_to(ROOT)} names modules that do not exist (moved or removed?): {stale}"


def test_every_module_has_a_line():
    modules = sorted(str(p.relative_to(ROOT)) for folder in MAPPED for p in (ROOT / folder).rglob("*.py"))
    missing = [m for m in modules if m not in _named()]
    assert not missing, (f"{MAP.relative_to(ROOT)} has no line for: {', '.join(missing)}; add one under its package "
                         "('- `path/to/module.py` — what this room owns.')")


def test_the_way_down_is_spelled_out():
    text = MAP.read_text()
    for room in ("distattn/api.py", "distattn/_ops.py", "distattn/attention.py", "distattn/comm.py",
                 "kernels/__init__.py"):
        assert f"`{room}`" in text.split("## What each room owns")[0], f"the one way down does not name {room}"
