"""Offload in ``launch/train.py``: checkpoints (``--offload-checkpoints``), optimizer state (``--offload-optimizer``).

``--offload-checkpoints`` keeps what each decoder layer's checkpoint keeps in host memory between forward and
backward (``distattn.offload``): the layer input with layer-boundary checkpointing, plus attention's
``out, lse`` with ``--remat``. ``--offload-optimizer`` shards the parameters with FSDP2's ``CPUOffloadPolicy``
(``train_model``): the fp32 parameter shards, their gradients and AdamW's moments live in host memory and
the optimizer steps on the CPU.

Before anything is allocated (``check``, before the process group exists): pinned memory must be available on
CUDA, and the host bytes the byte model predicts for every rank of this node (``distattn.memory.techniques``, the
planner's own accounting: on CUDA each pinned block rounded up to a power of two, as PyTorch's pinned allocator
allocates it) must fit ``--host-mem`` GiB or, by default, MemAvailable.
"""

from __future__ import annotations

from train_config import RunConfig, UsageError

GIB = 1 << 30


def host_bytes(cfg: RunConfig, config) -> dict[str, int]:
    """Host bytes one rank of this job offloads, by kind: the planner's accounting (``train_memory.host_bytes``:
    on CUDA every pinned block rounded up to a power of two, as PyTorch's pinned allocator really allocates it)."""
    import train_memory

    return train_memory.host_bytes(cfg, config)


def check(cfg: RunConfig, config) -> None:
    """Refuse (``UsageError``) offload without pinned memory on CUDA, or more host memory than the node has."""
    from distattn.offload import check_host_memory, format_bytes, pinned_memory_available

    args = cfg.args
    if not (args.offload_checkpoints or args.offload_optimizer):
        return
    if args.offload_checkpoints:
        from distattn._compat import check_hf_offload

        try:
            check_hf_offload()
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if cfg.device_type == "cuda" and not pinned_memory_available():
        raise UsageError("offload on CUDA needs pinned host memory, which cannot be allocated here (check "
                         "`ulimit -l`); run without --offload-checkpoints/--offload-optimizer")
    need = host_bytes(cfg, config)
    per_node = cfg.env.local_world_size * sum(need.values())
    parts = " + ".join(f"{kind} {format_bytes(n)}" for kind, n in need.items())
    try:
        check_host_memory(per_node, None if args.host_mem is None else int(args.host_mem * GIB),
                          what=f"offload ({cfg.env.local_world_size} ranks on this node x ({parts})"
                          + (", pinned blocks rounded up to powers of two)" if cfg.device_type == "cuda" else ")"))
    except ValueError as exc:
        raise UsageError(f"{exc} (--host-mem)") from exc


def enable_checkpointing(cfg: RunConfig, model) -> None:
    """``--remat`` and/or ``--offload-checkpoints`` on the Hugging Face model."""
    from distattn.integrations.hf import enable_remat_checkpointing, offload_checkpoints

    if cfg.args.offload_checkpoints:
        offload_checkpoints(model, remat=cfg.args.remat)
    elif cfg.args.remat:
        enable_remat_checkpointing(model)
