"""Single-device attention math with carried softmax statistics (installed as ``distattn.kernels``).

This layer never touches ``torch.distributed`` and never imports the layer above it (``distattn``): it only
knows how to fold key/value chunks, one after another, into an exact attention result for one block of queries.

Legend: ``b`` batch, ``s_q``/``s_k`` query/key length, ``h_q``/``h_kv`` query/key-value heads, ``d`` head dim.

Layout and conventions (every backend, every caller):
    q ``(b, s_q, h_q, d)``; k, v ``(b, s_k, h_kv, d)``; ``h_q % h_kv == 0`` and query head ``h`` reads key/value
    head ``h // (h_q // h_kv)`` (GQA/MQA; keys and values are never repeated in memory).
    ``lse`` is fp32, natural log, ``(b, h_q, s_q)``.

Global positions and the causal mask:
    query row ``i`` sits at global position ``q_start + i`` and key ``j`` at ``k_start + j``; with
    ``causal=True`` a query sees a key iff ``k_pos <= q_pos``::

        k_start=4, s_k=4        keys 4 5 6 7
        q_start=5, s_q=3   q 5:      x x . .
                           q 6:      x x x .
                           q 7:      x x x x

    A query row that sees no key at all gets output 0 and lse -inf, zero gradients, never NaN.

Masks beyond causal (packed documents, sliding windows) are data, not code paths: ``bounds=KeyBounds(lo, hi)``
gives every query row the interval ``[lo, hi]`` of global key positions it sees, nondecreasing down the rows
(``_masks.py``; builders ``window_bounds`` and ``varlen_bounds``). With ``bounds`` the ``causal`` flag must be
False (the bounds already say it). ``softcap > 0`` soft-caps the logits: ``softcap * tanh(scale * q.k / softcap)``.

The carried state (``AttnState``) is the *normalized* fp32 partial result ``(out, lse)`` of the keys folded
so far: ``out (b, s_q, h_q, d)`` fp32 and ``lse (b, h_q, s_q)`` fp32. It is exactly the classic
FlashAttention state (accumulator, running max ``m``, running sum ``l``) with ``acc = out``, ``m = lse`` and
``l = 1``, so a kernel loads it as such, folds a chunk with the online softmax, and stores
``out = acc / l``, ``lse = m + ln(l)``. The same representation is what travels between ranks as a
partial result, so folding, merging and finalizing all speak one format. An empty state is ``out = 0``,
``lse = -inf``.

Operations:
    ``new_state(q)``                       empty state for a block of queries
    ``fold_(state, q, k, v, ...)``         fold one key/value chunk into the state (in place)
    ``merge_(state, out, lse)``            merge a partial ``(out, lse)`` computed elsewhere (in place)
    ``finalize(state, dtype)``             ``(out in dtype, lse fp32)``
    ``forward(q, k, v, ...)``              one chunk, start to finish (the fused "last fold" path)
    ``attn_delta(dout, out)``              ``rowsum(dout * out)`` in fp32, computed once per backward
    ``backward_chunk_(...)``               add one key/value chunk's ``dq, dk, dv`` into fp32 accumulators

Backends share one protocol (see ``_torch.TorchBackend``): ``"torch"`` (pure PyTorch, any device; the
reference), ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``) and ``"sdpa"`` (PyTorch's fused attention
ops, one call per dense or diagonal-causal piece of a chunk, the torch reference for other masks and softcap;
the default on CPU, selectable on CUDA; ``_sdpa.py``).

Launch configs of the Triton kernels on CUDA: deterministic per shape class (``_triton.py``), or tuned once before
training (``_tune.py``): ``autotune(cases)`` benchmarks (or reads its disk cache) and installs the result in this
process; ``tune_table``, ``install_table`` and ``table_to_json``/``table_from_json`` are its parts. On the ranks of a
process group call ``distattn.autotune`` (the layer above), which tunes on rank 0 and installs rank 0's table on
every rank.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from ._masks import KeyBounds, varlen_bounds, window_bounds

__all__ = [
    "AttnState",
    "new_state",
    "fold_",
    "merge_",
    "finalize",
    "forward",
    "attn_delta",
    "backward_chunk_",
    "get_backend",
    "check_backend",
    "available_backends",
    "BACKENDS",
    "KeyBounds",
    "window_bounds",
    "varlen_bounds",
    "autotune",
    "autotune_enabled",
    "TuneCase",
    "check_tune_args",
    "tune_table",
    "install_table",
    "table_to_json",
    "table_from_json",
]

_TUNE_NAMES = ("autotune", "autotune_enabled", "TuneCase", "check_tune_args", "tune_table", "install_table",
               "table_to_json", "table_from_json")


def __getattr__(name: str):
    # Lazily: _tune imports the Triton launcher, whose kernels are decorated on import (TRITON_INTERPRET must be
    # set before that), so ``import distattn.kernels`` alone never imports it.
    if name in _TUNE_NAMES:
        from . import _tune

        return getattr(_tune, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

BACKENDS = ("torch", "triton", "sdpa")


class AttnState(NamedTuple):
    """Carried softmax state: normalized fp32 partial output and its log-sum-exp."""

    out: torch.Tensor  # (b, s_q, h_q, d) fp32
    lse: torch.Tensor  # (b, h_q, s_q) fp32, natural log; -inf where no key was seen yet


def _triton_available(device: torch.device) -> tuple[bool, str]:
    try:
        from ._triton import is_available
    except ImportError as exc:  # triton missing, or the module failed to import
        return False, f"the triton backend could not be imported ({exc})"
    return is_available(device)


def _sdpa_available(device: torch.device) -> tuple[bool, str]:
    from ._sdpa import is_available

    return is_available(device)


def available_backends(device: torch.device | str) -> tuple[str, ...]:
    """Backends that can run on ``device``, best first."""
    device = torch.device(device)
    names = ["torch"]
    if _sdpa_available(device)[0]:
        names.insert(0, "sdpa")
    if _triton_available(device)[0]:
        names.insert(0 if device.type == "cuda" else len(names) - 1, "triton")
    return tuple(names)


def _default_backend(device: torch.device) -> str:
    # triton on CUDA is the fast path; on CPU PyTorch's fused ops are (the Triton interpreter is a test vehicle,
    # not a default), with the torch reference where neither can run.
    if device.type == "cuda" and _triton_available(device)[0]:
        return "triton"
    return "sdpa" if _sdpa_available(device)[0] else "torch"


_CACHE: dict[str, object] = {}


def check_backend(name: str | None, device: torch.device | str) -> str:
    """The name of the backend ``name`` resolves to on ``device`` (``None``: the best one available), checked.

    Pure validation: no backend object is built or cached, so a traced caller (``torch.compile``) that checks the
    name at its boundary reads no mutable state (a check of ``_CACHE`` there guarded on it, and the first call's
    own insertion recompiled the second call); the op resolves the name with :func:`get_backend` when it runs.

    Raises:
        ValueError: unknown name, or a backend that cannot run on ``device``.
    """
    device = torch.device(device)
    if name is None:
        name = _default_backend(device)
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is unknown; it must be one of {BACKENDS} or None (pick the best available)")
    if name == "triton":
        ok, why = _triton_available(device)
        if not ok:
            raise ValueError(f"backend='triton' cannot run on device {device}: {why}; use backend='torch' or None")
    if name == "sdpa":
        ok, why = _sdpa_available(device)
        if not ok:
            raise ValueError(f"backend='sdpa' cannot run on device {device}: {why}; use backend='torch' or None")
    return name


def get_backend(name: str | None, device: torch.device | str):
    """Return the backend object called ``name`` (``None``: the best one available on ``device``).

    Raises:
        ValueError: unknown name, or a backend that cannot run on ``device`` (:func:`check_backend`).
    """
    name = check_backend(name, device)
    if name not in _CACHE:
        if name == "torch":
            from ._torch import TorchBackend

            _CACHE[name] = TorchBackend()
        elif name == "sdpa":
            from ._sdpa import SdpaBackend

            _CACHE[name] = SdpaBackend()
        else:
            from ._triton import TritonBackend

            _CACHE[name] = TritonBackend()
    return _CACHE[name]


def _resolve(backend, device):
    return backend if hasattr(backend, "fold_") else get_backend(backend, device)


def new_state(q: torch.Tensor) -> AttnState:
    """Empty state for the queries ``q (b, s_q, h_q, d)``: out 0, lse -inf."""
    b, s_q, h_q, d = q.shape
    out = torch.zeros(b, s_q, h_q, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h_q, s_q), float("-inf"), dtype=torch.float32, device=q.device)
    return AttnState(out, lse)


def _mask_kw(causal: bool, bounds, softcap: float) -> dict:
    assert bounds is None or not causal, "bounds already describe the mask: pass causal=False with them"
    return dict(causal=causal, bounds=bounds, softcap=float(softcap))


def fold_(state: AttnState, q, k, v, *, softmax_scale: float, q_start: int = 0, k_start: int = 0,
          causal: bool = False, bounds: KeyBounds | None = None, softcap: float = 0.0, backend=None) -> AttnState:
    """Fold the key/value chunk ``k, v (b, s_k, h_kv, d)`` into ``state`` in place and return it."""
    be = _resolve(backend, q.device)
    be.fold_(state.out, state.lse, q, k, v, scale=softmax_scale, q_start=q_start, k_start=k_start,
             fresh=False, out_final=None, **_mask_kw(causal, bounds, softcap))
    return state


def merge_(state: AttnState, out: torch.Tensor, lse: torch.Tensor, backend=None) -> AttnState:
    """Merge a partial ``(out (b, s_q, h_q, d), lse (b, h_q, s_q))`` for the same queries into ``state``."""
    _resolve(backend, out.device).merge_(state.out, state.lse, out, lse)
    return state


def finalize(state: AttnState, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: the output cast once to ``dtype``; lse stays fp32."""
    return state.out.to(dtype), state.lse


