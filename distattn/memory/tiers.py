"""The live bytes of a whole training step, device and host apart: the measure the step's byte model is held to.

``step_bytes`` is a dispatch mode (as ``measure.LiveBytes``) that follows every storage alive in a region and says,
at each moment, which tier holds it:

* **host**: a pinned storage (``is_pinned()``: CUDA's pinned host memory), or one named by the ``host`` callable at
  that moment (checkpoints offloaded by ``distattn.offload``, whose CPU path copies into plain memory; the parameter
  shards, gradients and optimizer states of FSDP2's ``CPUOffloadPolicy``). ``host`` is asked again after every op, so
  a storage becomes host-resident when it is put in the offload's hands (a checkpoint's copy, a gradient assigned to
  an offloaded parameter) and stays so until it is freed; on CPU the offload hands its host copy back to autograd as
  is, so the fetched checkpoint stays a host byte (on CUDA it is copied into a new device storage);
* **device**: every other storage: what ``torch.cuda.memory_allocated`` would count on a GPU.

What is counted: the storages of the tensors given to ``count`` (alive before the region: parameters, gradients,
optimizer states, the batch) and every storage an op of the region returns that is new (factories, copies, casts;
views, aliases and in-place results are none). Frees are found by weak references, swept after every op, so each
peak (device and host apart) is exact at op granularity. Not seen: an op's internal scratch that never leaves it,
tensors made without dispatch (``torch.from_numpy``), and what ``opaque`` functions allocate and free before they
return (a CPU kernel's per-tile scratch: a GPU kernel keeps it in registers and shared memory; kept apart as
``opaque_peak``). ``moment`` names the device peak: the phase (``phase(name)``), the innermost running module, the
autograd node being run (backward) and the op.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from distattn.memory.measure import _ModuleStack

__all__ = ["StepBytes", "step_bytes", "Moment"]

_TOTAL = {"device": "device", "host": "host", "host-compute": "host"}  # the tier each storage's bytes count in


@dataclass(frozen=True)
class Moment:
    """Where a peak happened."""

    phase: str
    """The ``phase`` label (``forward``, ``backward``, ``optimizer``, ...) or ``""``."""
    module: str
    """Innermost module whose forward was running (a recomputation's, in backward) or ``""``."""
    node: str
    """The autograd node being run (backward), or ``""``."""
    op: str
    """The op that allocated the byte that set the peak."""

    def __str__(self) -> str:
        return " / ".join(p for p in (self.phase, self.module, self.node, self.op) if p)


def _local(t: torch.Tensor) -> torch.Tensor:
    local = getattr(t, "_local_tensor", None)  # a DTensor (FSDP2 parameter): its shard on this rank
    return local if isinstance(local, torch.Tensor) else t


def _storage(t) -> torch.UntypedStorage | None:
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return None
    try:
        storage = _local(t).untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage if storage.nbytes() else None


def _pinned(storage) -> bool:
    """Whether ``storage`` is pinned host memory; asked with this mode off (``is_pinned`` makes a tensor)."""
    if storage.device.type != "cpu" or not torch.cuda.is_available():
        return False
    with _disable_current_modes():
        return storage.is_pinned()


class StepBytes(TorchDispatchMode):
    """Device and host live bytes of a region (see the module docstring); ``device_peak``, ``host_peak``."""

    def __init__(self, host=None, model: torch.nn.Module | None = None, snapshot: bool = False, host_compute=None):
        super().__init__()
        self._compute_fn = host_compute
        self._snapshot = snapshot
        self.at_peak: list[tuple[str, str, int]] = []
        """With ``snapshot``: ``(tier, where it was allocated, bytes)`` of every storage alive at the device peak."""
        self._host_fn = host
        # address -> [weak ref, bytes, tier, where allocated]; tier "device" or "host"
        self._live: dict[int, list] = {}
        self.now = {"device": 0, "host": 0}  # "host-compute" storages count as "host"
        self.device_peak = self.host_peak = 0
        self.moment: Moment | None = None
        self.host_moment: Moment | None = None
        self._phase = ""
        self._op = ""
        names = {id(m): (n or type(m).__name__) for n, m in model.named_modules()} if model is not None else {}
        self._modules = _ModuleStack(names)
        self._opaque_depth = 0
        self._opaque_base: list[dict] = []
        self.opaque_peak = 0

    # -- what is alive ------------------------------------------------------------------------------------
    def count(self, tensors) -> None:
        """Count the storages of ``tensors`` (alive before the region) from now on."""
        for t in tree_leaves(list(tensors)):
            self._add(_storage(t))
        self._reclassify()

    def _add(self, storage, tier: str | None = None, where: str = "counted") -> None:
        if storage is None:
            return
        ptr = storage.data_ptr()
        if ptr in self._live:
            return
        if tier is None:
            tier = "host" if _pinned(storage) else "device"
        self._live[ptr] = [StorageWeakRef(storage), storage.nbytes(), tier, where]
        self.now[_TOTAL[tier]] += storage.nbytes()

    def _sweep(self) -> None:
        for ptr, (ref, nbytes, tier, where) in list(self._live.items()):
            storage = None if ref.expired() else torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            if storage is not None and storage.data_ptr() == ptr and storage.nbytes() == nbytes:
                continue
            # freed, or resized in place (FSDP2 frees its unsharded parameters with resize_(0) and regrows them)
            del self._live[ptr]
            self.now[_TOTAL[tier]] -= nbytes
            if storage is not None and storage.nbytes():
                self._add(storage, tier, where)

    def _reclassify(self) -> None:
        named = [(t, "host") for t in tree_leaves(list(self._host_fn()))] if self._host_fn else []
        if self._compute_fn is not None:
            named += [(t, "host-compute") for t in tree_leaves(list(self._compute_fn()))]
        for t, tier in named:
            storage = _storage(t)
            if storage is None:
                continue
            entry = self._live.get(storage.data_ptr())
            if entry is None:
                self._add(storage, tier)
            elif entry[2] != tier and entry[2] != "host-compute":
                self.now[_TOTAL[entry[2]]] -= entry[1]
                self.now[_TOTAL[tier]] += entry[1]
                entry[2] = tier

    def _note_peaks(self) -> None:
        if self._opaque_depth:  # an opaque function's transients: its own working set, not the region's
            base = self._opaque_base[-1]
            self.opaque_peak = max(self.opaque_peak, self.now["device"] - base["device"])
            return
        if self.now["device"] > self.device_peak:
            self.device_peak = self.now["device"]
            self.moment = self._where()
            if self._snapshot:
                self.at_peak = [(e[2], e[3], e[1]) for e in self._live.values()]
        if self.now["host"] > self.host_peak:
            self.host_peak = self.now["host"]
            self.host_moment = self._where()

    def _where(self) -> Moment:
        node = torch._C._current_autograd_node()
        return Moment(self._phase, self._modules.current, type(node).__name__ if node is not None else "", self._op)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()
        inputs = {s.data_ptr() for s in map(_storage, tree_leaves((args, kwargs))) if s is not None}
        self._op = func.__name__
        # an op whose inputs all live where the host computes (an offloaded optimizer's step) runs on the host
        # (never inside a module's forward or an autograd node: there FSDP2 copies the offloaded shards to the device,
        # which on the CPU is no copy at all)
        on_host = (bool(inputs) and not self._modules.current and torch._C._current_autograd_node() is None
                   and all(self._live.get(p, (0, 0, ""))[2] == "host-compute" for p in inputs))
        for t in tree_leaves(out):
            storage = _storage(t)
            if storage is not None and storage.data_ptr() not in inputs:
                self._add(storage, "host-compute" if on_host else None,
                          where=str(self._where()) if self._snapshot else "")
        self._reclassify()
        self._note_peaks()
        return out

    # -- labels and kernels --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str):
        """Label the moments inside (``forward``, ``backward``, ``optimizer``)."""
        old, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = old

    def opaque(self, fn):
        """``fn`` wrapped: what it allocates and frees before it returns is its working set (``opaque_peak``), out
        of the peaks; what it returns counts from the moment it returns."""
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            self._opaque_base.append(dict(self.now))
            self._opaque_depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._opaque_depth -= 1
                self._opaque_base.pop()
                self._sweep()
                self._reclassify()
                self._note_peaks()
        return wrapped

    def _resized(self, storage, before: int) -> None:
        """A storage resized in place (FSDP2 allocates and frees its unsharded parameters so, outside dispatch)."""
        entry = self._live.pop(before, None)
        tier = "device"
        if entry is not None:
            tier = entry[2]
            self.now[_TOTAL[tier]] -= entry[1]
        if storage.nbytes():
            self._add(storage, tier, where=str(self._where()) + " (resize_)" if self._snapshot else "")
            self._reclassify()
            self._note_peaks()

    def __enter__(self):
        self._modules.__enter__()
        original, mode = torch.UntypedStorage.resize_, self

        def resize_(storage, size):
            before = storage.data_ptr()
            out = original(storage, size)
            mode._resized(storage, before)
            return out

        torch.UntypedStorage.resize_ = resize_
        self._restore = lambda: setattr(torch.UntypedStorage, "resize_", original)
        return super().__enter__()

    def __exit__(self, *exc):
        self._sweep()
        self._restore()
        self._modules.__exit__(*exc)
        return super().__exit__(*exc)


def step_bytes(host=None, model: torch.nn.Module | None = None, snapshot: bool = False, host_compute=None
               ) -> StepBytes:
    """Context manager: the device and host live bytes of a region, their peaks and moments (``StepBytes``).

    Args:
        host: a callable returning the tensors that are host-resident now (besides pinned ones); asked after
            every op.
        model: names the modules in ``moment`` (``named_modules``).
        snapshot: keep ``at_peak``, what was alive at the device peak and where each was allocated (slower).
        host_compute: a callable returning host-resident tensors that the host also computes with (the parameter
            shards, gradients and optimizer states of an offloaded optimizer, stepped on the CPU): an op whose tensor
            inputs are all such (or made by such ops) allocates its outputs on the host.
    """
    return StepBytes(host=host, model=model, snapshot=snapshot, host_compute=host_compute)
