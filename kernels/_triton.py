"""Triton backend: thin launchers around the kernels of ``_triton_fwd.py`` / ``_triton_bwd.py``.

Legend: q_bshd (b, s_q, h_q, d), k_bshd / v_bshd (b, s_k, h_kv, d), lse_bhs (b, h_q, s_q) fp32 natural log.

On CUDA each attention kernel launches with a config chosen deterministically per pick key (``_PickKey``: kernel,
BLOCK_D, dtype, MASK kind, power-of-two bucket of the chunk lengths, TMA, shared memory): the config that
a tuning installed for that key in ``_CHOSEN`` (``_tune.install_table``), else the first config of ``_CONFIGS``
that the filter keeps (the tables and the filter: ``_triton_configs.py``). Every rank therefore launches the same
config, and nothing is ever benchmarked at launch time, inside a distributed step. ``autotune`` (``_tune.py``) benchmarks the kept configs once, before training, caches
its choices on disk per GPU name, Triton version and kernel sources, and installs the table in this process;
``distattn.autotune`` has rank 0 of a process group do that and installs rank 0's table on every rank
(``launch/train.py`` calls it when ``DISTATTN_AUTOTUNE=1``). MASK: 0 none, 1 causal on
positions, 2 per-row key bounds (``_masks.KeyBounds``: packed documents, sliding windows). Under
``TRITON_INTERPRET=1`` (CPU tests) one fixed small configuration is used, because the interpreter is slow and
timing it would measure nothing. Whether the kernels are interpreted is decided by Triton when they are
*decorated*, i.e. when this module is first imported, so the environment variable must be set before that
(tests/conftest.py and tests/test_triton.py do so).
"""
import functools
import os
from typing import Optional

import torch

# The config tables and their filter (a room of their own); their names stay reachable here as before.
from ._triton_configs import (_CONFIGS, _MAX_TILE_D256, _NARROW_ONLY, _SPILLS, _SPILLS_TMA,  # noqa: F401
                              _PickKey, _keep_config, _mma_n, _smem_bytes, _wide)

try:
    import triton

    import distattn.kernels._masks as _masks
    import distattn.kernels._triton_bwd as _bwd
    import distattn.kernels._triton_fwd as _fwd
    _IMPORT_ERROR: Optional[BaseException] = None
except ImportError as exc:  # the package stays importable without triton; get_backend reports why
    triton = None
    _IMPORT_ERROR = exc

# Decided once, when the kernels were decorated: read it off the kernel object rather than the environment.
_INTERPRET = _IMPORT_ERROR is None and type(_fwd._fwd_kernel).__name__ == "InterpretedFunction"
if _INTERPRET:
    import distattn.kernels._interp_compat as _interp_compat
    _interp_compat.install()  # Triton 3.6's interpreter under NumPy >= 2.4 (a no-op elsewhere)
_INTERP_BLOCK = 16  # smallest tile tl.dot accepts; keeps the interpreter fast enough for CI
_MIN_BLOCK_D = 16


def is_available(device) -> tuple[bool, str]:
    """Whether TritonBackend can run on ``device``; the string says why not (empty when it can)."""
    if _IMPORT_ERROR is not None:
        return False, f"triton is not importable: {_IMPORT_ERROR}"
    dev = torch.device(device)
    if dev.type == "cuda":
        # Compiled kernels, or (if decorated under TRITON_INTERPRET=1) the interpreter on CUDA tensors.
        if not torch.cuda.is_available():
            return False, "device is cuda but torch.cuda.is_available() is False"
        return True, ""
    if dev.type != "cpu" or os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False, (f"the triton backend needs a CUDA device, got {dev.type!r}; on CPU set TRITON_INTERPRET=1 "
                       "before importing distattn to run it on CPU through the Triton interpreter")
    if not _INTERPRET:
        return False, ("TRITON_INTERPRET=1 was set after distattn.kernels._triton was imported, so its kernels "
                       "were compiled for a GPU; set it before the first import")
    return True, ""


# ----------------------------------------------------------------------------- autotuning (CUDA only)

def _len_bucket(*lengths: int) -> int:
    """Power-of-two bucket of the longest length (>= 64): the autotune key for sequence length."""
    return max(64, triton.next_power_of_2(max(lengths)))


