"""Sequence-tiled token-wise work: the LM head with its loss, and MLPs, over tiles of this rank's tokens.

What does not mix tokens can run over tiles of ``t`` tokens, and its backward can recompute one tile at a time
from the saved input, so the large per-token intermediates never exist for the whole shard::

    untiled loss   hidden (N, h) ─ head ─▶ logits (N, V) ─ fp32 ─ log_softmax ─ nll      keeps (N, V) logits
    tiled loss     hidden (N, h) ─▶ for each tile: logits (t, V) ─ ... ─ per-token loss   keeps hidden, labels
                   backward: for each tile, recompute logits (t, V), softmax grad, dhidden[tile] = dlogits W,
                   dW += dlogits^T hidden[tile] (fp32 accumulator)

    untiled MLP    x (N, h) ─ gate, up (N, f) ─ act, * (N, f) ─ down ─▶ (N, h)          keeps 4 x (N, f)
    tiled MLP      x (N, h) ─▶ for each tile: the MLP on (t, h)                          keeps x
                   backward: for each tile, recompute the tile's MLP with autograd, take its gradients;
                   parameter gradients accumulate over tiles (fp32)

Both are exact: every token's result is computed as in the untiled layer (fp32 log-softmax on the logits of
the head's compute dtype; the MLP's own forward), only the parameter-gradient sums run over tiles in another
order. A tile larger than the shard is one tile. Autocast: the state at forward is restored for the recompute
in backward, so the recomputed tiles are the forward's.

Byte model (``tiled_loss_bytes``, ``tiled_mlp_bytes``): what each technique keeps for backward and its
working set per tile, in bytes; ``tests/test_tiling.py`` holds them equal to what saved-tensor hooks measure.
Shape legend: ``N`` tokens of this rank (batch x shard), ``h`` hidden, ``V`` vocabulary, ``f`` MLP width, ``t`` tile.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

__all__ = ["check_tile", "tiled_head_loss_sum", "tiled_mlp", "TileBytes", "tiled_loss_bytes", "tiled_mlp_bytes"]

IGNORE_INDEX = -100


def check_tile(tokens, what: str = "tile") -> int:
    """``tokens`` as a tile size: a positive ``int`` (a tile larger than the shard is one tile)."""
    try:  # an int (numpy's, a one-element integer tensor), never a float or a bool
        if isinstance(tokens, bool):
            raise TypeError
        tokens = operator.index(tokens)
    except TypeError:
        raise ValueError(f"{what} size must be a positive int (tokens per tile), got {tokens!r} of type "
                         f"{type(tokens).__name__}; pass e.g. {what}=4096") from None
    if tokens <= 0:
        raise ValueError(f"{what} size must be a positive number of tokens, got {tokens}; pass e.g. 4096 "
                         f"(a tile larger than the shard is one tile)")
    return tokens


@dataclass(frozen=True)
class _Autocast:
    """The autocast state of a forward, to run its recompute in backward the same way."""

    device_type: str
    enabled: bool
    dtype: torch.dtype

    @classmethod
    def current(cls, device: torch.device) -> "_Autocast":
        kind = device.type
        return cls(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))

    def context(self):
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)


def _tiles(n: int, tile: int):
    return ((a, min(a + tile, n)) for a in range(0, n, tile))


# -- LM head + cross-entropy ------------------------------------------------------------------------------
@dataclass(frozen=True)
class _LossOptions:
    tile: int
    ignore_index: int
    compute_dtype: torch.dtype  # the head matmul's dtype: the autocast dtype, else the hidden states'


def _head_logits(h_t, w_c, b_c, dtype) -> torch.Tensor:
    """fp32 logits ``(t, V)`` of one tile, the head computed in ``dtype`` as the untiled (autocast) linear does."""
    with torch.autocast(h_t.device.type, enabled=False):
        return F.linear(h_t.to(dtype), w_c, b_c).float()


class _TiledHeadLoss(torch.autograd.Function):
    """Sum over tokens of ``cross_entropy(hidden @ W^T + b, labels)``; saves hidden and labels only."""

    @staticmethod
    def forward(ctx, hidden_nh, weight_vh, bias_v, labels_n, opts: _LossOptions):
        c = opts.compute_dtype
        w_c, b_c = weight_vh.to(c), None if bias_v is None else bias_v.to(c)
        losses = torch.empty(hidden_nh.shape[0], dtype=torch.float32, device=hidden_nh.device)
        for a, b in _tiles(hidden_nh.shape[0], opts.tile):
            logits = _head_logits(hidden_nh[a:b], w_c, b_c, c)  # (t, V) fp32: the only (., V) tensors, per tile
            losses[a:b] = F.cross_entropy(logits, labels_n[a:b], ignore_index=opts.ignore_index, reduction="none")
            del logits
        ctx.save_for_backward(hidden_nh, labels_n)
        ctx.weight, ctx.bias, ctx.opts = weight_vh, bias_v, opts  # parameters: kept anyway, not activations
        return losses.sum()

    @staticmethod
    def backward(ctx, grad_sum):
        hidden, labels = ctx.saved_tensors
        weight, bias, opts = ctx.weight, ctx.bias, ctx.opts
        c = opts.compute_dtype
        w_c, b_c = weight.to(c), None if bias is None else bias.to(c)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        d_hidden = torch.empty_like(hidden) if need_h else None
        d_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        d_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        for a, b in _tiles(hidden.shape[0], opts.tile):
            d_logits = _tile_logits_grad(hidden[a:b], labels[a:b], w_c, b_c, grad_sum, opts)  # (t, V) in c
            with torch.autocast(hidden.device.type, enabled=False):
                if need_h:
                    d_hidden[a:b] = d_logits @ w_c
                if need_w:
                    _accumulate_head_grad(d_w, d_logits, hidden[a:b].to(c), opts.tile)
                if need_b:
                    d_b += d_logits.sum(0, dtype=torch.float32)
            del d_logits
        return (d_hidden, None if d_w is None else d_w.to(weight.dtype),
                None if d_b is None else d_b.to(bias.dtype), None, None)


def _accumulate_head_grad(d_w, d_logits, h_c, block: int) -> None:
    """``d_w (V, h) fp32 += d_logits^T h_c``: in place when c is fp32; else the c-dtype product (the tensor-core
    matmul) ``block`` vocabulary rows at a time, so no ``(V, h)`` partial is ever made."""
    if d_logits.dtype == torch.float32:
        d_w.addmm_(d_logits.t(), h_c)
        return
    for v in range(0, d_w.shape[0], block):
        d_w[v:v + block] += d_logits[:, v:v + block].t() @ h_c


def _tile_logits_grad(h_t, labels_t, w_c, b_c, grad_sum, opts: _LossOptions) -> torch.Tensor:
    """d(sum of the tile's losses * grad_sum)/d(logits) ``(t, V)``, in the head's compute dtype.

    ``grad_sum * (softmax - onehot(label))`` per valid row, 0 for ignored rows: the formula PyTorch's
    log_softmax + nll_loss backward evaluates (``exp(logp) * g - g`` at the target), in fp32.
    """
    logp = torch.log_softmax(_head_logits(h_t, w_c, b_c, opts.compute_dtype), dim=-1)  # fp32 (t, V)
    valid = labels_t != opts.ignore_index
    scale = torch.where(valid, grad_sum.float(), 0.0)  # (t,) fp32; 0 silences ignored rows
    d = logp.exp_().mul_(scale[:, None])  # in place: softmax * g, no second (t, V) buffer
    rows = torch.arange(labels_t.shape[0], device=labels_t.device)
    d[rows, torch.where(valid, labels_t, 0)] -= scale
    return d.to(opts.compute_dtype)


def tiled_head_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, tokens: int,
                        bias: torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Sum over tokens of ``cross_entropy(hidden @ weight^T + bias, labels)``, ``tokens`` tokens at a time.

    Equal (to fp32 rounding) to ``F.cross_entropy(F.linear(hidden, weight, bias).float().flatten(0, -2),
    labels.flatten(), ignore_index=ignore_index, reduction="sum")``, with the same gradients for ``hidden``,
    ``weight`` (a tied embedding too: autograd adds it to the embedding's) and ``bias``; the ``(N, V)`` logits
    exist one tile of ``(tokens, V)`` at a time, forward and backward (recomputed there from ``hidden``).

    Args:
        hidden: ``(..., h)`` this rank's final hidden states (any leading shape; ``N`` tokens in all).
        weight: ``(V, h)`` the head (``lm_head.weight``, or the tied embedding); any ``V``.
        labels: ``hidden.shape[:-1]`` integer targets; ``ignore_index`` rows count nothing.
        tokens: tokens per tile (a positive int; more than ``N`` is one tile).
        bias: ``(V,)`` or ``None``.

    Returns:
        fp32 scalar: the sum of the per-token losses (fp32 log-softmax of the logits in the head's dtype).
    """
    tile = check_tile(tokens, "tokens")
    if hidden.shape[:-1] != labels.shape or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"hidden (..., h), weight (V, h) and labels hidden.shape[:-1] expected, got hidden "
                         f"{tuple(hidden.shape)}, weight {tuple(weight.shape)}, labels {tuple(labels.shape)}")
    auto = _Autocast.current(hidden.device)
    dtype = auto.dtype if auto.enabled else hidden.dtype
    if not auto.enabled and weight.dtype != hidden.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and the head weight ({weight.dtype}) must have one dtype "
                         f"outside autocast, as for F.linear; cast one of them or run under torch.autocast")
    opts = _LossOptions(tile=tile, ignore_index=ignore_index, compute_dtype=dtype)
    return _TiledHeadLoss.apply(hidden.flatten(0, -2), weight, bias, labels.flatten().to(hidden.device), opts)


