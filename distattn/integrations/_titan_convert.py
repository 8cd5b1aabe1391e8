"""The model converter (torchtitan's ``ModelConfigConverter``) and the checks of a torchtitan config against it."""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.models.common.attention import FlexAttention, VarlenAttention
from torchtitan.protocols.model import ModelConfigConverter

from distattn.integrations._titan_attention import DistAttention

__all__ = ["DistAttnConverter", "check_parallelism"]


class DistAttnConverter(ModelConfigConverter):
    """Give every attention block of a torchtitan model distattn's sequence-parallel attention.

    Swaps each block's ``attention.inner_attention`` config (``FlexAttention`` or ``VarlenAttention``: causal
    attention within packed documents, the mask torchtitan's language models use) for
    :class:`~distattn.integrations.torchtitan.DistAttention`'s, keeping the block's window (``VarlenAttention``'s
    ``window_size``; a Flex block's ``sliding_window_size``). GQA passes through (distattn's native GQA). No model
    file is edited; pass it to a ``model_registry(..., converters=[DistAttnConverter.Config(...)])``.

    Raises (``convert``, the same on every rank, before any step):
        ValueError: an inner attention it does not know (its type named), or heads that the Ulysses ranks do not
            split.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        schedule: str = "balanced"
        """distattn's schedule, one of ``"balanced"``, ``"ring"``, ``"zigzag"``."""
        sp_degree: int = 0
        """Ranks per sequence-parallel group (0: the whole world; else blocks of consecutive ranks, and the
        world holds ``world / sp_degree`` data-parallel replicas)."""
        ulysses_degree: int = 1
        """Ulysses ranks per group (heads split over them by an all-to-all); must divide the query and the
        key/value heads."""

        def __post_init__(self):
            DistAttention.Config(schedule=self.schedule, sp_degree=self.sp_degree,
                                 ulysses_degree=self.ulysses_degree)  # the same checks, the same messages

    def __init__(self, config: Config) -> None:
        self.config = config

    def convert(self, model_config):
        layers = getattr(model_config, "layers", None)
        if layers is None:
            raise ValueError(f"DistAttnConverter converts decoder configs with .layers (torchtitan's Decoder.Config); "
                             f"got {type(model_config).__name__}")
        for i, layer in enumerate(layers):
            attention = getattr(layer, "attention", None)
            if attention is None:  # hybrid models: a block without full attention
                continue
            attention.inner_attention = self._inner(attention, f"layers[{i}].attention")
        return model_config

    def _inner(self, attention, where: str) -> DistAttention.Config:
        inner = attention.inner_attention
        c = self.config
        if isinstance(inner, DistAttention.Config):
            return inner
        if isinstance(inner, VarlenAttention.Config):
            window = tuple(inner.window_size)
        elif isinstance(inner, FlexAttention.Config):
            w = getattr(attention, "sliding_window_size", None)
            window = (w - 1, 0) if w else (-1, 0)
        else:
            raise ValueError(f"{where}.inner_attention is {type(inner).__qualname__}, which DistAttnConverter cannot "
                             f"serve: it converts FlexAttention and VarlenAttention (causal within packed "
                             f"documents, optionally windowed)")
        _check_heads(attention, c.ulysses_degree, where)
        return DistAttention.Config(window_size=window, schedule=c.schedule, sp_degree=c.sp_degree,
                                    ulysses_degree=c.ulysses_degree)


def _check_heads(attention, ulysses: int, where: str) -> None:
    heads_q = attention.n_heads
    heads_kv = getattr(attention, "n_kv_heads", None) or heads_q
    for name, heads in (("n_heads", heads_q), ("n_kv_heads", heads_kv)):
        if heads % ulysses:
            raise ValueError(f"{where}.{name} ({heads}) must be a multiple of ulysses_degree ({ulysses}): the "
                             f"Ulysses all-to-all splits heads over its ranks; choose a ulysses_degree that divides "
                             f"{heads_q} and {heads_kv}, or 1")


def check_parallelism(parallelism, model_config=None, world_size: int | None = None) -> None:
    """Refuse a torchtitan ``ParallelismConfig`` that the plug-in cannot run with, before step 1 (same facts on every
    rank, same error): context parallelism on as well (the plug-in shards the sequence itself), tensor or pipeline
    parallelism (not composed with it yet), and a ``sp_degree`` that does not divide the world.

    Args:
        parallelism: torchtitan's ``ParallelismConfig`` (``Trainer.Config.parallelism``).
        model_config: the converted model config (its ``DistAttention`` settings are checked against the world).
        world_size: the job's ranks (default: ``torch.distributed``'s world, when initialized).
    """
    if getattr(parallelism, "context_parallel_degree", 1) > 1:
        raise ValueError(f"parallelism.context_parallel_degree = {parallelism.context_parallel_degree} with "
                         f"DistAttnConverter: distattn shards the sequence itself (shard_batch) and torchtitan's "
                         f"context parallelism would shard it again; set context_parallel_degree = 1")
    for name in ("tensor_parallel_degree", "pipeline_parallel_degree"):
        if getattr(parallelism, name, 1) > 1:
            raise ValueError(f"parallelism.{name} = {getattr(parallelism, name)} is not composed with "
                             f"DistAttnConverter yet; set it to 1 (data parallelism: FSDP2 over whole "
                             f"sequence-parallel groups, distattn.set_fsdp_gradient_divide_factor)")
    if model_config is None:
        return
    if world_size is None:
        import torch.distributed as dist

        world_size = dist.get_world_size() if dist.is_initialized() else 1
    for layer in getattr(model_config, "layers", []):
        inner = getattr(getattr(layer, "attention", None), "inner_attention", None)
        if isinstance(inner, DistAttention.Config):
            p = inner.sp_degree or world_size
            if world_size % p or p % inner.ulysses_degree:
                raise ValueError(f"sp_degree={inner.sp_degree} must divide the world size {world_size} and "
                                 f"ulysses_degree={inner.ulysses_degree} must divide it")
            return

