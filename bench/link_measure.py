"""The links the per-pair timeline assumes, measured with the executor's own rounds (issue 39).

    torchrun --nproc-per-node 8 bench/link_measure.py --out links.json           # one node: NVLink
    torchrun --nnodes 2 --nproc-per-node 8 ... bench/link_measure.py --out links.json   # and the link across
    python bench/link_measure.py --spawn 3 --device cpu --out links.json          # gloo on this machine (a dry run)
    DISTATTN_LINK=links.json python train.py ...     # the placement solver and schedule="auto" time on them
    python -m distattn.schedule explain --world 64 --link links.json             # the cost model on them

The timeline (``distattn.schedule.timeline``), the placement solver and ``schedule="auto"`` charge a round of the
executor ``max(bytes sent, bytes received) / bandwidth + latency * messages`` per link, with the bandwidth and the
per-message latency of ``distattn.schedule.cluster.LINKS``: assumptions (NVLink 300 GB/s and 3 us per message). The
worst packed batches at P = 64 miss the 1.10x goal by the latency alone on that assumption
(``bench/results/placement-sim/LATENCY.md``), and no machine here has two GPUs to measure it. This measures it where
there are: every rank posts rounds as the executor does (``distattn.comm.PeerExchange``: one batch of ``isend`` /
``irecv``, on the fetch side stream on CUDA) to ``m`` peers at once, each message ``s`` bytes, sending to the next
``m`` ranks and receiving from the ``m`` before; a message is what the timeline counts as one, one task's transfer,
sent as the executor sends a k/v fetch: ``--tensors`` (2: k and v) tensors of ``s / 2`` bytes, each its own ``isend``;
``--rounds`` rounds back to back per sample (the steady state the executor runs in), the slowest rank's time per round,
the median of ``--reps`` samples. Inside a node the peers are the node's own (the ``intra`` link), across nodes the
ranks ``G, 2G, ..`` away (``inter``, with two nodes or more; ``G``: ``--gpus-per-node``, default torchrun's
``LOCAL_WORLD_SIZE``). Each link is fitted (``distattn.schedule.cluster.fit_link``: least squares of that formula over
every ``m`` and ``s``) and written with its samples and each sample's fitted time to ``--out`` (format
``distattn-links/1``), which ``DISTATTN_LINK=<file>`` hands to the library
(``distattn.schedule.cluster.cluster_from_file``: the placement solver, ``schedule="auto"``; the CLI's ``--link
<file>``). Every rank must read the same figures: a placed call's agreement compares them.

What it measures is the executor's round on the backend the run uses: NCCL on CUDA (torchrun), gloo on CPU tensors
(``--spawn`` or ``--device cpu``, loopback TCP here: a dry run that proves the path and the fit, not a GPU's link).
Without two GPUs nothing here is measured of NVLink; the presets stay what the published figures use.
"""

from __future__ import annotations

import argparse
import json
import os
import queue as queues
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from distattn.comm import PeerExchange  # noqa: E402
from distattn.schedule.cluster import LINKS_FORMAT, fit_link  # noqa: E402

SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 24)
"""Message sizes (bytes) on CUDA: 4 KiB (latency-bound) to 16 MiB (a shard's k/v at 4096 tokens, 8 kv heads of 128,
bf16, is 16 MiB)."""
CPU_SIZES = (1 << 12, 1 << 20)
"""On CPU (gloo over loopback): 4 KiB and 1 MiB, a dry run that finishes in seconds."""


def peers_of(rank: int, world: int, g: int, link: str, m: int) -> tuple[list[int], list[int]]:
    """``(send to, receive from)``: ``m`` peers of ``rank`` inside its node of ``g`` ranks (``"intra"``: the next
    ``m`` ranks of the node, cyclically) or across nodes (``"inter"``: the ranks ``g, 2g, .., m g`` ahead, cyclically
    over the world); receiving from the same offsets behind, so every send meets a receive."""
    if link == "intra":
        base, local = rank - rank % g, rank % g
        return ([base + (local + o) % g for o in range(1, m + 1)], [base + (local - o) % g for o in range(1, m + 1)])
    return [(rank + o * g) % world for o in range(1, m + 1)], [(rank - o * g) % world for o in range(1, m + 1)]