# -- MLP --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _MLPOptions:
    tile: int
    autocast: _Autocast
    fn: Callable[[torch.Tensor], torch.Tensor]  # (t, h) -> (t, h_out), reads its parameters itself


class _TiledMLP(torch.autograd.Function):
    """``fn`` applied per tile of rows; saves only its input, recomputes each tile with autograd in backward."""

    @staticmethod
    def forward(ctx, x_nh, opts: _MLPOptions, *params):
        out = None
        for a, b in _tiles(x_nh.shape[0], opts.tile):
            y = opts.fn(x_nh[a:b])
            if out is None:
                out = y.new_empty((x_nh.shape[0],) + tuple(y.shape[1:]))
            out[a:b] = y
            del y
        ctx.save_for_backward(x_nh)
        ctx.opts, ctx.params = opts, params  # parameters: kept anyway, not activations
        return out

    @staticmethod
    def backward(ctx, d_out):
        (x,) = ctx.saved_tensors
        opts, params = ctx.opts, ctx.params
        want = [i for i, p in enumerate(params) if ctx.needs_input_grad[2 + i]]
        need_x = ctx.needs_input_grad[0]
        d_x = torch.empty_like(x) if need_x else None
        acc: dict[int, torch.Tensor] = {}
        # One autocast region for all tiles: its cast copies of the weights are made once, not per tile.
        with opts.autocast.context():
            for a, b in _tiles(x.shape[0], opts.tile):
                x_t = x[a:b].detach().requires_grad_(need_x)
                with torch.enable_grad():
                    y = opts.fn(x_t)
                inputs = ([x_t] if need_x else []) + [params[i] for i in want]
                grads = torch.autograd.grad(y, inputs, d_out[a:b], allow_unused=True)
                del y
                if need_x:
                    d_x[a:b], grads = grads[0], grads[1:]
                for i, g in zip(want, grads):
                    if g is not None:
                        _accumulate(acc, i, g)
                del grads, g  # this tile's parameter gradients are in the accumulators: free them now
        d_params = [acc[i].to(p.dtype) if i in acc else None for i, p in enumerate(params)]
        return (d_x, None, *d_params)


