"""ALST's training step as DeepSpeed 0.19.8 and ArcticTraining ship it, on one rank of a gloo group
(``bench/peers/train_step.py`` runs it beside distattn and the one-process reference).

The pieces, called the way ArcticTraining's ``Trainer``/``SFTTrainer`` call them:

* ``UlyssesSPAttentionHF.register_with_transformers(config path, "sdpa", P, micro_batch, seq_length)`` before the
  model is built (it overrides transformers' ``"sdpa"`` attention with the Ulysses all-to-all wrapper), and the sdpa
  mask function registered as ``None`` (ArcticTraining: "prevent causal mask from being created");
* ``TiledMLP`` on the model's MLP class, patched before the model is built (ArcticTraining's
  ``enable_tiled_mlp_compute``: ``down(act(gate(x)) * up(x))`` over shards, the shard count agreed by a MAX
  all-reduce);
* ``TiledFusedLogitsLoss`` over the final hidden states with a per-shard ``loss_sum`` and the differentiable
  token-weighted ``all_gather`` of the per-rank losses (``SFTTrainer.loss``);
* the activation-checkpoint offload: DeepSpeed's ``CheckpointHiddenStatesOffload``
  (``get_checkpoint_hidden_states_offloading_ctx_manager``) around forward and backward, with transformers'
  non-reentrant gradient checkpointing;
* the batch: contiguous sequence shards of ``input_ids``, global ``position_ids`` and ``shift_labels`` (labels
  shifted on the whole sequence, ``-100`` last), what ``UlyssesSPDataLoaderAdapter`` hands each rank.

Not used: the DeepSpeed engine (ZeRO); gradients are averaged over the group as the engine averages over its
data-parallel ranks (one all-reduce per parameter, then / P: the all_gather's backward has already summed every rank's
share into each) and a plain ``torch.optim.AdamW`` steps, as in the distattn stack (the same optimizer for both).

Patches (two, listed in the results; ``fix_head_grad`` says the second): on a CPU accelerator DeepSpeed's offload
engine skips every tensor
(``deepspeed/runtime/activation_checkpointing/offload_activations.py``, ``_ActivationOffloadEngine._should_skip``:
``get_accelerator().is_synchronized_device()`` is True for the CPU accelerator; "cpu-like accelerators have no
streams; offload_input never offloads there"). ``offload_on_cpu`` gives the engine instance a ``_should_skip`` without
that one term, so the checkpointed layer inputs are copied into host buffers and restored in backward, as on a GPU
without streams. ``tests/test_peers_train_step.py`` checks that DeepSpeed still skips on CPU (so a release that
changes it is noticed) and that with the patch the offload moves bytes.
"""

from __future__ import annotations

import math
import os
import tempfile

import torch
import torch.distributed as dist

PATCHES = {
    "alst-offload-on-cpu": "DeepSpeed's _ActivationOffloadEngine._should_skip without is_synchronized_device() (True "
                           "on the CPU accelerator, where it would offload nothing); deepspeed 0.19.8",
    "alst-head-grad": "the LM head's gradient from TiledFusedLogitsLoss (computed in its forward, never scaled by the "
                      "gradient that reaches the loss) times P / (target tokens): as shipped it is the gradient of the "
                      "token sum, (target tokens) times the mean's (fix_head_grad); deepspeed 0.19.8",
}


def init_deepspeed_comm() -> None:
    """DeepSpeed's communication layer over the gloo group the harness already made (builds nothing new)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("DS_BUILD_OPS", "0")
    import deepspeed.comm

    deepspeed.comm.init_distributed(dist_backend="gloo", dist_init_required=False, verbose=False)


def register(config, *, sp: int, micro_batch: int, seq_len: int):
    """``register_with_transformers`` from a saved config (ArcticTraining passes the model's name or path)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    import transformers.masking_utils

    with tempfile.TemporaryDirectory() as path:
        config.save_pretrained(path)
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=path, core_attn_implementation="sdpa", sequence_parallel_size=sp,
            micro_batch_size=micro_batch, seq_length=seq_len, seq_length_is_variable=True)
    transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS.register("sdpa", lambda *args, **kwargs: None)
    return mpu


