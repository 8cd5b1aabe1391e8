r"""SDPA backend: the kernel contract on PyTorch's own fused attention ops (the CPU fast path).

PyTorch's fused attention ops return the log-sum-exp next to the output and take it back in their backward,
which is all a carried-state fold needs:

* forward: one op call per piece of the chunk gives a normalized ``(out, lse)`` partial, merged in fp32 into the
  carried state (``TorchBackend.merge_``; a fresh single-piece fold writes it directly);
* backward: the op's backward with the *final* ``lse`` of the rows, so the chunk's probabilities are the
  globally normalized ones and its dq, dk, dv add up across chunks to the gradients of the whole attention.

Ops: on CPU ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (fp32/fp16/bf16, GQA natively,
strided ``(b, h, s, d)`` views of our ``(b, s, h, d)`` tensors, no copies); on CUDA the flash op
(``aten._scaled_dot_product_flash_attention``; fp16/bf16, ``d % 8 == 0``, ``d <= 256``; keys/values repeated per
call for GQA; GPU-only and not yet run on a GPU: ``pytest -m gpu tests/test_sdpa.py`` checks it).

Which chunks: SDPA's ``is_causal`` is aligned top-left (row ``i`` sees keys ``j <= i``). A causal chunk with any
offset ``DIAG = q_start - k_start`` (row ``i`` sees ``j <= i + DIAG``) is cut into at most three pieces, each a
dense or a top-left-causal *square* op call (square: the alignment is unambiguous on every op)::

        keys j ->                    rows [0, r0)      see nothing (DIAG < 0): no call
      +--------+---------+------+    rows [r0, r1)     dense keys [0, j0) + causal square [j0, j0 + r1 - r0)
   r0 |  dense |\        |      |    rows [r1, s_q)    see every key: one dense call
      |        |  \      |      |
   r1 +--------+----\----+------+    with j0 = r0 + DIAG and r1 = min(s_q, s_k - DIAG).
      |        dense             |   The distributed executor's diagonal pairs (DIAG = 0, s_q = s_k) are one
      +--------------------------+   causal call; its off-diagonal pairs one dense call.

Masks the ops cannot express (``bounds``: packed documents, windows) and ``softcap > 0`` go to the torch
reference, per call, with the same numbers and contract. The backward's ``delta = rowsum(dout * out)`` is computed
by the ops from ``out`` itself; the contract passes ``delta`` instead, so the op receives an ``out`` in the
direction of ``dout`` with exactly that row sum (``out' = dout * delta / |dout|^2``; see ``_out_for_delta``).

Legend: ``b`` batch, ``s_q``/``s_k`` query/key length, ``h_q``/``h_kv`` heads, ``d`` head dim; ``bhsd`` marks
the ops' layout (a transposed view of ours).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._torch import TorchBackend

_NEG_INF = float("-inf")


class _Piece(NamedTuple):
    """One op call: query rows ``[r0, r1)`` against keys ``[c0, c1)`` of the chunk, top-left causal or dense."""

    r0: int
    r1: int
    c0: int
    c1: int
    causal: bool


def causal_pieces(s_q: int, s_k: int, diag: int, causal: bool) -> list[_Piece]:
    """The op calls that cover a chunk's visible (row, key) pairs exactly once (see the module docstring).

    ``diag = q_start - k_start``; without ``causal`` the whole chunk is one dense piece. Rows that see no key
    belong to no piece; an empty list means the chunk is invisible to every row.
    """
    if s_q == 0 or s_k == 0:
        return []
    if not causal or diag >= s_k - 1:  # every row sees every key
        return [_Piece(0, s_q, 0, s_k, False)]
    r0 = min(max(0, -diag), s_q)  # rows before r0 see nothing
    r1 = max(min(s_q, s_k - diag), r0)  # rows from r1 on see every key
    j0 = r0 + diag  # first key of the causal square (>= 0)
    pieces = []
    if r1 > r0:
        if j0 > 0:
            pieces.append(_Piece(r0, r1, 0, j0, False))
        pieces.append(_Piece(r0, r1, j0, j0 + (r1 - r0), True))
    if r1 < s_q:
        pieces.append(_Piece(r1, s_q, 0, s_k, False))
    return pieces


def _bhsd(x_bshd: torch.Tensor) -> torch.Tensor:
    """(b, s, h, d) -> (b, h, s, d) view."""
    return x_bshd.transpose(1, 2)


class _CpuOps:
    """``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward."""

    @staticmethod
    def usable(q: torch.Tensor) -> bool:
        return q.dtype in (torch.float32, torch.float16, torch.bfloat16)

    @staticmethod
    def finite(*tensors) -> bool:
        """The CPU op returns out 0 (a masked row) for a NaN query row at some sizes: chunks holding a NaN or an
        infinity go to the reference, which propagates them as one device does. One reduction per tensor, on
        the host already (no device synchronization on CPU)."""
        return all(bool(torch.isfinite(t).all()) for t in tensors)

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal: bool, scale: float):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)


_CUDA_AUX: dict = {}


class _CudaFlashOps:
    """``aten._scaled_dot_product_flash_attention`` and its backward (GPU only; keys/values repeated for GQA)."""

    @staticmethod
    def usable(q: torch.Tensor) -> bool:
        d = q.shape[-1]
        return q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256

    @staticmethod
    def finite(*tensors) -> bool:
        """Not checked on CUDA: a check would synchronize the host with the device every chunk. How the CUDA op
        carries NaN/Inf is what the GPU tier's non-finite test measures."""
        return True

    @staticmethod
    def _repeat(k, v, h_q):
        g = h_q // k.shape[1]
        return (k, v) if g == 1 else (k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1))

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float):
        k, v = _CudaFlashOps._repeat(k, v, q.shape[1])
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1]

    @staticmethod
    def _dense_aux(q):
        """cum_seq_q, cum_seq_k, philox seed, philox offset of a dense, dropout-free call, exactly as the forward op
        returns them (undefined / empty tensors the backward reads as "not varlen, no dropout"), cached."""
        key = (q.device, q.dtype)
        if key not in _CUDA_AUX:
            x = torch.zeros(1, 1, 1, 8, device=q.device, dtype=q.dtype)
            res = torch.ops.aten._scaled_dot_product_flash_attention(x, x, x, 0.0, False, False)
            _CUDA_AUX[key] = (res[2], res[3], res[6], res[7])
        return _CUDA_AUX[key]

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal: bool, scale: float):
        h_kv = k.shape[1]
        kr, vr = _CudaFlashOps._repeat(k, v, q.shape[1])
        cu_q, cu_k, seed, offset = _CudaFlashOps._dense_aux(q)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, kr, vr, out, lse, cu_q, cu_k, q.shape[2], kr.shape[2], 0.0, causal, seed, offset, scale=scale)
        if kr is not k:  # GQA: sum the repeated heads' gradients back onto their kv head
            b, _, s_k, d = k.shape
            dk = dk.reshape(b, h_kv, -1, s_k, d).sum(2)
            dv = dv.reshape(b, h_kv, -1, s_k, d).sum(2)
        return dq, dk, dv