def _accumulate(acc: dict, i: int, g: torch.Tensor) -> None:
    if i not in acc:  # the first tile's gradient is fresh: it becomes the fp32 accumulator
        acc[i] = g if g.dtype == torch.float32 else g.float()
    else:
        acc[i] += g


def tiled_mlp(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: Sequence[torch.Tensor], *,
              tokens: int) -> torch.Tensor:
    """``fn(x)`` computed over tiles of ``tokens`` tokens, forward and backward (recomputed from ``x``).

    ``fn`` must be token-wise (row ``i`` of the result depends on row ``i`` of ``x`` only) and deterministic
    (no dropout): it is run again on each tile in backward. Its ``(tokens, ffn)`` intermediates exist for one
    tile at a time; ``x`` is all that is kept for backward.

    Args:
        fn: ``(t, h) -> (t, h_out)``, e.g. a bound ``LlamaMLP.forward``; it reads its parameters itself.
        x: ``(..., h)`` the MLP input (any leading shape).
        params: every tensor ``fn`` reads that needs a gradient (``list(mlp.parameters())``); their gradients
            are summed over tiles in fp32 and returned once, so DDP/FSDP hooks see one gradient per step.
        tokens: tokens per tile (a positive int; more than the shard is one tile).

    Returns:
        ``(..., h_out)``.
    """
    tile = check_tile(tokens, "tokens")
    if x.numel() == 0:  # an empty shard: nothing to tile
        return fn(x)
    opts = _MLPOptions(tile=tile, autocast=_Autocast.current(x.device), fn=fn)
    out = _TiledMLP.apply(x.reshape(-1, x.shape[-1]), opts, *params)
    return out.reshape(*x.shape[:-1], out.shape[-1])


