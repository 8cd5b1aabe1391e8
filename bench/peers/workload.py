"""One workload description for every system, its tensors and its fp64 one-process reference.

A :class:`Workload` is the work (batch, tokens per rank, heads q/kv, head dim, mask, P, dtype); ``make_inputs`` builds
the global tensors from a seed (every rank alike, and the reference), ``visible`` the boolean mask of which key each
query sees on global positions (the one definition every adapter's result is held to), ``reference`` the fp64
forward and backward and the error of plain PyTorch at the workload's precision (the accuracy rule's baseline:
flash-attention's, as ``tests/attn_ref.py``: our error <= 2 x plain PyTorch's + a floor of a couple of ulps).

Masks: ``causal``; ``docs`` (packed documents, ``cu_seqlens`` over the whole stream, causal inside each document;
``docs="uniform"`` or ``"longtail"``, lengths that are multiples of nothing); ``window`` (causal sliding window of
``window`` keys to the left). Legend: ``b`` batch, ``T`` tokens of the whole sequence (P x n), ``h`` heads, ``d`` head
dim. Layout ``(b, T, h, d)``, as distattn's API.

Imports: torch and numpy only.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

__all__ = ["Workload", "WORKLOADS", "make_inputs", "visible", "reference", "errors", "work_area", "ACCURACY_FACTOR"]

ACCURACY_FACTOR = 2.0  # flash-attention's rule: at most twice plain PyTorch's error at the same precision
# + a floor of one or two ulps of the result's scale (plain PyTorch can be exact on a tensor by luck)
_FLOOR_REL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """The work every system runs (global sequence ``T = world * tokens_per_rank``)."""

    name: str
    """Row label, e.g. ``"llama3-gqa"``."""
    world: int
    """P, ranks of the sequence-parallel group."""
    tokens_per_rank: int
    """n; the sequence is ``P * n`` tokens."""
    heads_q: int = 32
    """query heads"""
    heads_kv: int = 8
    """key/value heads (GQA: heads_q % heads_kv == 0)"""
    head_dim: int = 128
    """d"""
    mask: str = "causal"
    """``"causal"``, ``"docs"`` (packed documents, causal in each) or ``"window"`` (causal sliding window)."""
    docs: str = "uniform"
    """with ``mask="docs"``: ``"uniform"`` (near-equal lengths) or ``"longtail"`` (one long, many short)."""
    window: int = -1
    """with ``mask="window"``: keys to the left a query sees (flash-attn's ``window_size=(window, 0)``)."""
    batch: int = 1
    """b (packed documents: 1, one stream)."""
    dtype: str = "float32"
    """``"float32"``, ``"bfloat16"`` or ``"float16"``"""
    seed: int = 0

    def __post_init__(self):
        if self.mask not in ("causal", "docs", "window"):
            raise ValueError(f"Workload.mask={self.mask!r}: use 'causal', 'docs' or 'window'")
        if self.heads_q % self.heads_kv:
            raise ValueError(f"heads_q ({self.heads_q}) must be a multiple of heads_kv ({self.heads_kv})")
        if self.mask == "window" and self.window < 1:
            raise ValueError(f"Workload.window={self.window}: a sliding window needs window >= 1")
        if self.mask == "docs" and (self.batch != 1 or self.docs not in ("uniform", "longtail")):
            raise ValueError("packed documents: batch=1 (one stream) and docs='uniform' or 'longtail'")
        if self.dtype not in _DTYPES:
            raise ValueError(f"Workload.dtype={self.dtype!r}: use one of {sorted(_DTYPES)}")

    @property
    def total(self) -> int:
        return self.world * self.tokens_per_rank

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def cu_seqlens(self) -> list[int] | None:
        """Cumulative document lengths over the whole stream (``docs`` only), a fixed draw from ``seed``."""
        if self.mask != "docs":
            return None
        rng = np.random.default_rng(1000 + self.seed)
        T = self.total
        if self.docs == "uniform":  # ~8 documents, lengths jittered by +-20%
            k = max(2, min(8, T // 16))
            lens = rng.uniform(0.8, 1.2, size=k)
        else:  # one document of ~half the stream, the rest in short ones (a long tail of lengths)
            rest = rng.pareto(1.5, size=max(3, min(24, T // 12))) + 0.2
            lens = np.concatenate([[rest.sum()], rest])
        lens = np.maximum(1, np.floor(lens / lens.sum() * T)).astype(int)
        lens[-1] += T - lens.sum()  # the stream is exactly T tokens (the last document absorbs rounding)
        while lens[-1] < 1:  # rounding left the last one empty: take a token from the longest
            i = int(np.argmax(lens[:-1]))
            lens[i] -= 1
            lens[-1] += 1
        return [0] + np.cumsum(lens).tolist()

    def describe(self) -> str:
        mask = ("causal" if self.mask == "causal" else f"causal window {self.window}" if self.mask == "window" else
                f"packed docs ({self.docs}, lengths {_lengths(self.cu_seqlens())})")
        return (f"b={self.batch} n={self.tokens_per_rank}/rank h={self.heads_q}/{self.heads_kv} d={self.head_dim} "
                f"{mask} P={self.world} {self.dtype}")


def _lengths(cu) -> str:
    return " ".join(str(b - a) for a, b in zip(cu, cu[1:]))


def WORKLOADS(world: int, tokens_per_rank: int, dtype: str = "float32") -> list[Workload]:
    """The harness's standard set at one P: LLaMA-3-8B heads (32/8 GQA, d 128), MHA, packed docs, a window."""
    n = tokens_per_rank
    common = dict(world=world, tokens_per_rank=n, dtype=dtype)
    return [
        Workload(name="llama3-gqa", heads_q=32, heads_kv=8, head_dim=128, **common),
        Workload(name="mha", heads_q=8, heads_kv=8, head_dim=64, **common),
        Workload(name="docs-uniform", heads_q=32, heads_kv=8, head_dim=128, mask="docs", docs="uniform", **common),
        Workload(name="docs-longtail", heads_q=32, heads_kv=8, head_dim=128, mask="docs", docs="longtail", **common),
        Workload(name="window", heads_q=32, heads_kv=8, head_dim=128, mask="window", window=max(1, n // 2) + 1,
                 **common),
    ]


def make_inputs(w: Workload) -> dict[str, torch.Tensor]:
    """Global ``q (b, T, h_q, d)``, ``k, v (b, T, h_kv, d)`` and ``dout`` in the workload's dtype, from its seed."""
    g = torch.Generator().manual_seed(w.seed)
    b, T, d = w.batch, w.total, w.head_dim
    mk = lambda h: torch.randn(b, T, h, d, generator=g).to(w.torch_dtype)  # noqa: E731
    return {"q": mk(w.heads_q), "k": mk(w.heads_kv), "v": mk(w.heads_kv), "dout": mk(w.heads_q)}


def visible(w: Workload) -> torch.Tensor:
    """``(T, T)`` bool: query at global position p sees key at position j."""
    pos = torch.arange(w.total)
    qp, kp = pos[:, None], pos[None, :]
    seen = kp <= qp
    if w.mask == "window":
        seen &= kp >= qp - w.window
    if w.mask == "docs":
        cu = torch.tensor(w.cu_seqlens())
        doc = torch.bucketize(pos, cu[1:], right=True)
        seen &= doc[:, None] == doc[None, :]
    return seen


def _masked(q, k, v, seen, dtype):
    """softmax(q k^T / sqrt(d) on ``seen``) v in ``dtype``; GQA by repeating k/v (reference only)."""
    rep = q.shape[2] // k.shape[2]
    qd, kd, vd = (t.to(dtype).transpose(1, 2) for t in (q, k, v))  # (b, h, T, d)
    kd, vd = kd.repeat_interleave(rep, dim=1), vd.repeat_interleave(rep, dim=1)
    s = (qd @ kd.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~seen, float("-inf"))
    return (torch.softmax(s, dim=-1) @ vd).transpose(1, 2)


def _run(inputs, seen, dtype):
    q, k, v = (inputs[n].detach().to(dtype).requires_grad_() for n in "qkv")  # grads in ``dtype`` too
    out = _masked(q, k, v, seen, dtype)
    out.backward(inputs["dout"].to(dtype))
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def reference(w: Workload, inputs: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """``(fp64 results, plain PyTorch's error per tensor at the workload's dtype)``: out, dq, dk, dv."""
    seen = visible(w)
    ref = _run(inputs, seen, torch.float64)
    plain = _run(inputs, seen, torch.float32 if w.torch_dtype == torch.float32 else w.torch_dtype)
    base = {name: (plain[name].double() - ref[name]).abs().max().item() for name in ref}
    return ref, base


def errors(w: Workload, got: dict, ref: dict, base: dict) -> tuple[dict, bool]:
    """Max error of each of out/dq/dk/dv against fp64 and whether all keep the accuracy rule."""
    errs, ok = {}, True
    for name in ("out", "dq", "dk", "dv"):
        if got.get(name) is None:
            errs[name] = None
            continue
        errs[name] = (got[name].double() - ref[name]).abs().max().item()
        floor = _FLOOR_REL[w.torch_dtype] * max(ref[name].abs().max().item(), 1.0)
        ok &= errs[name] <= ACCURACY_FACTOR * base[name] + floor
    return errs, ok


def work_area(w: Workload, rows: torch.Tensor | None = None) -> int:
    """Visible (query, key) pairs x query heads x batch of the query rows ``rows`` (all rows: ``None``)."""
    seen = visible(w)
    if rows is not None:
        seen = seen[rows]
    return int(seen.sum()) * w.heads_q * w.batch
