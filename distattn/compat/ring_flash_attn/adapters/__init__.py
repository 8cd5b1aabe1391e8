"""ring-flash-attention's ``ring_flash_attn.adapters``: the Hugging Face adapter (``hf_adapter``)."""

from distattn.compat.ring_flash_attn.adapters.hf_adapter import substitute_hf_flash_attn

__all__ = ["substitute_hf_flash_attn"]
