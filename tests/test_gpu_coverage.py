"""Every CUDA-only branch of kernels/, distattn/ and launch/ is reached by a GPU-tier test (CPU tier: runs anywhere).

``tests/gpu_coverage.py`` finds the sites (``torch.cuda``, ``.is_cuda``, comparisons with ``"cuda"``) with ``ast`` and
keeps the map site -> covering tests; this file holds the two equal, so a new CUDA branch without a GPU-tier test
(or a test renamed or dropped from the tier) fails here, on a CPU-only machine.
"""
import ast
import textwrap

from gpu_coverage import COVERAGE, ROOT, cuda_sites


def _gpu_tests(rel: str) -> dict[str, bool]:
    """``{test function: in the GPU tier}`` of one test file (module ``pytestmark`` or a ``mark.gpu`` decorator)."""
    tree = ast.parse((ROOT / rel).read_text())
    module_gpu = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                     and "mark.gpu" in ast.unparse(n.value) for n in tree.body)
    return {n.name: module_gpu or any("mark.gpu" in ast.unparse(d) for d in n.decorator_list)
            for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def _comment_above(lines: list[str], node: ast.FunctionDef) -> list[str]:
    """The block of comment lines right above a function and its decorators."""
    i = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 2
    block = []
    while i >= 0 and lines[i].startswith("#"):
        block.append(lines[i])
        i -= 1
    return block


def test_every_cuda_site_has_a_gpu_test_and_no_entry_is_stale():
    sites = cuda_sites()
    missing = sorted(set(sites) - set(COVERAGE))
    assert not missing, ("CUDA-only code without a GPU-tier test; add a test under tests/test_gpu_*.py and an entry "
                         "to COVERAGE in tests/gpu_coverage.py for: "
                         + ", ".join(f"{s} (line {sites[s]})" for s in missing))
    stale = sorted(set(COVERAGE) - set(sites))
    assert not stale, f"COVERAGE entries naming no CUDA site (renamed? removed? fix tests/gpu_coverage.py): {stale}"


def test_every_covering_test_exists_in_the_gpu_tier():
    bad = []
    for site, tests in COVERAGE.items():
        assert tests, f"{site}: no covering test"
        for entry in tests:
            rel, _, name = entry.partition("::")
            tier = _gpu_tests(rel) if (ROOT / rel).is_file() else {}
            if not tier.get(name):
                bad.append(f"{site} -> {entry} ({'not in the GPU tier' if name in tier else 'no such test'})")
    assert not bad, "\n".join(bad)


def test_every_gpu_tier_test_says_which_cuda_branch_it_covers():
    """Each GPU-tier test has a comment above it (and its decorators), starting "# CUDA-only", naming its branch."""
    silent = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tier = _gpu_tests(rel)
        lines = path.read_text().splitlines()
        for node in ast.parse("\n".join(lines)).body:
            if isinstance(node, ast.FunctionDef) and tier.get(node.name):
                if not any(c.startswith("# CUDA-only") for c in _comment_above(lines, node)):
                    silent.append(f"{rel}::{node.name}")
    assert not silent, f"GPU-tier tests without a '# CUDA-only: ...' comment above them: {silent}"


def test_the_finder_sees_each_kind_of_site(tmp_path):
    """The scanner itself: torch.cuda, .is_cuda, == / != "cuda", methods and closures named by their function."""
    pkg = tmp_path / "kernels"
    pkg.mkdir()
    (pkg / "m.py").write_text(textwrap.dedent('''
        import torch
        X = torch.cuda.is_available()

        def a(t):
            def inner():
                return t.is_cuda
            return inner

        class C:
            def b(self, device):
                return device.type != "cuda"

            def c(self, device_type):
                return "cuda" == device_type

        def d(device):
            return device.type == "cpu"
    '''))
    for folder in ("distattn", "launch"):
        (tmp_path / folder).mkdir()
    assert set(cuda_sites(tmp_path)) == {"kernels/m.py:<module>", "kernels/m.py:a", "kernels/m.py:C.b",
                                         "kernels/m.py:C.c"}

