"""Measuring activation memory: what a forward saves for backward, and (CUDA) what the allocator saw.

``saved_activations`` counts the tensors autograd keeps between forward and backward, one count per
underlying allocation (storage): a view, a transpose or a split of one allocation is that allocation once,
and a storage's bytes are its ``nbytes()`` (the whole allocation, not the viewed part)::

    with saved_activations(ignore=model.parameters()) as acc:
        loss = model(x).sum()
    acc.bytes                 # int
    acc.by_module()           # {"model.layers.0.mlp": bytes, ...}
    acc.records               # one SavedStorage per counted allocation (shape, dtype, nbytes, module, producer)

Three mechanisms keep tensors for backward, and each is seen:

* autograd's saved tensors (``ctx.save_for_backward``, every built-in derivative formula, the registered
  ``torch.ops.distattn.attention``): through ``torch.autograd.graph.saved_tensors_hooks``;
* a non-reentrant ``torch.utils.checkpoint`` region: PyTorch pushes its own saved-tensor hooks inside the
  region, so tensors saved *inside* never reach ours (they are dropped and recomputed: correctly not counted).
  What the region keeps is its inputs: the positional ones the checkpoint saves as saved tensors *before*
  pushing its hooks, so ours sees them (a reentrant checkpoint saves them with ``save_for_backward``: also
  seen); keyword arguments (and the arguments bound in a ``functools.partial`` function, which is how
  transformers checkpoints a layer) it keeps in its recompute closure, so the wrapper below records those
  (module label ``"<checkpoint kwargs>"``); tensors captured by any other closure stay invisible;
* selective checkpointing (``context_fn=create_selective_checkpoint_contexts(...)``, distattn's
  ``remat_checkpoint``): the ops the policy saves are cached by a dispatch mode, outside autograd. While the
  context is active, ``torch.utils.checkpoint``'s non-reentrant generator is wrapped so that, when a
  checkpointed forward ends, the tensors in its selective-checkpoint cache are counted too (module label
  ``"<checkpoint cache>"``, producer = the cached op).

Breakdown: ``module`` is the qualified name of the innermost ``nn.Module`` whose forward was running when the
tensor was saved (global forward pre/post hooks keep a stack; names come from ``named_modules`` of the
``model=`` argument, else the class name); ``producer`` is the autograd node that produced the saved tensor
(``grad_fn`` name, e.g. ``"MulBackward0"``; ``"leaf"`` for a tensor created outside autograd, such as the
inputs or a tensor computed without grad).

A storage whose owner died before the query (a temporary saved by a node that was already freed) is not
counted: the measure is what is alive for backward.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.utils.checkpoint as _tuc
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["SavedStorage", "SavedActivations", "saved_activations", "AllocatorDelta", "allocator_delta", "LiveBytes",
           "live_bytes"]

CHECKPOINT_CACHE = "<checkpoint cache>"
CHECKPOINT_KWARGS = "<checkpoint kwargs>"


@dataclass(frozen=True)
class SavedStorage:
    """One counted allocation (the first saved tensor that referenced it describes it)."""

    shape: tuple
    """Shape of the first saved tensor viewing this storage."""
    dtype: torch.dtype
    nbytes: int
    """Bytes of the whole storage."""
    module: str
    """Innermost module running when it was first saved (``""``: outside any module)."""
    producer: str
    """Name of the autograd node that produced it, or ``"leaf"``."""


class _ModuleStack:
    """Global forward pre/post hooks that keep the stack of running modules' names."""

    def __init__(self, names: dict[int, str]):
        self.names = names
        self.stack: list[str] = []
        self.handles = []

    def __enter__(self):
        mod = torch.nn.modules.module
        self.handles = [mod.register_module_forward_pre_hook(self._pre),
                        mod.register_module_forward_hook(self._post, always_call=True)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def _pre(self, module, args):
        self.stack.append(self.names.get(id(module), type(module).__name__))

    def _post(self, module, args, out):
        if self.stack:
            self.stack.pop()

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else ""


def _storage_ptr(t: torch.Tensor) -> int | None:
    """Address of ``t``'s allocation (a DTensor's local shard's), or None when it has none to give."""
    local = getattr(t, "_local_tensor", None)  # DTensor (FSDP2 parameters): its shard on this rank
    t = local if isinstance(local, torch.Tensor) else t
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # e.g. a storage freed by FSDP, a tensor subclass without one
        return None


def _alive_bytes(ref: StorageWeakRef) -> int:
    try:
        return torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
    except (RuntimeError, AttributeError):
        return 1  # cannot look: count it as it was


class SavedActivations:
    """What one ``saved_activations`` region saved for backward (see the module docstring)."""

    def __init__(self, ignore: Iterable[torch.Tensor] | None = None, model: torch.nn.Module | None = None):
        self._ignored = {ptr for ptr in map(_storage_ptr, ignore or ()) if ptr is not None}
        names = {id(m): (name or type(m).__name__) for name, m in model.named_modules()} if model is not None else {}
        self._modules = _ModuleStack(names)
        # storage address -> (weak reference, record); an address whose storage died may be reused.
        self._seen: dict[int, tuple[StorageWeakRef, SavedStorage]] = {}
        self._stack = contextlib.ExitStack()

    # -- recording --------------------------------------------------------------------------------------
    def _record(self, t: torch.Tensor, module: str | None = None, producer: str | None = None) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        ptr = _storage_ptr(t)
        if ptr is None:
            return
        storage = t.untyped_storage()
        if ptr in self._ignored or storage.nbytes() == 0:
            return
        old = self._seen.get(ptr)
        if old is not None and not old[0].expired():
            return  # this allocation is already counted
        if producer is None:
            producer = type(t.grad_fn).__name__ if t.grad_fn is not None else "leaf"
        rec = SavedStorage(tuple(t.shape), t.dtype, storage.nbytes(),
                           self._modules.current if module is None else module, producer)
        self._seen[ptr] = (StorageWeakRef(storage), rec)

    def _pack(self, t):
        self._record(t)
        return t

    def _checkpoint_generator(self, original):
        acc = self

        def generator(fn, preserve_rng_state=True, context_fn=_tuc.noop_context_fn, *rest, **kwargs):
            contexts = []
            # Keyword arguments are not saved tensors: the checkpoint keeps them alive in its recompute closure.
            # A functools.partial (how transformers passes a layer's keyword arguments) keeps its own.
            bound = (fn.args, fn.keywords) if isinstance(fn, functools.partial) else ()
            for t in tree_leaves((kwargs, bound)):
                if isinstance(t, torch.Tensor):
                    acc._record(t, module=CHECKPOINT_KWARGS)

            def capturing_context_fn():
                fwd, rec = context_fn()
                contexts.append(fwd)
                return fwd, rec

            yield from original(fn, preserve_rng_state, capturing_context_fn, *rest, **kwargs)
            for fwd in contexts:  # selective checkpointing: the outputs its policy chose to keep
                for key, entries in getattr(fwd, "storage", {}).items():
                    op_name = str(key[0] if isinstance(key, tuple) else key)
                    for entry in (entries.values() if isinstance(entries, dict) else entries):
                        for wrapped in tree_leaves(entry):
                            val = getattr(wrapped, "val", None)
                            if isinstance(val, torch.Tensor):
                                acc._record(val, module=CHECKPOINT_CACHE, producer=op_name)

        return generator

    def __enter__(self) -> SavedActivations:
        self._stack.enter_context(self._modules)
        self._stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
        original = _tuc._checkpoint_without_reentrant_generator
        _tuc._checkpoint_without_reentrant_generator = self._checkpoint_generator(original)
        self._stack.callback(setattr, _tuc, "_checkpoint_without_reentrant_generator", original)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    # -- queries ----------------------------------------------------------------------------------------
    @property
    def records(self) -> list[SavedStorage]:
        """One record per counted allocation that still holds memory, in the order first saved.

        An allocation freed since (expired), or resized to nothing (FSDP2 frees the all-gathered weights that
        a forward saved and gathers them again for backward), keeps no memory between forward and backward.
        """
        return [rec for ref, rec in self._seen.values() if not ref.expired() and _alive_bytes(ref)]

    @property
    def bytes(self) -> int:
        """Bytes of the distinct allocations saved for backward (and still alive)."""
        return sum(rec.nbytes for rec in self.records)

    def by_module(self) -> dict[str, int]:
        """Bytes per module (innermost running module when first saved)."""
        out: dict[str, int] = defaultdict(int)
        for rec in self.records:
            out[rec.module] += rec.nbytes
        return dict(out)

    def by_producer(self) -> dict[str, int]:
        """Bytes per producing autograd node (or cached op)."""
        out: dict[str, int] = defaultdict(int)
        for rec in self.records:
            out[rec.producer] += rec.nbytes
        return dict(out)

    def signature(self) -> list[tuple[int, torch.dtype]]:
        """Sorted ``(nbytes, dtype)`` per allocation: compare with a model's tensor list."""
        return sorted(((r.nbytes, r.dtype) for r in self.records), key=lambda x: (x[0], str(x[1])))


def saved_activations(ignore: Iterable[torch.Tensor] | None = None, model: torch.nn.Module | None = None
                      ) -> SavedActivations:
    """Context manager counting what the enclosed forward saves for backward (see the module docstring).

    Args:
        ignore: tensors not to count (their storages), typically ``model.parameters()`` (a Linear saves its
            weight, a view of the parameter) and inputs shared by every layer (RoPE's cos/sin).
        model: names the modules in the breakdown (``named_modules``); without it, class names.
    """
    return SavedActivations(ignore=ignore, model=model)


# -- CUDA allocator deltas ------------------------------------------------------------------------------
class AllocatorDelta:
    """Allocator counters around a region (CUDA): ``delta`` = after - before of ``allocated_bytes.all.*``.

    Keys: ``allocated`` (bytes newly allocated), ``freed``, ``current`` (still alive at exit), ``peak`` (rise
    of the peak above the level at entry: the peak is reset at entry).
    """

    def __init__(self, device=None):
        self.device = device
        self.before: dict[str, int] = {}
        self.after: dict[str, int] = {}
        self.delta: dict[str, int] = {}

    def _stats(self) -> dict[str, int]:
        prefix = "allocated_bytes.all."
        return {k[len(prefix):]: v for k, v in torch.cuda.memory_stats(self.device).items() if k.startswith(prefix)}

    def __enter__(self) -> AllocatorDelta:
        if not torch.cuda.is_available():
            raise RuntimeError("allocator_delta needs a CUDA device (torch.cuda.is_available() is False); on CPU "
                               "measure saved bytes with saved_activations()")
        warm_cuda_libraries(self.device)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.before = self._stats()
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize(self.device)
        self.after = self._stats()
        self.delta = {k: self.after[k] - self.before.get(k, 0) for k in self.after}
        # after reset, "peak" before is the level at entry: the rise is what the region added on top of it.
        self.delta["peak"] = self.after.get("peak", 0) - self.before.get("current", 0)


def warm_cuda_libraries(device=None) -> None:
    """Create the cuBLAS handle and its workspace now, so the region's first GEMM does not allocate it."""
    torch.cuda.current_blas_handle()
    a = torch.ones(8, 8, device=device or "cuda", requires_grad=True)
    (a @ a).sum().backward()  # forward and backward GEMMs: the workspaces of both threads' handles


def allocator_delta(device=None) -> AllocatorDelta:
    """Context manager: CUDA allocator deltas (allocated / freed / current / peak) around a region."""
    return AllocatorDelta(device)


# -- live bytes of a region, any device (the executor's buffers on CPU) ---------------------------------------
class LiveBytes(TorchDispatchMode):
    """The peak of the live bytes of the storages allocated inside a region, seen at the dispatch level.

    Every op's outputs are looked at: a storage not seen before is an allocation (factories, copies, casts,
    ``contiguous()``); an output on the storage of one of the op's inputs (a view, an alias, an in-place op) is none.
    Frees are found by weak references, swept before each new allocation is counted, so the peak (which only rises
    at an allocation) is exact. Works on any device, CPU included, where the CUDA allocator's counters
    (``allocator_delta``) do not exist; allocations inside one op that never leave it (an op's own scratch) are not
    seen, nor are tensors made without dispatch (``torch.from_numpy``).

    ``opaque(fn)`` wraps a function (a kernel) whose *transient* allocations (freed before it returns) are its own
    working set: they are kept out of ``peak`` and their largest total is ``opaque_peak``; what the function returns
    (or otherwise leaves alive) is counted from its allocation on. ``peak_excluding(tensors)``: the peak without the
    storages of ``tensors`` (a call's outputs) — the log of allocations and frees is replayed.
    """

    def __init__(self):
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int, int]] = {}  # address -> (ref, bytes, allocation id)
        self._log: list[tuple[int, int]] = []  # (allocation id, +bytes) or (allocation id, -bytes), in order
        self._next = 0
        self._opaque_depth = 0
        self._transient: set[int] = set()  # ids allocated inside an opaque function and freed before it returned
        self._opaque_ids: list[set[int]] = []
        self.opaque_peak = 0
        self._opaque_now = 0

    def _sweep(self) -> None:
        for ptr, (ref, nbytes, aid) in list(self._live.items()):
            if ref.expired():
                del self._live[ptr]
                self._log.append((aid, -nbytes))
                if self._opaque_ids and aid in self._opaque_ids[-1]:
                    self._opaque_now -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()
        # an output on an input's storage (a view, an alias, an in-place op) is no allocation
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                  and t.device.type != "meta"}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or ptr in self._live or ptr in inputs:
                continue
            aid, self._next = self._next, self._next + 1
            self._live[ptr] = (StorageWeakRef(storage), nbytes, aid)
            self._log.append((aid, nbytes))
            if self._opaque_ids:
                self._opaque_ids[-1].add(aid)
                self._opaque_now += nbytes
                self.opaque_peak = max(self.opaque_peak, self._opaque_now)
        return out

    def opaque(self, fn):
        """``fn`` wrapped: its transient allocations are its working set (``opaque_peak``), not the region's."""
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            self._opaque_ids.append(set())
            self._opaque_now = 0
            try:
                return fn(*args, **kwargs)
            finally:
                self._sweep()
                ids = self._opaque_ids.pop()
                alive = {aid for _, _, aid in self._live.values()}
                self._transient |= ids - alive
        return wrapped

    def __exit__(self, *exc):
        self._sweep()
        return super().__exit__(*exc)

    def peak_excluding(self, tensors=()) -> int:
        """Peak live bytes of the region's allocations, without the storages of ``tensors`` and the transients of
        the opaque functions."""
        ptrs = {_storage_ptr(t) for t in tensors}
        skip = set(self._transient) | {aid for ptr, (_, _, aid) in self._live.items() if ptr in ptrs}
        now = peak = 0
        for aid, delta in self._log:
            if aid not in skip:
                now += delta
                peak = max(peak, now)
        return peak

    @property
    def peak(self) -> int:
        return self.peak_excluding(())


def live_bytes() -> LiveBytes:
    """Context manager: the peak of live bytes allocated in the region, any device (see ``LiveBytes``)."""
    return LiveBytes()
