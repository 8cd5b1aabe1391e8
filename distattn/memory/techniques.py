"""The byte model of the long-sequence techniques: sequence-tiled loss and MLP, offloaded checkpoints, offloaded
optimizer state; per rank, device and host, with the host-device traffic and the recomputation they cost.

The techniques (``Techniques``) compose with every checkpointing strategy of ``distattn.memory.model``:

* ``loss_tile``: the LM head and cross-entropy run over tiles of ``loss_tile`` tokens and recompute each tile's
  logits in backward (``distattn.tiling``): the fp32 log-softmax ``(n, V)`` is never kept, and the loss backward
  holds one tile's logits and their gradient instead of the whole shard's.
* ``mlp_tile``: the MLP runs over tiles of ``mlp_tile`` tokens and keeps only its input; its ``(n, ffn)``
  intermediates exist for one tile at a time (forward and backward), at the price of one more MLP forward.
* ``offload_checkpoints``: what full or remat checkpointing keeps per layer lives in host memory between forward and
  backward; the device holds the layer being copied out and the one prefetched back (two layers' worth).
* ``offload_optimizer``: FSDP2's ``CPUOffloadPolicy``: fp32 parameters, gradients and AdamW states live on the host;
  the device holds the gathered half-precision parameters of the layers being computed.

``technique_peak`` gives the training step's device peak: the largest of the moments ``launch/train.py``'s step
passes through (``TechniquePeak.moments`` lists them): the loss backward; a layer's backward at the last, the last but
one, the second and the first layer (what a layer's backward holds is linear in its index but for FSDP2's prefetch of
the next layer's parameters, absent in the first layer's, and the previous layer's reduce-scatter input, absent in
the last layer's), inside its MLP's backward and, with distattn, its attention's
backward and forward, where the executor's own buffers (``distattn.memory.executor``: a replay of the plan) sit on
top of the layer's tensors; the root's gradient reduction; AdamW's step. Each with the techniques applied and
FSDP2's root, head gradient, prefetch and reduce-scatter input (``fsdp2_items``). Held to a whole-step measurement on
CPU (``bench/step_memory.py``, ``tests/test_step_memory.py``). Then the host bytes at their peak (pinned blocks
rounded to powers of two: ``host_block``), the bytes that cross the host-device link per step, and the FLOPs of the
step and of its recomputation.

Legend as in ``distattn.memory.model``: ``b`` batch, ``n`` tokens on this rank, ``h`` hidden, ``f`` ffn, ``V`` vocab,
``L`` layers, ``A`` bytes of the activation dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from distattn.memory.executor import attention_buffers
from distattn.memory.model import (ModelSpec, Saved, _dtypes, layer_saved_tensors, model_saved_tensors,
                                   steady_state_bytes)
from distattn.tiling import tiled_loss_bytes, tiled_mlp_bytes

__all__ = ["Techniques", "TechniquePeak", "technique_peak", "mlp_saved_names", "step_flops", "host_limit_bytes",
           "tiled_layer_saved_tensors", "fsdp2_items", "host_block", "optimizer_host_bytes", "cpu_adamw_temporaries"]


@dataclass(frozen=True, kw_only=True)
class Techniques:
    """Which long-sequence techniques a step uses (all off: today's step)."""

    loss_tile: int | None = None
    """Tokens per tile of the LM head + loss (``None``: untiled)."""
    mlp_tile: int | None = None
    """Tokens per tile of the MLP (``None``: untiled)."""
    offload_checkpoints: bool = False
    """Checkpointed tensors (full or remat) live in host memory between forward and backward."""
    offload_optimizer: bool = False
    """fp32 parameters, gradients and AdamW states on the host (FSDP2 ``CPUOffloadPolicy``)."""

    def __post_init__(self):
        for name in ("loss_tile", "mlp_tile"):
            tile = getattr(self, name)
            if tile is not None and (isinstance(tile, bool) or not isinstance(tile, int) or tile <= 0):
                raise ValueError(f"{name} must be a positive number of tokens or None, got {tile!r}")

    def label(self) -> str:
        parts = [f"loss tile {self.loss_tile}" if self.loss_tile else "", f"mlp tile {self.mlp_tile}" if self.mlp_tile
                 else "", "offload ckpt" if self.offload_checkpoints else "", "offload optim" if self.offload_optimizer
                 else ""]
        return ", ".join(p for p in parts if p) or "none"


@dataclass(frozen=True)
class TechniquePeak:
    """A step's memory on one rank with techniques: the device peak, the host bytes, the traffic, the FLOPs."""

    total: int
    """Device bytes at the peak."""
    parts: dict
    moment: str
    host: dict = field(default_factory=dict)
    """Host bytes per component (this rank's share)."""
    traffic: int = 0
    """Bytes that cross the host-device link per step (both directions)."""
    flops: float = 0.0
    """FLOPs of the step with its recomputation."""
    recompute_flops: float = 0.0
    """FLOPs recomputed (checkpointing, tiles) on top of forward + backward."""
    moments: tuple = ()
    """Every moment the model weighs: ``(name, total bytes, parts)``, the peak among them."""
    host_moment: str = ""
    """When the host bytes peak (``host`` holds their parts then)."""

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def dominant(self) -> str:
        return max(self.parts, key=self.parts.get)


def mlp_saved_names(saved: list[Saved]) -> list[Saved]:
    """The entries of a layer's saved list that belong to its MLP (what the tiled MLP replaces by its input)."""
    keys = ("gate_proj", "up_proj", "gate/up_proj", "down_proj", "mlp.", "fc1", "fc2")
    return [s for s in saved if any(s.name.startswith(k) for k in keys)]


def step_flops(model: ModelSpec, batch: int, seq: int, sp: int, *, causal: bool = True) -> tuple[float, float, float]:
    """Per rank: ``(matmul FLOPs of one layer's forward, attention FLOPs of one layer's forward, head FLOPs)``."""
    n = seq // sp
    lay = model.layer
    mat = 2 * batch * n * lay.matmul_params
    att = 4 * batch * lay.heads * n * seq * lay.head_dim * (0.5 if causal else 1.0)
    head = 2 * batch * n * lay.hidden * model.vocab
    return mat, att, head


def _mlp_flops(model: ModelSpec, batch: int, n: int) -> float:
    lay = model.layer
    return 2 * batch * n * (3 if lay.family == "llama" else 2) * lay.hidden * lay.ffn


def technique_peak(model: ModelSpec, batch: int, seq: int, *, sp: int = 1, shard: int = 1,
                   precision: str = "bf16", strategy: str = "full", impl: str = "distattn",
                   tech: Techniques = Techniques(), schedule: str = "balanced", partials: str = "fp32",
                   pinned: bool = True, mode: str | None = None, device: str = "cuda",
                   fsdp_layout: str = "root") -> TechniquePeak:
    """The step's device peak, host bytes, traffic and FLOPs on one rank (see the module doc).

    Args:
        model: the model; batch: sequences per step; seq: tokens per sequence (whole); sp: ranks that split it;
        shard: ranks that shard weights/grads/AdamW (FSDP2); precision, strategy, impl: as ``step_peak``.
        schedule, partials: the attention call's (``DistAttnConfig``): its executor's buffers
            (``distattn.memory.executor``) are part of the moments in a layer's attention forward and backward.
        pinned: host buffers are pinned (CUDA), so PyTorch's pinned caching allocator rounds each to a power of two.
        mode: how the parameters are held, as ``launch/train_model.shard`` does: ``fsdp2`` (sharded ``shard`` ways,
            the root and the layer computed unsharded), ``ddp`` or ``none`` (every rank holds all); ``None``: FSDP2
            when ``precision`` is bf16/fp16 (train.py on CUDA), else ``shard``-way sharded state without FSDP2's
            extra buffers.
        device: ``cuda``, or ``cpu`` (where the tests measure): there an offloaded checkpoint is used from its host
            copy, no device copy is fetched.
        fsdp_layout: FSDP2's groups beyond the decoder layers: ``root`` (``launch/train.py``: embeddings, final norm
            and LM head in the root, unsharded from the forward to the end of the backward) or ``split``
            (accelerate's ``fsdp2_prepare_model``, what the Trainer runs: the embeddings a group resharded after its
            forward, the final norm and LM head a group kept unsharded from its forward to its backward).
    """
    if fsdp_layout not in ("root", "split"):
        raise ValueError(f"fsdp_layout={fsdp_layout!r}: expected 'root' (train.py) or 'split' (accelerate)")
    if tech.offload_checkpoints and strategy not in ("full", "remat"):
        raise ValueError(f"offload_checkpoints moves what full or remat checkpointing keeps; strategy={strategy!r} "
                         f"keeps every activation (use strategy='full' or 'remat')")
    act, _, _, _ = _dtypes(precision)
    A = act.itemsize
    n = seq // sp
    lay = model.layer
    kw = dict(impl=impl, precision=precision, sp=sp)
    cuda = device == "cuda"
    fsdp_on = precision in ("bf16", "fp16") if mode is None else mode == "fsdp2"
    if mode in ("none", "ddp"):  # every rank holds every parameter, gradient and AdamW state
        shard = 1
    fsdp = fsdp2_items(model, A) if fsdp_on else {}
    steady = steady_state_bytes(model, shard=shard, gather_bytes=A)
    # gradients are made in backward (train.py zeroes them with set_to_none): one layer's fp32 shard each, and the
    # head and final norm's (FSDP2: the head's unsharded gradient, reduced with the root's at the end of backward)
    grad_layer = -(-4 * lay.params // shard)
    head_params = (0 if model.tie_embeddings else model.vocab * lay.hidden) + lay.hidden
    grad_head = fsdp.get("head_grad", 0) if fsdp_on else 4 * head_params
    split = fsdp_on and fsdp_layout == "split"
    if split:  # the tail group's gradients are reduced right after the loss backward: its sharded fp32 shard stays
        grad_head = 0 if tech.offload_optimizer else -(-4 * head_params // shard)
    host: dict[str, int] = {}
    traffic = 0
    resident = {"weights+adam": steady["weights"] + steady["adam"] + steady["buffers"]}
    if tech.offload_optimizer:  # fp32 params + grads + AdamW on the host; the device holds the gathered half
        # parameters of the layer computed and the one prefetched, and the root's (embeddings, head) throughout
        host.update(optimizer_host_bytes(model, shard, pinned))
        host["AdamW temporaries"] = cpu_adamw_temporaries(model, shard)
        traffic += 2 * steady["weights"] + steady["grads"]  # params to the device (forward, backward), grads back
        resident, grad_layer = {}, 0

    def gathered(i: int) -> dict:
        """FSDP2 in layer ``i``'s backward: that layer's parameters unsharded in the compute dtype and (CUDA: on a
        side stream; sharded over ranks: the all-gather's output, copied out when layer ``i - 1`` starts) the next
        layer's, prefetched; none at the loss backward, the root's throughout (``resident``)."""
        if not fsdp_on:
            return {}
        prefetch = cuda or (shard > 1 and i > 0)
        return {"gathered params (layers)": (2 if prefetch else 1) * A * lay.params}

    if fsdp_on and not split:
        resident["FSDP2 root (embeddings, head: unsharded)"] = fsdp["root"]

    layer_list = layer_saved_tensors(lay, batch, seq, strategy=strategy, **kw)
    full_list = layer_saved_tensors(lay, batch, seq, strategy="none", **kw)
    if tech.mlp_tile:
        full_list = _with_tiled_mlp(full_list, batch, n, lay.hidden, _dtypes(precision)[1])
        if strategy == "none":
            layer_list = full_list
    layer_kept = sum(t.nbytes for t in layer_list)
    layer_full = sum(t.nbytes for t in full_list)
    if tech.offload_checkpoints:
        host["checkpoints"] = model.layers * sum(host_block(t.nbytes, pinned) for t in layer_list)
        traffic += 2 * layer_kept * model.layers  # out in forward, back in backward

    def others(i: int) -> int:
        """Kept bytes on the device of every layer but layer ``i`` during its backward (layers < i are waiting; on
        CUDA an offloaded layer i - 1 is prefetched, on the CPU the host copy is used as it is)."""
        if tech.offload_checkpoints:
            return layer_kept if cuda and i > 0 else 0
        return i * layer_kept

    rest_list = model_saved_tensors(model, batch, seq, precision=precision, strategy=strategy, sp=sp, impl=impl)
    shared = {"rope tables, ids": sum(t.nbytes for t in rest_list if t.name.startswith(_SHARED))}
    logits = batch * n * model.vocab * 8  # the fp32 log-softmax grad + the fp32 logit grad (train.py holds no logits)
    if tech.loss_tile:  # distattn.tiling's own byte model: one tile's working set, the fp32 weight-gradient sum
        rest_list = [t for t in rest_list if not t.name.startswith("loss.log_softmax")]
        tb = tiled_loss_bytes(batch * n, lay.hidden, model.vocab, tech.loss_tile, A)
        logits = tb.tile_working + tb.backward_fixed + batch * n * lay.hidden * 4  # + the fp32 input gradient
    rest = sum(t.nbytes for t in rest_list)
    # the untiled MLP's backward at its largest, beyond its saved tensors: the product's (GELU: the activation's)
    # backward makes two (n, ffn) gradients where the down projection's input was freed, beside the down projection's
    # weight gradient and two (n, hidden) gradients of the MLP's output (views copied by its reshapes); measured in
    # bench/results/step-memory
    swiglu = lay.family == "llama"
    grad_bytes = 4 if _dtypes(precision)[3] else A  # autocast: fp32 parameters and gradients
    mlp_tile_ws = (batch * n * lay.ffn * A + lay.hidden * lay.ffn * grad_bytes + 2 * batch * n * lay.hidden * A
                   + (0 if swiglu else lay.hidden * grad_bytes))
    if tech.mlp_tile:  # one tile's working set and the fp32 parameter-gradient sums beside a tile's gradients
        mb = tiled_mlp_bytes(batch * n, lay.hidden, lay.ffn, tech.mlp_tile, A,
                             kind="swiglu" if swiglu else "gelu")
        mlp_tile_ws = mb.tile_working + mb.backward_fixed

    kept_all = 0 if tech.offload_checkpoints else model.layers * layer_kept
    # accelerate's tail group: unsharded through the loss backward. Its pre-backward prefetches the last layer's
    # parameters (sharded: the all-gather's output): untiled after the log-softmax's backward (the peak), tiled inside
    # the tiled loss's backward, which runs the head per tile (measured: bench/results/hf-trainer-memory)
    prefetched = A * lay.params if tech.loss_tile and (cuda or shard > 1) else 0
    tail = {"FSDP2 tail (final norm, head: unsharded)": A * head_params,
            "gathered params (the last layer, prefetched)": prefetched} if split else {}
    begin = {**resident, **tail, "layer activations": kept_all, "head/loss saved": rest, "logits + logit grads": logits}
    moments = [(begin, "at the loss backward")]
    resid_grads = 2 * batch * n * lay.hidden * _dtypes(precision)[1].itemsize  # in the residual stream's dtype
    on_host_ckpt = layer_kept if tech.offload_checkpoints and not cuda else 0  # CPU: the layer's kept stay host
    # what a layer's backward holds is linear in its index but for FSDP2's prefetch (none in the first layer's) and
    # the previous layer's reduce-scatter input (none in the last layer's): four layers bound every layer
    last = model.layers - 1
    ends = {last: "the last layer's", max(last - 1, 0): "the last but one layer's", min(1, last): "the second layer's",
            0: "the first layer's"}
    for i, when in ends.items():
        in_backward = {"grads made (head, later layers)": grad_head + (model.layers - 1 - i) * grad_layer,
                       # the previous layer's, kept until this one's reduce-scatter (none before the last layer's)
                       "reduce-scatter input (a layer's grads, fp32)":
                       fsdp.get("reduce_scatter", 0) if i < model.layers - 1 else (4 * head_params if split else 0),
                       **shared}
        during = {**resident, **gathered(i), "layer activations": others(i), **in_backward,
                  ("recomputed layer" if strategy != "none" else "the layer's saved tensors"):
                  layer_full - on_host_ckpt + resid_grads + mlp_tile_ws}
        moments.append((during, f"in {when} backward" + (" (recomputed)" if strategy != "none" else "")))
        if impl == "distattn":
            moments += _attention_moments(model, batch, n, sp, act, full_list, {**resident, **gathered(i)}, others(i),
                                          in_backward,
                                          shared, resid_grads, strategy, schedule, partials, on_host_ckpt, when)
    if fsdp_on:  # the root's reduction at the end of backward (FSDP2 reshards the root's parameters first): its
        # unsharded gradients copied into the fp32 reduce-scatter input beside the first layer's (then freed); then
        # that input, the sharded output and, on one rank, the division's result (``foreach_reduce``)
        root_params = model.params - model.layers * lay.params
        copy_in = (A + 4) * root_params + fsdp["reduce_scatter"]
        if split:  # the embeddings' group: gathered again for their backward, their gradients beside them
            root_params -= head_params
            copy_in = max(2 * A * root_params, (A + 4) * root_params) + fsdp["reduce_scatter"]
        reduce = max(copy_in, 4 * root_params + -(-4 * root_params // shard) * (2 if shard == 1 else 1))
        end = {**{k: v for k, v in resident.items() if not k.startswith("FSDP2 root")},
               "grads made (every layer)": model.layers * grad_layer + (grad_head if split else 0),
               "the root's reduce-scatter (grads, fp32 input, output)": reduce}
        moments.append((end, "at the root's gradient reduction, the end of backward"))
    if not tech.offload_optimizer:  # AdamW's step: every gradient made, and its temporaries (sqrt, then the division):
        # foreach on CUDA, one list of a whole group (the matrices: ~every parameter); on the CPU one tensor at a time
        temp = 4 * -(-model.params // shard) if cuda else cpu_adamw_temporaries(model, shard)
        opt = {**resident, "grads (every parameter)": steady["grads"], "AdamW temporaries": temp}
        moments.append((opt, "in the optimizer step"))
    parts, moment = max(moments, key=lambda m: sum(m[0].values()))
    parts = {k: v for k, v in parts.items() if v}
    host, host_moment = _host_peak(host, pinned)

    mat, att, head = step_flops(model, batch, seq, sp)
    mlp = _mlp_flops(model, batch, n)
    recompute = {"none": 0.0, "selective": att, "full": mat + att, "remat": mat}[strategy] * model.layers
    if tech.mlp_tile:
        recompute += mlp * model.layers  # the tiles recompute the MLP forward in backward
    if tech.loss_tile:
        recompute += head
    flops = 3 * (model.layers * (mat + att) + head)
    weighed = tuple((name, sum(m.values()), {k: v for k, v in m.items() if v}) for m, name in moments)
    return TechniquePeak(sum(parts.values()), parts, moment, host, traffic, flops + recompute, recompute, weighed,
                         host_moment)


_SHARED = ("input_ids", "rope.", "position_ids")  # what every layer's backward still reads (HF's keyword arguments)
_BEFORE_ATTENTION = ("ln1.", "qkv_proj.", "attn.q", "attn.k", "attn.v")  # a layer's saved tensors up to attention


def _attention_moments(model, batch, n, sp, act, full_list, base, others, in_backward, shared, grads, strategy,
                       schedule, partials, on_host=0, when="a layer's") -> list:
    """The step inside a layer's attention call: its executor's buffers (the plan's replay, with the call's outputs)
    on top of every other layer's kept tensors and this layer's saved tensors up to attention.

    Backward (after the MLP, the second norm and o_proj gave theirs back): the layer's ``ln1``, projection input,
    q/k/v and the op's out/lse, the incoming ``dout``, two fp32 residual-stream gradients. Forward (the last layer's
    first forward; with full checkpointing also every layer's recompute, in backward): the layer's tensors up to q/k/v.
    """
    lay = model.layer
    common = dict(batch=batch, heads=lay.heads, kv_heads=lay.kv_heads, head_dim=lay.head_dim, dtype=act,
                  partials=partials)
    bwd = attention_buffers(schedule, sp, n, phase="backward", **common)
    fwd = attention_buffers(schedule, sp, n, phase="forward", **common)
    upto = sum(t.nbytes for t in full_list if t.name.startswith(_BEFORE_ATTENTION) or t.name.startswith("attn."))
    qkv = sum(t.nbytes for t in full_list if t.name.startswith(_BEFORE_ATTENTION))
    dout = batch * n * lay.heads * lay.head_dim * act.itemsize
    backward = {**base, "layer activations": others, **in_backward,
                "layer up to attention + grads": upto + dout + grads - on_host,
                f"attention backward buffers ({schedule})": bwd.total}
    recompute_fwd = strategy == "full"  # remat keeps attention's outputs: its forward is never recomputed
    forward = {**base, "layer activations": others, **(in_backward if recompute_fwd else shared),
               "layer up to attention": qkv - on_host, f"attention forward buffers ({schedule})": fwd.total}
    return [(backward, f"in {when} attention backward ({bwd.moment})"),
            (forward, f"in {when} attention forward ({fwd.moment})")]


def fsdp2_items(model: ModelSpec, A: int = 2) -> dict[str, int]:
    """What FSDP2 (``launch/train_model.py``: every decoder layer and then the root ``fully_shard``-ed, bf16 compute,
    fp32 reduction) holds beyond the sharded state, per rank:

    * ``root``: the root's parameters (embeddings, LM head, final norm) gathered in bf16 at the start of the forward
      and kept unsharded through the backward (FSDP2 does not reshard the root after its forward);
    * ``head_grad``: the LM head's unsharded bf16 gradient, made in the loss backward and reduced with the root's, at
      the end of the backward;
    * ``reduce_scatter``: one layer's fp32 reduce-scatter input (``reduce_dtype=float32``; its unsharded gradients
      are freed once copied in), kept by FSDP2 until the next layer's reduce-scatter, while that layer's backward
      runs.
    """
    h = model.layer.hidden
    emb = model.vocab * h * (1 if model.tie_embeddings else 2) + model.max_positions * h + h
    return {"root": A * emb, "head_grad": 0 if model.tie_embeddings else A * model.vocab * h,
            "reduce_scatter": 4 * model.layer.params}


def host_block(nbytes: int, pinned: bool = True) -> int:
    """Host bytes one buffer of ``nbytes`` takes: PyTorch's pinned (CUDA host) caching allocator rounds every block
    up to a power of two (``CachingHostAllocator``), so a 4.63 GiB layer input takes 8 GiB; plain memory: ``nbytes``."""
    if not pinned or nbytes <= 0:
        return nbytes
    return 1 << (nbytes - 1).bit_length()


def optimizer_host_bytes(model: ModelSpec, shard: int, pinned: bool = True) -> dict[str, int]:
    """FSDP2's ``CPUOffloadPolicy(pin_memory=True)``: every parameter's fp32 shard and its gradient's in pinned host
    memory (each rounded to a power of two), AdamW's two fp32 states in plain host memory (``torch.optim`` makes them
    like the parameters' shards). FSDP2 shards dim 0: ``ceil(rows / shard)`` rows per rank."""
    lay, h = model.layer, model.layer.hidden
    d = lay.head_dim
    shapes = [(lay.heads * d, h), (lay.kv_heads * d, h), (lay.kv_heads * d, h), (h, lay.heads * d)]
    shapes += [(lay.ffn, h), (lay.ffn, h), (h, lay.ffn)] if lay.family == "llama" else [(lay.ffn, h), (h, lay.ffn)]
    shapes += [(h, 1), (h, 1)]
    rows = lambda shape: -(-shape[0] // shard) * shape[1]  # noqa: E731
    per_layer = [rows(s) * 4 for s in shapes]
    root = [rows((model.vocab, h)) * 4] * (1 if model.tie_embeddings else 2) + [rows((h, 1)) * 4]
    tensors = per_layer * model.layers + root
    pinned_bytes = sum(host_block(t, pinned) for t in tensors)
    return {"weights (pinned)": pinned_bytes, "grads (pinned)": pinned_bytes, "adam": 2 * sum(tensors)}


def _matrices(model: ModelSpec) -> list[tuple[int, int]]:
    """The shapes of the parameters AdamW decays (``launch/train_model.param_groups``: 2-D ones), in the model's
    parameter order (Hugging Face LLaMA: embeddings, each layer's q, k, v, o, gate, up, down, then the LM head)."""
    lay, h, d = model.layer, model.layer.hidden, model.layer.head_dim
    layer = [(lay.heads * d, h), (lay.kv_heads * d, h), (lay.kv_heads * d, h), (h, lay.heads * d)]
    layer += [(lay.ffn, h), (lay.ffn, h), (h, lay.ffn)] if lay.family == "llama" else [(lay.ffn, h), (h, lay.ffn)]
    return [(model.vocab, h)] + layer * model.layers + ([] if model.tie_embeddings else [(model.vocab, h)])


def cpu_adamw_temporaries(model: ModelSpec, shard: int = 1) -> int:
    """AdamW on CPU tensors (no foreach there) steps one fp32 tensor at a time: the square root of its second moment
    and the division by it (``denom``) beside the previous tensor's ``denom``, still bound by the loop's variable;
    the largest over the decay group's matrices in parameter order, each sharded on dim 0 ``shard`` ways."""
    sizes = [-(-rows // shard) * cols * 4 for rows, cols in _matrices(model)]
    return max(2 * cur + prev for prev, cur in zip([0] + sizes, sizes))


def _host_peak(host: dict[str, int], pinned: bool) -> tuple[dict[str, int], str]:
    """The host bytes at their peak and its moment. Offloaded checkpoints (filled by the end of the forward, freed
    through the backward) and the offloaded optimizer's gradients and temporaries (made through the backward, used
    by the step) meet only in part; in plain host memory the larger of the two moments is the peak. PyTorch's
    pinned caching allocator keeps every freed block for reuse by a request of its own size class, so with pinned
    memory both are counted (a bound: its blocks rarely match)."""
    late = ("grads (pinned)", "AdamW temporaries")
    if pinned or not host.get("checkpoints") or not any(host.get(k) for k in late):
        return host, "the step" if host else ""
    forward_end = {k: v for k, v in host.items() if k not in late}
    step = {k: v for k, v in host.items() if k != "checkpoints"}
    if sum(forward_end.values()) > sum(step.values()):
        return forward_end, "at the end of the forward (every checkpoint offloaded)"
    return step, "in the optimizer step"


def tiled_layer_saved_tensors(spec, batch: int, seq: int, *, impl: str = "distattn", precision: str = "bf16",
                              strategy: str = "none", sp: int = 1, device: str = "cuda") -> list[Saved]:
    """``layer_saved_tensors`` of a layer whose MLP runs tiled (``distattn.tiling``): the MLP keeps its input only."""
    saved = layer_saved_tensors(spec, batch, seq, impl=impl, precision=precision, strategy=strategy, sp=sp,
                                device=device)
    if strategy in ("full", "remat"):
        return saved
    return _with_tiled_mlp(saved, batch, seq // sp, spec.hidden, _dtypes(precision)[1])


def _with_tiled_mlp(saved: list[Saved], b: int, n: int, h: int, norm_dtype: torch.dtype) -> list[Saved]:
    """A layer's saved list with the MLP's entries (inputs, intermediates, autocast's weight copies) replaced by what
    the tiled MLP keeps: its input, the second norm's output (fp32 under autocast: the cast happens per tile)."""
    mlp = mlp_saved_names(saved)
    return [s for s in saved if s not in mlp] + [Saved("tiled_mlp.input (ln2 output)", (b, n, h), norm_dtype)]


def check_tile(name: str, tile, tokens: int) -> int:
    """A tile size for ``tokens`` tokens: a positive int; larger than ``tokens`` runs as one tile."""
    if isinstance(tile, bool) or not isinstance(tile, int) or tile <= 0:
        raise ValueError(f"{name} must be a positive number of tokens, got {tile!r}")
    return min(tile, max(tokens, 1))


def host_limit_bytes(host_gib_per_node: float, gpus_per_node: int) -> int:
    """This rank's share of a node's host memory."""
    if host_gib_per_node <= 0 or gpus_per_node < 1:
        raise ValueError(f"host memory ({host_gib_per_node} GiB) and GPUs per node ({gpus_per_node}) must be "
                         f"positive")
    return math.floor(host_gib_per_node * 2 ** 30 / gpus_per_node)
