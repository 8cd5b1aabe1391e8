"""The deterministic config choice of the Triton launcher (the default on CUDA, for every key not tuned).

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
    from distattn.kernels import autotune_enabled

    monkeypatch.delenv("DISTATTN_AUTOTUNE", raising=False)
    assert not autotune_enabled()
    monkeypatch.setenv("DISTATTN_AUTOTUNE", "1")
    assert autotune_enabled()
    monkeypatch.setenv("DISTATTN_AUTOTUNE", "yes")
    with pytest.raises(ValueError, match=r"DISTATTN_AUTOTUNE='yes' must be 0 or 1"):
        autotune_enabled()


def test_mma_width_rule_matches_the_sm90_compile_report():
    # Shapes ptxas reported (bench/results/compile-sm90/): m64n32 for 64 rows on 8 warps, m64n64 for 128 rows,
    # mma.sync below a warpgroup's 64 rows.
    assert tr._mma_n(64, 64, 8) == 32 and tr._mma_n(128, 64, 8) == 64 and tr._mma_n(64, 128, 4) == 128
    assert tr._mma_n(32, 64, 4) == 0 and tr._mma_n(16, 64, 8) == 0
    assert tr._wide("dkdv", 64, 128, 8, 64) and not tr._wide("dkdv", 16, 64, 8, 128)


@pytest.mark.parametrize("name", ["fwd", "dq", "dkdv"])
@pytest.mark.parametrize("block_d", [64, 128])
def test_two_byte_picks_are_wide_where_a_wide_config_fits(name, block_d):
    for bucket in (64, 4096):
        pick = tr._Heuristic(name, _Raw()).pick({"Q": torch.empty(1, dtype=torch.bfloat16), "BLOCK_D": block_d,
                                                 "LEN_BUCKET": bucket})
        if (name, block_d) in tr._NARROW_ONLY or (name == "dkdv" and bucket == 64):
            continue  # dK/dV d=128: every wide config spills; a 64-token bucket: no wide dK/dV tile fits
        assert tr._wide(name, pick[0], pick[1], pick[2], block_d), (name, block_d, bucket, pick)
