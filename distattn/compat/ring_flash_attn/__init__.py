"""ring-flash-attention's API on distattn: change one import, keep the call.

``from ring_flash_attn import zigzag_ring_flash_attn_func`` -> ``from distattn.compat.ring_flash_attn import
zigzag_ring_flash_attn_func``; ``from ring_flash_attn.adapters.hf_adapter import DATA_PARAMS`` ->
``from distattn.compat.ring_flash_attn.adapters.hf_adapter import DATA_PARAMS``. Every function takes
ring-flash-attention's (0.1.x) arguments in its positional order with its defaults (``causal=False`` everywhere, as
there), expects its layout of the shards and returns what it returns (``out``; ``(out, lse, None)`` with
``return_attn_probs=True``; ``lse`` fp32 natural log, ``(b, h, n)`` for the dense functions and ``(h, n)`` for the
varlen ones, in the local token order of the call). Each is a thin
translation onto ``distattn.dist_flash_attn_func`` / ``dist_flash_attn_varlen_func`` (one plan, one op): no attention
code of its own.

Layouts, per rank ``r`` of ``P`` (``n`` tokens per rank):

    ring_*            contiguous: tokens [r*n, (r+1)*n)                  -> distattn schedule "balanced", as is
    zigzag_ring_*     chunks r and 2P-1-r of 2P                          -> distattn schedule "zigzag", as is
    stripe_*          token i on rank i % P                              -> moved to contiguous and back (*)
    ring_*_varlen     chunk r of P of EVERY document; local cu_seqlens   -> moved to contiguous and back (*)
                      (each document's local length; global = P x local)
    zigzag_*_varlen   chunks r and 2P-1-r of 2P of every document        -> moved to contiguous and back (*)
    llama3_*_varlen   contiguous; per-rank local cu_seqlens_q, cu_seqlens_k + local_k_slice from
                      llama3_flash_attn_prepare_cu_seqlens               -> the global cu_seqlens rebuilt (**)

(*) distattn has no plan for these layouts, so the call moves q, k, v to the contiguous layout in ONE all-to-all
(``distattn.compat._relayout``), runs the balanced schedule there and moves ``out`` back (``lse`` too when
returned); the backward moves ``dout`` in and ``dq, dk, dv`` back. Cost per call and rank: ``(P-1)/P`` of
``q + k + v + out`` forward and of ``dout + dq + dk + dv`` backward crosses ranks once (about two ring steps of
k/v traffic with GQA-free shapes), plus one agreement all-reduce. Shard in the contiguous (or zigzag) layout to
avoid it.
(**) llama3's arguments describe only the rank's own neighbourhood; the call gathers every rank's (a few ints, one
agreement all-reduce and two small all-gathers), rebuilds the global ``cu_seqlens``, and checks that each rank's
arguments are exactly what ``llama3_flash_attn_prepare_cu_seqlens`` gives for it (a clear error on every rank
otherwise). ``substitute_hf_flash_attn`` skips all of this: ``update_ring_flash_attn_params`` keeps the global
``cu_seqlens``. Under ``torch.compile`` that host step is one opaque op (``distattn::llama3_documents``) whose
result the attention op reads when it runs: the llama3 functions compile with ``fullgraph=True``
(``tests/test_compile_cold.py``).

Arguments, decided one by one:
    * ``dropout_p > 0``: ``ValueError`` (ring-flash-attention applies dropout per block without saving the RNG
      state for its backward; distattn computes no attention dropout).
    * ``alibi_slopes``: ``ValueError`` unless None (ring-flash-attention asserts None too).
    * ``deterministic``: accepted; distattn's backward is always deterministic.
    * ``window_size``: computed on GLOBAL positions for every layout (ring-flash-attention passes it to each
      block's kernel, which is only right for ``(-1, -1)``). ``causal=False`` is accepted by the zigzag and stripe
      functions too (ring-flash-attention asserts causal there): the result is exact for any layout.
    * ``heads_k_stride`` (llama3, HF adapter): validated as there (> 0, divides ``h_kv``) and otherwise unused: it
      bounds llama3's all-gather buffer, and distattn never gathers k/v (they travel chunk by chunk).
    * ``max_seqlen*``: checked to be at least the longest (local) document, as flash-attn; not otherwise needed.
distattn's extras, keyword-only after ``group``: ``softcap`` (Gemma-2 soft-capping), ``backend``, ``timeout``;
GQA/MQA without repeating k/v; the llama3 functions and the HF adapter take documents of any length (the others
keep ring-flash-attention's divisibility rules, which their layouts need); every wait is bounded.
``group`` is a flat process group (or None); distattn's two-dimensional groups go through its own API.

Coverage of ring-flash-attention's ``__init__`` (every public name):

    ============================================  ===========================================================
    ring_flash_attn_func / _qkvpacked / _kvpacked  yes: dist_flash_attn_func, schedule "balanced"
    ring_flash_attn_varlen_func / _qkvpacked /     yes: moved to contiguous (*), dist_flash_attn_varlen_func
        _kvpacked
    zigzag_ring_flash_attn_func / _qkvpacked /     yes: dist_flash_attn_func, schedule "zigzag"
        _kvpacked
    zigzag_ring_flash_attn_varlen_func /           yes: moved to contiguous (*), dist_flash_attn_varlen_func
        _qkvpacked / _kvpacked
    stripe_flash_attn_func / _qkvpacked /          yes: moved to contiguous (*), dist_flash_attn_func
        _kvpacked
    llama3_flash_attn_varlen_func / _qkvpacked /   yes: global cu_seqlens rebuilt (**), dist_flash_attn_varlen_func
        _kvpacked
    llama3_flash_attn_prepare_cu_seqlens           yes: same five results (tensors on cu_seqlens' device, ints,
                                                   a slice)
    substitute_hf_flash_attn                       yes: registers the adapter under transformers' flash_attention_<n>
                                                   names and HF_IMPLEMENTATION in its public AttentionInterface
                                                   (``adapters.hf_adapter``: which names load without flash-attn);
                                                   transformers' private ``_flash_attention_forward`` is not patched
    update_ring_flash_attn_params                  yes: keeps the global cu_seqlens for the adapter, and fills
                                                   DATA_PARAMS with this rank's llama3 view
    ============================================  ===========================================================

and of ``ring_flash_attn.adapters.hf_adapter`` (``distattn.compat.ring_flash_attn.adapters.hf_adapter``), every name
Axolotl's releases import and the rest of the module: ``DATA_PARAMS`` (written per batch, read by every forward;
a caller may write it), ``check_params``, ``create_ring_flash_attention_forward`` (replaceable on the module before
``substitute_hf_flash_attn``, which then runs the replacement), ``flash_attention_forward`` (the registered function),
``use_ring_attn`` / ``RING_ATTN_SWITCH``, ``substitute_hf_flash_attn``, ``update_ring_flash_attn_params``.

Not covered: the ``*_forward``/``*_backward`` internals of the function modules, ``RingComm`` and ``utils``, and the
function modules' own paths (``ring_flash_attn.zigzag_ring_flash_attn_varlen`` ...): import the functions from the
package instead.

Legend: ``b`` batch, ``n`` this rank's tokens, ``h``/``h_kv`` heads, ``d`` head dim, ``P`` ranks.
"""

