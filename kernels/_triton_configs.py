"""The launch configs of the Triton kernels on CUDA and the filter that keeps the ones worth running.

It owns the candidate tables (``_CONFIGS``: ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` per kernel, in order of
preference), what the sm_90 compile reports ruled out (``_SPILLS``, ``_SPILLS_TMA``, ``_NARROW_ONLY``,
``_MAX_TILE_D256``), the filter (``_keep_config``: shared memory, register spills, wide MMAs) and ``_PickKey``, the key
a launch's choice and the tuned table (``_tune.py``) are filed under. Pure Python over ints and strings: it imports
nothing of the package and neither torch nor triton; ``_triton.py`` (the launchers, which pick a config per launch)
imports it and hands its names on, so ``_triton._CONFIGS`` and the rest keep their names.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["_CONFIGS", "_MAX_TILE_D256", "_SPILLS", "_NARROW_ONLY", "_SPILLS_TMA", "_mma_n", "_wide", "_smem_bytes",
           "_keep_config", "_PickKey"]


# (BLOCK_M, BLOCK_N, num_warps, num_stages); for dkdv BLOCK_N is the resident key block. Picked from sm_90
# compiles of these kernels (ptxas register/spill report, bench/results/compile-sm90/): every (head dim, dtype)
# has configs that do not spill, e.g. fwd d=128 (128, 64, 8, 3), d=256 (64, 32, 8, 2); dkdv d=64 and d=128
# (64, 128, 8, 2) through descriptors; fp32 only 32x32 tiles (its "ieee" dots run on FMA units and need far
# more registers).
_CONFIGS = {
    "fwd": [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 64, 4, 4), (128, 32, 8, 2),
            (64, 32, 8, 2), (64, 64, 8, 2), (32, 32, 4, 2), (32, 32, 8, 2)],
    "dq": [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3), (32, 64, 8, 2), (64, 32, 8, 2),
           (32, 32, 4, 2), (32, 32, 8, 2)],
    "dkdv": [(64, 128, 8, 2), (64, 128, 8, 1), (32, 64, 4, 3), (32, 128, 8, 3), (16, 64, 8, 3), (32, 64, 8, 2),
             (64, 64, 8, 3), (32, 32, 8, 2), (16, 32, 4, 2), (32, 32, 4, 2)],
}
# Largest tile (BLOCK_M * BLOCK_N) kept for d = 256 with 2-byte inputs: bigger ones spill registers heavily.
_MAX_TILE_D256 = {"fwd": 64 * 64, "dq": 64 * 64, "dkdv": 32 * 64}
# Configs that spill registers with 2-byte inputs, by BLOCK_D, from the sm_90a compile report (ptxas spill stores
# in bytes, the worst of causal/dense, MHA and GQA 32/8 heads, which share one key). BLOCK_D = 128 also serves
# d = 80 and 96 (padded to 128). dkdv here is its pointer path (bench/results/compile-sm90/pointer-bf16.md);
# with descriptors see _SPILLS_TMA.
#   128: fwd (128, 64, 4, 3) 588 B, fwd (128, 128, 8, 2) 52 B; dkdv (64, 128, 8, 2) 248 B, (64, 128, 8, 1) 24 B,
#        (64, 64, 8, 3) 100 B, (32, 64, 4, 3) 32 B; (32, 128, 8, 3), (32, 64, 8, 2), (32, 32, 4, 2) spilled
#        before the kernel's rewrite and stay out (narrow anyway)
#   64:  dkdv (32, 32, 4, 2) 4 B (before the rewrite)
# Pruned here rather than left to chance (a spilling config can still win a noisy benchmark).
_SPILLS = {
    128: {("fwd", 128, 64, 4, 3), ("fwd", 128, 128, 8, 2), ("dkdv", 64, 128, 8, 2), ("dkdv", 64, 128, 8, 1),
          ("dkdv", 32, 64, 4, 3), ("dkdv", 64, 64, 8, 3), ("dkdv", 32, 128, 8, 3), ("dkdv", 32, 64, 8, 2),
          ("dkdv", 32, 32, 4, 2)},
    64: {("dkdv", 32, 32, 4, 2)},
    # 256 (full-tma.md and d256.md, bf16 and fp16 alike): fwd (64, 64, 4, 3) 376 B, (128, 32, 8, 2) 228 B,
    # (32, 32, 8, 2) 60 B, (64, 64, 8, 2) 28 B (the carried fold); dq (64, 32, 4, 3) 488 B
    256: {("fwd", 64, 64, 4, 3), ("fwd", 128, 32, 8, 2), ("fwd", 32, 32, 8, 2), ("fwd", 64, 64, 8, 2),
          ("dq", 64, 32, 4, 3)},
}
# (kind, BLOCK_D) where, without descriptors, no config with wide MMAs fits in registers, so narrow ones stay
# allowed: dK/dV at d=128 keeps two fp32 [128 keys, 128] accumulators (128 registers a thread at 8 warps), and
# the per-element addresses of the streamed q, do, lse, delta tiles push every wide shape over 255 registers.
_NARROW_ONLY = {("dkdv", 128)}
# The dK/dV kernel through tensor descriptors (sm_90+, aligned inputs; ``TMA`` in the launcher): q, do, lse and
# delta need no address registers and dk, dv leave by reduction, so every dK/dV config of _CONFIGS compiles
# without spills at d 64 and 128, bf16, MHA and GQA, causal and dense (bench/results/compile-sm90/tma-bf16.md).
# d=256 stays narrow (two fp32 [keys, 256] accumulators leave room for 32-64 keys only) and these spill there:
# (32, 64, 4, 3) 3744 B, (32, 32, 4, 2) 448 B, (32, 64, 8, 2) 112 B, (16, 64, 8, 3) 12 B, (16, 32, 4, 2) 8 B.
_SPILLS_TMA: dict = {128: set(), 64: set(),
                     256: {("dkdv", 32, 64, 4, 3), ("dkdv", 32, 32, 4, 2), ("dkdv", 32, 64, 8, 2),
                           ("dkdv", 16, 64, 8, 3), ("dkdv", 16, 32, 4, 2)}}


def _mma_n(m: int, n: int, warps: int) -> int:
    """N of the wgmma Triton (sm_90) emits for an [m, n] product on ``warps`` warps; 0 when it is not wgmma.

    A warpgroup covers 64 rows; warps left over once the rows are covered (16 rows a warp) split the columns."""
    if m % 64 or warps % 4:
        return 0  # mma.sync
    return n // max(warps // (m // 16), 1)


def _wide(kind: str, bm: int, bn: int, warps: int, block_d: int) -> bool:
    """Every matmul product of the kernel is a wgmma with N >= 64 (what keeps Hopper's tensor cores busy)."""
    products = {"fwd": [(bm, bn), (bm, block_d)],                     # S = Q K^T, O += P V
                "dq": [(bm, bn), (bm, block_d)],                      # S, dP = dO V^T; dQ += dS K
                "dkdv": [(bn, bm), (bn, block_d)]}[kind]              # S^T = K Q^T, dP^T; dV += P^T dO, dK
    return all(_mma_n(m, n, warps) >= 64 for m, n in products)


def _smem_bytes(kind: str, bm: int, bn: int, stages: int, block_d: int, elt: int) -> int:
    """Shared memory: resident tiles + stages x streamed tiles (matches Triton's sm_90 allocation here)."""
    rows = {"fwd": bm + 2 * stages * bn,        # q resident; k, v streamed
            "dq": 2 * bm + 2 * stages * bn,     # q, do resident; k, v streamed
            "dkdv": 2 * bn + 2 * stages * bm}[kind]  # k, v resident; q, do streamed
    return rows * block_d * elt


def _keep_config(kind, bm, bn, stages, block_d, elt, bucket, smem_limit, warps=None, narrow_ok=False,
                 tma=False) -> bool:
    """narrow_ok: second pass when no wide config is kept (short sequences: a bucket smaller than every wide tile).
    tma: the dK/dV kernel reads q, do, lse, delta through tensor descriptors (its own spill table)."""
    if _smem_bytes(kind, bm, bn, stages, block_d, elt) > smem_limit:
        return False  # would fail to launch (OutOfResources)
    if max(bm, bn) > bucket:
        return False  # a tile longer than the sequence only adds masked work
    if elt >= 4:
        return bm * bn <= 32 * 32
    if (kind, bm, bn, warps, stages) in (_SPILLS_TMA if tma and kind == "dkdv" else _SPILLS).get(block_d, ()):
        return False
    if block_d >= 256:
        return bm * bn <= _MAX_TILE_D256[kind]
    narrow_only = (kind, block_d) in _NARROW_ONLY and not (tma and kind == "dkdv")
    if warps is not None and not narrow_ok and 64 <= block_d <= 128 and not narrow_only \
            and not _wide(kind, bm, bn, warps, block_d):
        return False  # a narrow wgmma or mma.sync where a wide config exists (bench/compile_report.py)
    return bm * bn >= 1024  # 2-byte inputs: tiny tiles leave the tensor cores idle


class _PickKey(NamedTuple):
    """What a launch's config choice depends on: everything ``_keep_config`` reads, plus MASK (causal and dense
    launches keep the same configs but may prefer different ones). Also the key of the tuned table."""

    kernel: str  # "fwd", "dq" or "dkdv"
    block_d: int
    dtype: str  # "bfloat16", "float16", "float32" (sets the element size the filter reads)
    mask: int
    len_bucket: int
    tma: bool  # dK/dV through tensor descriptors: its own spill table
    smem: int  # bytes of shared memory per block on the launch's device

    def text(self) -> str:
        """``kernel=fwd,block_d=128,...``: the form of the JSON cache and of the table ranks exchange."""
        return ",".join(f"{name}={int(v) if isinstance(v, bool) else v}" for name, v in self._asdict().items())

    @classmethod
    def from_text(cls, text: str) -> "_PickKey":
        kv = dict(item.split("=", 1) for item in text.split(","))
        if set(kv) != set(cls._fields):
            raise ValueError(f"{text!r} is not a pick key: it needs exactly the fields {cls._fields}")
        return cls(kv["kernel"], int(kv["block_d"]), kv["dtype"], int(kv["mask"]), int(kv["len_bucket"]),
                   bool(int(kv["tma"])), int(kv["smem"]))
