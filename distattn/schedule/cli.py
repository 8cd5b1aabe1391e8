"""``python -m distattn.schedule``: the simulator's table for dense plans and for packed-document streams.

Examples::

    python -m distattn.schedule --world 2 4 8 16 32 64 --seq-per-rank 32768 --heads 32 --head-dim 128
    python -m distattn.schedule --world 8 16 64 --seq-per-rank 4096 --docs uniform:8192      # packed documents
    python -m distattn.schedule --world 8 16 64 --seq-per-rank 4096 --docs longtail:2048 --window 4096

``--docs uniform:N`` draws document lengths uniformly from 1..N, ``longtail:M`` from a log-normal of median M
(sigma 1.5: mostly short documents, a few very long ones), until the stream of ``P * seq-per-rank`` tokens is
full (the last document is cut); ``--seed`` fixes the draw.
"""

from __future__ import annotations

import argparse

import numpy as np

from distattn.schedule import SCHEDULES, MaskSpec, Shapes, format_table, simulate


def document_lengths(spec: str, total: int, seed: int = 0) -> tuple[int, ...]:
    """Cumulative lengths of documents drawn by ``spec`` (``uniform:N`` or ``longtail:M``) filling ``total`` tokens."""
    kind, _, value = spec.partition(":")
    if kind not in ("uniform", "longtail") or not value.isdigit() or int(value) < 1:
        raise ValueError(f"--docs {spec!r}: use uniform:N (lengths 1..N) or longtail:M (log-normal, median M)")
    rng = np.random.default_rng(seed)
    cu = [0]
    while cu[-1] < total:
        if kind == "uniform":
            length = int(rng.integers(1, int(value) + 1))
        else:
            length = max(1, int(rng.lognormal(np.log(int(value)), 1.5)))
        cu.append(min(total, cu[-1] + length))
    return tuple(cu)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m distattn.schedule",
                                     description="Simulate the sequence-parallel plans; print a markdown table.")
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--seq-per-rank", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32, help="query heads")
    parser.add_argument("--heads-kv", type=int, default=None, help="kv heads (default: --heads)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype-bytes", type=int, default=2)
    parser.add_argument("--non-causal", action="store_true")
    parser.add_argument("--docs", default=None, help="packed documents: uniform:N or longtail:M (see module doc)")
    parser.add_argument("--window", type=int, default=-1, help="sliding window (left) in tokens; -1: none")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    shapes = Shapes(
        batch=args.batch, seq_per_rank=args.seq_per_rank, heads_q=args.heads,
        heads_kv=args.heads_kv or args.heads, head_dim=args.head_dim, dtype_bytes=args.dtype_bytes,
    )  # fmt: skip
    causal = not args.non_causal
    reports = []
    for p in args.world:
        window = (args.window, 0 if causal else args.window)
        cu = document_lengths(args.docs, p * args.seq_per_rank, args.seed) if args.docs else None
        mask = MaskSpec(causal=causal, window=window, cu_seqlens=cu) if (cu or args.window >= 0) else None
        reports += [simulate(p, causal, s, shapes, mask=mask) for s in SCHEDULES]
    print(f"<!-- {shapes} docs={args.docs} window={args.window} seed={args.seed} -->")
    print(format_table(reports))
