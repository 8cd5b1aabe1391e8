"""One byte counter and one memory measure, the same for every system the peers harness runs.

**Bytes.** ``count_bytes()`` wraps, for the length of the region, every point-to-point and collective function of
``torch.distributed`` (``send``/``recv``, ``isend``/``irecv``: what ``batch_isend_irecv``'s ``P2POp`` calls;
``all_reduce``, ``all_to_all_single``, ``all_to_all``, ``all_gather_into_tensor``/``all_gather``,
``reduce_scatter_tensor``/``reduce_scatter``, ``broadcast``, ``gather``/``scatter``/``reduce``, ``barrier``) and of
its functional collectives (``torch.distributed._functional_collectives``: ``all_to_all_single``,
``all_gather_tensor``, ``reduce_scatter_tensor``, ``all_reduce``, ``broadcast`` and their autograd variants; what
PyTorch's context parallel and DTensor call), on the module objects where callers look them up. One wrapper for
distattn, DeepSpeed, megatron-core, PyTorch CP and yunchang alike::

    with count_bytes() as c:
        out = system(q, k, v)
    c.sent, c.recv            # bytes this rank sent / received
    c.calls                   # {"all_to_all_single": 2, ...}
    c.by_op                   # {"all_to_all_single": [sent, recv], ...}

Only the outermost call counts (``all_gather_into_tensor`` delegating to ``all_gather_single`` is one call). Why not
a dispatch mode on the ``c10d`` operators: a dispatch mode is switched off while an operator it saw runs, so it misses
every collective issued inside a registered op (distattn's ``torch.ops.distattn.attention``) or inside a tensor
subclass's dispatch (DTensor: PyTorch CP's ring). A caller that bound a function at import time
(``from torch.distributed import send``) is not seen: none of the peers measured here does.

What a collective moves per rank is the bandwidth-optimal (ring) algorithm's figure, the convention of nccl-tests'
"bus bandwidth", on a group of ``P`` ranks: ``all_reduce`` of ``n`` bytes sends and receives ``2 (P-1) n / P``;
``all_gather`` (``n`` in) and ``reduce_scatter`` (``n`` out) ``(P-1) n``; ``all_to_all`` everything but the block
that stays on this rank (uneven splits included); ``broadcast``/``scatter``: the root sends ``n`` per peer and a peer
receives ``n``; ``reduce``/``gather`` the mirror; point-to-point the tensor's bytes. A ``barrier`` moves nothing but
is a call.

**Memory.** ``measure_memory()``: ``saved`` is distattn's ``saved_activations`` (bytes of the distinct allocations
autograd keeps between forward and backward, the inputs excluded); ``peak`` the rise of the CPU allocator's live bytes
above the level at entry, from the profiler's allocation events (``profile_memory``): every allocation of the process's
thread, inside registered ops and tensor subclasses included, which ``distattn.memory.measure.live_bytes`` (a
dispatch mode, like the counter above) cannot see. With ``device`` a CUDA device, ``peak`` is that device's caching
allocator's peak above its level at entry (``torch.cuda.max_memory_allocated``): the same for every system too.

Imports: torch and ``distattn.memory.measure`` only (the harness and ``train_step.py`` import this module).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
from torch.utils._pytree import tree_leaves

from distattn.memory.measure import live_bytes, saved_activations

__all__ = ["ByteCounter", "count_bytes", "MemoryMeasure", "measure_memory", "mark_forward_done", "DIST_FUNCTIONS",
           "FUNCOL_FUNCTIONS", "live_bytes", "saved_activations"]

DIST_FUNCTIONS = ("send", "recv", "isend", "irecv", "all_reduce", "all_to_all_single", "all_to_all",
                  "all_gather_into_tensor", "all_gather_single", "all_gather", "_all_gather_base",
                  "reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter", "_reduce_scatter_base",
                  "broadcast", "gather", "scatter", "reduce", "barrier")
FUNCOL_FUNCTIONS = ("all_to_all_single", "all_to_all_single_autograd", "all_gather_tensor",
                    "all_gather_tensor_autograd", "all_gather_single", "reduce_scatter_tensor",
                    "reduce_scatter_tensor_autograd", "all_reduce", "broadcast")


def _nbytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(x) if isinstance(t, torch.Tensor))


def _group_of(group, functional: bool):
    """``(size, rank)`` of a call's group: a ProcessGroup/None, or any group form functional collectives take."""
    if functional and group is not None and not isinstance(group, dist.ProcessGroup):
        group = c10d._resolve_process_group(funcol._resolve_group_name(group))
    return dist.get_world_size(group), dist.get_rank(group)


