"""Fault probes of issue 21, as an operator of a long training job meets them: time to error on each rank and
whether the next good call is exact. CPU, gloo, 2 ranks; every probe runs in its own spawned pair of processes
with a hard bound, so a probe that hangs is reported as such instead of stopping the run.

    python bench/faults.py --out bench/results/faults        # writes faults.md and faults.json

Run it on two checkouts (before/after a change) to compare: it uses only the public API and
``distattn.comm.communicator`` (present since issue 14).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

CALL_TIMEOUT_S = 3.0  # timeout= of every call in the probes (and DISTATTN_REBUILD_TIMEOUT where it exists)
PROBE_BOUND_S = 90.0  # a probe still running after this is reported as a hang
EXACT = 1e-5


def _data(world, n, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, world * n, h, 8, generator=g) for h in (2, 1, 1)]


def _good(world, seed):
    """A dense causal call on every rank: its largest error against one device (``inf``: it raised)."""
    import distattn

    q, k, v = _data(world, 8, seed)
    shard = distattn.shard_sequence
    try:
        out = distattn.dist_flash_attn_func(shard(q), shard(k), shard(v), causal=True, timeout=CALL_TIMEOUT_S)
    except Exception:  # noqa: BLE001
        return float("inf")
    return (out - shard(distattn.flash_attn_func(q, k, v, causal=True))).abs().max().item()


def _timed(fn):
    start = time.monotonic()
    try:
        fn()
        return "ok", time.monotonic() - start
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}", time.monotonic() - start


# -- probes: fn(rank, world) -> dict ---------------------------------------------------------------------------
def probe_validation(rank, world):
    """The last rank passes decreasing cu_seqlens, the others valid ones; then two good calls."""
    import torch

    import distattn

    _good(world, 0)
    q, k, v = _data(world, 8, 1)
    shard = distattn.shard_sequence
    cu = [0, 9, 5, world * 8] if rank == world - 1 else [0, 5, 13, world * 8]
    error, took = _timed(lambda: distattn.dist_flash_attn_varlen_func(
        shard(q)[0], shard(k)[0], shard(v)[0], torch.tensor(cu, dtype=torch.int32), world * 8, causal=True,
        timeout=CALL_TIMEOUT_S))
    return {"error": error, "seconds": took, "next calls' max error": max(_good(world, 2), _good(world, 3))}


def probe_nan(rank, world):
    """A NaN in one query element: is the output row NaN (as on one device) or silently 0?"""
    import distattn

    q, k, v = _data(world, 8, 4)
    q[0, world * 8 - 3, 1, 2] = float("nan")
    shard = distattn.shard_sequence
    out = distattn.dist_flash_attn_func(shard(q), shard(k), shard(v), causal=True, timeout=CALL_TIMEOUT_S)
    full = distattn.gather_sequence(out.contiguous())
    return {"NaN row kept": bool(full[0, world * 8 - 3, 1].isnan().all()),
            "NaN elements": int(full.isnan().sum())}


def probe_nan_gradients(rank, world):
    """A NaN or an inf in one element of q, k or v (an early and a late row), causal, each schedule: do the NaN/inf
    masks of dq, dk and dv equal the one-device call's? Counts the cases that differ."""
    import torch

    import distattn

    cases = differ = 0
    for schedule in ("ring", "balanced", "zigzag"):
        for which in range(3):
            for row in (1, world * 8 - 3):
                for bad in (float("nan"), float("inf")):
                    full = _data(world, 8, 5)
                    full[which][0, row, 0, 1] = bad
                    shard = lambda t: distattn.shard_sequence(t, schedule=schedule)  # noqa: E731
                    mine = [shard(t).clone().requires_grad_() for t in full]
                    out = distattn.dist_flash_attn_func(*mine, causal=True, schedule=schedule,
                                                        timeout=CALL_TIMEOUT_S)
                    out.sum().backward()
                    one = [t.clone().requires_grad_() for t in full]
                    distattn.flash_attn_func(*one, causal=True).sum().backward()
                    cases += 1
                    same = all(torch.equal(m.grad.isnan(), shard(o.grad).isnan())
                               and torch.equal(m.grad.isinf(), shard(o.grad).isinf()) for m, o in zip(mine, one))
                    differ += not same
    return {"cases whose dq/dk/dv NaN/inf masks differ from one device": differ, "of": cases}


