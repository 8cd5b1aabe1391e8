"""Peers' APIs as thin translations onto distattn's plans (ARCHITECTURE.md, "Compatibility is translation").

``distattn.compat.ring_flash_attn``: ring-flash-attention's functions and its Hugging Face adapter
(``.adapters.hf_adapter``); change one import.
``distattn.compat.flash_attn``: flash-attn's module paths on one device (``flash_attn``, ``.flash_attn_interface``
with ``flash_attn_with_kvcache``, ``.bert_padding``).
Not to be confused with ``distattn._compat``, the shims for the torch/transformers versions distattn supports.
"""
