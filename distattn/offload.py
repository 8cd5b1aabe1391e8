"""Offloaded checkpoints: what a checkpoint keeps per layer waits in host memory between forward and backward.

Layer-boundary ("full") checkpointing keeps each layer's input ``x (b, n, hidden)``; remat checkpointing
(``distattn.checkpoint``) keeps ``x`` and attention's ``out (b, n, h_q, d)``, ``lse (b, h_q, n)`` fp32. With a
:class:`CheckpointOffload` these tensors are copied to host memory as soon as they are produced and the device
copies are dropped, so between forward and backward a layer costs ~0 device bytes::

    forward   layer i:  x_i ──D2H (side stream)──▶ host        out_i, lse_i ──D2H──▶ host   (remat)
    backward  layer i:  starts ─▶ H2D of layer i-1's tensors (side stream) ─▶ recompute + backward of layer i
                        (layer i's own tensors were fetched when layer i+1's backward started; the last
                        layer's are fetched on demand, the one copy that is not hidden)

Scope: only what the checkpoint keeps goes to the host. The checkpoint's inputs reach
``torch.autograd.graph.saved_tensors_hooks`` pushed around the ``checkpoint`` call (every tensor saved inside the
checkpointed function meets the checkpoint's own, innermost hooks instead), and attention's outputs are taken
by a dispatch mode that plays selective checkpointing's ``MUST_SAVE`` for the registered op
``torch.ops.distattn.attention`` (:data:`distattn._ops.OP`), with host memory as the place it keeps them.
Shared tensors (rotary tables, masks) are passed to a checkpointed function as keyword arguments (as
Hugging Face does) and are not copied.

CUDA: copies run on two side streams (device-to-host, host-to-device) into pinned host buffers with
``non_blocking``; ``record_stream`` keeps a source block from being reused before its copy has finished and the
compute stream waits on an event before it uses a fetched tensor. CPU: pinned memory needs CUDA, so host
buffers are plain memory and "fetching" hands back the host copy itself (host and device are one memory);
the copies out, the accounting and the order of fetches are the same code.

The byte model (:func:`offload_bytes`) is what the planner reads; tests hold it equal to the accounting.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from distattn._ops import OP

__all__ = ["CheckpointOffload", "LayerAccount", "KeptTensor", "OffloadBytes", "offload_bytes",
           "optimizer_offload_bytes", "host_memory_available", "check_host_memory", "pinned_memory_available",
           "format_bytes"]

GIB = 1 << 30
LSE_BYTES = 4  # lse is fp32 at every API (ARCHITECTURE.md)


# -- the byte model -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OffloadBytes:
    """Bytes of offloaded checkpoints on one rank, for one forward + backward."""

    per_layer: int
    """Host bytes one layer's checkpoint keeps (``x``; remat: ``+ out + lse``)."""
    host_per_step: int
    """Host bytes at the end of forward: ``layers * per_layer``."""
    device_per_layer: int
    """Device bytes a layer's checkpoint keeps between its forward and its backward: 0."""
    device_transient: int
    """Device bytes of fetched checkpoints at once in backward: the layer running and the one prefetched."""
    traffic_per_step: int
    """Host-device bytes moved per step: every kept tensor out once (forward) and back once (backward)."""


def offload_bytes(*, batch: int, tokens: int, hidden: int, heads_q: int, head_dim: int, layers: int, remat: bool,
                  act_bytes: int = 2, attn_bytes: int | None = None) -> OffloadBytes:
    """The byte model of :class:`CheckpointOffload` on one rank.

    Args:
        batch, tokens: ``b`` and this rank's ``n`` (the sequence shard, not the global length).
        hidden, heads_q, head_dim, layers: the model's shape.
        remat: remat checkpointing (keeps attention's ``out, lse``) rather than layer-boundary checkpointing.
        act_bytes: bytes per element of the layer input ``x``; attn_bytes: of attention's ``out`` (default
            ``act_bytes``). ``lse`` is always fp32.
    """
    per_layer = batch * tokens * hidden * act_bytes
    if remat:
        out = batch * tokens * heads_q * head_dim * (attn_bytes or act_bytes)  # (b, n, h_q, d)
        per_layer += out + batch * heads_q * tokens * LSE_BYTES  # + lse (b, h_q, n) fp32
    return OffloadBytes(per_layer=per_layer, host_per_step=layers * per_layer, device_per_layer=0,
                        device_transient=min(2, layers) * per_layer, traffic_per_step=2 * layers * per_layer)