def probe_tags(rank, world):
    """Calls past 2^31 on the default group and on a whole-world subgroup (seq set as after ~2^31 calls)."""
    import torch.distributed as dist

    from distattn import comm

    _good(world, 0)
    comm.communicator(None, CALL_TIMEOUT_S).seq = 2 ** 31 - 3
    errs = [_good(world, s) for s in range(4)]
    sub = dist.new_group(list(range(world)))
    comm.communicator(sub, CALL_TIMEOUT_S).seq = 2 ** 31 - 2
    import distattn

    q, k, v = _data(world, 8, 9)
    shard = distattn.shard_sequence
    for _ in range(3):
        try:
            out = distattn.dist_flash_attn_func(shard(q), shard(k), shard(v), causal=True, group=sub,
                                                timeout=CALL_TIMEOUT_S)
            errs.append((out - shard(distattn.flash_attn_func(q, k, v, causal=True))).abs().max().item())
        except Exception:  # noqa: BLE001
            errs.append(float("inf"))
    return {"calls past 2^31 exact": sum(e < EXACT for e in errs), "of": len(errs)}


def probe_stall(rank, world):
    """The last rank sleeps 12 s; the others keep calling; then all meet (barrier) and make two calls. Where the
    library has ``set_step``, the calls declare their step (0; 1 during the stall; 2 and 3 after the barrier)."""
    import torch.distributed as dist

    import distattn

    step = getattr(distattn, "set_step", lambda index: None)
    step(0)
    _good(world, 0)
    step(1)
    errors = []
    if rank == world - 1:
        time.sleep(12.0)
        errors.append(_timed(lambda: _good_or_raise(world, 1)))
    else:
        start = time.monotonic()
        while time.monotonic() - start < 14.0:
            errors.append(_timed(lambda: _good_or_raise(world, 1)))
    dist.barrier()
    after = []
    for seed in (2, 3):
        step(seed)
        after.append(_good(world, seed))
    return {"calls during the stall": len(errors), "ok": sum(e == "ok" for e, _ in errors),
            "slowest error (s)": max((t for e, t in errors if e != "ok"), default=0.0),
            "next calls' max error": max(after)}


def _good_or_raise(world, seed):
    import distattn

    q, k, v = _data(world, 8, seed)
    shard = distattn.shard_sequence
    distattn.dist_flash_attn_func(shard(q), shard(k), shard(v), causal=True, timeout=CALL_TIMEOUT_S)


def probe_kill(rank, world):
    """The last rank dies (SIGKILL) after a good call; the survivors make three calls."""
    import torch.distributed as dist

    _good(world, 0)
    dist.barrier()
    if rank == world - 1:
        os.kill(os.getpid(), 9)
    time.sleep(0.5)
    calls = [_timed(lambda: _good_or_raise(world, 1)) for _ in range(3)]
    return {"errors": [e for e, _ in calls], "seconds": [round(t, 2) for _, t in calls]}


