"""distattn: exact attention for sequences too long for one GPU.

The sequence is split across the ranks of a process group; each rank keeps its own chunk and the ranks trade
key/value chunks peer to peer while they compute (the DistFlashAttn system), on top of a FlashAttention-2
kernel that carries softmax statistics across chunks.

The public functions take flash-attn's arguments in flash-attn's order (``distattn.api``; the packed variants
``*_qkvpacked_func``/``*_kvpacked_func`` in ``distattn.api_packed``). ``autotune`` tunes the
Triton kernels' launch configs once for a process group (rank 0 benchmarks, every rank installs its choice;
``distattn.tune``); ``distattn.kernels.autotune`` does the same for one process.
"""

from distattn.api import (
    choose_schedule,
    dist_flash_attn_func,
    dist_flash_attn_varlen_func,
    flash_attn_func,
    flash_attn_varlen_func,
)
from distattn.api_packed import (
    dist_flash_attn_kvpacked_func,
    dist_flash_attn_qkvpacked_func,
    dist_flash_attn_varlen_kvpacked_func,
    dist_flash_attn_varlen_qkvpacked_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from distattn.checkpoint import remat_checkpoint
from distattn.comm import DistAttnError
from distattn.communicators import set_step
from distattn.gradients import reduce_gradients, register_ddp_gradient_hook, set_fsdp_gradient_divide_factor
from distattn.sharding import gather_sequence, shard_sequence
from distattn.topology import make_2d_groups
from distattn.tune import autotune

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "dist_flash_attn_func", "dist_flash_attn_varlen_func",
           "shard_sequence", "gather_sequence", "make_2d_groups", "choose_schedule", "remat_checkpoint", "DistAttnError",
           "set_step", "autotune", "reduce_gradients", "register_ddp_gradient_hook", "set_fsdp_gradient_divide_factor",
           "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "dist_flash_attn_qkvpacked_func", "dist_flash_attn_kvpacked_func",
           "dist_flash_attn_varlen_qkvpacked_func", "dist_flash_attn_varlen_kvpacked_func"]
__version__ = "0.1.0"
