"""The published activation-memory formulas the byte model is checked against (``tests/test_memory.py``).

Imports nothing of ``distattn.memory``: ``model`` hands these names on, and a ``ModelSpec`` argument is only read.

Korthikanti et al.'s per-layer bytes with tensor/sequence parallelism and recomputation, the padding-free note's
per-layer bytes and their expectation over random lengths, and the memory-arithmetic post's nanoGPT formulas.
"""

from __future__ import annotations

__all__ = ["korthikanti_layer_bytes", "padding_free_layer_bytes", "expected_padding_bytes", "nanogpt_activation_bytes",
           "nanogpt_steady_state_bytes"]


# -- published formulas (reproduced by tests/test_memory.py) --------------------------------------------
def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, *, t: int = 1, mode: str = "none",
                            sequence_parallel: bool = False) -> float:
    """Per-layer activation bytes of Korthikanti et al. (16-bit, GPT layer with dropout; the checkpointing
    notes): ``sbh(34 + 5as/h)``, with ``t``-way tensor parallelism ``sbh(10 + 24/t + 5as/(ht))``, with
    sequence parallelism too ``sbh(34 + 5as/h)/t``; ``mode='selective'`` drops the ``5as/h`` term,
    ``mode='full'`` keeps only the layer input ``2sbh``."""
    if mode == "full":
        return 2 * s * b * h
    quad = 0 if mode == "selective" else 5 * a * s / h
    if sequence_parallel:
        return s * b * h * (34 + quad) / t
    return s * b * h * (10 + 24 / t + quad / t)


def padding_free_layer_bytes(max_len: int, total: int, b: int, h: int, a: int, impl: str) -> float:
    """The padding-free note's per-layer bytes for a batch of ``b`` sequences, longest ``max_len``, ``total``
    tokens: naive ``K b h (34 + 5aK/h)``, FlashAttention on a padded batch ``34 K b h + total (h + 2a)``,
    padding-free ``total h (35 + 2a/h)``."""
    if impl == "naive":
        return max_len * b * h * (34 + 5 * a * max_len / h)
    if impl == "flash":
        return 34 * max_len * b * h + total * (h + 2 * a)
    if impl == "padding_free":
        return total * h * (35 + 2 * a / h)
    raise ValueError(f"impl={impl!r} must be 'naive', 'flash' or 'padding_free'")


def expected_padding_bytes(N: int, b: int, h: int, a: int, impl: str, layer_bytes=padding_free_layer_bytes) -> float:
    """Expected per-layer bytes when a batch holds ``b`` lengths drawn uniformly from ``1..N``.

    ``K = max`` has ``P(K = k) = (k/N)^b - ((k-1)/N)^b``; the total's mean is ``b (N+1)/2`` and, given the
    bytes are linear in the total, ``E[f(K, total)] = sum_k P(K=k) f(k, E[total | K=k])`` with
    ``E[total | K=k]`` = k + (b-1) E[S | S <= k] computed exactly (order statistics of i.i.d. uniforms).
    """
    out = 0.0
    for k in range(1, N + 1):
        p = (k / N) ** b - ((k - 1) / N) ** b
        if p == 0.0:
            continue
        # E[sum | max = k]: one value is k; by exchangeability the others average E[S | S <= k] adjusted for
        # ties: sum over i of E[S_i | K = k] = b * E[S_1 | K = k].
        p_le_k, p_le_km1 = (k / N) ** b, ((k - 1) / N) ** b
        # E[S_1 1{K=k}] = E[S_1 1{K<=k}] - E[S_1 1{K<=k-1}], E[S_1 1{K<=j}] = (j(j+1)/2 / N) (j/N)^(b-1)
        e1 = lambda j: (j * (j + 1) / 2 / N) * (j / N) ** (b - 1)  # noqa: E731
        total = b * (e1(k) - e1(k - 1)) / (p_le_k - p_le_km1)
        out += p * layer_bytes(k, total, b, h, a, impl)
    return out


def nanogpt_activation_bytes(model, batch: int, seq: int) -> int:
    """The memory-arithmetic post's activation formula: ``L (36 Ne + 6 Na) + 6 Ne + 6 Nl`` (fp16 autocast,
    eager attention without dropout; it leaves out the LayerNorm statistics and the half weight copies)."""
    h, a, L = model.layer.hidden, model.layer.heads, model.layers
    ne, na, nl = batch * seq * h, batch * a * seq * seq, batch * seq * model.vocab
    return L * (36 * ne + 6 * na) + 6 * ne + 6 * nl


def nanogpt_steady_state_bytes(model, batch: int, seq: int, cublas_workspaces: int = 2) -> dict[str, int]:
    """The memory-arithmetic post's steady state: 4N + 4N_buf (weights + causal-mask buffers, one (T, T)
    fp32 per layer), 4N grads, 8N Adam, two 8,519,680-byte cuBLAS workspaces, int64 inputs and targets."""
    n = model.params
    buf = seq * seq * model.layers
    return {"params": n, "model": 4 * n + 4 * buf, "grads": 4 * n, "adam": 8 * n,
            "cublas": cublas_workspaces * 8_519_680, "inputs": 2 * batch * seq * 8}
