"""A byte-exact model of what a training step keeps: saved tensors per layer, steady state, step peak.

Every layer's saved activations are an explicit list of ``Saved(name, shape, dtype)``, one entry per
allocation autograd keeps (views of one allocation are one entry), so a test can compare the model with
``distattn.memory.saved_activations`` tensor by tensor. The lists were determined by measuring
transformers 5.23's ``LlamaDecoderLayer`` (eager / sdpa / distattn attention) and the GPT-style block of
``tests/test_memory.py`` on CPU, in fp32 and under bf16 autocast; the tests keep them equal.

Legend: ``b`` batch, ``n`` tokens of the sequence on this rank (``seq // sp``), ``h`` hidden, ``a``/``a_kv``
query/key-value heads, ``d`` head dim, ``f`` MLP hidden, ``V`` vocabulary. ``A`` is the activation dtype
(bf16/fp16 under autocast or pure half precision, else fp32). Under autocast:

* the residual stream and the norms stay fp32 (RMSNorm upcasts; LayerNorm is an fp32 autocast op);
* every Linear casts its input to half precision *per call*: q/k/v projections save three half copies of
  the same normed input, gate/up two; and the half copy of each weight (autocast's weight cache) is saved
  by the matmul, so it lives until backward: ``2 * (layer matmul parameters)`` bytes per layer — the
  "unexplained" linear-layer allocations of the memory-arithmetic post are exactly these copies;
* RoPE multiplies by fp32 cos/sin, so q/k leave RoPE in fp32 and attention casts them (sdpa, distattn);
* eager softmax is fp32 (HF passes ``dtype=float32``; autocast runs softmax in fp32), and the
  probabilities are cast again (half) for the PV matmul: both are saved.

In a half-precision model (``precision="bf16"``: what FSDP2's mixed precision computes with, as
``launch/train.py`` does on CUDA) there are no weight copies and one projection input; RMSNorm saves its fp32
upcast of the input (not the input), the rstd, and its normalized output cast back to half.

What is not modelled byte-exactly (the planner's peak, not the saved-activation lists): the transients of a
backward (gradients of one layer, the loss's fp32 logit gradients: ``step_peak``), FSDP's gathered parameters,
communication buffers, allocator rounding and fragmentation, CUDA-only extras (flash kernels' RNG state).

Strategies (``strategy=``): ``none``; ``full`` (checkpoint every layer at its input: the input stays);
``selective`` (checkpoint only the attention core — QK^T, softmax, dropout, PV; its inputs q/k/v and its
output stay, Megatron's selective recomputation); ``remat`` (distattn's: the layer input and the attention
op's ``(out, lse)`` stay; needs ``impl="distattn"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Saved", "LayerSpec", "ModelSpec", "PRESETS", "IMPLS", "STRATEGIES", "PRECISIONS", "layer_saved_tensors",
           "model_saved_tensors", "activation_bytes", "steady_state_bytes", "StepPeak", "step_peak",
           "korthikanti_layer_bytes", "padding_free_layer_bytes", "expected_padding_bytes", "nanogpt_activation_bytes",
           "nanogpt_steady_state_bytes", "spec_from_hf_config", "get_preset"]

IMPLS = ("eager", "sdpa", "distattn")
STRATEGIES = ("none", "full", "selective", "remat")
PRECISIONS = ("fp32", "amp-bf16", "amp-fp16", "bf16", "fp16")
_HALF = {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Saved:
    """One allocation kept for backward."""

    name: str
    shape: tuple
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * (1 if self.dtype == torch.bool else self.dtype.itemsize)


@dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """The shape of one decoder layer."""

    family: str = "llama"
    """``"llama"`` (RMSNorm, RoPE, gated MLP, GQA: HF ``LlamaDecoderLayer``) or ``"gpt"`` (LayerNorm, fused
    qkv Linear, plain MLP, dropout: the layer of the published derivations)."""
    hidden: int
    heads: int
    kv_heads: int | None = None
    """Key/value heads (``None``: ``heads``; GPT: always ``heads``)."""
    ffn: int
    """MLP hidden size (``f``)."""
    act: str = "silu"
    """MLP activation: ``silu``/``gelu`` (input saved) or ``relu`` (output saved instead)."""
    attn_dropout: bool = False
    """Dropout on the attention probabilities (eager attention only)."""
    resid_dropout: bool = False
    """GPT: dropout after the attention projection and after the MLP (saves a bool mask each)."""
    bias: bool = False
    """GPT: LayerNorm and Linear biases (parameters only; biases save nothing)."""

    def __post_init__(self):
        if self.family not in ("llama", "gpt"):
            raise ValueError(f"family={self.family!r} must be 'llama' or 'gpt'")
        kv = self.heads if self.kv_heads is None else self.kv_heads
        if self.hidden % self.heads or self.heads % kv:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads}), and heads a "
                             f"multiple of kv_heads ({kv})")
        if self.act not in ("silu", "gelu", "relu"):
            raise ValueError(f"act={self.act!r} must be one of 'silu', 'gelu', 'relu'")
        object.__setattr__(self, "kv_heads", kv)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def matmul_params(self) -> int:
        """Weights of the layer's matmuls (what autocast copies to half precision)."""
        h, d = self.hidden, self.head_dim
        attn = h * (self.heads * d) * 2 + 2 * h * (self.kv_heads * d)
        mlp = (3 if self.family == "llama" else 2) * h * self.ffn
        return attn + mlp

    @property
    def params(self) -> int:
        """All parameters of the layer (norm weights; GPT: LayerNorm and Linear biases too)."""
        if self.family == "llama":
            return self.matmul_params + 2 * self.hidden
        h = self.hidden
        return self.matmul_params + 2 * h + ((2 * h + 3 * h + h + self.ffn + h) if self.bias else 0)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A whole causal LM: ``layers`` copies of ``layer`` plus embeddings, final norm and head."""

    name: str = "custom"
    layer: LayerSpec
    layers: int
    vocab: int
    tie_embeddings: bool = False
    max_positions: int = 0
    """GPT: learned position embeddings (rows); LLaMA: 0 (RoPE)."""

    @property
    def params(self) -> int:
        h = self.layer.hidden
        emb = self.vocab * h * (1 if self.tie_embeddings else 2) + self.max_positions * h
        final_norm = h * (2 if self.layer.bias else 1)
        return self.layers * self.layer.params + emb + final_norm


def _llama(h, f, layers, heads, kv, name, vocab=32000):
    return ModelSpec(name=name, layer=LayerSpec(hidden=h, heads=heads, kv_heads=kv, ffn=f), layers=layers,
                     vocab=vocab)


# The shapes of launch/train_config.py's presets (copied: the library does not import launch/), with the
# vocabulary of the published model (the byte-level presets use 256).
PRESETS: dict[str, ModelSpec] = {
    "tiny": _llama(128, 384, 4, 4, 4, "tiny", vocab=256),
    "tiny-gqa": _llama(128, 384, 4, 4, 2, "tiny-gqa", vocab=256),
    "tiny-mqa": _llama(128, 384, 4, 4, 1, "tiny-mqa", vocab=256),
    "small": _llama(512, 1408, 8, 8, 8, "small", vocab=256),
    "small-gqa": _llama(512, 1408, 8, 8, 2, "small-gqa", vocab=256),
    "llama-1b": _llama(2048, 5632, 22, 32, 4, "llama-1b"),
    "llama-7b": _llama(4096, 11008, 32, 32, 32, "llama-7b"),
    "llama-7b-gqa": _llama(4096, 11008, 32, 32, 8, "llama-7b-gqa"),
    "llama3-8b": _llama(4096, 14336, 32, 32, 8, "llama3-8b", vocab=128256),
    "llama-13b": _llama(5120, 13824, 40, 40, 40, "llama-13b"),
    # GPT-2 small as in nanoGPT (vocab padded to 50304, tied head, no bias) - the memory-arithmetic post.
    "gpt2-small": ModelSpec(name="gpt2-small", layer=LayerSpec(family="gpt", hidden=768, heads=12, ffn=3072,
                                                               act="gelu"),
                            layers=12, vocab=50304, tie_embeddings=True, max_positions=1024),
}


def get_preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)} (or pass an HF "
                         f"config.json path)") from None


def spec_from_hf_config(cfg: dict, name: str = "hf") -> ModelSpec:
    """A LLaMA-family ``ModelSpec`` from a Hugging Face ``config.json`` dictionary."""
    try:
        h, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        layer = LayerSpec(hidden=h, heads=heads, kv_heads=int(cfg.get("num_key_value_heads") or heads),
                          ffn=int(cfg["intermediate_size"]), act=str(cfg.get("hidden_act", "silu")),
                          attn_dropout=float(cfg.get("attention_dropout", 0.0)) > 0)
        return ModelSpec(name=name, layer=layer, layers=int(cfg["num_hidden_layers"]), vocab=int(cfg["vocab_size"]),
                         tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    except KeyError as e:
        raise ValueError(f"HF config lacks {e.args[0]!r}; a LLaMA-family config.json needs hidden_size, "
                         f"intermediate_size, num_hidden_layers, num_attention_heads and vocab_size") from None


# -- per-layer saved tensors ----------------------------------------------------------------------------
def _dtypes(precision: str):
    """(activation dtype, norm/residual dtype, softmax dtype, autocast?)"""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} must be one of {PRECISIONS}")
    if precision == "fp32":
        return torch.float32, torch.float32, torch.float32, False
    half = _HALF[precision]
    if precision.startswith("amp-"):
        return half, torch.float32, torch.float32, True
    return half, half, half, False


def _device_dtypes(precision: str, device: str):
    """Where CPU and CUDA differ (measured on CPU; CUDA per the published derivations):
    (dropout mask dtype given the dropout input dtype, bare-softmax dtype under autocast, LayerNorm stats dtype).

    CUDA: ``native_dropout`` keeps a bool mask (1 byte), autocast runs ``softmax`` in fp32, LayerNorm's
    mean/rstd are fp32. CPU: dropout keeps its scaled noise in the input dtype, autocast leaves ``softmax`` in
    the half dtype, and a half-precision LayerNorm keeps half-precision statistics.
    """
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r} must be 'cuda' or 'cpu'")
    act, norm_dt, _, amp = _dtypes(precision)
    if device == "cuda":
        return (lambda dt: torch.bool), (torch.float32 if amp else act), torch.float32
    return (lambda dt: dt), act, (norm_dt if not amp else torch.float32)


def _check(spec: LayerSpec, impl: str, strategy: str):
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} must be one of {IMPLS}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} must be one of {STRATEGIES}")
    if strategy == "remat" and impl != "distattn":
        raise ValueError("strategy='remat' keeps the outputs of distattn's registered op, so it needs "
                         f"impl='distattn' (got impl={impl!r}); use strategy='full' or 'selective' otherwise")
    if spec.attn_dropout and impl != "eager":
        raise ValueError(f"attention dropout is modelled for impl='eager' only (got impl={impl!r})")


def _llama_layer(spec: LayerSpec, b: int, n: int, impl: str, precision: str, strategy: str, device: str
                 ) -> list[Saved]:
    h, a, akv, d, f = spec.hidden, spec.heads, spec.kv_heads, spec.head_dim, spec.ffn
    act, norm_dt, soft_dt, amp = _dtypes(precision)  # HF's eager softmax is fp32 explicitly, on any device
    mask_dt = _device_dtypes(precision, device)[0]
    fp32 = torch.float32
    x = Saved("input (ln1 input, residual)", (b, n, h), norm_dt)
    if strategy == "full":
        return [x]
    # A half-precision model (FSDP2 mixed precision): RMSNorm's fp32 upcast of its input is what is saved (the
    # half input itself is not), and its normalized output is cast back to half before the weight multiply.
    pure = not amp and act != fp32

    def norm(i, inp):
        if pure:
            return [Saved(f"ln{i}.input (fp32 copy)", (b, n, h), fp32), Saved(f"ln{i}.rstd", (b, n, 1), fp32),
                    Saved(f"ln{i}.normed (half)", (b, n, h), act)]
        return [inp, Saved(f"ln{i}.rstd", (b, n, 1), fp32), Saved(f"ln{i}.normed", (b, n, h), norm_dt)]

    out: list[Saved] = norm(1, x)
    if amp:
        out += [Saved(f"{p}_proj.input (half copy)", (b, n, h), act) for p in "qkv"]
        out += [Saved(f"{p}_proj.weight (half copy)", shape, act) for p, shape in
                (("q", (a * d, h)), ("k", (akv * d, h)), ("v", (akv * d, h)), ("o", (h, a * d)))]
    else:
        out.append(Saved("qkv_proj.input (ln1 output)", (b, n, h), act))
    if strategy == "remat":
        return [x, Saved("attn.out", (b, n, a, d), act), Saved("attn.lse", (b, a, n), fp32)]
    if strategy == "selective":  # the core's inputs (RoPE outputs are fp32: cos/sin are fp32) and output
        rope_dt = fp32 if amp else act
        out += [Saved("core.q (rope out)", (b, a, n, d), rope_dt), Saved("core.k (rope out)", (b, akv, n, d), rope_dt),
                Saved("core.v (v_proj out)", (b, n, akv * d), act),
                Saved("o_proj.input (core out)", (b, n, a * d), act)]
    elif impl == "eager":
        # HF: softmax in fp32, then cast to the query's dtype (fp32 under autocast: RoPE's output; half in a
        # half model), dropout, then PV (autocast casts the probabilities to half once more)
        p_dt = act if pure else fp32
        out += [Saved("attn.q", (b, a, n, d), act), Saved("attn.k (repeated to a heads)", (b, a, n, d), act),
                Saved("attn.softmax", (b, a, n, n), fp32)]
        if spec.attn_dropout:
            out += [Saved("attn.dropout.mask", (b, a, n, n), mask_dt(p_dt)),
                    Saved("attn.dropout.out", (b, a, n, n), p_dt)]
        if amp or (pure and not spec.attn_dropout):
            out.append(Saved("attn.probs (half copy for PV)", (b, a, n, n), act))
        out += [Saved("attn.v (repeated to a heads)", (b, a, n, d), act), Saved("o_proj.input", (b, n, a * d), act)]
    else:  # sdpa / distattn: a FlashAttention-style op saves q, k, v, out (= o_proj input) and lse
        out += [Saved("attn.q", (b, a, n, d), act), Saved("attn.k", (b, akv, n, d), act),
                Saved("attn.v", (b, akv, n, d), act), Saved("attn.out (o_proj input)", (b, n, a, d), act),
                Saved("attn.lse", (b, a, n), fp32)]
    out += norm(2, Saved("ln2.input (residual)", (b, n, h), norm_dt))
    if amp:
        out += [Saved(f"{p}_proj.input (half copy)", (b, n, h), act) for p in ("gate", "up")]
        out += [Saved(f"{p}_proj.weight (half copy)", shape, act) for p, shape in
                (("gate", (f, h)), ("up", (f, h)), ("down", (h, f)))]
    else:
        out.append(Saved("gate/up_proj.input (ln2 output)", (b, n, h), act))
    if spec.act != "relu":
        out.append(Saved(f"mlp.gate_out ({spec.act} input)", (b, n, f), act))
    out += [Saved(f"mlp.{spec.act}_out", (b, n, f), act), Saved("mlp.up_out", (b, n, f), act),
            Saved("down_proj.input", (b, n, f), act)]
    return out


def _gpt_layer(spec: LayerSpec, b: int, n: int, impl: str, precision: str, strategy: str, device: str
               ) -> list[Saved]:
    h, a, d, f = spec.hidden, spec.heads, spec.head_dim, spec.ffn
    act, norm_dt, _, amp = _dtypes(precision)
    mask_dt, soft_dt, stat_dt = _device_dtypes(precision, device)
    fp32 = torch.float32
    x = Saved("input (ln1 input, residual)", (b, n, h), norm_dt)
    if strategy == "full":
        return [x]
    if strategy == "remat":
        return [x, Saved("attn.out", (b, n, a, d), act), Saved("attn.lse", (b, a, n), fp32)]
    out = [x, Saved("ln1.mean", (b, n, 1), stat_dt), Saved("ln1.rstd", (b, n, 1), stat_dt),
           Saved("qkv.input" + (" (half copy)" if amp else " (ln1 output)"), (b, n, h), act)]
    if amp:
        out += [Saved(f"{p}.weight (half copy)", shape, act) for p, shape in
                (("qkv", (3 * h, h)), ("proj", (h, h)), ("fc1", (f, h)), ("fc2", (h, f)))]
    if strategy == "selective":  # the core's inputs are views of the qkv output
        out += [Saved("qkv.out (q, k, v views)", (b, n, 3 * h), act), Saved("proj.input (core out)", (b, n, h), act)]
    elif impl == "eager":  # the batched matmuls copy the strided q, k^T, v views into contiguous operands
        out += [Saved(f"attn.{p} (contiguous copy)", (b * a, n, d), act) for p in ("q", "k^T", "v")]
        out.append(Saved("attn.softmax", (b, a, n, n), soft_dt))
        if spec.attn_dropout:
            out += [Saved("attn.dropout.mask", (b, a, n, n), mask_dt(soft_dt)),
                    Saved("attn.dropout.out", (b, a, n, n), soft_dt)]
        if amp and soft_dt != act:
            out.append(Saved("attn.probs (half copy for PV)", (b, a, n, n), act))
        out.append(Saved("proj.input", (b, n, h), act))
    else:
        out += [Saved("qkv.out (q, k, v views)", (b, n, 3 * h), act),
                Saved("attn.out (proj input)", (b, n, h), act), Saved("attn.lse", (b, a, n), fp32)]
    if spec.resid_dropout:
        out.append(Saved("attn.resid_dropout.mask", (b, n, h), mask_dt(act)))
    out += [Saved("ln2.input (residual)", (b, n, h), norm_dt), Saved("ln2.mean", (b, n, 1), stat_dt),
            Saved("ln2.rstd", (b, n, 1), stat_dt),
            Saved("fc1.input" + (" (half copy)" if amp else " (ln2 output)"), (b, n, h), act)]
    if spec.act != "relu":
        out.append(Saved(f"fc1.out ({spec.act} input)", (b, n, f), act))
    out.append(Saved(f"fc2.input ({spec.act} output)", (b, n, f), act))
    if spec.resid_dropout:
        out.append(Saved("mlp.dropout.mask", (b, n, h), mask_dt(act)))
    return out


def layer_saved_tensors(spec: LayerSpec, batch: int, seq: int, *, impl: str = "sdpa", precision: str = "amp-bf16",
                        strategy: str = "none", sp: int = 1, device: str = "cuda") -> list[Saved]:
    """The allocations one layer keeps for backward on one rank.

    Args:
        spec: the layer.
        batch: sequences per step on this rank.
        seq: tokens per sequence, whole sequence; each of the ``sp`` sequence-parallel ranks holds
            ``seq // sp`` of them (and its bytes are what is returned).
        impl: attention implementation: ``eager`` (materialized softmax), ``sdpa`` (a FlashAttention-style
            kernel: PyTorch's sdpa, flash-attn), ``distattn`` (the registered op; a padding-free packed batch
            is the same list with ``batch=1, seq=total tokens``).
        precision: ``fp32``, ``amp-bf16``/``amp-fp16`` (fp32 parameters under autocast) or ``bf16``/``fp16``
            (a model cast to half precision).
        strategy: ``none``, ``full``, ``selective``, ``remat`` (see the module docstring).
        sp: sequence-parallel degree (``seq`` must divide).
        device: ``cuda`` (planning) or ``cpu`` (where the tests measure): dropout masks, autocast softmax and
            half-precision LayerNorm statistics differ (see ``_device_dtypes``).
    """
    _check(spec, impl, strategy)
    if sp < 1 or seq % sp:
        raise ValueError(f"seq ({seq}) must be a multiple of the sequence-parallel degree sp ({sp})")
    build = _llama_layer if spec.family == "llama" else _gpt_layer
    return build(spec, batch, seq // sp, impl, precision, strategy, device)


def model_saved_tensors(model: ModelSpec, batch: int, seq: int, *, precision: str = "amp-bf16",
                        strategy: str = "none", sp: int = 1, impl: str = "sdpa") -> list[Saved]:
    """The allocations kept outside the decoder layers (HF ``LlamaForCausalLM`` with ``labels=``, per rank).

    Input ids, RoPE cos/sin (shared by every layer, counted once), the final norm, the head's input (and its
    half weight copy under autocast) and the loss: HF upcasts the logits to fp32 and ``log_softmax`` keeps its
    fp32 output ``(b*n, V)``; ``nll_loss`` keeps the targets and a scalar weight. (The half logits themselves
    are not saved; the caller's ``outputs.logits`` keeps them alive: see ``step_peak``.) A checkpointed layer
    stack keeps cos/sin too (every layer's recompute needs them).
    """
    n = seq // sp
    b, h, V = batch, model.layer.hidden, model.vocab
    act, norm_dt, _, amp = _dtypes(precision)
    fp32, i64 = torch.float32, torch.int64
    out = [Saved("input_ids", (b, n), i64)]
    if model.layer.family == "llama":
        # HF builds position_ids (1, n) when none are given, so cos/sin are (1, n, d), shared by the batch
        rope_dt = act if not amp else fp32  # cos/sin take the dtype of the embeddings
        out += [Saved(f"rope.{fn}", (1, n, model.layer.head_dim), rope_dt) for fn in ("cos", "sin")]
        if strategy in ("full", "remat"):  # HF's per-layer checkpoint keeps the layer's keyword arguments
            out.append(Saved("position_ids (checkpoint kwargs)", (1, n), i64))
            if impl == "eager":
                out.append(Saved("causal mask (checkpoint kwargs)", (b, 1, n, n), fp32))
    if model.layer.family == "llama" and not amp and act != fp32:
        out += [Saved("final_norm.input (fp32 copy)", (b, n, h), fp32), Saved("final_norm.rstd", (b, n, 1), fp32),
                Saved("final_norm.normed (half)", (b, n, h), act)]
    else:
        out += [Saved("final_norm.input", (b, n, h), norm_dt), Saved("final_norm.rstd", (b, n, 1), fp32),
                Saved("final_norm.normed", (b, n, h), norm_dt)]
    if amp:
        out += [Saved("lm_head.input (half copy)", (b, n, h), act), Saved("lm_head.weight (half copy)", (V, h), act)]
    else:
        out.append(Saved("lm_head.input (final norm output)", (b, n, h), act))
    out += [Saved("loss.log_softmax (fp32)", (b * n, V), fp32), Saved("loss.targets", (b * n,), i64),
            Saved("loss.total_weight", (), fp32)]
    return out


def activation_bytes(model: ModelSpec, batch: int, seq: int, *, impl: str = "sdpa", precision: str = "amp-bf16",
                     strategy: str = "none", sp: int = 1, tp: int = 1) -> int:
    """Bytes saved for backward by a whole forward on one rank (all layers + the rest).

    ``tp > 1``: Megatron-style tensor + sequence parallelism of degree ``tp`` (every layer activation is
    split ``tp`` ways: heads and MLP columns inside the blocks, tokens outside), per Korthikanti et al.;
    the embedding/head part is split over the vocabulary the same way.
    """
    per_layer = sum(t.nbytes for t in layer_saved_tensors(model.layer, batch, seq, impl=impl, precision=precision,
                                                          strategy=strategy, sp=sp))
    rest = sum(t.nbytes for t in model_saved_tensors(model, batch, seq, precision=precision, strategy=strategy, sp=sp,
                                                     impl=impl))
    return math.ceil((model.layers * per_layer + rest) / tp)


# -- steady state and peak ------------------------------------------------------------------------------
def steady_state_bytes(model: ModelSpec, *, shard: int = 1, tp: int = 1, buffers: int = 0, opt_shard: int = 1,
                       half_params: bool = False, gather_bytes: int = 4) -> dict[str, int]:
    """fp32 master weights, fp32 gradients and AdamW's two fp32 states, per rank.

    ``shard``: ranks that shard them (FSDP2 / ZeRO-3; 1: replicated). ``tp``: tensor-parallel degree (every
    weight split ``tp`` ways). With ``shard > 1`` FSDP also holds the unsharded fp32 parameters of the
    layer being computed and of the one prefetched (``gathered``). ``buffers``: non-parameter fp32 elements.
    ``opt_shard``: ranks that additionally shard the AdamW states only (Megatron's distributed optimizer over
    the data-parallel group, ZeRO-1). ``half_params``: the model's parameters are bf16/fp16 (Megatron-style
    mixed precision) and the optimizer keeps an fp32 master copy (counted with the AdamW states).
    ``gather_bytes``: bytes per element of FSDP's unsharded parameters (2 under FSDP2's bf16 ``param_dtype``).
    """
    n = model.params
    per = lambda nbytes: math.ceil(nbytes / (shard * tp))  # noqa: E731
    out = {"weights": per((2 if half_params else 4) * n), "grads": per(4 * n),
           "adam": math.ceil(per((12 if half_params else 8) * n) / opt_shard), "buffers": 4 * buffers}
    out["gathered"] = 2 * gather_bytes * math.ceil(model.layer.params / tp) if shard > 1 else 0
    return out


@dataclass(frozen=True)
class StepPeak:
    """The peak of one training step on one rank and what it is made of."""

    total: int
    parts: dict
    """Bytes per component at the peak moment."""
    moment: str
    """When the peak happens."""

    @property
    def dominant(self) -> str:
        return max(self.parts, key=self.parts.get)


def step_peak(model: ModelSpec, batch: int, seq: int, *, impl: str = "sdpa", precision: str = "amp-bf16",
              strategy: str = "none", sp: int = 1, tp: int = 1, shard: int = 1, opt_shard: int = 1,
              half_params: bool = False, chunked_loss: bool = False) -> StepPeak:
    """Peak bytes of a step per rank: steady state + saved activations + the largest transient.

    Two candidate moments: (1) the start of backward, where the half logits (held by the caller) and the
    fp32 gradients of the log-softmax output and of the logits exist on top of everything saved (the peak the
    memory-arithmetic post observes); (2) the backward of one checkpointed layer (``full``/``selective``/
    ``remat``), where that layer's recomputed activations exist next to every other layer's kept tensors plus
    an input- and output-gradient. ``chunked_loss``: the head and loss run in sequence chunks, so their
    terms are those of one 1/8 chunk. Steady state: ``steady_state_bytes`` (``precision='bf16'`` with
    ``shard > 1`` is FSDP2's mixed precision: fp32 sharded parameters, bf16 compute; ``half_params`` is
    Megatron's: bf16 parameters, fp32 master weights in the optimizer).
    """
    act, _, _, amp = _dtypes(precision)
    steady = steady_state_bytes(model, shard=shard, tp=tp, opt_shard=opt_shard, half_params=half_params,
                                gather_bytes=act.itemsize)
    n = seq // sp
    kw = dict(impl=impl, precision=precision, sp=sp)
    layer_kept = sum(t.nbytes for t in layer_saved_tensors(model.layer, batch, seq, strategy=strategy, **kw)) // tp
    rest_list = model_saved_tensors(model, batch, seq, precision=precision, strategy=strategy, sp=sp, impl=impl)
    rest = sum(t.nbytes for t in rest_list) // tp
    logit_elems = batch * n * model.vocab // tp
    loss_saved = 4 * logit_elems
    if chunked_loss:
        rest -= loss_saved - loss_saved // 8
        logit_elems //= 8
    layers = model.layers * layer_kept
    begin = {"weights+grads+adam": sum(steady.values()), "layer activations": layers, "head/loss saved": rest,
             "logits + logit grads": logit_elems * (act.itemsize + 4 + 4)}
    moments = [StepPeak(sum(begin.values()), begin, "at the loss backward")]
    if strategy != "none":
        full_layer = sum(t.nbytes for t in layer_saved_tensors(model.layer, batch, seq, strategy="none",
                                                               **{**kw, "impl": impl})) // tp
        grads = 2 * batch * n * model.layer.hidden * 4 // tp
        during = {"weights+grads+adam": sum(steady.values()), "layer activations": layers - layer_kept,
                  "head/loss saved": 0, "recomputed layer": full_layer + grads}
        moments.append(StepPeak(sum(during.values()), during, "in a recomputed layer's backward"))
    return max(moments, key=lambda p: p.total)


# The published formulas (Korthikanti et al., the padding-free note, nanoGPT's memory arithmetic) live in
# distattn.memory.published; their names are handed on here, where the tests and callers have always read them.
from distattn.memory.published import (expected_padding_bytes, korthikanti_layer_bytes,  # noqa: E402,F401
                                       nanogpt_activation_bytes, nanogpt_steady_state_bytes, padding_free_layer_bytes)
