"""The MoE router's load-balancing loss of a sequence-parallel model, over the whole sequence.

transformers' MoE causal LMs (Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS, ...: their ``load_balancing_loss_func``, the
Switch Transformer's eqs. 4-6) built with ``output_router_logits=True`` add ``coef * aux`` to the loss::

    aux = E * sum_e f_e * P_e     f_e = (top-k assignments to expert e) / rows,  P_e = (its router probabilities) / rows

where a row is one token of one layer, every row of the batch under its attention mask counts, and ``coef`` is the
model's ``router_aux_loss_coef``. ``f`` and ``P`` are means over the whole sequence, so the mean of the shards' own
losses (what each rank's model computes) is another number. Here each rank sums its own rows (E assignment counts, E
probability sums, the row count), the sums are all-reduced, and ``aux`` is formed from the totals: the same value on
every rank. The top-k choice has no gradient, so ``aux`` is linear in the probability sums once ``f`` is known: the
backward of ``E * sum_e f_e * (this rank's probability sum of e) / rows`` is exactly this rank's share of the whole
sequence's gradient, and summing the shares over the group (``distattn.gradients``) gives the gradient of one process.

Re-exported by ``distattn.integrations.hf`` (``load_balancing_loss``, for hand-written loops); the Trainer
(``_hf_trainer``) uses the pieces with its bounded all-reduce, and holds the model's own ``aux_loss`` of each rank's
rows to this formula (``model_aux_mismatch``), so a model whose aux loss is another is refused, never mixed up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distattn.sharding import group_size as _group_size
from distattn.topology import all_reduce as all_reduce_group

__all__ = ["load_balancing_loss", "RouterLossTerms", "router_loss_terms", "outputs_router_logits", "balancing_sums",
           "balancing_loss", "model_aux_mismatch", "refuse_other_losses"]

# Where transformers' MoE models keep the loss's coefficient (JetMoe: aux_loss_coef; DBRX sets the first from
# ffn_config.moe_loss_weight) and the experts per token, on the model or its (text) config.
_COEF_NAMES = ("router_aux_loss_coef", "aux_loss_coef")
_TOP_K_NAMES = ("num_experts_per_tok",)
MODEL_CHECK_RTOL = 1e-3  # ours vs the model's own aux of this rank's rows: the same fp32 sums (~1e-7 apart); a model
# with another formula or another top-k is off by far more (each expert's share sums to top_k)


@dataclass(frozen=True, kw_only=True)
class RouterLossTerms:
    """What a model's load-balancing term needs besides its router logits."""

    top_k: int
    """Experts per token (``num_experts_per_tok``): the top-k of every row counts ``top_k`` assignments."""
    coef: float
    """``router_aux_loss_coef``: the term added to the loss is ``coef * aux``."""


def router_loss_terms(model) -> RouterLossTerms:
    """``top_k`` and ``coef`` of a transformers MoE model, from the model or its config (``text_config`` too).

    Raises:
        ValueError: the model has neither (it returns an ``aux_loss`` but is not one of transformers' routed MoEs).
    """
    top_k, coef = _find(model, _TOP_K_NAMES), _find(model, _COEF_NAMES)
    if top_k is None or coef is None:
        raise ValueError(f"{type(model).__name__} returns an aux_loss, but distattn finds no "
                         f"{'num_experts_per_tok' if top_k is None else 'router_aux_loss_coef'} on it or its config, "
                         f"so it cannot form that loss over the whole sequence: sequence parallelism supports the "
                         f"load-balancing loss of transformers' MoE models (Mixtral, Qwen-MoE, ...); build the model "
                         f"with output_router_logits=False to train without it")
    return RouterLossTerms(top_k=int(top_k), coef=float(coef))


def outputs_router_logits(model) -> bool:
    """Whether the model's forward returns router logits by default (``config.output_router_logits``, or its
    ``text_config``'s): then it returns the ``aux_loss`` that its loss adds."""
    config = getattr(model, "config", None)
    return any(bool(getattr(c, "output_router_logits", False)) for c in (config, getattr(config, "text_config", None))
               if c is not None)


_OWN_LOSSES = ("loss", "aux_loss", "loss_sum")  # loss_sum: the tiled loss's own sum (_hf_tiling)


def refuse_other_losses(model, outputs) -> None:
    """Raise for a loss in the model's output other than ``loss`` and ``aux_loss`` (a router z-loss, ...): one
    process would add it to the loss, and distattn does not know how to form it over the whole sequence."""
    items = outputs.items() if hasattr(outputs, "items") else ()  # a ModelOutput (a tuple output has no names)
    others = [key for key, value in items if "loss" in key and key not in _OWN_LOSSES and value is not None]
    if others:
        raise ValueError(f"{type(model).__name__} returns {others}, losses that distattn cannot form over the whole "
                         f"sequence (sequence parallelism computes the cross-entropy and the MoE load-balancing "
                         f"loss); build the model without them")


def _find(model, names):
    config = getattr(model, "config", None)
    for owner in (model, config, getattr(config, "text_config", None)):
        for name in names:
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return value
    return None


