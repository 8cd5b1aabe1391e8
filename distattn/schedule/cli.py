"""``python -m distattn.schedule``: the simulator's table for dense plans and for packed-document streams.

Examples::

    python -m distattn.schedule --world 2 4 8 16 32 64 --seq-per-rank 32768 --heads 32 --head-dim 128
    python -m distattn.schedule --world 8 16 64 --seq-per-rank 4096 --docs uniform:8192      # packed documents
    python -m distattn.schedule --world 8 16 64 --seq-per-rank 4096 --docs longtail:2048 --window 4096
    python -m distattn.schedule --world 8 16 --seq-per-rank 4096 --heads-kv 8 --docs pile:4 --link nvlink  # per pair

``python -m distattn.schedule explain``: the cost model's prediction for every candidate (flat ring, balanced,
zigzag; Ulysses x ring) on a cluster, and why the winner won (``distattn.schedule.cost``)::

    python -m distattn.schedule explain --world 16 --heads 32 --heads-kv 8 --head-dim 128 --seq-per-rank 4096 --link ib

``--link nvlink``: every link is NVLink (one NVLink domain); ``--link ib`` (default): NVLink inside a node of
``--gpus-per-node`` GPUs, 100 Gb/s InfiniBand across (both assumed rates); ``--link links.json``: the links
``bench/link_measure.py`` measured (``distattn.schedule.cluster.cluster_from_file``).

``--docs uniform:N`` draws document lengths uniformly from 1..N, ``longtail:M`` from a log-normal of median M
(sigma 1.5: mostly short documents, a few very long ones), ``pile:B`` from the Pile's published mixture at ``B`` bytes
per token (``distattn.schedule.corpora``, cited there), until the stream of ``P * seq-per-rank`` tokens is full (the
last document is cut); ``--seed`` fixes the draw.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import numpy as np

from distattn.schedule.cluster import LINKS, cluster_from_env
from distattn.schedule.corpora import pile_lengths
from distattn.schedule.masks import MaskSpec
from distattn.schedule.pairs import PlanTooLarge, out_of_memory
from distattn.schedule.plan import SCHEDULES
from distattn.schedule.sim import Shapes, format_table, simulate


def document_lengths(spec: str, total: int, seed: int = 0) -> tuple[int, ...]:
    """Cumulative lengths of documents drawn by ``spec`` (``uniform:N`` or ``longtail:M``) filling ``total`` tokens.

    Drawn in batches (a stream of 4G tokens holds a million documents): the generator gives the same lengths one at a
    time or as an array, so the documents are those of a draw per document."""
    kind, _, value = spec.partition(":")
    if kind not in ("uniform", "longtail", "pile") or not value.isdigit() or int(value) < 1:
        raise ValueError(f"--docs {spec!r}: use uniform:N (lengths 1..N), longtail:M (log-normal, median M) or "
                         f"pile:B (the Pile's published mixture at B bytes per token, e.g. pile:4)")
    rng = np.random.default_rng(seed)
    size = int(value)
    ends, reached = [np.zeros(1, dtype=np.int64)], 0
    while reached < total:
        batch = max(16, (total - reached) // size + 16)  # about the documents left (mean length: N / 2 or more)
        if kind == "uniform":
            lengths = rng.integers(1, size + 1, size=batch)
        elif kind == "pile":
            lengths = pile_lengths(rng, max(16, (total - reached) // 1000 + 16), size)
        else:
            lengths = np.maximum(1, rng.lognormal(np.log(size), 1.5, size=batch).astype(np.int64))
        cum = reached + np.cumsum(lengths)
        cut = int(np.searchsorted(cum, total, side="left")) + 1  # the first document to reach the end is the last
        ends.append(np.minimum(cum[:cut], total))
        reached = int(ends[-1][-1])
    return tuple(np.concatenate(ends).tolist())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m distattn.schedule",
                                     description="Simulate the sequence-parallel plans; print a markdown table. "
                                                 "`python -m distattn.schedule explain --help`: the cost model.")
    _add_shape_args(parser, [2, 4, 8, 16, 32, 64])
    parser.add_argument("--link", type=_link_arg, default=None,
                        help="also the per-pair timeline's columns on this cluster (distattn.schedule.timeline): "
                             "nvlink, ib or a links file of bench/link_measure.py")
    return parser


def _link_arg(value: str) -> str:
    """``--link``: a preset (``nvlink``, ``ib``) or an existing links file."""
    if value in LINKS or os.path.isfile(value):
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is neither one of {tuple(LINKS)} nor a links file "
                                     f"(bench/link_measure.py writes one)")


def _add_shape_args(parser: argparse.ArgumentParser, world_default) -> None:
    parser.add_argument("--world", type=int, nargs="+", default=world_default)
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


def build_explain_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m distattn.schedule explain",
                                     description="Predict every candidate plan's time on a cluster; say why the "
                                                 "winner won (distattn.schedule.cost; assumed link and FLOP rates).")
    _add_shape_args(parser, [8])
    parser.add_argument("--link", type=_link_arg, default="ib",
                        help="nvlink: every link NVLink; ib: NVLink inside a node, 100 Gb/s InfiniBand across; or "
                             "a links file of bench/link_measure.py (the links measured)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="default: 8, or the links file's")
    parser.add_argument("--flops", type=float, default=None, help="attention FLOP/s per GPU (default: 350e12)")
    parser.add_argument("--partials", choices=("fp32", "input"), default="fp32")
    return parser


def _shapes(args) -> Shapes:
    return Shapes(
        batch=args.batch, seq_per_rank=args.seq_per_rank, heads_q=args.heads,
        heads_kv=args.heads_kv or args.heads, head_dim=args.head_dim, dtype_bytes=args.dtype_bytes,
    )  # fmt: skip


def _mask(args, p: int) -> MaskSpec | None:
    causal = not args.non_causal
    window = (args.window, 0 if causal else args.window)
    cu = document_lengths(args.docs, p * args.seq_per_rank, args.seed) if args.docs else None
    return MaskSpec(causal=causal, window=window, cu_seqlens=cu) if (cu or args.window >= 0) else None


def explain_main(argv=None) -> None:
    from distattn.schedule.cost import choose

    args = build_explain_parser().parse_args(argv)
    extra = {} if args.flops is None else {"flops": args.flops}
    # a preset's nodes hold 8 GPUs unless --gpus-per-node says otherwise; a links file's hold what it measured
    gpus = args.gpus_per_node if args.gpus_per_node is not None else (8 if args.link in LINKS else None)
    cluster = dataclasses.replace(cluster_from_env(args.link, gpus), **extra)
    shapes = _shapes(args)
    for i, p in enumerate(args.world):
        choice = choose(p, shapes, causal=not args.non_causal, mask=_mask(args, p), cluster=cluster,
                        partials=args.partials)
        print(("\n" if i else "") + choice.explain())


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["explain"]:
        return _clear_limits(lambda: explain_main(argv[1:]), argv[1:])
    args = build_parser().parse_args(argv)
    return _clear_limits(lambda: _table(args), argv)


def _table(args) -> None:
    shapes = _shapes(args)
    causal = not args.non_causal
    reports = []
    for p in args.world:
        cluster = None if args.link is None else cluster_from_env(args.link, 8 if args.link in LINKS else None)
        reports += [simulate(p, causal, s, shapes, mask=_mask(args, p), cluster=cluster) for s in SCHEDULES]
    print(f"<!-- {shapes} docs={args.docs} window={args.window} seed={args.seed} -->")
    print(format_table(reports))


def _clear_limits(run, argv) -> None:
    """Run the command; a plan past a memory bound (``PlanTooLarge``) or a process out of memory (``MemoryError``,
    e.g. under ``ulimit -v``) ends in one line on stderr that names the size and what to do, exit status 1."""
    try:
        run()
    except MemoryError as exc:
        if not isinstance(exc, PlanTooLarge):
            args = build_parser().parse_known_args(argv)[0]
            docs = f" of {args.docs} documents" if args.docs else ""
            exc = out_of_memory(f"simulating {max(args.world)} ranks x {args.seq_per_rank} tokens{docs}", exc)
        print(f"python -m distattn.schedule: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