def optimizer_offload_bytes(num_params: int, shard: int) -> dict[str, int]:
    """Host bytes and traffic of FSDP2's ``CPUOffloadPolicy`` on one rank (``num_params`` over ``shard`` ranks).

    Host: the fp32 parameter shard, its fp32 gradient and AdamW's two fp32 moments (16 B per parameter).
    Traffic per step: the fp32 shard goes to the device for each all-gather (forward and, resharded after
    forward, backward again: 8 B) and the reduced fp32 gradient comes back (4 B).
    """
    local = -(-num_params // shard)
    return {"host": 16 * local, "h2d_per_step": 8 * local, "d2h_per_step": 4 * local}


# -- host memory --------------------------------------------------------------------------------------------
def host_memory_available() -> int:
    """Bytes of host memory available now: ``MemAvailable`` from ``/proc/meminfo``, else free pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file's unit is kB
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def format_bytes(nbytes: int) -> str:
    """``1.50 GiB`` from a tenth of a GiB up, else ``12.00 MiB``."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB // 10 else f"{nbytes / (1 << 20):.2f} MiB"


def check_host_memory(needed: int, limit: int | None = None, what: str = "offload") -> None:
    """Raise ``ValueError`` if ``needed`` bytes exceed ``limit`` (default: :func:`host_memory_available`)."""
    if limit is not None and limit <= 0:
        raise ValueError(f"the host memory limit must be > 0 bytes, got {limit}")
    available = host_memory_available() if limit is None else limit
    if needed > available:
        source = "the limit given" if limit is not None else "MemAvailable in /proc/meminfo"
        raise ValueError(f"{what} needs {format_bytes(needed)} of host memory but {source} is "
                         f"{format_bytes(available)}; use more nodes, a shorter sequence, fewer offloaded "
                         f"tensors, or raise the limit if the host has the memory")


def pinned_memory_available() -> bool:
    """Whether page-locked host memory can be allocated (it needs a working CUDA runtime)."""
    if not torch.cuda.is_available():
        return False
    try:
        torch.empty(1, pin_memory=True)
    except RuntimeError:
        return False
    return True


# -- accounting ---------------------------------------------------------------------------------------------
@dataclass
class KeptTensor:
    """One tensor a layer's checkpoint keeps: what it is, its size, and (weakly) the original's storage."""

    what: str  # "input", "attn_out" or "attn_lse"
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    source: StorageWeakRef = field(repr=False)


@dataclass
class LayerAccount:
    """Where one checkpointed layer's kept tensors live (index ``layer`` in forward order of this step)."""

    layer: int
    kept: list[KeptTensor] = field(default_factory=list)

    @property
    def host_bytes(self) -> int:
        """Bytes of this layer's copies in host memory."""
        return sum(k.nbytes for k in self.kept)

    @property
    def device_bytes(self) -> int:
        """Bytes of the originals whose storage is still alive (measured, by weak reference): ~0 after forward."""
        return sum(k.nbytes for k in self.kept if not k.source.expired())


class _Layer:
    """One checkpointed call's host copies, their device copies once fetched, and the events that order them."""

    def __init__(self, step: int, index: int):
        self.step, self.index = step, index
        self.host: list[torch.Tensor] = []
        self.device_of: list[torch.device] = []
        self.d2h_done: list[object] = []  # CUDA events (None on CPU)
        self.fetched: dict[int, tuple[torch.Tensor, object]] = {}  # slot -> (device tensor, CUDA event or None)
        self.attn_slots: list[tuple[int, int]] = []  # (out, lse) slots of each attention call, in call order
        self.prefetched = False  # its copy to the device has been started
        self.started = False  # its backward has begun


# -- the offloader ------------------------------------------------------------------------------------------
class CheckpointOffload:
    """Keeps what each checkpointed layer saves in host memory; records where every byte is.

    Args:
        remat: remat checkpointing (layer input + attention's ``out, lse``) if True, else layer-boundary.
        pin_memory: pinned host buffers; default: when CUDA is available. ``True`` without pinned memory
            available raises ``ValueError``.
        host_limit_bytes: raise ``MemoryError`` before copying past this many live host bytes (default none).

    Use :meth:`checkpoint` (or ``distattn.checkpoint.remat_checkpoint(..., offload=...)``) per layer, or
    :meth:`attach` to modules that checkpoint themselves (Hugging Face decoder layers). ``layers`` and
    ``events`` describe the current step (they restart at the first forward after a backward).
    """

    def __init__(self, *, remat: bool = True, pin_memory: bool | None = None, host_limit_bytes: int | None = None):
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
            if pin_memory and not pinned_memory_available():
                raise ValueError("checkpoint offload on CUDA needs pinned host memory, which cannot be allocated "
                                 "here (locked-memory limit? check `ulimit -l`); pass pin_memory=False to offload "
                                 "into pageable memory (synchronous, slower copies)")
        elif pin_memory and not pinned_memory_available():
            raise ValueError("pin_memory=True needs pinned host memory, which needs CUDA and is unavailable here; "
                             "pass pin_memory=False (plain host memory; on CPU there is nothing to pin)")
        if host_limit_bytes is not None and host_limit_bytes <= 0:
            raise ValueError(f"host_limit_bytes must be > 0, got {host_limit_bytes}")
        self.remat, self.pin_memory, self.host_limit_bytes = remat, pin_memory, host_limit_bytes
        self.layers: list[LayerAccount] = []
        self.events: list[tuple[str, int]] = []  # ("offload" | "fetch" | "prefetch" | "use", layer)
        self.bytes_to_host = self.bytes_to_device = 0  # this step's traffic
        self.live_host_bytes = 0  # host copies not yet freed, every step
        self._step = 0
        self._records: list[weakref.ref] = []
        self._running: list[_Layer] = []  # checkpointed calls whose forward is running (innermost last)
        self._streams: dict[tuple[str, torch.device], object] = {}
        self._hooks: list = []
        self._attached_calls: list[contextlib.ExitStack | None] = []

    # -- entering a checkpointed call ---------------------------------------------------------------------
    def checkpoint(self, function, *args, **kwargs):
        """``function(*args, **kwargs)`` checkpointed (non-reentrant), its kept tensors offloaded."""
        with self.region():
            return checkpoint(function, *args, use_reentrant=False, context_fn=self.context_fn, **kwargs)

    @contextlib.contextmanager
    def region(self):
        """Scope of one checkpointed call: the tensors the checkpoint saves as its inputs go to the host."""
        record = self._begin()
        self._running.append(record)
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(record, t), self._unpack):
                yield record
        finally:
            self._running.pop()

    def context_fn(self):
        """A checkpoint ``context_fn``: remat keeps attention's outputs (on the host); full keeps nothing more."""
        if not self.remat:
            return contextlib.nullcontext(), contextlib.nullcontext()
        if not self._running:
            raise RuntimeError("CheckpointOffload.context_fn runs only inside CheckpointOffload.region() "
                               "(use CheckpointOffload.checkpoint or attach)")
        record = self._running[-1]
        return _KeepAttention(self, record), _RestoreAttention(self, record)

    def attach(self, modules) -> None:
        """Offload the checkpoints of ``modules`` that checkpoint their own forward (HF decoder layers).

        A module counts as checkpointed while ``module.training`` and its ``gradient_checkpointing`` flag are
        set and grad mode is on; otherwise nothing is offloaded. :meth:`detach` removes the hooks.
        """
        for module in modules:
            self._hooks.append(module.register_forward_pre_hook(self._enter_module))
            self._hooks.append(module.register_forward_hook(self._exit_module, always_call=True))

    def detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _enter_module(self, module, _args):
        active = module.training and getattr(module, "gradient_checkpointing", False) and torch.is_grad_enabled()
        stack = contextlib.ExitStack() if active else None
        if stack is not None:
            stack.enter_context(self.region())
        self._attached_calls.append(stack)

    def _exit_module(self, _module, _args, _output):
        stack = self._attached_calls.pop()
        if stack is not None:
            stack.close()

    # -- forward: copies out ------------------------------------------------------------------------------
    def _begin(self) -> _Layer:
        alive = [r() for r in self._records]
        if all(r is None or r.started for r in alive):  # the previous step's backward has begun: a new step
            self._step += 1
            self._records, self.layers, self.events = [], [], []
            self.bytes_to_host = self.bytes_to_device = 0
        record = _Layer(self._step, len(self._records))
        self._records.append(weakref.ref(record))
        self.layers.append(LayerAccount(record.index))
        return record

    def _pack(self, record: _Layer, tensor: torch.Tensor):
        if tensor.numel() == 0:  # e.g. older torch's dummy input of the checkpoint: nothing to move
            return ("as-is", tensor)
        return ("host", record, self._offload(record, tensor, "input"))

    def _offload(self, record: _Layer, tensor: torch.Tensor, what: str) -> int:
        """Copy ``tensor`` to host memory; returns its slot in ``record``."""
        nbytes = tensor.numel() * tensor.element_size()
        if self.host_limit_bytes is not None and self.live_host_bytes + nbytes > self.host_limit_bytes:
            raise MemoryError(f"checkpoint offload: {self.live_host_bytes + nbytes} host bytes would exceed "
                              f"host_limit_bytes={self.host_limit_bytes}; raise the limit or offload less")
        src = tensor.detach()
        with torch.no_grad():
            if src.device.type == "cuda":  # CUDA only: a side stream into pinned memory, overlapping compute
                stream = self._stream("d2h", src.device)
                stream.wait_stream(torch.cuda.current_stream(src.device))  # src is complete on the compute stream
                with torch.cuda.stream(stream):
                    host = torch.empty_like(src, device="cpu", pin_memory=self.pin_memory)
                    host.copy_(src, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(stream)
                src.record_stream(stream)  # the compute stream must not reuse src's block before the copy ends
            else:  # CPU: plain memory (pinning needs CUDA); a real copy, so the original can be freed
                host = torch.empty_like(src, device="cpu")
                host.copy_(src)
                done = None
        record.host.append(host)
        record.device_of.append(src.device)
        record.d2h_done.append(done)
        self.live_host_bytes += nbytes
        self.bytes_to_host += nbytes
        weakref.finalize(host, self._freed, nbytes)
        self.layers[record.index].kept.append(KeptTensor(what, tuple(src.shape), src.dtype, nbytes,
                                                         StorageWeakRef(src.untyped_storage())))
        self.events.append(("offload", record.index))
        return len(record.host) - 1

    def _freed(self, nbytes: int) -> None:
        self.live_host_bytes -= nbytes

    def _stream(self, kind: str, device: torch.device):  # CUDA only
        key = (kind, device)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device)
        return self._streams[key]

    # -- backward: copies back, one layer ahead -----------------------------------------------------------
    def _unpack(self, packed):
        if packed[0] == "as-is":
            return packed[1]
        _, record, slot = packed
        return self._fetch(record, slot)

    def _fetch(self, record: _Layer, slot: int) -> torch.Tensor:
        """Layer ``record``'s tensor ``slot`` on its device; the first fetch of a layer prefetches the previous."""
        if not record.started:  # this layer's backward begins (its recomputation asks for its inputs)
            record.started = True
            if not record.prefetched:
                self._copy_in(record)
                self.events.append(("fetch", record.index))
            previous = self._previous(record)
            if previous is not None and not previous.prefetched:
                self._copy_in(previous)
                self.events.append(("prefetch", previous.index))
            self.events.append(("use", record.index))
        if slot not in record.fetched:  # used before (a second backward with retain_graph): fetch again
            self._copy_in(record, slots=[slot])
        tensor, ready = record.fetched.pop(slot)  # drop our reference: autograd frees it after its use
        if ready is not None:  # CUDA only: the compute stream waits for the copy, not the host
            torch.cuda.current_stream(tensor.device).wait_event(ready)
        return tensor

    def _previous(self, record: _Layer) -> _Layer | None:
        if record.step != self._step or record.index == 0:
            return None
        return self._records[record.index - 1]()

    def _copy_in(self, record: _Layer, slots=None) -> None:
        """Start copying ``record``'s host tensors back to their devices."""
        record.prefetched = True
        for slot in range(len(record.host)) if slots is None else slots:
            host, device = record.host[slot], record.device_of[slot]
            self.bytes_to_device += host.numel() * host.element_size()
            if device.type == "cuda":  # CUDA only
                stream, compute = self._stream("h2d", device), torch.cuda.current_stream(device)
                buf = torch.empty_like(host, device=device)  # on the compute stream, which frees it after use
                stream.wait_stream(compute)  # the block's previous user on the compute stream is done
                if record.d2h_done[slot] is not None:
                    stream.wait_event(record.d2h_done[slot])  # the host copy is complete
                with torch.cuda.stream(stream):
                    buf.copy_(host, non_blocking=True)
                    ready = torch.cuda.Event()
                    ready.record(stream)
                buf.record_stream(stream)  # freed unused, the block still waits for the copy
                record.fetched[slot] = (buf, ready)
            else:  # CPU: the host copy is the device copy
                record.fetched[slot] = (host, None)

    # -- accounting -----------------------------------------------------------------------------------------
    @property
    def host_bytes(self) -> int:
        """Host bytes of this step's offloaded checkpoints."""
        return sum(layer.host_bytes for layer in self.layers)


