"""Fallbacks for the oldest supported torch and transformers (setup.py names the tested range): each gives the
newer API's behaviour on the older release, and tests run it at both ends (``.ci/run``'s lower-end phase).

- ``dist.new_group(..., sort_ranks=False)`` is missing from torch 2.11 (2.13 has it), whose ``new_group`` always
  sorts the ranks; see ``keeps_order`` and ``new_group_in_order``.
- transformers 5.17 names HF's per-layer checkpointing ``gradient_checkpointing_enable/disable``; later 5.x
  releases call it ``activation_checkpointing_enable/disable`` (the old names become deprecated aliases).
"""

from __future__ import annotations

import inspect

import torch.distributed as dist

__all__ = ["SORT_RANKS", "keeps_order", "new_group_in_order", "hf_checkpointing_enable", "hf_checkpointing_disable"]

# Whether this torch's new_group can keep the caller's rank order (a public keyword, looked up once).
SORT_RANKS = "sort_ranks" in inspect.signature(dist.new_group).parameters


def keeps_order(ranks) -> bool:
    """Whether ``new_group_in_order(ranks)`` can give group rank ``r`` to ``ranks[r]`` on this torch.

    Always with ``sort_ranks``. Without it (torch 2.11) ``new_group`` sorts, which is the same order exactly when
    ``ranks`` is already sorted; there every group a user can make is (``new_group`` and ``split_group`` sort
    too), so only a list made by hand can fail this check."""
    ranks = list(ranks)
    return SORT_RANKS or ranks == sorted(ranks)


def new_group_in_order(ranks, **kwargs):
    """``dist.new_group(ranks, **kwargs)`` whose group rank ``r`` is global rank ``ranks[r]`` (a collective).

    Raises:
        ValueError: ``ranks`` is not sorted and this torch cannot keep its order (check ``keeps_order`` first).
    """
    ranks = list(ranks)
    if SORT_RANKS:
        return dist.new_group(ranks=ranks, sort_ranks=False, **kwargs)
    if not keeps_order(ranks):
        raise ValueError(f"new_group_in_order: ranks {ranks} are not sorted, and this torch's new_group has no "
                         f"sort_ranks= to keep their order (it would renumber the group); use the group itself")
    return dist.new_group(ranks=ranks, **kwargs)


def hf_checkpointing_enable(model, kwargs: dict | None = None) -> None:
    """Turn on a transformers model's own per-layer activation checkpointing with ``kwargs`` (passed to
    ``torch.utils.checkpoint``; ``None``: transformers' default), under whichever name this release has."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def hf_checkpointing_disable(model) -> None:
    """Turn a transformers model's per-layer activation checkpointing off, under whichever name this release has."""
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


HF_OFFLOAD_MIN = (5, 23)
"""Offloaded checkpoints on Hugging Face decoder layers (``distattn.offload.CheckpointOffload.attach``) enter their
region in the layer's forward pre-hook, which transformers 5.23 runs before the layer's checkpoint; 5.17's layers
call the checkpoint first (its ``context_fn`` then runs outside the region). Tested: 5.23 works, 5.17 does not."""


def hf_offload_supported() -> bool:
    """Whether this transformers runs offloaded checkpoints on its decoder layers (``HF_OFFLOAD_MIN``)."""
    import re

    import transformers

    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", transformers.__version__).groups())
    return (major, minor) >= HF_OFFLOAD_MIN


def check_hf_offload() -> None:
    """A clear error where ``hf_offload_supported()`` is false."""
    if not hf_offload_supported():
        import transformers

        raise ValueError(f"offloaded checkpoints on Hugging Face models need transformers >= "
                         f"{'.'.join(map(str, HF_OFFLOAD_MIN))} (this is {transformers.__version__}, whose decoder "
                         f"layers call their checkpoint before the layer's hooks); upgrade transformers, or use "
                         f"distattn.checkpoint.remat_checkpoint(..., offload=) on your own blocks")
