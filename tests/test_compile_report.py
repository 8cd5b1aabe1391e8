"""The sm_90a compile report (bench/compile_report.py --quick): no spills, 64-bit sequence and head offsets.

Compiles the configs the launcher may pick for d 64/128 (bf16, causal, MHA; GQA for dK/dV) for Hopper with the bundled ptxas: no GPU
needed, about a minute on two idle cores. Skipped when the installed Triton cannot target sm_90.
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import compile_report  # noqa: E402

# Every kept config of the subset compiles to wgmma with N >= 64 on every product (bench/results/compile-sm90/
# quick-tma.md): since the dK/dV kernel reads through tensor descriptors, d=128 fits wide too (it was the last
# narrow kernel: m64n8, see quick-wide.md).
_WHY = compile_report.sm90_unavailable()


def _quick(*flags) -> tuple[int, int, int, int]:
    """``compile_report.py --quick *flags``: (configs, spilling, narrow_mma, int32_offsets) of its summary line."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "compile_report.py"), "--quick", *flags],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=880)
    assert res.returncode == 0, res.stderr[-3000:]
    last = res.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"configs=(\d+) spilling=(\d+) narrow_mma=(\d+) int32_offsets=(\d+)", last)
    assert m, f"no summary line: {last!r}"
    return tuple(map(int, m.groups()))


@pytest.mark.skipif(bool(_WHY), reason=f"installed Triton cannot compile for sm_90: {_WHY}")
@pytest.mark.timeout(900)
def test_quick_report_no_spills_64bit_offsets():
    configs, spilling, narrow, i32 = _quick()
    assert configs > 0
    assert spilling == 0, f"{spilling} kept configs spill registers: prune them in kernels/_triton.py _keep_config"
    assert i32 == 0, f"{i32} compiled kernels multiply a sequence or head stride in int32 (wraps at 2^31)"
    assert narrow == 0, f"{narrow} kept configs use narrow MMAs (wgmma N < 64 or mma.sync): see _keep_config"


@pytest.mark.skipif(bool(_WHY), reason=f"installed Triton cannot compile for sm_90: {_WHY}")
@pytest.mark.timeout(900)
def test_pointer_path_64bit_offsets():
    """The dK/dV kernel without descriptors (fp32, unaligned or pre-Hopper inputs, DISTATTN_TMA=0) steps its GQA
    heads by pointer: no ``g * stride_h`` in int32 (it made int32_offsets=4 here). d=128 keeps its narrow MMAs."""
    configs, spilling, _, i32 = _quick("--no-tma", "--d", "128")
    assert configs > 0 and spilling == 0
    assert i32 == 0, f"{i32} compiled kernels multiply a sequence or head stride in int32 (wraps at 2^31)"


def test_int32_offset_check_sees_a_wrapping_product():
    # The IR pattern of `offs_m[:, None] * stride_qs` in int32, and its 64-bit fix.
    bad = """
    %offs = tt.expand_dims %rows {axis = 1 : i32} : tensor<128xi32> -> tensor<128x1xi32>
    %s = tt.splat %stride_qs : i32 -> tensor<128x1xi32>
    %p = arith.muli %offs, %s : tensor<128x1xi32>
    %k = arith.muli %stride_ks, %c64_i32 : i32
    """
    good = bad.replace("tensor<128x1xi32>", "tensor<128x1xi64>").replace(": i32 -> tensor<128x1xi64>",
                                                                         ": i64 -> tensor<128x1xi64>")
    assert compile_report.int32_stride_products(bad) == 1  # the constant BLOCK * stride is not counted
    assert compile_report.int32_stride_products(good) == 0
    # A head index (a GQA loop's g) times a head stride: (g * s * d) passes 2^31 at 1M tokens, d 128, 17 heads.
    head = """
    %h = arith.muli %g, %stride_qh : i32
    %h64 = arith.muli %g64, %stride_kh : i64
    """
    assert compile_report.int32_stride_products(head) == 1