def balancing_sums(router_logits, top_k: int, token_mask: torch.Tensor | None = None):
    """This rank's sums of the load-balancing loss, all layers together, as transformers forms them.

    Args:
        router_logits: the model's ``router_logits``: one ``(rows, E)`` tensor per routed layer (``(batch, n, E)``
            is flattened), this rank's tokens in order.
        top_k: experts per token.
        token_mask: ``(batch, n)`` 1 for a token that counts, 0 for padding (``None``: all count).

    Returns:
        ``(counts (E,), probs (E,), rows)``: fp32 top-k assignments per expert and router-probability sums (with
        their gradient), and the number of rows (token x layer) counted.
    """
    layers = [g.reshape(-1, g.shape[-1]) for g in router_logits]
    experts, device = layers[0].shape[-1], layers[0].device
    mask = None if token_mask is None else token_mask.reshape(-1).to(device=device, dtype=torch.float32)
    if mask is not None and mask.numel() != layers[0].shape[0]:
        raise ValueError(f"token_mask has {mask.numel()} tokens but the router logits have {layers[0].shape[0]} rows "
                         f"per layer: pass this rank's mask, shaped like its input_ids")
    counts = torch.zeros(experts, dtype=torch.float32, device=device)
    probs = torch.zeros(experts, dtype=torch.float32, device=device)
    for logits in layers:
        weights = torch.softmax(logits, dim=-1)  # in the logits' dtype, then fp32 sums: as transformers does
        chosen = torch.topk(weights, top_k, dim=-1).indices
        ones = torch.ones(chosen.shape[0], device=device) if mask is None else mask
        counts = counts.scatter_add(0, chosen.reshape(-1), ones.repeat_interleave(top_k))
        probs = probs + (weights.float() * ones.unsqueeze(-1)).sum(dim=0)
    rows = float(len(layers) * layers[0].shape[0]) if mask is None else mask.sum() * len(layers)
    return counts, probs, torch.as_tensor(rows, dtype=torch.float32, device=device)


def balancing_loss(counts, probs, rows, totals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole sequence's ``aux`` from ``totals`` (the all-reduced ``cat([counts, probs, rows])``, fp64), and
    this rank's differentiable share.

    Returns:
        ``(aux, share)``: ``aux`` fp64, the same on every rank that holds the same totals (0 when no row counts);
        ``share`` an fp32 scalar whose gradient is this rank's part of ``aux``'s (its value is not ``aux``'s part).
    """
    experts = counts.shape[0]
    total_counts, total_probs, total_rows = totals[:experts], totals[experts:2 * experts], totals[-1].clamp(min=1.0)
    f = total_counts / total_rows  # no gradient: the top-k choice is a constant of the loss
    aux = experts * (f * total_probs).sum() / total_rows
    share = experts * (f.to(probs.dtype) * probs).sum() / total_rows.to(probs.dtype)
    return aux, share


def model_aux_mismatch(model_aux, router_logits, top_k: int, token_mask, sums) -> torch.Tensor:
    """1.0 if the model's own ``aux_loss`` (of all this rank's rows, padding too: the model sees no mask) is not the
    loss of ``balancing_sums`` on the same rows (another formula, another top-k), else 0.0, as a tensor (all-reduce
    it, so that every rank refuses together). ``sums``: ``balancing_sums(router_logits, top_k, token_mask)``."""
    if token_mask is not None and not bool(token_mask.all()):
        with torch.no_grad():
            sums = balancing_sums(router_logits, top_k, None)
    counts, probs, rows = (t.detach().double() for t in sums)
    ours = counts.shape[0] * (counts * probs).sum() / rows.clamp(min=1.0) ** 2
    model_aux = torch.as_tensor(model_aux, dtype=torch.float64, device=ours.device)
    return ((ours - model_aux).abs() > MODEL_CHECK_RTOL * model_aux.abs() + 1e-6).double()


def load_balancing_loss(router_logits, top_k: int, token_mask: torch.Tensor | None = None,
                        group=None) -> torch.Tensor:
    """transformers' load-balancing loss (``load_balancing_loss_func``) over the whole sequence of ``group``.

    Multiply by the model's ``router_aux_loss_coef`` and add to ``causal_lm_loss``'s; the gradient sum over the group
    (``distattn.reduce_gradients``) is then the whole sequence's.

    Args:
        router_logits: ``outputs.router_logits`` of a model built with ``output_router_logits=True``, this rank's.
        top_k: the model's ``num_experts_per_tok``.
        token_mask: ``(batch, n)`` this rank's tokens that count (1) and padding (0); ``None``: all count. One process
            counts every token under the ``attention_mask``, so the padding of a sharded batch must be 0 here:
            ``shard_inputs(batch, group, token_mask=True)["token_mask"]``.
        group: the sequence-parallel group, as for ``causal_lm_loss``.

    Returns:
        A scalar: the whole sequence's loss on every rank; its gradient is this rank's share.
    """
    counts, probs, rows = balancing_sums(router_logits, top_k, token_mask)
    totals = torch.cat([counts.detach(), probs.detach(), rows.reshape(1)]).double()
    if _group_size(group) > 1:
        all_reduce_group(totals, group)
    aux, share = balancing_loss(counts, probs, rows, totals)
    return aux.float() + (share - share.detach())
