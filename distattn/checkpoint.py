"""Rematerialization-aware checkpointing: checkpoint at the attention output, not at the layer boundary.

Checkpointing a transformer layer at its input (what Hugging Face's gradient checkpointing does) makes the
backward pass re-run the layer's forward, attention included — the most expensive op at long sequence
lengths and, distributed, a second round of communication. The DistFlashAttn paper (Sec. 3.3, Table 5)
keeps the attention output instead: per layer the checkpoint holds the layer input and attention's
``(out, lse)``, the backward recomputes everything else (norms, projections, RoPE, MLP), and attention's
backward is fed the saved ``out``/``lse``. Attention's forward runs exactly once per step.

This is PyTorch's own selective activation checkpointing with one policy: the registered op
``torch.ops.distattn.attention`` (see ``distattn._ops``) is ``MUST_SAVE``, every other op is recomputed::

    forward    x ─ norm ─ qkv ─ rope ─[attention]─ o_proj ─ + ─ norm ─ mlp ─ + ─▶
    kept       x                       out, lse
    backward   recompute norm, qkv, rope; attention returns the kept out/lse (no kernel, no communication);
               recompute o_proj ... mlp; then attention's backward runs once, from out/lse.

Per layer the memory kept between forward and backward is ``x (b, n, hidden)`` + ``out (b, n, h_q, d)`` +
``lse (b, h_q, n)`` fp32, against ``x`` alone for layer-boundary checkpointing.

Your own transformer block: call attention through ``distattn.dist_flash_attn_func`` (it runs as the
registered op) and checkpoint the block with ``remat_checkpoint``::

    from distattn import dist_flash_attn_func
    from distattn.checkpoint import remat_checkpoint

    class Block(torch.nn.Module):
        def forward(self, x):                          # x: this rank's shard (b, n, hidden)
            q, k, v = self.qkv(self.norm1(x)).unflatten(-1, (3, heads, head_dim)).unbind(2)  # (b, n, h, d)
            x = x + self.proj(dist_flash_attn_func(q, k, v, causal=True).flatten(2))
            return x + self.mlp(self.norm2(x))

    for block in blocks:
        x = remat_checkpoint(block, x)

Anything that accepts a checkpoint ``context_fn`` takes ``remat_context_fn``:
``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=remat_context_fn)``.
Hugging Face models: ``distattn.integrations.hf.enable_remat_checkpointing(model)``.

Offloaded checkpoints (``distattn.offload``): what a checkpoint keeps per layer waits in host memory between
forward and backward, copied out as it is produced and prefetched one layer ahead in backward::

    offload = CheckpointOffload(remat=True)            # one per model; offload.layers: bytes per layer
    for block in blocks:
        x = remat_checkpoint(block, x, offload=offload)   # or full_checkpoint(block, x, offload=...)
"""

from __future__ import annotations

import gc

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from distattn._ops import COUNTERS, OP, OpCounters, reset_counters
from distattn.offload import CheckpointOffload

__all__ = [
    "remat_policy",
    "remat_context_fn",
    "remat_checkpoint",
    "full_checkpoint",
    "CheckpointOffload",
    "COUNTERS",
    "OpCounters",
    "reset_counters",
    "retained_bytes",
]


def remat_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective-checkpoint policy: keep the attention op's outputs, recompute every other op."""
    return CheckpointPolicy.MUST_SAVE if op is OP else CheckpointPolicy.PREFER_RECOMPUTE


def remat_context_fn():
    """A fresh pair of selective-checkpoint contexts for one checkpointed call (pass as ``context_fn``)."""
    return create_selective_checkpoint_contexts(remat_policy)


def remat_checkpoint(function, *args, offload: CheckpointOffload | None = None, **kwargs):
    """``function(*args, **kwargs)``, checkpointed so that only its input and attention's ``(out, lse)`` stay.

    ``function`` must call attention through ``distattn.dist_flash_attn_func`` (an attention called any other way is
    recomputed like the rest). Non-reentrant checkpointing, so keyword arguments and nested calls work.
    ``offload``: a ``CheckpointOffload(remat=True)``; what stays then waits in host memory. Tensor arguments
    shared by every layer (rotary tables, masks) belong in ``kwargs``: positional tensors are what is kept.
    """
    if offload is None:
        return checkpoint(function, *args, use_reentrant=False, context_fn=remat_context_fn, **kwargs)
    if not offload.remat:
        raise ValueError("remat_checkpoint(offload=...) needs CheckpointOffload(remat=True); this one is for "
                         "layer-boundary checkpoints (use full_checkpoint with it)")
    return offload.checkpoint(function, *args, **kwargs)


def full_checkpoint(function, *args, offload: CheckpointOffload | None = None, **kwargs):
    """``function(*args, **kwargs)`` checkpointed at its input (layer-boundary): only the input stays.

    ``offload``: a ``CheckpointOffload(remat=False)``; the input then waits in host memory.
    """
    if offload is None:
        return checkpoint(function, *args, use_reentrant=False, **kwargs)
    if offload.remat:
        raise ValueError("full_checkpoint(offload=...) needs CheckpointOffload(remat=False); this one keeps "
                         "attention outputs (use remat_checkpoint with it)")
    return offload.checkpoint(function, *args, **kwargs)


# -- measuring what a forward keeps ---------------------------------------------------------------------
class _StorageBirths(TorchDispatchMode):
    """Records a weak reference to the storage of every tensor an op produces while the mode is active."""

    def __init__(self):
        super().__init__()
        self.born: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Views and in-place results share an input's storage: not new memory (e.g. ``weight.t()``).
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.untyped_storage().nbytes():
                storage = t.untyped_storage()
                if storage.data_ptr() in inputs:
                    continue
                # Keyed by address: two live storages never share one, and a dead one's entry may be replaced.
                self.born[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        return out


def retained_bytes(function, *args, **kwargs) -> tuple[object, int]:
    """Run ``function(*args, **kwargs)``; return its result and the bytes its forward keeps alive.

    "Kept alive" means storages created during the call that still exist once it has returned, other than
    the result's own: what autograd saved for backward, what a checkpoint cached — whatever the mechanism.
    (Saved-tensor hooks cannot measure this: a non-reentrant checkpoint installs its own hooks, which hide
    the tensors saved inside it, and selective checkpointing keeps its cache outside autograd.) Tensors
    created before the call (the inputs, parameters) are not counted.
    """
    births = _StorageBirths()
    was_enabled = gc.isenabled()
    gc.disable()  # objects born during the call stay in the youngest generation...
    try:
        with births:
            result = function(*args, **kwargs)
        gc.collect(0)  # ...so collecting it frees any reference cycle they formed (a full collect costs ~0.5 s)
    finally:
        if was_enabled:
            gc.enable()
    own = {t.untyped_storage().data_ptr() for t in tree_leaves(result) if isinstance(t, torch.Tensor)}
    kept = sum(nbytes for ptr, (ref, nbytes) in births.born.items() if ptr not in own and not ref.expired())
    return result, kept
