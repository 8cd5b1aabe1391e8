"""``--pack --schedule placed``: each batch's placement, solved ahead while the step before runs.

A packed batch's placement (``distattn.sharding.placement``) is a new solve per batch, 0.1-3 s of CPU at 16-64 ranks
(``bench/results/placement-sim/SOLVE-AHEAD.md``): on the loop's thread it would hold every step back by that much.
Before step ``i`` runs, :func:`placements` asks worker processes for the placements of batches ``i + 1`` and
``i + 2`` (``distattn.sharding.solve_ahead``, :data:`AHEAD`) and takes batch ``i``'s, solved while the steps before
ran (the first step's is solved here); the step's record says how long it waited for it (``placement_wait_s``) and
who solved it (``placement_source``). The layout is the one an inline solve gives, on every rank
alike.
"""

from __future__ import annotations

import time

__all__ = ["window_of", "placement_args", "placements", "placed_documents"]


def window_of(model, ids) -> tuple[int, int]:
    """The window a packed stream ``ids`` is placed for: the one the model's layers mostly run with
    (``distattn.integrations.hf.placement_window``; causal without a config)."""
    from distattn.integrations.hf import placement_window

    config = getattr(getattr(model, "module", model), "config", None)  # DDP wraps the model; FSDP2 does not
    return (-1, -1) if config is None else placement_window(config, ids.numel())


def placement_args(model, ids, positions, sp_size: int) -> tuple:
    """``(cu_seqlens, tokens per rank, window)`` of a packed batch (on the host), as ``shard_batch`` derives them."""
    from distattn.packing import cu_seqlens_from_position_ids

    return cu_seqlens_from_position_ids(positions[None]), ids.numel() // sp_size, window_of(model, ids)


AHEAD = 2
"""Batches asked for ahead, each in its own worker: where one solve takes longer than a step (0.7-3 s windowed at
P = 64, ``SOLVE-AHEAD.md``), two solves in flight keep up with steps half as long."""


def placements(job, dataset, batch, step: int, first: int) -> dict:
    """``--schedule placed`` with ``--pack``: the next :data:`AHEAD` batches' placements (the batches after ``step``,
    the sample ``first`` on) started in workers (those asked for already keep their solve), then this batch's taken
    (waiting for its worker, or solved now: the first step's, or while the workers still import the library);
    ``{"placement_wait_s": seconds, "placement_source": "ahead" (a worker's), "inline" (solved now) or "cached" (an
    earlier batch had the same documents), "placement_workers_ready": whether the workers were ready}``, or ``{}``
    for any other schedule."""
    cfg = job.cfg
    if cfg.args.schedule != "placed" or not cfg.args.pack:
        return {}
    from distattn.schedule import ahead
    from distattn.sharding import placement, placement_source, solve_ahead

    stride = cfg.args.batch_size * cfg.dp_size  # samples per step, over the replicas
    # the run's first step asks for the next AHEAD batches; every later step for the one AHEAD on (the rest are asked)
    for later in range(1 if step == job.first_step + 1 else AHEAD, min(AHEAD, cfg.args.steps - step) + 1):
        cu, n, window = placement_args(job.model, *dataset.batch(first + later * stride, cfg.args.batch_size),
                                       cfg.sp_size)
        solve_ahead(cu, n, job.group, window=window, workers=AHEAD)
    cu, n, window = placement_args(job.model, *batch, cfg.sp_size)
    warm = ahead.ready()  # a worker still importing the library leaves this batch to an inline solve
    t0 = time.perf_counter()
    with placement_source() as where:
        placement(cu, n, job.group, window=window)
    wait = time.perf_counter() - t0
    return {"placement_wait_s": wait, "placement_source": where["source"], "placement_workers_ready": warm}


def placed_documents(cfg, inputs) -> dict:
    """``--schedule placed``: the stream's documents for the model's hook, which gathers the shards by their
    placement (``distattn.integrations.hf.shard_batch``); other schedules: nothing."""
    if cfg.args.schedule != "placed":
        return {}
    cu, longest = inputs["cu_seq_lens"], inputs["max_length"]
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
