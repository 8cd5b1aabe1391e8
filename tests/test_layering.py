"""The layers import one way (ARCHITECTURE.md): ``kernels/`` is single-device math, so no module under it imports
``torch.distributed`` or the layer above it (``distattn``), at module level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parent.parent / "kernels"


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every import in ``path``, the modules that ``import_module``/``__import__`` name
    included; a relative import is written with its leading dots."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            found += [(node.lineno, f"{base}.{alias.name}" if base and not base.endswith(".") else base + alias.name)
                      for alias in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                "import_module", "__import__"):
            found += [(node.lineno, a.value) for a in node.args[:1] if isinstance(a, ast.Constant)]
    return found


def _upward_or_distributed(name: str) -> bool:
    if name == "torch.distributed" or name.startswith("torch.distributed."):
        return True
    if name.startswith(".."):  # kernels/ has no subpackages: two dots leave it
        return True
    return (name == "distattn" or name.startswith("distattn.")) and not (
        name == "distattn.kernels" or name.startswith("distattn.kernels."))


def test_no_kernels_module_imports_torch_distributed_or_distattn():
    sources = sorted(KERNELS.rglob("*.py"))
    assert {"__init__.py", "_tune.py", "_triton.py"} <= {p.name for p in sources}
    bad = [f"{p.relative_to(KERNELS.parent)}:{line}: {name}" for p in sources for line, name in _imports(p)
           if _upward_or_distributed(name)]
    assert not bad, "kernels/ must not import torch.distributed or distattn's upper layers:\n" + "\n".join(bad)


def test_the_check_sees_every_way_of_writing_such_an_import(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import torch.distributed as dist\nfrom torch import distributed\n"
                    "def f():\n    from distattn import comm\n    import importlib\n"
                    "    importlib.import_module('torch.distributed')\nfrom .. import api\n"
                    "from . import _triton\nfrom distattn.kernels import _masks\nimport torch\n")
    flagged = [name for _, name in _imports(path) if _upward_or_distributed(name)]
    assert sorted(flagged) == ["..api", "distattn.comm", "torch.distributed", "torch.distributed", "torch.distributed"]