def tile_mlp_class(mlp_cls, tile_tokens: int) -> None:
    """The MLP class's forward as ALST's ``TiledMLP`` over shards of about ``tile_tokens`` tokens (all ranks agree
    on the count with a MAX all-reduce, as ArcticTraining does; its own default is ``ceil(seqlen / hidden)``)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def swiglu(mlp, x):
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))

    def forward(mlp, x):
        count = torch.tensor(math.ceil(x.shape[-2] / tile_tokens), device=x.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        params = [mlp.down_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight]
        return TiledMLP.apply(swiglu, mlp, x, int(count.item()), params)

    mlp_cls.forward = forward


def tiled_loss(model, batch: dict, group, loss_tile: int) -> torch.Tensor:
    """``SFTTrainer.loss`` with SP > 1 and no Liger: ``TiledFusedLogitsLoss`` then the token-weighted mean."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss
    import torch.distributed.nn.functional as dist_fn

    shift_labels = batch["shift_labels"]
    hidden = model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                         use_cache=False).last_hidden_state

    def loss_sum(lm, x, y):
        logits = lm.lm_head(x)
        good = (y != -100).sum()
        if good == 0:  # every target ignored: a zero that still reaches the head's gradient
            return (logits.sum() * 0.0).float()
        return lm.loss_function(logits=logits, labels=None, vocab_size=lm.config.vocab_size, shift_labels=y) * good

    shards = max(1, math.ceil(shift_labels.numel() / loss_tile))
    total = TiledFusedLogitsLoss.apply(loss_sum, model, hidden, shift_labels, None, shards, [model.lm_head.weight],
                                       "sum")
    good = (shift_labels != -100).sum()
    loss = total / max(good, 1)
    losses = dist_fn.all_gather(loss, group=group)
    goods = dist_fn.all_gather(good, group=group)
    return sum(lo * g for lo, g in zip(losses, goods)) / sum(goods), int(sum(goods))


def fix_head_grad(model, world: int, good_tokens: int) -> None:
    """The second listed patch, applied after ``backward``: ``TiledFusedLogitsLoss`` computes the head's weight
    gradient inside its forward (``torch.autograd.backward`` per shard with an incoming gradient of 1 for
    ``output_reduction="sum"``) and its backward scales only the hidden states' gradient (``x_grad *= grads[0]``), so
    the head gets the gradient of the token *sum*, not of the mean that ``SFTTrainer.loss`` returns: ``good_tokens``
    times too large. Scaled here to the same convention as every other parameter's gradient on this rank (``P`` times
    its share, which the engine's average over the ``P`` ranks undoes)."""
    model.lm_head.weight.grad.mul_(world / good_tokens)


def offload_on_cpu(engine) -> None:
    """The listed patch: this offload engine offloads on the CPU accelerator too (see the module docstring)."""
    def should_skip(tensor: torch.Tensor) -> bool:
        return (engine._num_bytes(tensor) < engine.min_offload_bytes or isinstance(tensor, torch.nn.Parameter)
                or (tensor.numel() > 1 and 0 in tensor.stride()))

    engine._should_skip = should_skip


def offload_context(patch: bool = True):
    """DeepSpeed's checkpoint offload context (``CheckpointHiddenStatesOffload``), patched to act on CPU."""
    from deepspeed.runtime.activation_checkpointing.offload_activations import (
        get_checkpoint_hidden_states_offloading_ctx_manager)

    from deepspeed.accelerator import get_accelerator

    ctx = get_checkpoint_hidden_states_offloading_ctx_manager()
    if patch and get_accelerator().is_synchronized_device():  # the CPU accelerator: it would skip every tensor
        offload_on_cpu(ctx)
    return ctx


def host_buffer_site():
    """(owner, name) of DeepSpeed's host-buffer routine, for ``train_measure.host_site``."""
    from deepspeed.runtime.activation_checkpointing.offload_activations import _ActivationOffloadEngine

    return _ActivationOffloadEngine, "_empty_cpu_like"


def shard(input_ids: torch.Tensor, rank: int, world: int) -> dict:
    """This rank's contiguous shard of the batch, with global positions and globally shifted labels."""
    b, s = input_ids.shape
    n = s // world
    positions = torch.arange(s).expand(b, s)
    shift = torch.cat([input_ids[:, 1:], torch.full((b, 1), -100, dtype=input_ids.dtype)], dim=1)
    part = slice(rank * n, (rank + 1) * n)
    return {"input_ids": input_ids[:, part].contiguous(), "position_ids": positions[:, part].contiguous(),
            "shift_labels": shift[:, part].contiguous()}