@functools.lru_cache(maxsize=None)
def _max_shared_mem_cached(device) -> int:
    return _max_shared_mem(device)


def _max_shared_mem(device) -> int:
    props = torch.cuda.get_device_properties(device)
    smem = getattr(props, "shared_memory_per_block_optin", 0)
    if not smem:
        smem = triton.runtime.driver.active.utils.get_device_properties(props.index)["max_shared_mem"]
    return smem


def _pick_key(name: str, named: dict) -> _PickKey:
    """The key of one launch (``named``: the kernel's arguments by name, as the launcher passes them)."""
    ref = named["Q"]
    return _PickKey(name, int(named["BLOCK_D"]), str(ref.dtype).removeprefix("torch."), int(named.get("MASK", 0)),
                    int(named["LEN_BUCKET"]), bool(named.get("TMA", False)), _max_shared_mem_cached(ref.device))


def _kept(name: str, named: dict) -> list:
    """The configs of ``_CONFIGS[name]`` the filter keeps for this launch, in order of preference (never empty).

    Wide MMAs first; narrow ones only when no wide config fits (short sequences); when nothing fits at all, the
    config with the smallest shared-memory footprint. What ``autotune`` benchmarks, and the heuristic's list."""
    key = _pick_key(name, named)
    elt = named["Q"].element_size()
    for narrow_ok in (False, True):
        kept = [c for c in _CONFIGS[name]
                if _keep_config(name, c[0], c[1], c[3], key.block_d, elt, key.len_bucket, key.smem, warps=c[2],
                                narrow_ok=narrow_ok, tma=key.tma)]
        if kept:
            return kept
    return [min(_CONFIGS[name], key=lambda c: _smem_bytes(name, c[0], c[1], c[3], key.block_d, elt))]


# Configs installed by ``_tune.install_table`` (``distattn.autotune``: rank 0's choice on every rank): _PickKey ->
# (BLOCK_M, BLOCK_N, num_warps, num_stages). Keys not in it fall back to the heuristic.
_CHOSEN: dict = {}


class _Heuristic:
    """Launch with the config tuned for this launch's key (``_CHOSEN``), else the first listed config
    (``_CONFIGS`` is in order of preference, from the sm_90 compile report) that the filter keeps:
    deterministic, so every rank of a process group picks the same config and nothing is benchmarked inside a
    distributed step."""

    def __init__(self, name: str, raw):
        self.name, self.raw = name, raw

    def pick(self, named: dict) -> tuple[int, int, int, int]:
        chosen = _CHOSEN.get(_pick_key(self.name, named))
        return chosen if chosen is not None else _kept(self.name, named)[0]

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            named = dict(zip(self.raw.arg_names, args), **kwargs)
            bm, bn, warps, stages = self.pick(named)
            meta = dict(kwargs, BLOCK_M=bm, BLOCK_N=bn)
            return self.raw[grid(meta) if callable(grid) else grid](
                *args, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **kwargs)
        return launch


def _raw_kernel(name: str):
    """The jit function of kernel ``name`` ("fwd", "dq", "dkdv")."""
    return {"fwd": _fwd._fwd_kernel, "dkdv": _bwd._bwd_dkdv_kernel, "dq": _bwd._bwd_dq_kernel}[name]


def _kernel(name: str):
    """The launchable kernel: config from the tuned table or the heuristic on CUDA, the raw jit function under
    the interpreter (the launcher passes its fixed tiles, ``_blocks``)."""
    raw = _raw_kernel(name)
    return raw if _INTERPRET else _Heuristic(name, raw)


def _blocks() -> dict:
    """Fixed tile sizes for the untuned path (interpreter)."""
    return {"BLOCK_M": _INTERP_BLOCK, "BLOCK_N": _INTERP_BLOCK} if _INTERPRET else {}


# ----------------------------------------------------------------------------- helpers

def _unit_d(t: torch.Tensor) -> torch.Tensor:
    """The kernels address d with unit stride; everything else goes through explicit strides."""
    return t if t.stride(-1) == 1 else t.contiguous()


# ----------------------------------------------------------------------------- TMA (dK/dV kernel)

_TMA_MODE = os.environ.get("DISTATTN_TMA", "auto")  # "0": never use tensor descriptors (the pointer path)


