"""The patches a peer needs to run here (CPU, gloo), each one small named function, listed beside its results.

Every patch checks that what it replaces is still where it was and raises :class:`PatchBroken` naming the peer,
the version and what moved otherwise, so a peer's new release that breaks a patch says so (tests/test_peers.py runs
every installed adapter, hence every patch, at P = 2).

* ``deepspeed_no_shm_build`` — DeepSpeed-Ulysses reaches ``torch.distributed`` through ``deepspeed.comm``, whose
  backend object exists only after ``deepspeed.init_distributed`` (``deepspeed.comm.all_to_all_single`` calls
  ``cdb.all_to_all_single`` on a module global that is ``None`` before). ``init_distributed`` adopts the process group
  torch made, but its ``TorchBackend`` first JIT-compiles ``deepspeed_shm_comm_op`` on CPU (a shared-memory
  all-reduce: minutes of C++ on a small machine), which Ulysses' all-to-all never uses. The patch makes that build
  return ``None`` (DeepSpeed's own "op not compatible" path) while ``init_distributed`` runs.
* ``torch_cp_cpu_sdpa`` — ``context_parallel`` routes SDPA's CUDA ops (flash, efficient, cuDNN) through its ring
  code; on CPU SDPA dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu``, which CP does not know
  (``NotImplementedError``/sharding errors). The patch registers that op and its backward with CP's DTensor op
  handlers, calling CP's own ``_templated_ring_attention(_backward)`` (private APIs: pinned to torch 2.13).
* ``yunchang_cpu_flash`` — USP (``yunchang``) calls ``aten._scaled_dot_product_flash_attention`` for its torch
  attention types, a CUDA-only op; the patch points yunchang's module global at the CPU flash op
  (``_scaled_dot_product_flash_attention_for_cpu``: same out and lse), with kv heads repeated for GQA as flash-attn
  does natively. Its torch backward is not implemented (``pytorch_attn_backward`` raises): forward only.
* ``megatron_cpu_device`` — megatron-core (0.19.2) allocates its communication and ``baddbmm`` buffers with
  ``device=torch.cuda.current_device()`` (``tensor_parallel.mappings``, ``utils.GlobalMemoryBuffer``), in the forward
  and in the backward; without CUDA that call raises "Torch not compiled with CUDA enabled". The patch makes it
  return ``"cpu"`` while active (the adapters hold it from ``prepare`` to ``finish``, the backward included).
* ``megatron_cpu_masks`` — the PyTorch softmax path of megatron-core's ``DotProductAttention``
  (``fusions.fused_softmax.FusedScaleMaskSoftmax.forward_torch_softmax``) builds its causal and sliding-window masks
  with ``device="cuda"`` (``transformer.utils.get_default_causal_mask``, ``get_sliding_window_causal_mask``). The patch
  points ``fused_softmax``'s two names at the same masks built on the CPU (same formulas: ``True`` = masked).

megatron-core's weight initialization forks its CUDA RNG tracker (``model_parallel_cuda_manual_seed`` needs CUDA);
its ``use_cpu_initialization=True`` option initializes on the CPU instead and the runs here load their weights, so no
patch of the tracker is needed (attention dropout is 0, and with sequence parallelism its dropout does not fork).
"""

from __future__ import annotations

import contextlib
import importlib.metadata

import torch

__all__ = ["PatchBroken", "deepspeed_no_shm_build", "torch_cp_cpu_sdpa", "yunchang_cpu_flash", "megatron_cpu_device",
           "megatron_cpu_masks", "PATCHES"]


class PatchBroken(RuntimeError):
    """A peer's release moved what a patch replaces: the patch needs updating for that version."""


def _broken(package: str, what: str) -> PatchBroken:
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    return PatchBroken(f"{package} {version}: {what}; bench/peers/patches.py needs updating for this version")


@contextlib.contextmanager
def deepspeed_no_shm_build():
    """While active, ``deepspeed.comm``'s ``TorchBackend`` builds no shared-memory comm op (see the module doc)."""
    import importlib
    ds_torch = importlib.import_module("deepspeed.comm.torch")  # `import a.b.torch as x` would give torch itself
    if not callable(getattr(ds_torch, "build_shm_op", None)):
        raise _broken("deepspeed", "deepspeed.comm.torch.build_shm_op is gone")
    original = ds_torch.build_shm_op
    ds_torch.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_torch.build_shm_op = original