def _loop_through_stall(rank, world, phase):
    """The README's loop (skip a batch that raises DistAttnError; ``set_step`` where the library has it), no barrier,
    over 12 batches; the last rank sleeps 9 s inside the ``phase`` of batch 1 (in a wait of the exchange)."""
    import torch

    import distattn
    from distattn import comm

    wait, armed = comm.PeerExchange.wait, [rank == world - 1]

    def stalling_wait(exchange, slot):
        if armed[0] and exchange.where.startswith(phase) and getattr(exchange, "_batch", None) == 1:
            armed[0] = False
            time.sleep(9.0)
        return wait(exchange, slot)

    comm.PeerExchange.wait = stalling_wait
    post = comm.PeerExchange.__init__
    current = [0]

    def tagged_init(self, *args, **kw):
        post(self, *args, **kw)
        self._batch = current[0]

    comm.PeerExchange.__init__ = tagged_init
    shard = distattn.shard_sequence
    ok, wrong, errors = [], [], 0
    for b in range(12):
        current[0] = b
        if hasattr(distattn, "set_step"):
            distattn.set_step(b)
        q, k, v = _data(world, 8, 100 + b)
        qs, ks, vs = (shard(t).clone().requires_grad_() for t in (q, k, v))
        try:
            out = distattn.dist_flash_attn_func(qs, ks, vs, causal=True, timeout=CALL_TIMEOUT_S)
            out.sum().backward()
        except distattn.DistAttnError:
            errors += 1
            continue
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = distattn.flash_attn_func(*full, causal=True)
        ref.sum().backward()
        err = max((a - shard(r)).abs().max().item() for a, r in zip((out.detach(), qs.grad, ks.grad, vs.grad),
                                                                   (ref.detach(), *(t.grad for t in full))))
        (ok if err < EXACT else wrong).append(b)
    return {"batches exact": ok, "silently wrong": wrong, "errors": errors}


def probe_stall_forward_loop(rank, world):
    """A stall inside a forward under the README's skip loop: are the results after it exact?"""
    return _loop_through_stall(rank, world, "forward")


def probe_stall_backward_loop(rank, world):
    """The same inside a backward."""
    return _loop_through_stall(rank, world, "backward")


PROBES = {"one rank's bad cu_seqlens": probe_validation, "NaN in a query row": probe_nan,
          "NaN/inf in q, k or v: gradients": probe_nan_gradients,
          "calls past 2^31": probe_tags, "a rank stalls 12 s": probe_stall, "a rank dies": probe_kill,
          "stall inside a forward, skip loop": probe_stall_forward_loop,
          "stall inside a backward, skip loop": probe_stall_backward_loop}


# -- harness ---------------------------------------------------------------------------------------------------
def _worker(rank, world, init, name, queue):
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
        dist.barrier()
        result = PROBES[name](rank, world)
    except BaseException:  # noqa: BLE001
        result = {"crashed": traceback.format_exc().splitlines()[-1][:120]}
    queue.put((rank, result))
    queue.close()
    queue.join_thread()  # the result is in the pipe before the hard exit below
    os._exit(0)  # no teardown: a peer may be dead or stalled


def run_probe(name, world=2):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, world, os.path.join(tmp, "rdzv"), name, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        found, deadline = {}, time.monotonic() + PROBE_BOUND_S
        while len(found) < world and time.monotonic() < deadline:
            try:
                rank, result = queue.get(timeout=1.0)
                found[rank] = result
            except Exception:  # noqa: BLE001 - empty queue: check who is still alive
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    return {f"rank {r}": found.get(r, {"result": f"no answer within {PROBE_BOUND_S:g} s (hang or died)"})
            for r in range(world)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for faults.md and faults.json")
    parser.add_argument("--label", default="", help="a name for this checkout in the table (e.g. before/after)")
    parser.add_argument("--only", nargs="*", choices=list(PROBES), help="run these probes only")
    args = parser.parse_args(argv)
    os.environ.setdefault("DISTATTN_REBUILD_TIMEOUT", str(CALL_TIMEOUT_S))
    results = {}
    for name in args.only or PROBES:
        start = time.monotonic()
        results[name] = run_probe(name)
        print(f"{name}: {json.dumps(results[name])} ({time.monotonic() - start:.1f} s)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "faults.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [f"# Fault probes {args.label}", "", f"`python bench/faults.py --out {args.out}`: CPU, gloo, 2 ranks, "
             f"timeout={CALL_TIMEOUT_S:g} s per call, DISTATTN_REBUILD_TIMEOUT={CALL_TIMEOUT_S:g}.", "",
             "| probe | rank 0 | rank 1 |", "|---|---|---|"]
    for name, per_rank in results.items():
        cells = [json.dumps(per_rank[f"rank {r}"]).replace("|", "/") for r in range(2)]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    (args.out / "faults.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