def plan_of(world: int, g: int, peer_counts, sizes) -> list[tuple[str, int, int]]:
    """The samples, ``(link, peers, bytes)``: inside a node up to ``g - 1`` peers, across nodes up to
    ``world // g - 1``, every size; the same list on every rank."""
    if world % g:
        raise ValueError(f"--gpus-per-node {g} does not divide the world size {world}")
    out = []
    for link, most in (("intra", g - 1), ("inter", world // g - 1)):
        counts = sorted({min(m, most) for m in peer_counts if most >= 1})
        out += [(link, m, s) for m in counts for s in sizes]
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(device: torch.device, g: int, peer_counts, sizes, rounds: int, reps: int, tensors: int = 2) -> dict:
    """Every rank runs the same samples; returns (on every rank) the file's dict: each link's samples and fit.
    ``tensors``: the tensors of one message (the executor's k/v fetch: 2), each ``size / tensors`` bytes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    exchange = PeerExchange(None, device)
    samples = []
    for link, m, size in plan_of(world, g, peer_counts, sizes):
        to, frm = peers_of(rank, world, g, link, m)
        part = max(1, size // tensors)
        send = [[torch.ones(part, dtype=torch.uint8, device=device) for _ in range(tensors)] for _ in to]
        recv = [[torch.empty(part, dtype=torch.uint8, device=device) for _ in range(tensors)] for _ in frm]
        times = []
        for rep in range(reps + 1):  # the first is a warm-up (connections, buffers)
            dist.barrier()
            _sync(device)
            start = time.perf_counter()
            for r in range(rounds):
                slot = ("fetch", "measure", r % 2)
                exchange.post(slot, list(zip(to, send)), list(zip(frm, recv)))
                exchange.wait(slot)
            _sync(device)
            took = torch.tensor([(time.perf_counter() - start) / rounds], dtype=torch.float64, device=device)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's time per round
            if rep:
                times.append(float(took))
        samples.append({"link": link, "peers": m, "bytes": part * tensors, "tensors": tensors, "messages": 2 * m,
                        "max_bytes": m * part * tensors, "seconds": statistics.median(times), "reps": reps,
                        "rounds": rounds})
    backend = str(dist.get_backend())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU tensors"
    out = {"format": LINKS_FORMAT, "measured": True, "backend": backend, "device": name, "world_size": world,
           "gpus_per_node": g, "samples": samples, "intra": None, "inter": None}
    for link in ("intra", "inter"):
        rows = [s for s in samples if s["link"] == link]
        if not rows:
            continue
        what = f"measured, {backend} on {name}, {'inside a node' if link == 'intra' else 'across nodes'}"
        fitted = fit_link(what, [s["messages"] for s in rows], [s["max_bytes"] for s in rows],
                          [s["seconds"] for s in rows])
        out[link] = {"name": fitted.name, "bandwidth": fitted.bandwidth, "latency": fitted.latency}
        for s in rows:  # the fit beside each sample: how well the timeline's formula holds
            s["fitted_seconds"] = s["messages"] * fitted.latency + s["max_bytes"] / fitted.bandwidth
    return out


def _write(out: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    for link in ("intra", "inter"):
        entry = out[link]
        print(f"{link}: " + (entry["name"] if entry else "not measured (one node)"))
    worst = max((abs(s["fitted_seconds"] / s["seconds"] - 1) for s in out["samples"]), default=0.0)
    print(f"{len(out['samples'])} samples, the fit within {worst:.0%} of every one; wrote {path}")


def _spawned(rank: int, world: int, init: str, args: argparse.Namespace, queue) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
        out = measure(torch.device(args.device), args.gpus_per_node or world, args.peers,
                      args.sizes or CPU_SIZES, args.rounds, args.reps, args.tensors)
        queue.put((rank, out, None))
    except Exception as exc:  # noqa: BLE001 - handed to the parent, which raises it
        queue.put((rank, None, f"{type(exc).__name__}: {exc}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--spawn", type=int, default=0, help="run N processes here over gloo (no torchrun)")
    ap.add_argument("--device", default=None, help="cuda (torchrun default) or cpu")
    ap.add_argument("--gpus-per-node", type=int, default=None, help="default: LOCAL_WORLD_SIZE (torchrun)")
    ap.add_argument("--peers", type=int, nargs="+", default=[1, 2, 4, 7], help="peers per round")
    ap.add_argument("--sizes", type=int, nargs="+", default=None, help="bytes per message")
    ap.add_argument("--rounds", type=int, default=20, help="rounds back to back per sample")
    ap.add_argument("--reps", type=int, default=5, help="samples per size (the median is kept)")
    ap.add_argument("--tensors", type=int, default=2, help="tensors per message (the executor's k/v fetch: 2)")
    ap.add_argument("--timeout", type=float, default=600.0, help="--spawn: seconds before the run is given up")
    args = ap.parse_args(argv)
    for name in ("peers", "sizes"):
        if any(v < 1 for v in getattr(args, name) or ()):
            ap.error(f"--{name} must be positive")
    if min(args.rounds, args.reps, args.tensors) < 1:
        ap.error("--rounds, --reps and --tensors must be positive")
    if args.sizes and len(set(args.sizes)) < 2:
        ap.error("--sizes: give at least two sizes (the fit tells latency from bandwidth by them)")
    if args.spawn:
        args.device = args.device or "cpu"
        ctx, init = mp.get_context("spawn"), tempfile.mktemp(prefix="distattn-links-")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_spawned, args=(r, args.spawn, init, args, queue)) for r in range(args.spawn)]
        for proc in procs:
            proc.start()
        results, deadline = {}, time.monotonic() + args.timeout
        try:
            while len(results) < args.spawn:
                try:
                    rank, out, error = queue.get(timeout=max(1.0, deadline - time.monotonic()))
                except queues.Empty:
                    raise SystemExit(f"link_measure: no result from {args.spawn - len(results)} rank(s) within "
                                     f"--timeout {args.timeout:g} s") from None
                if error:
                    raise SystemExit(f"link_measure: rank {rank} failed: {error}")
                results[rank] = out
        finally:
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
        if os.path.exists(init):
            os.remove(init)
        _write(results[0], args.out)
        return
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        g = args.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        out = measure(device, g, args.peers, args.sizes or (SIZES if device.type == "cuda" else CPU_SIZES),
                      args.rounds, args.reps, args.tensors)
        if dist.get_rank() == 0:
            _write(out, args.out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
