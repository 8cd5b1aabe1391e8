"""One byte counter and one memory measure, the same for every system the peers harness runs.

**Bytes.** ``count_bytes()`` is a dispatch mode that sees every operator of the ``c10d`` family: every
``torch.distributed`` call (``send``, ``isend``/``irecv``, ``batch_isend_irecv``, ``all_reduce``, ``all_to_all_single``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``broadcast``, ...) and every functional collective
(``torch.distributed._functional_collectives``, what PyTorch's context parallel and DTensor use) reaches the process
group through one of these registered operators, whatever module called it and however it was imported. So one
wrapper counts distattn, DeepSpeed, megatron-core, PyTorch CP and yunchang alike::

    with count_bytes() as c:
        out = system(q, k, v)
    c.sent, c.recv            # bytes this rank sent / received
    c.calls                   # {"alltoall_base_": 2, ...}
    c.by_op                   # {"alltoall_base_": (sent, recv), ...}

What a collective moves per rank is the bandwidth-optimal (ring) algorithm's figure, the convention of nccl-tests'
"bus bandwidth", on a group of ``P`` ranks: ``all_reduce`` of ``n`` bytes sends and receives ``2 (P-1) n / P``;
``all_gather`` (``n`` in) and ``reduce_scatter`` (``n`` out) ``(P-1) n``; ``all_to_all`` everything but the block
that stays on this rank (uneven splits included); ``broadcast``/``scatter`` the root sends ``n`` per peer and a peer
receives ``n``, ``reduce``/``gather`` the mirror; point-to-point the tensor's bytes. A ``barrier`` moves nothing but
is a call. An operator of the family this table does not know is counted in ``unknown`` (a peer that starts using
one shows up instead of vanishing).

**Memory.** ``measure_memory()``: distattn's own measures (``distattn.memory.measure``), the same for every system:
``saved`` (bytes of the distinct allocations autograd keeps between forward and backward, the inputs excluded) and
``peak`` (the peak of live bytes allocated inside the region, seen at the dispatch level: any device, CPU included).

Imports: torch and ``distattn.memory.measure`` only (the harness and ``train_step.py`` import this module).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from distattn.memory.measure import live_bytes, saved_activations

__all__ = ["ByteCounter", "count_bytes", "MemoryMeasure", "measure_memory", "mark_forward_done", "COMM_NAMESPACES",
           "live_bytes", "saved_activations"]

# The operator namespaces of torch.distributed: c10d (the process group's ops, what dist.* calls),
# _c10d_functional (functional collectives) and its autograd variant.
COMM_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
_NO_BYTES = {"barrier", "monitored_barrier_", "wait_tensor", "_wrap_tensor_autograd"}


def _nbytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(x) if isinstance(t, torch.Tensor))


def _group(args, kwargs):
    """``(size, rank)`` of the process group an operator runs on (a ProcessGroup object or a group name)."""
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, torch.ScriptObject):
            a = dist.ProcessGroup.unbox(a)  # the operator's boxed form of the group
        if isinstance(a, dist.ProcessGroup):
            return a.size(), a.rank()
    name = [a for a in args if isinstance(a, str)]
    if name:
        from torch.distributed.distributed_c10d import _resolve_process_group
        pg = _resolve_process_group(name[-1])
        return pg.size(), pg.rank()
    return dist.get_world_size(), dist.get_rank()


def _split_bytes(t: torch.Tensor, splits, p: int, rank: int) -> tuple[int, int]:
    """``(total, own)`` bytes of an all-to-all buffer: the whole, and the block that stays on this rank."""
    total = _nbytes(t)
    if t.numel() == 0:
        return 0, 0
    row = total // t.shape[0]
    splits = list(splits or [])
    own = splits[rank] * row if splits else total // p
    return total, own


def _bytes_of(name: str, args, kwargs) -> tuple[int, int]:
    """``(sent, received)`` by this rank for one operator (see the module docstring's convention)."""
    if name in _NO_BYTES:
        return 0, 0
    if name == "send":
        return _nbytes(args[0]), 0
    if name in ("recv_", "recv_any_source_"):
        return 0, _nbytes(args[0])
    p, rank = _group(args, kwargs)
    if name in ("allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_", "all_reduce_coalesced",
                "all_reduce_coalesced_"):
        n = 2 * (p - 1) * _nbytes(args[0]) // p
        return n, n
    if name in ("allgather_", "_allgather_base_", "allgather_coalesced_", "allgather_into_tensor_coalesced_"):
        n = (p - 1) * _nbytes(args[1])  # args: (outputs, inputs, ...)
        return n, n
    if name in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced", "all_gather_into_tensor_out"):
        n = (p - 1) * _nbytes(args[0])  # functional: (input, group_size, group_name)
        return n, n
    if name in ("reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):
        n = (p - 1) * _nbytes(args[0])  # args: (outputs, inputs, ...)
        return n, n
    if name in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"):
        n = (p - 1) * _nbytes(args[0]) // p  # functional: (input, op, group_size, group_name)
        return n, n
    if name == "alltoall_base_":  # (output, input, pg, output_split_sizes, input_split_sizes, ...)
        out_total, out_own = _split_bytes(args[0], args[3], p, rank)
        in_total, in_own = _split_bytes(args[1], args[4], p, rank)
        return in_total - in_own, out_total - out_own
    if name == "all_to_all_single":  # functional: (input, output_split_sizes, input_split_sizes, group_name)
        in_total, in_own = _split_bytes(args[0], args[2], p, rank)
        out_rows = sum(args[1]) if args[1] else args[0].shape[0]
        row = in_total // args[0].shape[0] if args[0].numel() else 0
        out_own = (args[1][rank] if args[1] else out_rows // p) * row
        return in_total - in_own, out_rows * row - out_own
    if name == "alltoall_":  # (outputs, inputs, pg, ...)
        return (_nbytes(args[1]) - _nbytes(args[1][rank]), _nbytes(args[0]) - _nbytes(args[0][rank]))
    if name in ("broadcast_", "broadcast"):
        root = args[2] if name == "broadcast_" else args[1]
        n = _nbytes(args[0])
        return ((p - 1) * n, 0) if rank == root else (0, n)
    if name in ("scatter_", "gather_", "reduce_"):
        return _rooted(name, args, p, rank)
    raise KeyError(name)


def _rooted(name, args, p, rank) -> tuple[int, int]:
    if name == "reduce_":  # (tensors, pg, op, root, root_tensor, ...)
        n = _nbytes(args[0])
        return (0, (p - 1) * n) if rank == args[3] else (n, 0)
    root = args[3]  # scatter_/gather_: (outputs, inputs, pg, root, ...)
    if name == "scatter_":
        n = _nbytes(args[0])
        return ((p - 1) * n, 0) if rank == root else (0, n)
    n = _nbytes(args[1])
    return (0, (p - 1) * n) if rank == root else (n, 0)


class ByteCounter(TorchDispatchMode):
    """Bytes sent and received by this rank through ``torch.distributed`` inside the region (module docstring)."""

    def __init__(self):
        super().__init__()
        self.sent = 0
        self.recv = 0
        self.calls: dict[str, int] = defaultdict(int)
        self.by_op: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self.unknown: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in COMM_NAMESPACES:
            name = func.__name__.split(".")[0]
            try:
                sent, recv = _bytes_of(name, args, kwargs)
            except KeyError:
                self.unknown.append(f"{func.namespace}.{name}")
                sent = recv = 0
            if name not in ("wait_tensor", "_wrap_tensor_autograd"):
                self.calls[name] += 1
            self.sent += sent
            self.recv += recv
            self.by_op[name][0] += sent
            self.by_op[name][1] += recv
        return func(*args, **(kwargs or {}))

    def snapshot(self) -> tuple[int, int]:
        return self.sent, self.recv

    def p2p(self) -> tuple[int, int]:
        """Bytes of point-to-point transfers only (``send``/``recv``, batched or not)."""
        return self.by_op["send"][0], self.by_op["recv_"][1] + self.by_op["recv_any_source_"][1]


def count_bytes() -> ByteCounter:
    """Context manager: count this rank's ``torch.distributed`` bytes in the region (see ``ByteCounter``)."""
    return ByteCounter()


@dataclasses.dataclass
class MemoryMeasure:
    """What ``measure_memory`` found: ``saved`` (bytes kept for backward), ``peak`` (peak live bytes)."""

    saved: int = 0
    peak: int = 0


@contextlib.contextmanager
def measure_memory(ignore=()):
    """Measure the enclosed forward (saved bytes, ``ignore``'s storages excluded) and the peak of live bytes.

    Put the forward and the backward inside; ``saved`` is read at the moment the region's forward ends, which is
    when ``mark_forward_done(m)`` is called (after the forward, before the backward); without it, at the exit.
    """
    m = MemoryMeasure()
    live = live_bytes()
    saved = saved_activations(ignore=list(ignore))
    m._saved_ctx = saved  # read by mark_forward_done
    with live:
        with saved:
            m._forward_open = True
            yield m
            if m._forward_open:
                m.saved = saved.bytes
    m.peak = live.peak


def mark_forward_done(m: MemoryMeasure) -> None:
    """The forward has ended: record what it saved for backward now (its graph is alive)."""
    if m._forward_open:
        m.saved = m._saved_ctx.bytes
        m._forward_open = False
