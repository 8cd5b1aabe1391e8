"""The layer every method computes: LLaMA attention (and a full LLaMA decoder layer), weights and reference.

Legend: ``b`` batch, ``n`` tokens per rank, ``N`` total tokens, ``H`` hidden size, ``h_q``/``h_kv`` heads,
``d`` head dim, ``F`` MLP width. Activations are ``(b, seq, H)``; attention tensors ``(b, seq, heads, d)``.

Attention layer (no bias, as LLaMA)::

    q, k, v = x Wq^T, x Wk^T, x Wv^T          -> RoPE on q, k at global positions
    y = attention(q, k, v, causal) Wo^T

Full layer (pre-norm)::

    h = x + attn(rms_norm(x) * g1);   y = h + W_down (silu(W_gate u) * W_up u),  u = rms_norm(h) * g2

Every method (``bench/baselines/*``) computes exactly these functions; only where the work and the
communication happen differs. :func:`reference_attention_layer` / :func:`reference_llama_layer` compute them
on one process over the full sequence with any core attention, for the correctness tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LayerShape", "init_weights", "apply_rope", "rms_norm", "swiglu", "sp_attention",
           "reference_attention_layer", "reference_llama_layer", "llama_layer", "flops_per_layer",
           "ATTN_WEIGHTS", "MLP_WEIGHTS"]

ATTN_WEIGHTS = ("wq", "wk", "wv", "wo")
MLP_WEIGHTS = ("norm1", "norm2", "w_gate", "w_up", "w_down")
_RMS_EPS = 1e-6


@dataclass(frozen=True, kw_only=True)
class LayerShape:
    """Shape of one decoder layer. ``hidden = heads_q * head_dim`` (as LLaMA)."""

    heads_q: int = 32
    """query heads"""
    heads_kv: int = 32
    """key/value heads (GQA when fewer than ``heads_q``)"""
    head_dim: int = 128
    """d"""
    ffn: int = 11008
    """MLP width F (LLaMA-7B: 11008)"""
    rope_base: float = 10000.0
    """RoPE base"""

    def __post_init__(self):
        for name in ("heads_q", "heads_kv", "head_dim", "ffn"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LayerShape.{name}={value!r} must be a positive int")
        if self.heads_q % self.heads_kv:
            raise ValueError(f"heads_q ({self.heads_q}) must be a multiple of heads_kv ({self.heads_kv}) (GQA)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")

    @property
    def hidden(self) -> int:
        return self.heads_q * self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.heads_q // self.heads_kv


def init_weights(shape: LayerShape, *, seed: int = 0, dtype=torch.float32, device="cpu") -> dict:
    """Full (unsharded) weights of one layer, the same on every rank for the same seed.

    Linear weights are ``(out_features, in_features)`` with std ``in_features**-0.5``; norm gains ``1 + 0.1 z``
    so their gradients are exercised too.
    """
    g = torch.Generator().manual_seed(seed)
    hid, qd, kvd, f = shape.hidden, shape.heads_q * shape.head_dim, shape.heads_kv * shape.head_dim, shape.ffn

    def lin(out_f, in_f):
        return (torch.randn(out_f, in_f, generator=g) * in_f ** -0.5).to(dtype).to(device)

    def gain():
        return (1 + 0.1 * torch.randn(hid, generator=g)).to(dtype).to(device)

    return {"wq": lin(qd, hid), "wk": lin(kvd, hid), "wv": lin(kvd, hid), "wo": lin(hid, qd),
            "norm1": gain(), "norm2": gain(), "w_gate": lin(f, hid), "w_up": lin(f, hid), "w_down": lin(hid, f)}


def apply_rope(x_bshd: torch.Tensor, start: int, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding (rotate-half, as HF LLaMA) for tokens at global positions ``start .. start+s-1``.

    Angles are computed in fp64 and cast once, so a sequence shard gets exactly the rotation the same
    tokens get in the full sequence.
    """
    _, s, _, d = x_bshd.shape
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (d/2,)
    pos = torch.arange(start, start + s, dtype=torch.float64)
    ang = torch.cat([pos[:, None] * inv_freq[None]] * 2, dim=-1)  # (s, d)
    cos = ang.cos().to(x_bshd.dtype).to(x_bshd.device)[None, :, None, :]
    sin = ang.sin().to(x_bshd.dtype).to(x_bshd.device)[None, :, None, :]
    x1, x2 = x_bshd.chunk(2, dim=-1)
    return x_bshd * cos + torch.cat([-x2, x1], dim=-1) * sin


