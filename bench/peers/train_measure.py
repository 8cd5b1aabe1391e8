"""The training step's memory on one rank, device-resident and host-resident bytes apart, the same measure for every
stack (``bench/peers/train_step.py``).

The measure is ``distattn.memory.measure.LiveBytes`` (a dispatch mode that sees every storage an op allocates and,
by weak reference, when it is freed), run over one whole optimizer step: forward, backward, the gradient sum over the
group, ``optimizer.step()`` and ``zero_grad()``. What is alive when the step begins (parameters, AdamW states) is
added as ``resident`` bytes, counted once per storage.

Where a byte lives: on a CUDA run, a storage on the CPU is host memory. On a CPU-only machine host and device are one
memory, so a storage is *host-resident* when it was allocated inside an offloader's host-buffer routine, which
``host_site`` marks (distattn's ``CheckpointOffload._offload``, DeepSpeed's
``_ActivationOffloadEngine._empty_cpu_like``: in both, the only allocation is the host buffer the checkpointed
tensor is copied into); every other storage is device-resident. Each kind's peak is its own largest total over the
step (the two peaks need not fall at the same moment).

Blind spot, and its cross-check: a dispatch mode does not see what an op allocates and frees inside itself (SDPA's
scratch; distattn's attention is a registered op, so its executor's transient buffers). ``allocator_peak`` (the
harness's profiler measure, ``bench/peers/measure.py``) sees every allocation, device and host together, and is
reported beside. Imports: torch, ``distattn.memory.measure`` and ``bench.peers.measure``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves

from distattn.memory.measure import LiveBytes

__all__ = ["SplitLiveBytes", "StepPeak", "host_site", "resident_bytes", "measure_step"]

_HOST = threading.local()


@contextlib.contextmanager
def _host_allocations():
    depth = getattr(_HOST, "depth", 0)
    _HOST.depth = depth + 1
    try:
        yield
    finally:
        _HOST.depth = depth


def host_site(owner, name: str):
    """Mark ``owner.name`` (a function or method) as a host-buffer routine: what it allocates is host memory.

    Returns an undo function. Measurement only: the routine's behaviour is unchanged.
    """
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        with _host_allocations():
            return original(*args, **kwargs)

    setattr(owner, name, wrapped)
    return lambda: setattr(owner, name, original)


class SplitLiveBytes(LiveBytes):
    """``LiveBytes`` whose allocations are each marked device or host (see the module docstring)."""

    def __init__(self, device_type: str = "cpu"):
        super().__init__()
        self.device_type = device_type
        self._host_ids: set[int] = set()
        self._ops: dict[int, str] = {}  # allocation id -> the op that made it (for the breakdown at the peak)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = self._next
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self._next > first:
            name = func.__name__.split(".")[0]
            self._ops.update((aid, name) for aid in range(first, self._next))
            on_host = getattr(_HOST, "depth", 0) > 0
            if not on_host and self.device_type != "cpu":  # a real device: a CPU storage is host memory
                on_host = any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tree_leaves(out))
            if on_host:
                self._host_ids.update(range(first, self._next))
        return out

    def peaks(self) -> tuple[int, int]:
        """(device peak, host peak) of the region's allocations, each its own largest total."""
        now = {False: 0, True: 0}
        peak = {False: 0, True: 0}
        for aid, delta in self._log:
            kind = aid in self._host_ids
            now[kind] += delta
            peak[kind] = max(peak[kind], now[kind])
        return peak[False], peak[True]

    def device_breakdown(self, top: int = 6) -> dict[str, int]:
        """Live device-resident bytes at the device peak, by the op that allocated them (the largest ``top``)."""
        now, peak, at = 0, 0, 0
        device = [(aid, delta) for aid, delta in self._log if aid not in self._host_ids]
        for i, (_, delta) in enumerate(device):
            now += delta
            if now > peak:
                peak, at = now, i
        live: dict[int, int] = {}
        for aid, delta in device[:at + 1]:
            live[aid] = live.get(aid, 0) + delta
        by_op: dict[str, int] = {}
        for aid, nbytes in live.items():
            if nbytes:
                by_op[self._ops.get(aid, "?")] = by_op.get(self._ops.get(aid, "?"), 0) + nbytes
        return dict(sorted(by_op.items(), key=lambda kv: -kv[1])[:top])


def resident_bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors`` (parameters, optimizer states alive before a step)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    yield from model.parameters()
    yield from model.buffers()
    for p in model.parameters():
        if p.grad is not None:
            yield p.grad
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


@dataclass(frozen=True)
class StepPeak:
    """One optimizer step on one rank: its loss and its memory."""

    loss: float
    resident: int
    """Bytes alive when the step began (parameters, buffers, AdamW states), device-resident in every stack here."""
    device_peak: int
    """Peak device-resident bytes allocated during the step (on top of ``resident``)."""
    host_peak: int
    """Peak host-resident bytes allocated during the step (offloaded checkpoints)."""
    at_peak: dict
    """Live device-resident bytes at the device peak by the op that allocated them (the largest few)."""
    allocator_peak: int = 0
    """Cross-check: the rise of the CPU allocator's live bytes over the step (``bench/peers/measure.allocator_peak``,
    the profiler's allocation events): every allocation, scratch inside ops included (a registered op's, such as
    distattn's attention, and SDPA's), device and host together."""

    @property
    def device_total(self) -> int:
        return self.resident + self.device_peak


def measure_step(model, optimizer, step_fn, device_type: str = "cpu") -> StepPeak:
    """Run ``loss = step_fn()`` (forward + backward + gradient sum) then ``optimizer.step()`` and ``zero_grad()``
    under one ``SplitLiveBytes``; returns the loss and the peaks."""
    from torch.profiler import ProfilerActivity, profile

    from bench.peers.measure import allocator_peak

    resident = resident_bytes(_state_tensors(model, optimizer))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with SplitLiveBytes(device_type) as live:
            loss = step_fn()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss = float(loss.detach())
    device_peak, host_peak = live.peaks()
    return StepPeak(loss, resident, device_peak, host_peak, live.device_breakdown(), allocator_peak(prof))