def _ops_for(device: torch.device):
    return _CpuOps if device.type == "cpu" else _CudaFlashOps if device.type == "cuda" else None


def _out_for_delta(dout: torch.Tensor, delta: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An ``out' (b, s, h, d)`` with ``rowsum(dout * out') = delta``: ``dout * delta / |dout|^2``.

    The ops compute ``delta`` from ``out`` themselves; the contract hands us ``delta``. This ``out'`` is bounded
    by the real output's norm (Cauchy-Schwarz: ``|delta| <= |dout| |out|``), and rounding it to ``dtype``
    perturbs the row sum by at most one rounding of ``|delta|``, no more than rounding the real ``out`` would.
    Rows with ``dout = 0`` have ``delta = 0`` and get ``out' = 0``; a non-finite ``delta`` or ``dout`` stays
    non-finite in ``out'`` (``delta * 0`` is NaN for a NaN/Inf delta), so the ops see the NaN one device would.
    """
    do = dout.float()
    norm2 = (do * do).sum(-1)  # (b, s, h)
    dl = delta.transpose(1, 2)
    c = torch.where(norm2 != 0, dl / torch.where(norm2 != 0, norm2, 1.0), dl * 0.0)
    return (do * c[..., None]).to(dtype)


class SdpaBackend:
    """The backend protocol (see ``distattn.kernels``) on PyTorch's fused attention ops, torch reference fallback."""

    name = "sdpa"

    def __init__(self) -> None:
        self.ref = TorchBackend()

    def pieces(self, q, k, *, q_start, k_start, causal, bounds, softcap, finite=()):
        """The op calls for this chunk, or ``None`` when the ops cannot express it (use the reference).

        ``finite``: tensors that must hold no NaN/Inf for the op to run (``_CpuOps.finite``)."""
        ops = _ops_for(q.device)
        if bounds is not None or softcap or ops is None or not ops.usable(q) or q.shape[0] * q.shape[2] == 0:
            return None
        if not ops.finite(*finite):
            return None
        return causal_pieces(q.shape[1], k.shape[1], q_start - k_start, causal)

    # -- forward ---------------------------------------------------------------------------------------
    def fold_(self, out_f32, lse, q, k, v, *, scale, q_start, k_start, causal, fresh, out_final, bounds=None,
              softcap=0.0):
        kw = dict(q_start=q_start, k_start=k_start, causal=causal, bounds=bounds, softcap=softcap)
        pieces = self.pieces(q, k, **kw, finite=(q, k, v))
        if pieces is None:
            return self.ref.fold_(out_f32, lse, q, k, v, scale=scale, fresh=fresh, out_final=out_final, **kw)
        ops = _ops_for(q.device)
        s_q = q.shape[1]
        target = out_final if out_final is not None else out_f32
        if fresh and len(pieces) == 1 and pieces[0][:2] == (0, s_q):  # one call covers every row: no merge
            p = pieces[0]
            o, l = ops.forward(_bhsd(q), _bhsd(k[:, p.c0:p.c1]), _bhsd(v[:, p.c0:p.c1]), p.causal, scale)
            target.copy_(o.transpose(1, 2))
            lse.copy_(l)
            return
        state = out_f32
        if fresh:  # start from the empty state (out 0, lse -inf); rows no piece covers stay empty
            state = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if out_f32 is None else out_f32.zero_()
            lse.fill_(_NEG_INF)
        for p in pieces:
            o, l = ops.forward(_bhsd(q[:, p.r0:p.r1]), _bhsd(k[:, p.c0:p.c1]), _bhsd(v[:, p.c0:p.c1]), p.causal,
                               scale)
            # fp32 merge of the piece's normalized partial into the state's rows (views: written in place)
            self.ref.merge_(state[:, p.r0:p.r1], lse[:, :, p.r0:p.r1], o.transpose(1, 2), l)
        if target is not state:
            target.copy_(state)

    def merge_(self, out_f32, lse, out_part, lse_part):
        self.ref.merge_(out_f32, lse, out_part, lse_part)

    # -- backward --------------------------------------------------------------------------------------
    def delta(self, dout, out):
        return self.ref.delta(dout, out)

    def backward_chunk_(self, dout, q, k, v, lse, delta, dq_acc, dk_acc, dv_acc, *, scale, q_start, k_start,
                        causal, bounds=None, softcap=0.0):
        kw = dict(q_start=q_start, k_start=k_start, causal=causal, bounds=bounds, softcap=softcap)
        # lse may be -inf (rows that see no key); NaN or +inf there is what the reference must handle
        pieces = self.pieces(q, k, **kw, finite=(q, k, v, dout, delta, lse.masked_fill(lse == _NEG_INF, 0.0)))
        if pieces is None:
            return self.ref.backward_chunk_(dout, q, k, v, lse, delta, dq_acc, dk_acc, dv_acc, scale=scale, **kw)
        if not pieces:
            return None
        ops = _ops_for(q.device)
        dout = dout.to(q.dtype)
        out = _out_for_delta(dout, delta, q.dtype)
        # Every row of a piece sees a key of this chunk, so its final lse is finite: no exp(s - (-inf)) here.
        for p in pieces:
            rows, keys = slice(p.r0, p.r1), slice(p.c0, p.c1)
            dq, dk, dv = ops.backward(_bhsd(dout[:, rows]), _bhsd(q[:, rows]), _bhsd(k[:, keys]), _bhsd(v[:, keys]),
                                      _bhsd(out[:, rows]), lse[:, :, rows].contiguous(), p.causal, scale)
            dq_acc[:, rows] += dq.transpose(1, 2)
            dk_acc[:, keys] += dk.transpose(1, 2)
            dv_acc[:, keys] += dv.transpose(1, 2)
        return None


def is_available(device) -> tuple[bool, str]:
    """Whether SdpaBackend runs on ``device`` with its fused ops (it falls back to the reference per call)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        ok = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
        return ok, "" if ok else f"torch {torch.__version__} has no aten._scaled_dot_product_flash_attention_for_cpu"
    if dev.type == "cuda":
        ok = torch.cuda.is_available()
        return ok, "" if ok else "device is cuda but torch.cuda.is_available() is False"
    return False, f"the sdpa backend runs on cpu or cuda, got {dev.type!r}"