# -- byte model -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TileBytes:
    """Bytes of one tiled technique on one rank.

    Attributes:
        saved: kept for backward between forward and backward (what saved-tensor hooks see).
        tile_saved: what one tile's recompute keeps for its own backward (alive for one tile at a time).
        tile_working: the per-tile working set at its largest (the tile's live intermediates and gradients).
        backward_fixed: alive for the whole backward of the technique besides the tiles (gradient
            accumulators, cast weight copies), not counting the input gradient that any backward produces.
    """

    saved: int
    tile_saved: int
    tile_working: int
    backward_fixed: int


def tiled_loss_bytes(tokens: int, hidden: int, vocab: int, tile: int, dtype_bytes: int, *,
                     compute_bytes: int | None = None, weight_bytes: int | None = None,
                     label_bytes: int = 8) -> TileBytes:
    """Bytes of ``tiled_head_loss_sum`` over ``tokens`` tokens.

    ``dtype_bytes``: the hidden states'; ``compute_bytes``: the head matmul's (autocast dtype; default
    ``dtype_bytes``); ``weight_bytes``: the head weight's (default ``compute_bytes``); labels int64.

    saved = N*h*dtype + N*label (hidden, labels; the fp32 per-token losses are freed at the sum).
    tile_working (backward, beyond ``backward_fixed``): the larger of two moments of a tile, the fp32 logits
    beside their log-softmax (turned in place into dlogits): 2*t*V*4; and, when c is not fp32, dlogits cast to c
    beside one block of the c-dtype partial of dW (``min(tile, V)`` rows): t*V*c + min(tile, V)*h*c.
    backward_fixed: the fp32 weight-gradient
    accumulator (V*h*4) and the weight cast to c when its dtype differs (V*h*c). Not counted: the input
    gradient (N*h, which every backward makes) and per-row vectors of a tile (targets, masks, the tile's
    input cast: under t*(h*c + 64) bytes).
    """
    c = dtype_bytes if compute_bytes is None else compute_bytes
    w = c if weight_bytes is None else weight_bytes
    t = min(tile, tokens)
    working = max(2 * t * vocab * 4, t * vocab * c + min(tile, vocab) * hidden * c if c != 4 else 0)
    fixed = vocab * hidden * 4 + (vocab * hidden * c if w != c else 0)
    return TileBytes(saved=tokens * hidden * dtype_bytes + tokens * label_bytes, tile_saved=0,
                     tile_working=working, backward_fixed=fixed)


