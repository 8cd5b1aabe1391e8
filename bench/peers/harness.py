"""Run one system on one workload in its own process group under a deadline, and always return its row.

``run_one(system, workload, timeout, device=...)`` starts ``P`` fresh processes (a forkserver that imported torch
once), a gloo group over a file rendezvous, and in each rank: the adapter's ``prepare`` (a :class:`Refused` there is
the row's refused cell, with its text; so is the adapter's ``refuses``, asked before any process starts), its shard,
one warm-up call, one measured call (forward + backward under the one byte counter and the one memory measure of
:mod:`bench.peers.measure`), then ``reps`` timed calls without the measures.
The parent puts every rank's results back at their global positions and holds them to the fp64 one-process
reference (:mod:`bench.peers.workload`). A rank that raises gives an error row with its last line; ranks that do not
finish by the deadline are killed and give an error row that says so. Nothing here can hang the caller or drop a
row. A system that is not installed gives a "not installed" row without starting any process.

``device="cuda"`` (issue 37's GPU part): the ranks share the machine's GPUs (rank ``r`` on GPU ``r % count``: on one
GPU all P of them), joined by gloo with CUDA tensors, each system as it runs on CUDA (no CPU patches; a peer whose
collectives gloo cannot carry with CUDA tensors gets that error in its row). The inputs are made on the CPU from the
seed and moved to the GPU before the system shards them; the peak is then the caching allocator's
(``torch.cuda.max_memory_allocated`` above the level at entry) and every timed call is synchronized. On a machine
without CUDA the row says so, without starting any process.

Imports: torch, ``bench.peers.{adapters, measure, workload}``.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import queue
import statistics
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

from bench.peers.adapters import Refused, adapter
from bench.peers.measure import count_bytes, mark_forward_done, measure_memory
from bench.peers.workload import Workload, errors, make_inputs, reference

__all__ = ["Row", "run_one", "FIELDS"]


@dataclasses.dataclass
class Row:
    """One system x workload: what was measured, or why nothing was."""

    system: str
    workload: str
    world: int
    status: str = "ok"  # ok | refused | error | not installed | n/a
    version: str = ""
    patches: str = ""
    exact: bool | None = None
    err_out: float | None = None
    err_dq: float | None = None
    err_dk: float | None = None
    err_dv: float | None = None
    sent_max: int | None = None  # bytes per rank, forward + backward, the largest rank
    recv_max: int | None = None
    p2p_sent_max: int | None = None  # of which point-to-point
    calls: str = ""
    saved_max: int | None = None  # saved-activation bytes per rank (inputs excluded), the largest rank
    peak_max: int | None = None  # peak live bytes allocated in the call (forward + backward), the largest rank
    work_max: int | None = None  # visible (q, k) pairs x heads computed, the busiest rank
    balance: float | None = None  # work makespan / perfect balance (max / mean)
    wall_ms: float | None = None  # median forward + backward per call (gloo; CPU, or ranks sharing the GPU)
    device: str = "cpu"  # where the tensors and the computation were: cpu, or cuda (ranks sharing the GPUs)
    crosscheck: str = ""  # distattn: the counter's point-to-point bytes vs its own counters and simulator
    note: str = ""


FIELDS = [f.name for f in dataclasses.fields(Row)]


def _device(rank: int, device: str) -> torch.device:
    """This rank's device: the CPU, or GPU ``rank % count`` (every rank on one GPU when there is one)."""
    if device == "cpu":
        return torch.device("cpu")
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _rank(rank, world, system, w, reps, device="cpu"):
    import torch.distributed as dist
    dev = _device(rank, device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    a = adapter(system) if isinstance(system, str) else system()
    a.device = dev
    try:
        a.prepare(w)
    except Refused as exc:
        return {"refused": str(exc)}
    full = {name: t.to(dev) for name, t in make_inputs(w).items()}
    loc = a.shard(w, full)
    to_bshd = getattr(a, "to_bshd", lambda name, t: t)
    leaves = {n: loc[n].detach().clone().requires_grad_() for n in "qkv"}
    dout = loc["dout"]

    def call(measure=None):
        for t in leaves.values():
            t.grad = None
        out = a.forward(leaves["q"], leaves["k"], leaves["v"], w)
        if measure is not None:
            mark_forward_done(measure)
        if not a.forward_only:
            out.backward(dout)
        return out

    call()  # warm-up: lazy initialization, plan caches, the first allocation of buffers
    sync()
    dist.barrier()
    own = _distattn_counters()
    with count_bytes() as c, measure_memory(ignore=list(leaves.values()) + [dout], device=dev) as m:
        out = call(m)
    own = _distattn_counters(own)
    times = []
    for _ in range(reps):
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - t0)
    res = {"out": to_bshd("out", out.detach()).cpu()}
    if not a.forward_only:
        res.update({"d" + n: to_bshd("d" + n, leaves[n].grad).cpu() for n in "qkv"})
    if hasattr(a, "finish"):
        a.finish()
    return {"rows": a.rows, "res": res, "sent": c.sent, "recv": c.recv, "p2p": c.p2p(), "data": c.data(),
            "calls": dict(c.calls), "saved": m.saved, "peak": m.peak, "work": a.work(w),
            "wall": statistics.median(times) if times else None, "own": own}


