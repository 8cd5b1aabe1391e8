"""Moving a stream's tokens between two token layouts with one all-to-all (differentiable): how the compat layer runs
a peer's layout that distattn has no plan for (stripe; every document split per rank) on a layout it has one for.

A *token layout* says, for the ``T = P * n`` positions of a stream, which rank holds each and at which local index.
Three kinds, all with ``n`` tokens per rank:

    contiguous   rank r holds [r*n, (r+1)*n)                                  (distattn's balanced/ring layout)
    stripe       rank r holds r, r+P, r+2P, ...   (token i on rank i % P)    (ring-flash-attention's stripe)
    doc_chunks   every document is cut into K equal chunks; chunk j goes to rank j (K = P: ring-flash-attention's
                 varlen layout) or, with K = 2P, chunks r and 2P-1-r go to rank r (its zigzag varlen layout);
                 a rank keeps its pieces in document order

Moving ``x`` from layout A to layout B: each rank sorts its rows by (destination rank, index there), one
``all_to_all_single`` with uneven splits moves them, and the receiver scatters the rows to their indices. Every rank
derives both sides of the exchange from the layouts alone (shared metadata, no communication). The backward moves
the gradient from B back to A (the inverse exchange). Per call that is ``(P-1)/P`` of the rows crossing ranks once.

Before the first exchange of a call the ranks agree on its description (``distattn.agreement``: a rank whose input
failed validation raises on every rank instead of leaving the others waiting); every wait is bounded by the call's
timeout and a failure aborts the library's communicators, as distattn's executors do.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from distattn import agreement
from distattn.comm import COUNTERS, DistAttnError, all_gather_text, bounded_wait, communicator
from distattn.communicators import describe, open_call

__all__ = ["TokenLayout", "relayout", "relayout_many", "agree_on_move", "gather_call_texts"]

KINDS = ("contiguous", "stripe", "doc_chunks")


@dataclass(frozen=True)
class TokenLayout:
    """Where each position of a ``world * n`` token stream lives (see the module doc)."""

    kind: str
    world: int
    n: int
    cu: tuple[int, ...] = ()  # doc_chunks: the documents' global cumulative lengths (each a multiple of chunks)
    chunks: int = 1  # doc_chunks: K, chunks per document (P or 2P)

    def __post_init__(self):
        assert self.kind in KINDS and self.world >= 1 and self.n >= 0, self
        if self.kind == "doc_chunks":
            assert self.chunks in (self.world, 2 * self.world) and self.cu[-1] == self.world * self.n, self
            assert all((b - a) % self.chunks == 0 for a, b in zip(self.cu, self.cu[1:])), self

    def _slots(self, rank: int) -> tuple[int, ...]:
        """doc_chunks: the chunks of every document that ``rank`` holds, in local order."""
        return (rank,) if self.chunks == self.world else (rank, 2 * self.world - 1 - rank)

    def positions(self, rank: int) -> np.ndarray:
        """Global positions of ``rank``'s local tokens, in local order (int64)."""
        n, p = self.n, self.world
        if self.kind == "contiguous":
            return np.arange(rank * n, (rank + 1) * n, dtype=np.int64)
        if self.kind == "stripe":
            return rank + p * np.arange(n, dtype=np.int64)
        parts = []
        for a, b in zip(self.cu, self.cu[1:]):
            c = (b - a) // self.chunks  # chunk length of this document
            parts += [np.arange(a + j * c, a + (j + 1) * c, dtype=np.int64) for j in self._slots(rank)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def where(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(owner rank, local index)`` of every position in ``pos``."""
        n, p = self.n, self.world
        if self.kind == "contiguous":
            return pos // n, pos % n
        if self.kind == "stripe":
            return pos % p, pos // p
        cu = np.asarray(self.cu, dtype=np.int64)
        doc = np.searchsorted(cu, pos, side="right") - 1  # the (non-empty) document holding each position
        c = (cu[doc + 1] - cu[doc]) // self.chunks
        j = (pos - cu[doc]) // c  # chunk index within the document
        second = j >= p  # zigzag varlen: chunk 2P-1-r is the rank's second piece of the document
        owner = np.where(second, 2 * p - 1 - j, j)
        local_start = cu[doc] // p  # the document starts here in every rank's local stream
        return owner, local_start + second * c + (pos - cu[doc]) % c

    def describe(self) -> str:
        cu = hashlib.blake2b(repr(self.cu).encode(), digest_size=6).hexdigest() if self.cu else "-"
        return f"{self.kind}(P={self.world}, n={self.n}, K={self.chunks}, cu#{cu})"


@dataclass(frozen=True)
class _Exchange:
    """One rank's side of a move: the send order and split sizes, the receive split sizes and placement."""

    send_order: torch.Tensor
    send_counts: list[int]
    recv_place: torch.Tensor
    recv_counts: list[int]


@functools.lru_cache(maxsize=64)
def _exchange(src: TokenLayout, dst: TokenLayout, rank: int) -> _Exchange:
    mine = src.positions(rank)
    dest, index = dst.where(mine)
    send_order = np.lexsort((index, dest))  # by destination rank, then by the index there
    # The receiver gets, from each source s, the rows s holds of its own positions, in its index order:
    theirs = dst.positions(rank)
    source, _ = src.where(theirs)
    recv_place = np.argsort(source, kind="stable")  # received row i goes to local index recv_place[i]
    p = src.world
    return _Exchange(torch.from_numpy(send_order), np.bincount(dest, minlength=p).tolist(),
                     torch.from_numpy(recv_place), np.bincount(source, minlength=p).tolist())


def _move(x: torch.Tensor, src: TokenLayout, dst: TokenLayout, group, timeout: float) -> torch.Tensor:
    """Rows of ``x`` (dim 0 = this rank's tokens in ``src``'s order) -> this rank's rows in ``dst``'s order."""
    lib = communicator(group, timeout)
    ex = _exchange(src, dst, lib.rank)
    send = x.index_select(0, ex.send_order.to(x.device)).contiguous()
    stage = x.is_cuda and not lib.nccl  # gloo moves CUDA tensors through host memory
    s = send.cpu() if stage else send
    r = torch.empty(s.shape, dtype=s.dtype, device=s.device)
    try:
        work = dist.all_to_all_single(r, s, output_split_sizes=ex.recv_counts, input_split_sizes=ex.send_counts,
                                      group=lib.fetch, async_op=True)
        bounded_wait([work], timeout, f"distattn.compat: rank {lib.rank}: moving tokens {src.describe()} -> "
                                      f"{dst.describe()}", poll=lib.nccl)
    except DistAttnError:
        lib.abort()  # the peers then fail at once too; the next call rebuilds
        raise
    row_bytes = x[0].numel() * x.element_size() if x.shape[0] else 0
    COUNTERS.bytes_sent += (x.shape[0] - ex.send_counts[lib.rank]) * row_bytes  # rows kept stay off the wire
    COUNTERS.bytes_recv += (x.shape[0] - ex.recv_counts[lib.rank]) * row_bytes
    recv = r.to(x.device) if stage else r
    return torch.empty_like(recv).index_copy_(0, ex.recv_place.to(x.device), recv)


class _Relayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, dst, group, timeout):
        ctx.args = (src, dst, group, timeout)
        return _move(x, src, dst, group, timeout)

    @staticmethod
    def backward(ctx, grad):
        src, dst, group, timeout = ctx.args
        return _move(grad.contiguous(), dst, src, group, timeout), None, None, None, None


def agree_on_move(tensors, src: TokenLayout, dst: TokenLayout, group, timeout: float, what: str) -> None:
    """The ranks agree on a move before its exchange (shapes, dtype, layouts); the same ``ValueError`` on every
    rank otherwise. Pairs with ``distattn.api.validated_everywhere``'s rejection of a rank's bad input."""
    if src == dst or src.world == 1 or not agreement.enabled():
        return
    _agree(group, tensors, {"compat": what, "from": src.describe(), "to": dst.describe()}, timeout, what,
           "before moving tokens")


def _agree(group, tensors, extra: dict, timeout: float, what: str, when: str) -> None:
    """One call on ``group``: an agreement collective on its fields (``tensors``' shapes and dtypes, ``extra``); on a
    mismatch the library's groups are aborted and every rank raises the same error."""
    lib, seq = open_call(group, timeout)
    fields = agreement.call_fields("forward", seq, tensors, extra)
    device = next(iter(tensors.values())).device
    try:
        agreement.agree(lib, fields, device if lib.nccl else torch.device("cpu"), timeout,
                        f"{what} {describe(lib.position)}, {when}")
    except DistAttnError:
        lib.abort()
        raise


def relayout(x: torch.Tensor, src: TokenLayout, dst: TokenLayout, group, timeout: float, dim: int = 0):
    """``x``'s tokens along ``dim`` moved from ``src`` to ``dst`` (differentiable; identity on one rank)."""
    if src == dst or src.world == 1:
        return x
    rows = x.movedim(dim, 0)
    shape = rows.shape
    y = _Relayout.apply(rows.reshape(shape[0], -1), src, dst, group, timeout)
    return y.reshape(shape).movedim(0, dim)


def relayout_many(tensors, src: TokenLayout, dst: TokenLayout, group, timeout: float, dim: int = 0):
    """Several tensors of one dtype with the same token count along ``dim`` moved in ONE exchange (their rows
    side by side), e.g. q, k and v; returns them in order."""
    if src == dst or src.world == 1:
        return tuple(tensors)
    rows = [t.movedim(dim, 0) for t in tensors]
    flat = torch.cat([r.reshape(r.shape[0], -1) for r in rows], dim=1)
    moved = _Relayout.apply(flat, src, dst, group, timeout)
    widths = [r[0].numel() for r in rows]
    return tuple(part.reshape(r.shape).movedim(0, dim) for part, r in zip(moved.split(widths, dim=1), rows))


def gather_call_texts(tensors, text: str, group, timeout: float, what: str) -> list[str]:
    """Every rank's ``text`` (small JSON, in group-rank order), after the ranks agreed on the call's shapes: how a
    convention that gives each rank only its local view (llama3's local ``cu_seqlens``) becomes the global view."""
    if dist.get_world_size(group) == 1:
        return [text]
    if agreement.enabled():
        _agree(group, tensors, {"compat": what}, timeout, what, "before gathering the ranks' local cu_seqlens")
    lib = communicator(group, timeout)  # the agreement's (it raised if it failed)
    device = next(iter(tensors.values())).device
    try:
        return all_gather_text(lib.fetch, text, device if lib.nccl else torch.device("cpu"), timeout,
                               f"distattn.compat: rank {lib.rank}, {what}: gathering the ranks' local cu_seqlens")
    except DistAttnError:
        lib.abort()
        raise
