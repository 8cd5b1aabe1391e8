"""The deterministic config choice of the Triton launcher (``DISTATTN_AUTOTUNE=0``, the default on CUDA).

Every rank of a process group must launch the same config, and nothing may be benchmarked inside a
distributed step: the launcher takes the first config of ``_CONFIGS`` (ordered by preference from the sm_90
compile report) that the filter keeps. Checked here on CPU with a stand-in for the jit function.
"""

import pytest
import torch

tr = pytest.importorskip("distattn.kernels._triton")
if tr._IMPORT_ERROR is not None:
    pytest.skip(f"triton not importable: {tr._IMPORT_ERROR}", allow_module_level=True)

H100_SMEM = 232448  # sm_90 opt-in shared memory per block


class _Raw:
    """Records the launch the heuristic makes (grid, kwargs) instead of compiling."""

    arg_names = ["Q", "BLOCK_D", "LEN_BUCKET"]

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launched = (grid, kwargs)
        return run


@pytest.fixture(autouse=True)
def _smem(monkeypatch):
    monkeypatch.setattr(tr, "_max_shared_mem_cached", lambda device: H100_SMEM)


@pytest.mark.parametrize("name", ["fwd", "dq", "dkdv"])
@pytest.mark.parametrize("dtype,block_d", [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float16, 256),
                                           (torch.float32, 128)])
def test_first_kept_config_is_chosen_and_is_deterministic(name, dtype, block_d):
    q = torch.empty(1, dtype=dtype)
    named = {"Q": q, "BLOCK_D": block_d, "LEN_BUCKET": 4096}
    h = tr._Heuristic(name, _Raw())
    pick = h.pick(named)
    kept = [c for c in tr._CONFIGS[name] if tr._keep_config(name, c[0], c[1], c[3], block_d, q.element_size(), 4096,
                                                             H100_SMEM, warps=c[2])]
    assert kept and pick == kept[0]
    assert h.pick(dict(named)) == pick  # the same on every call (and so on every rank)
    if dtype == torch.float32:
        assert pick[0] * pick[1] <= 32 * 32  # fp32 ieee dots: small tiles only
    assert (name, *pick) not in tr._SPILLS.get(block_d, ())


def test_launch_passes_the_chosen_config_and_resolves_the_grid():
    raw = _Raw()
    h = tr._Heuristic("fwd", raw)
    q = torch.empty(1, dtype=torch.bfloat16)
    h[lambda meta: (100 // meta["BLOCK_M"], 7)](q, 128, 4096, MASK=1)
    grid, kwargs = raw.launched
    bm, bn, warps, stages = h.pick({"Q": q, "BLOCK_D": 128, "LEN_BUCKET": 4096})
    assert grid == (100 // bm, 7)
    assert (kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["num_warps"], kwargs["num_stages"]) == (bm, bn, warps, stages)
    assert kwargs["MASK"] == 1


def test_autotune_is_opt_in(monkeypatch):
    monkeypatch.delenv("DISTATTN_AUTOTUNE", raising=False)
    assert not tr.autotune_enabled()
    monkeypatch.setenv("DISTATTN_AUTOTUNE", "1")
    assert tr.autotune_enabled()