# -- attention's outputs: kept on the host, handed back in recomputation --------------------------------------
class _KeepAttention(TorchDispatchMode):
    """Forward of a remat checkpoint: copies each attention op's ``(out, lse)`` to the host."""

    def __init__(self, owner: CheckpointOffload, record: _Layer):
        super().__init__()
        self.owner, self.record = owner, record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is OP:
            self.record.attn_slots.append((self.owner._offload(self.record, out[0], "attn_out"),
                                           self.owner._offload(self.record, out[1], "attn_lse")))
        return out


class _RestoreAttention(TorchDispatchMode):
    """Recomputation of a remat checkpoint: each attention op returns its kept ``(out, lse)``, never runs."""

    def __init__(self, owner: CheckpointOffload, record: _Layer):
        super().__init__()
        self.owner, self.record, self.calls = owner, record, 0

    def __enter__(self):
        self.calls = 0  # a second backward (retain_graph) replays from the first call
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not OP:
            return func(*args, **(kwargs or {}))
        if self.calls >= len(self.record.attn_slots):
            raise RuntimeError(f"attention ran {self.calls + 1} times in the recomputation of checkpointed layer "
                               f"{self.record.index} but {len(self.record.attn_slots)} times in its forward; "
                               f"the checkpointed function must be deterministic")
        out_slot, lse_slot = self.record.attn_slots[self.calls]
        self.calls += 1
        return self.owner._fetch(self.record, out_slot), self.owner._fetch(self.record, lse_slot)
