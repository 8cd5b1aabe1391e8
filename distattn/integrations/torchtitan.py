"""torchtitan: distattn's sequence-parallel attention for packed documents, plugged in by a model converter.

torchtitan (0.3.0) has no context parallelism for packed variable-length documents (its ``VarlenAttention``
refuses it; its ``FlexAttention`` all-gathers keys and values). ``DistAttnConverter`` is a torchtitan
``ModelConfigConverter``: it swaps each block's ``attention.inner_attention`` config for :class:`DistAttention`, whose
config is a ``VarlenAttention.Config``, so torchtitan's own data path gives it the packed documents (per-document
``positions`` -> ``VarlenMetadata``). No torchtitan file is patched; torchtitan's context parallelism stays off::

    from torchtitan.models.llama3 import model_registry
    from distattn.integrations.torchtitan import DistAttnConverter, check_parallelism, shard_batch, sp_group

    spec = model_registry("8B", attn_backend="varlen",
                          converters=[DistAttnConverter.Config(schedule="balanced", sp_degree=0)])
    model = spec.model.build()                    # (then init_states, fully_shard per block and the root)
    check_parallelism(parallelism, spec.model)    # CP/TP/PP on as well -> one clear error on every rank
    distattn.set_fsdp_gradient_divide_factor(model, sp_group(model))   # FSDP2: sum over the group, mean over replicas

    batch = shard_batch(model, inputs, labels, positions)   # the whole rows in, this rank's shard out
    pred = model(batch["tokens"], positions=batch["positions"], attention_masks=batch["attention_masks"])
    loss = cross_entropy(pred.flatten(0, 1).float(), batch["labels"].flatten(), reduction="sum") \
        / batch["global_valid_tokens"]            # torchtitan's CrossEntropyLoss(pred, labels, global_valid_tokens)
    loss.backward(); optimizer.step()

What each piece guarantees:
    * attention is exact over the whole row within each document (causal; the block's window; GQA), the rows of a
      batch independent, by ``distattn.dist_flash_attn_varlen_func`` (``dist_flash_attn_func`` without documents);
    * RoPE gets each token's own position (the shard of the whole rows' positions, not ``0..n-1``);
    * the loss is each rank's term of the replica's token mean, so its backward gives each parameter this rank's
      share; ``distattn.gradients`` turns the shares into the full gradient (FSDP2: it divides by the number of
      data-parallel replicas, not by all ranks: the sum over the group is kept).

Bad input raises before the first step on every rank: an inner attention it does not know, heads the Ulysses
ranks do not split, a schedule it does not run (``"placed"``: the layout would change per batch) at ``convert``;
torchtitan's context parallelism (or TP/PP) on as well at ``check_parallelism`` (and torchtitan refuses CP with a
``VarlenAttention`` config too); masks of another kind (a Flex ``BlockMask``), masks built from a shard, or DTensor
inputs at the first forward.
"""

from __future__ import annotations

try:
    import torchtitan  # noqa: F401
except ImportError as e:  # one clear line instead of a traceback deep in the import
    raise ImportError("distattn.integrations.torchtitan needs torchtitan (tested with 0.3.0): pip install "
                      "'distattn[torchtitan]'") from e

from distattn.integrations._titan_attention import TITAN_SCHEDULES, DistAttention, sequence_parallel_group
from distattn.integrations._titan_batch import IGNORE_INDEX, attention_of, shard_batch, sp_group
from distattn.integrations._titan_convert import DistAttnConverter, check_parallelism

__all__ = ["DistAttnConverter", "DistAttention", "check_parallelism", "shard_batch", "sp_group", "attention_of",
           "sequence_parallel_group", "TITAN_SCHEDULES", "IGNORE_INDEX"]