def rms_norm(x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """LLaMA RMSNorm over the last dim; per token, so a sequence shard needs no communication."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _RMS_EPS) * gain


def swiglu(u: torch.Tensor, w_gate, w_up, w_down) -> torch.Tensor:
    return (torch.nn.functional.silu(u @ w_gate.t()) * (u @ w_up.t())) @ w_down.t()


def sp_attention(x_bnH, wq, wk, wv, wo, shape: LayerShape, core, start: int) -> torch.Tensor:
    """Projections + RoPE on the tokens at hand, ``core(q, k, v)`` for the attention, output projection.

    The body shared by the reference (full sequence, ``start=0``) and the sequence-parallel methods
    (Ulysses, ring, distattn: their shard, ``start = rank * n``); only ``core`` differs.
    """
    b, s, _ = x_bnH.shape
    q = (x_bnH @ wq.t()).view(b, s, -1, shape.head_dim)  # (b, s, h_q, d)
    k = (x_bnH @ wk.t()).view(b, s, -1, shape.head_dim)  # (b, s, h_kv, d)
    v = (x_bnH @ wv.t()).view(b, s, -1, shape.head_dim)
    q, k = apply_rope(q, start, shape.rope_base), apply_rope(k, start, shape.rope_base)
    out = core(q, k, v)  # (b, s, h_q, d)
    return out.reshape(b, s, -1) @ wo.t()


def llama_layer(x, attn, mlp, norm1, norm2) -> torch.Tensor:
    """Pre-norm decoder layer around any ``attn(u)`` and ``mlp(u)`` (each maps ``(b, s, H)`` to itself)."""
    h = x + attn(rms_norm(x, norm1))
    return h + mlp(rms_norm(h, norm2))


def reference_attention_layer(x_bNH, w: dict, shape: LayerShape, attn_fn, causal: bool = True):
    """The attention layer on one process over the full sequence; ``attn_fn(q, k, v, causal)`` -> out."""
    return sp_attention(x_bNH, w["wq"], w["wk"], w["wv"], w["wo"], shape,
                        lambda q, k, v: attn_fn(q, k, v, causal), start=0)


def reference_llama_layer(x_bNH, w: dict, shape: LayerShape, attn_fn, causal: bool = True):
    """The full decoder layer on one process over the full sequence."""
    return llama_layer(x_bNH, lambda u: reference_attention_layer(u, w, shape, attn_fn, causal),
                       lambda u: swiglu(u, w["w_gate"], w["w_up"], w["w_down"]), w["norm1"], w["norm2"])


def flops_per_layer(shape: LayerShape, tokens: int, *, causal: bool = True, full_layer: bool = True) -> dict:
    """Forward FLOPs of one layer over ``tokens`` tokens: matmuls (projections, MLP) and attention core.

    Attention core: ``4 * N^2 * h_q * d`` (QK^T and PV), halved for causal
    (the project's FLOP convention for every benchmark: useful work only, never recomputation). Backward is
    2x the matmuls and 2.5x the attention core.
    """
    hid, qd, kvd = shape.hidden, shape.heads_q * shape.head_dim, shape.heads_kv * shape.head_dim
    proj = 2 * tokens * hid * (2 * qd + 2 * kvd)
    mlp = 2 * tokens * 3 * hid * shape.ffn if full_layer else 0
    core = 4 * tokens * tokens * shape.heads_q * shape.head_dim * (0.5 if causal else 1.0)
    return {"matmul": proj + mlp, "attention": core}