def _distattn_counters(before=None):
    """distattn's own byte counters (``distattn.comm.COUNTERS``): a snapshot, or the change since ``before``."""
    from distattn.comm import COUNTERS
    now = (COUNTERS.bytes_sent, COUNTERS.bytes_recv)
    return now if before is None else (now[0] - before[0], now[1] - before[1])


def _worker(rank, world, init_file, system, w, reps, results, environ, device="cpu"):
    try:
        os.environ.clear()
        os.environ.update(environ)
        import torch.distributed as dist
        torch.set_num_threads(1)  # P ranks share the machine's cores
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        dist.barrier()
        try:
            value = _rank(rank, world, system, w, reps, device)
        finally:
            dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report anything
        results.put((rank, "error", traceback.format_exc()))


def _collect(procs, results, world, timeout):
    deadline, out, errs = time.monotonic() + timeout, {}, {}
    while len(out) + len(errs) < world:
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(set(range(world)) - set(out) - set(errs))
            return out, errs, f"timed out after {timeout:g} s (ranks {missing} did not finish)"
        try:
            rank, status, payload = results.get(timeout=min(left, 1.0))
        except queue.Empty:
            for r, p in enumerate(procs):
                if not p.is_alive() and p.exitcode not in (0, None) and r not in out and r not in errs:
                    errs[r] = f"rank {r} died with exit code {p.exitcode}"
            continue
        if status == "ok":
            out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errs[rank] = payload
    return out, errs, None


def _spawn(system, w: Workload, reps: int, timeout: float, device: str = "cpu"):
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(r, w.world, init_file, system, w, reps, results, dict(os.environ), device))
                 for r in range(w.world)]
        try:
            for p in procs:
                p.start()
            return _collect(procs, results, w.world, timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)