def _tma_device(device) -> bool:
    """``DISTATTN_TMA=0`` turns the descriptor path off (read at import; tests patch ``_TMA_MODE``)."""
    return _TMA_MODE != "0" and _tma_device_cached(device)


@functools.lru_cache(maxsize=None)
def _tma_device_cached(device) -> bool:
    """Whether the dK/dV kernel may read through tensor descriptors on this device: sm_90 and newer (TMA), the
    interpreter (which emulates them, so CPU tests cover that path), and ``meta`` tensors (only
    ``bench/compile_report.py`` launches on those, and it compiles for sm_90)."""
    if not hasattr(triton.language, "make_tensor_descriptor"):
        return False
    if _INTERPRET or device.type == "meta":
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _tma_aligned(t: torch.Tensor, unit_dim: int) -> bool:
    """A descriptor can address ``t``: 16-byte aligned base and strides, unit stride in ``unit_dim``, no
    broadcast (stride-0) dimension (e.g. the gradient of ``out.sum(1)``: the pointer path reads those)."""
    elt = t.element_size()
    return t.stride(unit_dim) == 1 and t.data_ptr() % 16 == 0 and \
        all(st * elt % 16 == 0 and (st > 0 or n == 1)
            for i, (st, n) in enumerate(zip(t.stride(), t.shape)) if i != unit_dim)


