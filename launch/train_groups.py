"""The process groups of ``launch/train.py``: the job's process group and each rank's sequence-parallel group.

Owns :func:`init_distributed` (the process group over torchrun's rendezvous, one key space per restart attempt, and
this rank's device) and :func:`sequence_group` (``sp`` consecutive ranks; two-dimensional under ``--ulysses``).
Imports torch, ``torch.distributed`` and ``distattn.topology``; ``train`` imports both (``bench/step_memory.py`` calls
them through ``train``).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from train_config import RunConfig


def init_distributed(cfg: RunConfig) -> torch.device:
    """Start the process group (one rank without torchrun) and pick this rank's device."""
    if cfg.device_type == "cuda":
        device = torch.device("cuda", cfg.cuda_index)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if "RANK" in os.environ:  # torchrun (or any env:// launcher)
        store, rank, world = next(dist.rendezvous("env://"))
        # torchrun keeps one TCP store for all restarts of a job, and the process group's keys (each rank's
        # address) do not change between attempts: a restarted rank can read its peer's address from the
        # dead attempt and fail to connect (pytorch/pytorch#135712, #167288). One key space per attempt.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"distattn-train/attempt-{attempt}", store)
        dist.init_process_group(cfg.dist_backend, store=store, rank=rank, world_size=world,
                                device_id=device if cfg.device_type == "cuda" else None)
    else:
        dist.init_process_group(cfg.dist_backend, store=dist.HashStore(), rank=0, world_size=1)
    return device


def sequence_group(cfg: RunConfig):
    """This rank's sequence-parallel group: ``sp`` consecutive ranks (``None``: all of them).

    ``--ulysses U > 1``: the group is two-dimensional (``distattn.topology``), ``U`` consecutive ranks per
    Ulysses group and ``sp / U`` per ring, so sequence index ``r * U + u`` is the rank's place in its sp block:
    ``(ulysses_group, ring_group)`` from ``make_2d_groups`` when sp is the world, else the ``("ring",
    "ulysses")`` face of a ``(dp, ring, ulysses)`` device mesh (every process must create every replica's groups).
    Used for attention, sharding and the loss; parameter gradients are reduced over all ranks by FSDP2/DDP.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if cfg.ulysses > 1:
        if cfg.sp_size == cfg.env.world_size:
            from distattn.topology import make_2d_groups

            return make_2d_groups(cfg.ulysses)
        mesh = init_device_mesh(cfg.device_type, (cfg.dp_size, cfg.sp_size // cfg.ulysses, cfg.ulysses),
                                mesh_dim_names=("dp", "ring", "ulysses"))
        return mesh["ring", "ulysses"]
    if cfg.sp_size == cfg.env.world_size:
        return None
    mesh = init_device_mesh(cfg.device_type, (cfg.dp_size, cfg.sp_size), mesh_dim_names=("dp", "sp"))
    return mesh.get_group("sp")