def _last_line(tb: str) -> str:
    lines = [ln for ln in tb.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else tb


def run_one(system, w: Workload, *, timeout: float = 300.0, reps: int = 3, device: str = "cpu") -> Row:
    """Measure ``system`` (a key of ``ADAPTERS``, or an adapter class) on ``w``, on ``device`` (``"cpu"`` or
    ``"cuda"``); always a row, never a hang."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: use 'cpu' or 'cuda'")
    a = adapter(system) if isinstance(system, str) else system()
    row = Row(system=a.name, workload=w.name, world=w.world, device=device,
              patches=" ".join(a.patches if device == "cpu" else getattr(a, "cuda_patches", ())))
    version = a.version()
    if version is None:
        return dataclasses.replace(row, status="not installed", note=f"pip install {a.package}")
    row.version = version
    if not a.applies(w):
        return dataclasses.replace(row, status="n/a", note="this system's variant is for another kind of mask")
    why = a.refuses(w, device) if hasattr(a, "refuses") else None  # an adapter-like class without it refuses nothing
    if why:
        return dataclasses.replace(row, status="refused", note=why)
    if device == "cuda" and not torch.cuda.is_available():
        return dataclasses.replace(row, status="error", note="device cuda: no CUDA device on this machine")
    try:
        out, errs, timed_out = _spawn(system, w, reps, timeout, device)
    except Exception as exc:  # noqa: BLE001 - the row says it
        return dataclasses.replace(row, status="error", note=f"could not start: {exc}")
    if timed_out or errs:
        first = _last_line(errs[min(errs)]) if errs else ""
        note = "; ".join(x for x in (timed_out, first) if x)
        return dataclasses.replace(row, status="error", note=note[:300])
    ranks = [out[r] for r in range(w.world)]
    if any("refused" in r for r in ranks):
        return dataclasses.replace(row, status="refused", note=next(r["refused"] for r in ranks if "refused" in r))
    return _fill(row, w, a, ranks)


@functools.lru_cache(maxsize=2)
def _reference_of(w: Workload):
    """The fp64 reference and plain PyTorch's error of ``w`` (a workload's every row holds to the same one: made
    once, not once per system)."""
    return reference(w, make_inputs(w))


def _fill(row: Row, w: Workload, a, ranks) -> Row:
    ref, base = _reference_of(w)
    got = {}
    for name in ranks[0]["res"]:
        t = torch.empty_like(ref[name])
        for r in ranks:
            t[:, r["rows"]] = r["res"][name].double()
        got[name] = t
    errs, ok = errors(w, got, ref, base)
    work = [r["work"] for r in ranks]
    calls: dict[str, int] = {}
    for r in ranks:
        for k, v in r["calls"].items():
            calls[k] = max(calls.get(k, 0), v)
    row.exact = ok
    row.err_out, row.err_dq, row.err_dk, row.err_dv = (errs[n] for n in ("out", "dq", "dk", "dv"))
    row.sent_max = max(r["sent"] for r in ranks)
    row.recv_max = max(r["recv"] for r in ranks)
    row.p2p_sent_max = max(r["p2p"][0] for r in ranks)
    row.calls = " ".join(f"{k}x{v}" for k, v in sorted(calls.items()))
    row.saved_max = max(r["saved"] for r in ranks)
    row.peak_max = max(r["peak"] for r in ranks)
    row.work_max = max(work)
    row.balance = round(max(work) / (sum(work) / len(work)), 4) if sum(work) else None
    row.wall_ms = round(1000 * statistics.median(r["wall"] for r in ranks), 2) if ranks[0]["wall"] else None
    if a.forward_only:
        row.note = "forward only (no backward on CPU)"
    if a.package == "distattn":
        row.crosscheck = _crosscheck(w, a, ranks)
    return row


def _crosscheck(w: Workload, a, ranks) -> str:
    """The one counter's point-to-point bytes (2-D: and all-to-alls) against distattn's own counters, and against its
    simulator."""
    u, _, schedule = a.degrees(w)
    two_d = u > 1  # distattn's 2-D: its own counters and the simulator include the all-to-alls
    mine = [tuple(r["data"] if two_d else r["p2p"]) for r in ranks]
    own_ok = all(tuple(m) == tuple(r["own"]) for m, r in zip(mine, ranks))
    text = f"own counters {'equal' if own_ok else 'DIFFER'}"
    try:
        from distattn.schedule import MaskSpec, Shapes, simulate
        mask = MaskSpec(causal=True, window=(w.window, 0) if w.mask == "window" else (-1, -1),
                        cu_seqlens=tuple(w.cu_seqlens()) if w.mask == "docs" else None)
        shapes = Shapes(batch=w.batch, seq_per_rank=w.tokens_per_rank, heads_q=w.heads_q, heads_kv=w.heads_kv,
                        head_dim=w.head_dim, dtype_bytes=w.torch_dtype.itemsize)
        sim = simulate(w.world, True, schedule, shapes, mask=None if mask.dense else mask, ulysses=u)
        sim_ok = list(sim.bytes_sent) == [m[0] for m in mine]
        text += f", simulator {'equal' if sim_ok else 'differs: ' + str(list(sim.bytes_sent))}"
    except Exception as exc:  # noqa: BLE001 - a cross-check that cannot run says why
        text += f", simulator n/a ({type(exc).__name__}: {exc})"[:160]
    return text