def torch_cp_cpu_sdpa() -> None:
    """Route CPU SDPA (``_scaled_dot_product_flash_attention_for_cpu`` and backward) through CP's ring code."""
    from torch.distributed.tensor import DTensor, Shard
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp
        ring, ring_bwd, handlers = cp._templated_ring_attention, cp._templated_ring_attention_backward, cp.custom_ops
    except (ImportError, AttributeError) as exc:
        raise _broken("torch", f"context parallel's ring functions or op handlers moved ({exc})") from exc
    aten = torch.ops.aten
    fwd_op = aten._scaled_dot_product_flash_attention_for_cpu
    bwd_op = aten._scaled_dot_product_flash_attention_for_cpu_backward

    def local(args, kwargs):
        args = [a.to_local() if isinstance(a, DTensor) else a for a in args]
        kwargs = {k: (a.to_local() if isinstance(a, DTensor) else a) for k, a in kwargs.items()}
        return args, kwargs

    def wrap(mesh, tensors):
        return tuple(DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in tensors)

    def forward(op_call, args, kwargs):
        mesh = args[0].device_mesh
        (q, k, v, *rest), kwargs = local(args, kwargs)
        dropout_p = rest[0] if rest else kwargs.pop("dropout_p", 0.0)
        is_causal = rest[1] if len(rest) > 1 else kwargs.pop("is_causal", False)
        if kwargs.get("attn_mask") is not None:
            raise NotImplementedError("attn_mask is not supported by context parallel")
        out, lse = ring(mesh.get_group(), 2, fwd_op.default, q, k, v, is_causal=is_causal, dropout_p=dropout_p,
                        scale=kwargs.get("scale"))
        return wrap(mesh, (out, lse))

    def backward(op_call, args, kwargs):
        mesh = args[0].device_mesh
        names = ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal")
        bound = dict(zip(names, local(args, {})[0]))
        bound.update(local((), kwargs)[1])
        grads = ring_bwd(mesh.get_group(), 2, bwd_op.default, grad_out=bound["grad_out"], grad_out_name="grad_out",
                         query=bound["query"], key=bound["key"], value=bound["value"], out=bound["out"],
                         logsumexp=bound["logsumexp"], is_causal=bound["is_causal"], dropout_p=bound["dropout_p"],
                         scale=bound.get("scale"))
        return wrap(mesh, grads[:3])

    handlers[fwd_op.default] = forward
    handlers[bwd_op.default] = backward


@contextlib.contextmanager
def yunchang_cpu_flash():
    """While active, yunchang's torch-flash attention runs the CPU flash SDPA op (see the module doc)."""
    import importlib
    kernels = importlib.import_module("yunchang.kernels.attention")
    if not hasattr(kernels, "_scaled_dot_product_flash_attention") or not callable(
            getattr(kernels, "pytorch_attn_forward", None)):
        raise _broken("yunchang", "yunchang.kernels.attention._scaled_dot_product_flash_attention (or "
                      "pytorch_attn_forward) is gone")
    original = kernels._scaled_dot_product_flash_attention

    def cpu_flash(q, k, v, dropout_p=0.0, is_causal=False, scale=None, **unused):  # (b, h, s, d)
        if k.shape[1] != q.shape[1]:  # GQA: flash-attn takes fewer kv heads; the CPU op wants them repeated
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal,
                                                                           scale=scale)

    kernels._scaled_dot_product_flash_attention = cpu_flash
    try:
        yield
    finally:
        kernels._scaled_dot_product_flash_attention = original


@contextlib.contextmanager
def megatron_cpu_device():
    """While active, ``torch.cuda.current_device()`` is ``"cpu"``, where megatron-core allocates (module doc)."""
    import importlib
    for name in ("megatron.core.tensor_parallel.mappings", "megatron.core.utils"):
        if "torch.cuda.current_device()" not in _source(importlib.import_module(name)):
            raise _broken("megatron-core", f"{name} no longer allocates on torch.cuda.current_device()")
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = original


@contextlib.contextmanager
def megatron_cpu_masks():
    """While active, megatron-core's torch softmax builds its causal / sliding-window masks on the CPU (module doc)."""
    import importlib
    fused = importlib.import_module("megatron.core.fusions.fused_softmax")
    names = ("get_default_causal_mask", "get_sliding_window_causal_mask")
    if not all(callable(getattr(fused, n, None)) for n in names):
        raise _broken("megatron-core", f"megatron.core.fusions.fused_softmax no longer calls {' / '.join(names)}")
    originals = {n: getattr(fused, n) for n in names}

    def causal(sq):  # transformer.utils.get_default_causal_mask, on the CPU
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    def sliding(sq, skv, window_size):  # transformer.utils.get_sliding_window_causal_mask, on the CPU
        m = torch.ones(sq, skv, dtype=torch.bool)
        return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])

    fused.get_default_causal_mask, fused.get_sliding_window_causal_mask = causal, sliding
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(fused, n, fn)


def _source(module) -> str:
    import inspect
    try:
        return inspect.getsource(module)
    except OSError:  # no source shipped: cannot tell, assume it still needs the patch
        return "torch.cuda.current_device()"


PATCHES = {
    "deepspeed_no_shm_build": "deepspeed.init_distributed on CPU JIT-builds a shm all-reduce op Ulysses never uses "
                              "(minutes); its build returns None while init runs",
    "torch_cp_cpu_sdpa": "CP knows only CUDA SDPA ops; CPU flash SDPA fwd/bwd registered with CP's handlers, "
                         "calling CP's own ring functions (private, torch 2.13)",
    "yunchang_cpu_flash": "USP's torch attention calls the CUDA-only flash SDPA op; aliased to the CPU flash op "
                          "(kv heads repeated for GQA); no torch backward in yunchang: forward only",
    "megatron_cpu_device": "megatron-core allocates comm and matmul buffers on torch.cuda.current_device(); "
                           "returns 'cpu' while the adapter runs (forward and backward)",
    "megatron_cpu_masks": "megatron-core's torch softmax builds causal / sliding-window masks on 'cuda'; the same "
                          "masks built on the CPU",
}
