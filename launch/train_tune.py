"""``DISTATTN_AUTOTUNE=1`` in ``launch/train.py``: the Triton launch configs tuned once, before step 1.

Rank 0 benchmarks the configs the kernels' filter keeps for this run's attention shapes (or reads its choices from
the disk cache, ``DISTATTN_TUNE_CACHE``, default ``~/.cache/distattn/tune``), and every rank installs rank 0's
choice (``distattn.autotune``), so nothing is timed inside a distributed step and every rank launches the
same configs. On CPU, or with another attention backend, there is nothing to tune: one line says so.
"""

from __future__ import annotations

import time

from train_config import JobFailed, RunConfig, UsageError


def check_env() -> None:
    """``UsageError`` for a ``DISTATTN_AUTOTUNE`` other than 0 or 1 (before the process group exists)."""
    from distattn.kernels import autotune_enabled

    try:
        autotune_enabled()
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def attention_cases(cfg: RunConfig, config) -> list[dict]:
    """The shapes of this run's attention kernel calls on one rank (``distattn.kernels.TuneCase`` fields).

    A call sees the rank's chunk of the ring (with ``--ulysses U``: ``U`` ranks' tokens, ``1/U`` of the heads);
    packed documents and zigzag layouts launch with per-row key bounds, plain causal runs launch the diagonal
    pairs causal and the others dense (with one ring rank: only the diagonal)."""
    from distattn.schedule import ulysses_heads

    heads_q = config.num_attention_heads
    heads_kv = getattr(config, "num_key_value_heads", None) or heads_q
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads_q
    ring = cfg.sp_size // cfg.ulysses
    if cfg.ulysses > 1:
        heads_q, heads_kv, _ = ulysses_heads(heads_q, heads_kv, cfg.ulysses)
    n = cfg.args.seq_len // ring
    shape = dict(batch=1 if cfg.args.pack else cfg.args.batch_size, seq_q=n, seq_k=n, heads_q=heads_q,
                 heads_kv=heads_kv, head_dim=head_dim, dtype=cfg.dtype)
    if cfg.args.pack or cfg.args.schedule == "zigzag":
        return [dict(shape, bounds=True)]
    return [dict(shape, causal=True)] + ([dict(shape, causal=False)] if ring > 1 else [])


def autotune_attention(cfg: RunConfig, config, device, log) -> None:
    """``DISTATTN_AUTOTUNE=1``: tune the Triton configs for this run's attention once, before step 1 (never inside
    a step): rank 0 benchmarks or reads its cache, and every rank launches rank 0's choice."""
    import distattn
    from distattn import kernels

    if not kernels.autotune_enabled():
        return
    if cfg.device_type != "cuda" or cfg.attn_backend != "triton":
        log(f"DISTATTN_AUTOTUNE=1: skipped, attention runs with the {cfg.attn_backend} backend on "
            f"{cfg.device_type} (only the Triton kernels on CUDA have launch configs to tune)")
        return
    t0 = time.perf_counter()
    try:
        table = distattn.autotune(attention_cases(cfg, config), device=device)
    except Exception as exc:  # noqa: BLE001 - autotune raises on every rank alike (rank 0's error is shared)
        raise JobFailed(f"DISTATTN_AUTOTUNE=1: {type(exc).__name__}: {exc}") from None
    log(f"DISTATTN_AUTOTUNE=1: {len(table)} kernel configs from rank 0 in {time.perf_counter() - t0:.1f} s")