from distattn.compat.ring_flash_attn._functions import (
    llama3_flash_attn_prepare_cu_seqlens,
    llama3_flash_attn_varlen_func,
    llama3_flash_attn_varlen_kvpacked_func,
    llama3_flash_attn_varlen_qkvpacked_func,
    ring_flash_attn_func,
    ring_flash_attn_kvpacked_func,
    ring_flash_attn_qkvpacked_func,
    ring_flash_attn_varlen_func,
    ring_flash_attn_varlen_kvpacked_func,
    ring_flash_attn_varlen_qkvpacked_func,
    stripe_flash_attn_func,
    stripe_flash_attn_kvpacked_func,
    stripe_flash_attn_qkvpacked_func,
    zigzag_ring_flash_attn_func,
    zigzag_ring_flash_attn_kvpacked_func,
    zigzag_ring_flash_attn_qkvpacked_func,
    zigzag_ring_flash_attn_varlen_func,
    zigzag_ring_flash_attn_varlen_kvpacked_func,
    zigzag_ring_flash_attn_varlen_qkvpacked_func,
)
from distattn.compat.ring_flash_attn.adapters.hf_adapter import substitute_hf_flash_attn, update_ring_flash_attn_params

__all__ = [
    "ring_flash_attn_func", "ring_flash_attn_qkvpacked_func", "ring_flash_attn_kvpacked_func",
    "ring_flash_attn_varlen_func", "ring_flash_attn_varlen_qkvpacked_func", "ring_flash_attn_varlen_kvpacked_func",
    "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_qkvpacked_func", "zigzag_ring_flash_attn_kvpacked_func",
    "zigzag_ring_flash_attn_varlen_func", "zigzag_ring_flash_attn_varlen_qkvpacked_func",
    "zigzag_ring_flash_attn_varlen_kvpacked_func",
    "stripe_flash_attn_func", "stripe_flash_attn_qkvpacked_func", "stripe_flash_attn_kvpacked_func",
    "llama3_flash_attn_varlen_func", "llama3_flash_attn_varlen_qkvpacked_func",
    "llama3_flash_attn_varlen_kvpacked_func", "llama3_flash_attn_prepare_cu_seqlens",
    "substitute_hf_flash_attn", "update_ring_flash_attn_params",
]
