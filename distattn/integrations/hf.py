"""Hugging Face transformers (5.x) integration: sequence-parallel LLaMA-family training in a few lines.

Tested with transformers 5.23 on ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MistralForCausalLM`` (GQA) and
``Gemma2ForCausalLM`` (attention logit soft-capping);
any model whose attention goes through transformers' ``AttentionInterface`` with the same block shape
works the same way. Every rank runs the same model on its own shard of the sequence
(``torchrun --nproc-per-node N train.py``)::

    import distattn, torch.distributed as dist
    from distattn.integrations.hf import causal_lm_loss, enable_remat_checkpointing, shard_batch, use_distattn

    dist.init_process_group("nccl")        # "gloo" on CPU
    model = LlamaForCausalLM.from_pretrained(...).cuda()
    use_distattn(model)                    # attention = distattn over the default group, no 4-D mask
    enable_remat_checkpointing(model)      # optional: checkpoint at attention outputs (distattn.checkpoint);
                                           # offload=True: what it keeps waits in host memory (distattn.offload)
    model.train()

    batch = shard_batch(input_ids, labels=input_ids)   # full (batch, seq) on every rank -> this rank's shard
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    loss = causal_lm_loss(logits, batch["shift_labels"])   # global token mean, same value on every rank
    loss.backward()
    distattn.reduce_gradients(model)       # each rank holds its share of every gradient: sum over the group
    optimizer.step()

Layouts and groups: ``use_distattn(model, group, schedule)`` and ``shard_batch(..., group=group, schedule=schedule)``
take the same two choices. ``schedule="balanced"`` or ``"ring"`` shard the sequence contiguously (rank ``r`` holds
tokens ``[r*n, (r+1)*n)``); ``"zigzag"`` gives rank ``r`` chunks ``r`` and ``2P-1-r`` of ``2P``, which balances
causal work by layout. ``group`` may be two-dimensional, ``(ulysses_group, ring_group)`` from
``distattn.make_2d_groups(U)`` or a 2-D ``DeviceMesh`` named ``("ring", "ulysses")``: heads are split over the
``U`` Ulysses ranks by an all-to-all and the sequence goes around the ring; the sequence is split over all
``U * R`` ranks (sequence index ``r * U + u``), and the loss and the gradient sums cover all of them. A batch
sharded with another layout than the model's raises ``ValueError`` at the first forward, on every rank.

Gradients: after ``loss.backward()`` every parameter's ``.grad`` is only this rank's share of the
full-sequence gradient (the part that flows through this rank's tokens); the full-sequence gradient is the sum
over the sequence-parallel group (a two-dimensional group: all its ``U * R`` ranks), and stepping on the shares
trains on a part of the batch. DDP and FSDP *average* over their ranks (``1/P`` of the gradient, silently). One
call per way of training gives the right gradient (``distattn.gradients``; it also averages over data-parallel
replicas): a plain loop calls ``distattn.reduce_gradients(model, group)`` after each backward; DDP,
``distattn.register_ddp_gradient_hook(ddp_model, group)`` once; FSDP2, ``distattn.set_fsdp_gradient_divide_factor(
model, group)`` once, after ``fully_shard``.

What the pieces guarantee:
    * RoPE sees global positions (``position_ids`` from ``shard_batch``), so every token is embedded as in the
      single-device model; attention is exact over the whole sequence (``distattn.dist_flash_attn_func``).
    * Labels are shifted on the full sequence before sharding, so the last token of a shard keeps its target
      (the first token of the next shard); the sequence's last target is -100.
    * ``causal_lm_loss`` counts target tokens over all ranks, so the loss is the full-sequence mean and each
      rank's backward gives exactly its share of the full-sequence gradient.

Masks: distattn never applies a per-token mask it was not told about. ``use_distattn`` registers distattn in
transformers' mask interface (``AttentionMaskInterface``), which receives the model's 2-D ``attention_mask``: an
all-ones mask is accepted (it masks nothing); a mask with any zero (padding) raises ``ValueError`` on every rank
of the group (the ranks agree with one small all-reduce, only when a mask is passed). Remove the padding
instead: ``shard_batch(input_ids, labels, attention_mask=mask)`` packs the rows padding-free.

Packed (padding-free) batches: ``shard_batch`` packs a list of documents, a padded batch with its mask, or
transformers' flattened format (``position_ids`` restarting at 0) into one stream split over the ranks; a forward
pre-hook (installed by ``use_distattn``, see ``_hf_packing``) derives the whole stream's documents on every
forward, and attention stays inside each document (``distattn.dist_flash_attn_varlen_func``). Sliding-window
models (Mistral) and attention logit soft-capping (Gemma-2) are computed.

Sequence tiling (``_hf_tiling``, ``distattn.tiling``): ``tile_mlp(model, tokens=4096)`` runs every decoder layer's MLP
over 4096-token tiles, keeping only its input for backward; ``tile_loss(model, tokens=4096, group=group)`` makes
``model(..., shift_labels=batch["shift_labels"]).loss`` equal ``causal_lm_loss``'s, computed over tiles with no
``(batch, n, vocab)`` logits (``tiled_causal_lm_loss(hidden, head, labels)`` for your own loop). Both compose with
either checkpointing.

MoE models (``output_router_logits=True``): ``load_balancing_loss(outputs.router_logits, top_k, token_mask, group)``
is the router's load-balancing loss over the whole sequence (``_hf_router``; ``SequenceParallelTrainer`` adds it).

Not supported (each raises ``ValueError`` at the first forward): padding masks and prepared 4-D masks, attention
dropout in training, and generation with a KV cache (``use_distattn`` sets ``config.use_cache = False``).
"""

from __future__ import annotations

# The face of the Hugging Face integration: it only hands names on. The rooms under it import downward (none
# imports this module): _hf_batch (shard_batch, causal_lm_loss) <- _hf_attention (use_distattn) <- _hf_checkpointing;
# _hf_data, _hf_tiling, _hf_router; _hf_trainer (imported lazily, only when the Trainer is asked for).
from distattn.integrations._hf_attention import (_DEFAULT_OPTIONS, ATTN_IMPLEMENTATION, _common_dtype, _Options,
                                                 _window, distattn_attention_forward, placement_window,
                                                 use_distattn)
from distattn.integrations._hf_batch import IGNORE_INDEX, causal_lm_loss, shard_batch
from distattn.integrations._hf_checkpointing import enable_remat_checkpointing, offload_checkpoints
from distattn.integrations._hf_data import ReplicaSampler, check_same_batches, shard_inputs
from distattn.integrations._hf_router import load_balancing_loss
from distattn.integrations._hf_tiling import global_mean, tile_loss, tile_mlp, tiled_causal_lm_loss

__all__ = ["use_distattn", "shard_batch", "causal_lm_loss", "enable_remat_checkpointing", "offload_checkpoints",
           "ATTN_IMPLEMENTATION", "IGNORE_INDEX", "tiled_causal_lm_loss", "tile_loss", "tile_mlp",
           "shard_inputs", "check_same_batches", "ReplicaSampler", "load_balancing_loss", "placement_window",
           "SequenceParallelTrainer", "SequenceParallelMixin"]  # noqa: F822 (the last two: __getattr__, lazily)
# handed on for the compat adapters and tests that call the attention function directly
_HANDED_ON = (_DEFAULT_OPTIONS, _Options, _common_dtype, _window, distattn_attention_forward, global_mean)
_TRAINER = ("SequenceParallelTrainer", "SequenceParallelMixin")  # import transformers.Trainer only when asked for


def __getattr__(name):
    if name in _TRAINER:
        import distattn.integrations._hf_trainer as trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