def _a2a(t, splits, p, rank, along_rows=True) -> tuple[int, int]:
    """``(total, own)`` bytes of an all-to-all buffer: the whole, and the block that stays on this rank."""
    total = _nbytes(t)
    if not t.numel():
        return 0, 0
    return total, (splits[rank] * (total // t.shape[0]) if splits else total // p)


def _bytes_of(name: str, a: dict, functional: bool) -> tuple[int, int]:
    """``(sent, received)`` by this rank for one call with bound arguments ``a`` (the module docstring's rule)."""
    if name == "barrier":
        return 0, 0
    if name in ("send", "isend"):
        return _nbytes(a["tensor"]), 0
    if name in ("recv", "irecv"):
        return 0, _nbytes(a["tensor"])
    p, rank = _group_of(a.get("group"), functional)
    if functional:
        x = a["self"]
        if name == "all_reduce":
            n = 2 * (p - 1) * _nbytes(x) // p
            return n, n
        if name.startswith("all_gather"):
            return (p - 1) * _nbytes(x), (p - 1) * _nbytes(x)
        if name.startswith("reduce_scatter"):
            return (p - 1) * _nbytes(x) // p, (p - 1) * _nbytes(x) // p
        if name.startswith("all_to_all_single"):
            in_total, in_own = _a2a(x, a["input_split_sizes"], p, rank)
            row = in_total // x.shape[0] if x.numel() else 0
            outs = a["output_split_sizes"]
            out_rows = sum(outs) if outs else x.shape[0]
            return in_total - in_own, (out_rows - (outs[rank] if outs else out_rows // p)) * row
        if name == "broadcast":
            return ((p - 1) * _nbytes(x), 0) if rank == a["src"] else (0, _nbytes(x))
    if name == "all_reduce":
        n = 2 * (p - 1) * _nbytes(a["tensor"]) // p
        return n, n
    if name in ("all_gather_into_tensor", "all_gather_single", "_all_gather_base"):
        return (p - 1) * _nbytes(a["input_tensor"]), (p - 1) * _nbytes(a["input_tensor"])
    if name == "all_gather":
        return (p - 1) * _nbytes(a["tensor"]), (p - 1) * _nbytes(a["tensor"])
    if name in ("reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter"):
        return (p - 1) * _nbytes(a["output"]), (p - 1) * _nbytes(a["output"])
    if name == "all_to_all_single":
        out_total, out_own = _a2a(a["output"], a["output_split_sizes"], p, rank)
        in_total, in_own = _a2a(a["input"], a["input_split_sizes"], p, rank)
        return in_total - in_own, out_total - out_own
    if name == "all_to_all":
        ins, outs = a["input_tensor_list"], a["output_tensor_list"]
        return _nbytes(ins) - _nbytes(ins[rank]), _nbytes(outs) - _nbytes(outs[rank])
    return _rooted(name, a, p, rank)


def _rooted(name, a, p, rank) -> tuple[int, int]:
    """broadcast/scatter (root sends to each peer), reduce/gather (root receives from each peer)."""
    group = a.get("group")
    root_key = {"broadcast": "src", "scatter": "src", "reduce": "dst", "gather": "dst"}[name]
    root = a.get("group_" + root_key)
    if root is None:
        root = a.get(root_key)
        root = dist.get_group_rank(group, root) if group is not None and root is not None else root
    n = _nbytes(a["tensor"])
    if name in ("broadcast", "scatter"):
        return ((p - 1) * n, 0) if rank == root else (0, n)
    return (0, (p - 1) * n) if rank == root else (n, 0)


class ByteCounter:
    """Bytes sent and received by this rank through ``torch.distributed`` inside the region (module docstring)."""

    def __init__(self):
        self.sent = 0
        self.recv = 0
        self.calls: dict[str, int] = defaultdict(int)
        self.by_op: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self._depth = threading.local()
        self._restore: list[tuple[object, str, object]] = []

    def _wrap(self, fn, name: str, functional: bool):
        sig = inspect.signature(fn)
        key = ("funcol." if functional else "") + name

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                bound = sig.bind(*args, **kwargs)
                bound.apply_defaults()
                sent, recv = _bytes_of(name, bound.arguments, functional)
                self.calls[key] += 1
                self.sent += sent
                self.recv += recv
                self.by_op[key][0] += sent
                self.by_op[key][1] += recv
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth

        return counted

    def __enter__(self) -> ByteCounter:
        for module, names, functional in ((c10d, DIST_FUNCTIONS, False), (funcol, FUNCOL_FUNCTIONS, True)):
            for name in names:
                fn = getattr(module, name, None)
                if fn is None:
                    continue
                wrapped = self._wrap(fn, name, functional)
                targets = [module] + ([dist] if not functional and getattr(dist, name, None) is fn else [])
                for target in targets:
                    self._restore.append((target, name, fn))
                    setattr(target, name, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for target, name, fn in reversed(self._restore):
            setattr(target, name, fn)
        self._restore.clear()

    def p2p(self) -> tuple[int, int]:
        """Bytes of point-to-point transfers only (``send``/``isend``, ``recv``/``irecv``; batched or not)."""
        return (self.by_op["send"][0] + self.by_op["isend"][0], self.by_op["recv"][1] + self.by_op["irecv"][1])

    def data(self) -> tuple[int, int]:
        """Bytes of point-to-point transfers and all-to-alls: the data movement, without the small all-reduces and
        barriers of checks (distattn's own counters count exactly these)."""
        a2a = [v for k, v in self.by_op.items() if k.split(".")[-1] in ("all_to_all", "all_to_all_single")]
        return (self.p2p()[0] + sum(v[0] for v in a2a), self.p2p()[1] + sum(v[1] for v in a2a))


def count_bytes() -> ByteCounter:
    """Context manager: count this rank's ``torch.distributed`` bytes in the region (see ``ByteCounter``)."""
    return ByteCounter()


@dataclasses.dataclass
class MemoryMeasure:
    """What ``measure_memory`` found: ``saved`` (bytes kept for backward), ``peak`` (rise of live bytes)."""

    saved: int = 0
    peak: int = 0
    _saved_ctx: object = None
    _forward_open: bool = False


def allocator_peak(prof) -> int:
    """The largest rise of live CPU bytes above the level at the start, from a profiler's allocation events."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    now = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        now += e.nbytes()
        peak = max(peak, now)
    return peak


@contextlib.contextmanager
def measure_memory(ignore=(), device=None):
    """Measure what the enclosed forward saves for backward (``ignore``'s storages excluded) and the peak rise of
    live bytes over the region (forward and backward).

    ``saved`` is read when ``mark_forward_done(m)`` is called (after the forward, before the backward, while its graph
    holds what it saved); without that call, at the exit. ``device``: a CUDA device measures the peak with its caching
    allocator's statistics instead (``max_memory_allocated`` above ``memory_allocated`` at entry, synchronized at
    both ends): every allocation on that device, by any thread of the process.
    """
    m = MemoryMeasure()
    saved = saved_activations(ignore=list(ignore))
    m._saved_ctx = saved
    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        region = contextlib.nullcontext()
    else:
        from torch.profiler import ProfilerActivity, profile
        region = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with region as prof:
        with saved:
            m._forward_open = True
            yield m
            if m._forward_open:
                mark_forward_done(m)
    if cuda:
        torch.cuda.synchronize(device)
        m.peak = torch.cuda.max_memory_allocated(device) - base
    else:
        m.peak = allocator_peak(prof)


def mark_forward_done(m: MemoryMeasure) -> None:
    """The forward has ended: record what it saved for backward now (its graph is alive)."""
    if m._forward_open:
        m.saved = m._saved_ctx.bytes
        m._forward_open = False