def _tma_stats(t: torch.Tensor) -> torch.Tensor:
    """lse / delta (b, h, s) fp32 as a descriptor can read them: a copy with s padded to a multiple of 4 when
    the rows are not 16-byte aligned (odd lengths); 1/(2d) of the bytes q and do move, once per call."""
    if _tma_aligned(t, 2):
        return t
    b, h, s = t.shape
    out = torch.empty((b, h, -(-s // 4) * 4), dtype=t.dtype, device=t.device)[:, :, :s]
    return out.copy_(t)


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for kernels that build tensor descriptors on the device (128 B each)."""
    buf = torch.empty(size, dtype=torch.int8, device=torch.device("cuda", torch.cuda.current_device()))
    assert buf.data_ptr() % alignment == 0, (buf.data_ptr(), alignment)  # the caching allocator aligns to 512 B
    return buf


def _ensure_allocator() -> None:
    """Device-side descriptors need a Triton scratch allocator in the launching thread's context (a ContextVar:
    autograd's backward threads start without one). Sets ours only where none is set."""
    try:
        from triton.runtime._allocation import NullAllocator, _allocator
        current = _allocator.get() if hasattr(_allocator, "get") else _allocator  # Triton 3.4: a plain global
        if not isinstance(current, NullAllocator):
            return
    except ImportError:  # a Triton that keeps it elsewhere: set ours
        pass
    triton.set_allocator(_scratch)


def _bsh(t: Optional[torch.Tensor]) -> tuple:
    return (t.stride(0), t.stride(1), t.stride(2)) if t is not None else (0, 0, 0)


def _block_d(d: int) -> int:
    return max(_MIN_BLOCK_D, triton.next_power_of_2(d))


def _row_block(d: int) -> int:
    """Rows per program of the elementwise kernels (merge, delta): ~8K elements per fp32 tile on CUDA."""
    return _INTERP_BLOCK if _INTERPRET else max(16, 8192 // _block_d(d))


def _dot_prec(dtype: torch.dtype) -> str:
    # fp32 inputs keep full fp32 precision: TF32 would silently degrade them on Ampere+.
    return "ieee" if dtype == torch.float32 else "tf32"


class _WritableUnitD:
    """An in-place output viewed with unit d stride: a contiguous copy is written back on exit."""

    def __init__(self, t: Optional[torch.Tensor]):
        self.orig = t
        self.t = None if t is None else _unit_d(t)

    def __enter__(self):
        return self.t

    def __exit__(self, *exc):
        if self.t is not None and self.t is not self.orig:
            self.orig.copy_(self.t)
        return False


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    assert q.dim() == 4 and k.shape == v.shape and k.shape[0] == q.shape[0] and k.shape[3] == q.shape[3], \
        (q.shape, k.shape, v.shape)
    assert q.shape[2] % k.shape[2] == 0, f"heads_q ({q.shape[2]}) must be a multiple of heads_kv ({k.shape[2]})"
    assert q.dtype == k.dtype == v.dtype, (q.dtype, k.dtype, v.dtype)
    assert q.shape[3] <= 256, f"head_dim {q.shape[3]} > 256 is not supported by the triton backend"


class _MaskArgs:
    """What the kernels need to know about one chunk pair's mask (see ``_masks.py``).

    kind: 0 none, 1 causal on positions (``j <= i + diag``, ``diag = q_start - k_start``), 2 per-row bounds.
    With bounds, ``lo``/``hi`` (s_q,) int32 are global key positions and the kernels subtract ``k_start``.
    """

    def __init__(self, q_start, k_start, causal, bounds, scale, softcap, like):
        self.kind = 2 if bounds is not None else (1 if causal else 0)
        self.diag, self.k_start = q_start - k_start, k_start
        self.bounds = bounds
        self.lo, self.hi = (bounds.lo, bounds.hi) if bounds is not None else (like, like)  # dummies: never read
        self.scale, self.softcap_value = scale, float(softcap)
        self.softcap = self.softcap_value > 0.0

    def scales(self) -> tuple[float, float, float]:
        """(qk_scale, cap_in, cap_out): scale / ln 2, and softcap's scale / softcap and softcap / ln 2."""
        if not self.softcap:
            return self.scale * 1.44269504, 1.0, 1.0  # 1/ln 2
        return self.scale * 1.44269504, self.scale / self.softcap_value, self.softcap_value * 1.44269504

    def per_key(self, s_k: int):
        """(first row, last row) that sees each key of the chunk, for the dK/dV kernel (bounds only)."""
        if self.bounds is None:
            return self.lo, self.hi
        t = _masks.transpose_bounds(self.bounds, self.k_start, s_k)
        return t.lo, t.hi


# ----------------------------------------------------------------------------- backend

class TritonBackend:
    """The kernel contract (fold_, merge_, delta, backward_chunk_) on Triton kernels."""

    name = "triton"

    def __init__(self) -> None:
        if _IMPORT_ERROR is not None:
            raise RuntimeError(f"the triton backend needs triton: {_IMPORT_ERROR}")

    def fold_(self, out_f32, lse, q, k, v, *, scale: float, q_start: int, k_start: int, causal: bool,
              fresh: bool, out_final, bounds=None, softcap: float = 0.0) -> None:
        """Fold one key/value chunk into the state (out_f32, lse_bhs); see the module docstring of _triton_fwd."""
        _check_qkv(q, k, v)
        assert out_f32 is not None or (fresh and out_final is not None), "out_f32 is needed unless fresh and last"
        b, s_q, h_q, d = q.shape
        s_k, h_kv = k.shape[1], k.shape[2]
        if b * s_q * h_q == 0:
            return
        q, k, v = _unit_d(q), _unit_d(k), _unit_d(v)
        mask = _MaskArgs(q_start, k_start, causal, bounds, scale, softcap, lse)
        with _WritableUnitD(out_f32) as acc, _WritableUnitD(out_final) as out:
            acc_arg = acc if acc is not None else lse  # never dereferenced when FRESH and LAST
            out_arg = out if out is not None else acc  # never written unless LAST
            kernel = _kernel("fwd")
            grid = lambda meta: (triton.cdiv(s_q, meta["BLOCK_M"]), h_q, b)  # noqa: E731
            kernel[grid](
                q, k, v, acc_arg, lse, out_arg, mask.lo, mask.hi,
                *_bsh(q), *_bsh(k), *_bsh(v), *_bsh(acc), *_bsh(out), *lse.stride(),
                h_q, h_q // h_kv, s_q, s_k, mask.diag, mask.k_start, *mask.scales(), _len_bucket(s_q, s_k),
                HEAD_DIM=d, BLOCK_D=_block_d(d), MASK=mask.kind, SOFTCAP=mask.softcap, FRESH=bool(fresh),
                LAST=out is not None, DOT_PREC=_dot_prec(q.dtype), **_blocks(),
            )

    def merge_(self, out_f32, lse, out_part, lse_part) -> None:
        """state (out_f32, lse) <- merge(state, (out_part, lse_part)), fp32, both-empty safe."""
        b, s_q, h, d = out_f32.shape
        assert out_part.shape == out_f32.shape and lse_part.shape == lse.shape == (b, h, s_q)
        if out_f32.numel() == 0:
            return
        out_part = _unit_d(out_part)
        block_m = _row_block(d)
        with _WritableUnitD(out_f32) as acc:
            _fwd._merge_kernel[(triton.cdiv(s_q, block_m), h, b)](
                acc, lse, out_part, lse_part, *_bsh(acc), *_bsh(out_part), *lse.stride(), *lse_part.stride(),
                h, s_q, HEAD_DIM=d, BLOCK_D=_block_d(d), BLOCK_M=block_m,
            )

    def delta(self, dout, out) -> torch.Tensor:
        """rowsum(dout * out) over d, fp32, (b, h_q, s_q)."""
        assert dout.shape == out.shape
        b, s_q, h, d = out.shape
        delta = torch.empty((b, h, s_q), dtype=torch.float32, device=out.device)
        if delta.numel() == 0:
            return delta
        dout, out = _unit_d(dout), _unit_d(out)
        block_m = _row_block(d)
        _bwd._bwd_preprocess_kernel[(triton.cdiv(s_q, block_m), h, b)](
            out, dout, delta, *_bsh(out), *_bsh(dout), *delta.stride(), h, s_q,
            HEAD_DIM=d, BLOCK_D=_block_d(d), BLOCK_M=block_m,
        )
        return delta

    def backward_chunk_(self, dout, q, k, v, lse, delta, dq_acc, dk_acc, dv_acc, *, scale: float,
                        q_start: int, k_start: int, causal: bool, bounds=None, softcap: float = 0.0) -> None:
        """Add this chunk's dq, dk, dv into the fp32 accumulators (deterministic: one add per element per launch)."""
        _check_qkv(q, k, v)
        b, s_q, h_q, d = q.shape
        s_k, h_kv = k.shape[1], k.shape[2]
        if b * s_q * h_q == 0 or s_k == 0:
            return
        q, k, v, dout = _unit_d(q), _unit_d(k), _unit_d(v), _unit_d(dout.to(q.dtype))
        mask = _MaskArgs(q_start, k_start, causal, bounds, scale, softcap, lse)
        rlo, rhi = mask.per_key(s_k)
        common = dict(HEAD_DIM=d, BLOCK_D=_block_d(d), MASK=mask.kind, SOFTCAP=mask.softcap,
                      DOT_PREC=_dot_prec(q.dtype), **_blocks())
        qk_scale, cap_in, cap_out = mask.scales()
        scalars = (s_q, s_k, mask.diag, mask.k_start, qk_scale, scale, cap_in, cap_out, _len_bucket(s_q, s_k))
        # 2-byte inputs only: fp32's FMA ("ieee") dots spill far more with descriptors than without (full-tma.md)
        tma = q.element_size() == 2 and _tma_device(q.device) and _tma_aligned(q, 3) and _tma_aligned(dout, 3)
        lse_k, delta_k = (_tma_stats(lse), _tma_stats(delta)) if tma else (lse, delta)
        if tma and q.device.type == "cuda" and not _INTERPRET:
            _ensure_allocator()
        with _WritableUnitD(dk_acc) as dk, _WritableUnitD(dv_acc) as dv:
            grid = lambda meta: (triton.cdiv(s_k, meta["BLOCK_N"]), h_kv, b)  # noqa: E731
            _kernel("dkdv")[grid](
                q, k, v, dout, lse_k, delta_k, dk, dv, mask.lo, mask.hi, rlo, rhi,
                *_bsh(q), *_bsh(k), *_bsh(v), *_bsh(dout), *lse_k.stride(), *delta_k.stride(), *_bsh(dk),
                *_bsh(dv), h_kv, h_q // h_kv, *scalars, TMA=tma, **common,
            )
        with _WritableUnitD(dq_acc) as dq:
            grid = lambda meta: (triton.cdiv(s_q, meta["BLOCK_M"]), h_q, b)  # noqa: E731
            _kernel("dq")[grid](
                q, k, v, dout, lse, delta, dq, mask.lo, mask.hi,
                *_bsh(q), *_bsh(k), *_bsh(v), *_bsh(dout), *lse.stride(), *delta.stride(), *_bsh(dq),
                h_q, h_q // h_kv, *scalars, **common,
            )