def forward(q, k, v, *, softmax_scale: float, q_start: int = 0, k_start: int = 0, causal: bool = False,
            bounds: KeyBounds | None = None, softcap: float = 0.0, backend=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over one key/value chunk: ``(out in q.dtype, lse fp32)`` (fused last fold)."""
    be = _resolve(backend, q.device)
    b, s_q, h_q, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device=q.device)
    be.fold_(None, lse, q, k, v, scale=softmax_scale, q_start=q_start, k_start=k_start, fresh=True,
             out_final=out, **_mask_kw(causal, bounds, softcap))
    return out, lse


def attn_delta(dout: torch.Tensor, out: torch.Tensor, backend=None) -> torch.Tensor:
    """``delta = rowsum(dout * out)``, fp32 ``(b, h_q, s_q)``."""
    return _resolve(backend, out.device).delta(dout, out)


def backward_chunk_(dout, q, k, v, lse, delta, dq_acc, dk_acc, dv_acc, *, softmax_scale: float,
                    q_start: int = 0, k_start: int = 0, causal: bool = False, bounds: KeyBounds | None = None,
                    softcap: float = 0.0, backend=None) -> None:
    """Add one key/value chunk's gradients into the fp32 accumulators ``dq_acc, dk_acc, dv_acc``.

    ``lse`` and ``delta`` must be the final ones (after every chunk was folded).
    """
    _resolve(backend, q.device).backward_chunk_(
        dout, q, k, v, lse, delta, dq_acc, dk_acc, dv_acc, scale=softmax_scale, q_start=q_start,
        k_start=k_start, **_mask_kw(causal, bounds, softcap))


def interpreter_enabled() -> bool:
    """True when Triton kernels run on CPU tensors through the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
