"""flash-attn's module paths on distattn, one device: change the import, keep the call.

    flash-attn (2.x)                          distattn
    ========================================  ==================================================================
    ``flash_attn``                            ``distattn.compat.flash_attn``
    ``flash_attn.flash_attn_interface``       ``distattn.compat.flash_attn.flash_attn_interface``
    ``flash_attn.bert_padding``               ``distattn.compat.flash_attn.bert_padding``

Coverage (flash-attn's names, arguments in its order with its defaults):

    ===========================================  ===============================================================
    flash_attn_func / _qkvpacked / _kvpacked     yes: ``distattn.flash_attn_func`` (+ packed), differentiable
    flash_attn_varlen_func / _qkvpacked /        yes: ``distattn.flash_attn_varlen_func``; ``block_table`` must be
        _kvpacked                                None (paged caches: ``flash_attn_with_kvcache``)
    flash_attn_with_kvcache                      yes (``_kvcache``): in-place append at ``cache_seqlens``, rotary
                                                 (interleaved or not), ``cache_batch_idx``, ``cache_leftpad``,
                                                 paged ``block_table`` (any page size), causal, window, softcap,
                                                 GQA, ``return_softmax_lse``; no backward, as flash-attn
    bert_padding: unpad_input, pad_input,        yes: plain PyTorch indexing, differentiable
        index_first_axis, index_put_first_axis,
        index_first_axis_residual,
        unpad_input_for_concatenated_sequences
    ===========================================  ===============================================================

Refused with a ``ValueError`` that names the alternative: ``dropout_p > 0`` (no attention dropout), ``alibi_slopes``
(no ALiBi: flash-attn's own functions), ``rotary_cos`` without new ``k, v`` (as flash-attn), ``block_table`` with
``cache_batch_idx`` or ``cache_leftpad`` (as flash-attn), ``block_table`` in ``flash_attn_varlen_func``. Differences:
a query row that sees no key gets ``lse`` -inf (flash-attn: +inf); ``return_attn_probs`` gives ``(out, lse, None)``
(no probabilities are materialized). Not covered: ``flash_attn.layers``, ``flash_attn.modules``, ``flash_attn.ops``
(rotary as a module, fused MLP/LayerNorm kernels), ``flash_attn.cute`` (FlashAttention-4) and FlashAttention-3's
top-level ``flash_attn_interface`` (other signatures). Across ranks: ``distattn.dist_flash_attn_func`` and
``distattn.compat.ring_flash_attn``.
"""

from distattn.compat.flash_attn.flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]
