"""flash-attn's ``flash_attn.flash_attn_interface`` on distattn: its public functions, one device.

``from flash_attn.flash_attn_interface import flash_attn_varlen_func`` -> ``from
distattn.compat.flash_attn.flash_attn_interface import flash_attn_varlen_func``. The package doc
(``distattn.compat.flash_attn``) has the coverage table.
"""

from distattn.api import flash_attn_func, flash_attn_varlen_func
from distattn.api_packed import (flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                 flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func)
from distattn.compat.flash_attn._kvcache import flash_attn_with_kvcache

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]