def tiled_mlp_bytes(tokens: int, hidden: int, ffn: int, tile: int, dtype_bytes: int, *, kind: str = "swiglu",
                    compute_bytes: int | None = None, param_bytes: int | None = None) -> TileBytes:
    """Bytes of ``tiled_mlp`` over ``tokens`` tokens for a LLaMA (``"swiglu"``: gate, up, down, no bias) or a
    GPT MLP (``"gelu"``: fc with bias, GELU, proj with bias).

    ``dtype_bytes``: the input's; ``compute_bytes``: the matmuls' (autocast dtype; default ``dtype_bytes``);
    ``param_bytes``: the parameters' (default ``compute_bytes``).

    saved = N*h*dtype (the input). tile_saved (what the tile's recompute keeps for its own backward, by tensor):
    swiglu: gate out, act(gate), up out, their product: 4*t*f*c; gelu: fc out, gelu out: 2*t*f*c; plus the tile
    input cast to c when c differs from the input dtype (t*h*c).

    tile_working: the larger of a tile's two moments (its backward runs as one ``autograd.grad``), beyond the
    accumulators: **in the tile's backward**, after the down projection's backward made its input gradient and its
    weight gradient, the product's backward makes two more ``(t, f)`` gradients beside the tile's saved tensors and
    its output: tile_saved + 2*t*f*c + t*h*c + h*f*(c, and p when the weights are cast: the gradient's cast); **at
    the last weight gradient** (gate's, fc's): every parameter gradient of the tile (n_params*c, their casts too
    when p != c) beside the last ``(t, f)`` gradient, the tile's output and its input gradients: swiglu 3*t*h*c
    (the up and gate paths' and their sum), gelu 2*t*h*c. The test measures both (``tests/test_tiling.py``).
    backward_fixed: the fp32 accumulators (n_params*4, the first tile's fp32 gradients become them; with one tile
    they are that tile's gradients, counted in its moment) and, when the parameters are not in c, the weight
    matrices cast to c (M*c, M = 3*h*f or 2*h*f, made once for all tiles). The input gradient (N*h) is not counted:
    every backward makes it.
    """
    if kind not in ("swiglu", "gelu"):
        raise ValueError(f"kind={kind!r}: expected 'swiglu' (LLaMA gate/up/down) or 'gelu' (GPT fc/proj)")
    c = dtype_bytes if compute_bytes is None else compute_bytes
    p = c if param_bytes is None else param_bytes
    t = min(tile, tokens)
    per_f = 4 if kind == "swiglu" else 2
    tile_saved = per_f * t * ffn * c + (t * hidden * c if c != dtype_bytes else 0)
    matrices = (3 if kind == "swiglu" else 2) * hidden * ffn
    n_params = matrices if kind == "swiglu" else matrices + ffn + hidden
    grad_bytes = c + (p if p != c else 0)  # a tile's weight gradient in c, and its cast to the parameter's dtype
    in_backward = tile_saved + 2 * t * ffn * c + t * hidden * c + hidden * ffn * grad_bytes
    at_end = n_params * grad_bytes + t * ffn * c + (3 if kind == "swiglu" else 2) * t * hidden * c
    casts = matrices * c if p != c else 0
    if tokens <= t:  # one tile: its gradients become the accumulators (fp32 ones as they are), none before them
        fp32 = (p if p != c else c) == 4
        return TileBytes(saved=tokens * hidden * dtype_bytes, tile_saved=tile_saved,
                         tile_working=max(in_backward, at_end + (0 if fp32 else n_params * 4)), backward_fixed=casts)
    return TileBytes(saved=tokens * hidden * dtype_bytes, tile_saved=tile_saved,
                     tile_working=max(in_backward, at_end), backward_fixed=casts + n_params * 4)
