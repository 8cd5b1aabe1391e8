"""Peers' APIs as thin translations onto distattn's plans (ARCHITECTURE.md, "Compatibility is translation").

``distattn.compat.ring_flash_attn``: ring-flash-attention's functions and Hugging Face adapter (change one import).
Not to be confused with ``distattn._compat``, the shims for the torch/transformers versions distattn supports.
"""
