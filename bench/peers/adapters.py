"""One adapter per system: its real entry point called the way its users call it, on a workload's shard.

An adapter runs inside one rank of the harness's process group. ``prepare(w)`` does what a user does once (import,
init, patches; raises :class:`Refused` with the system's own constraint when it cannot run the workload),
``shard(w, full)`` cuts this rank's inputs from the global tensors in the system's own layout and sets ``rows`` (the
global positions of this rank's tokens, to put results back), ``forward(q, k, v)`` is the system's call (the harness
runs backward on its output), ``work(w)`` the visible (query, key) pairs x heads this rank computes. The patches a
peer needs on CPU are named functions in :mod:`bench.peers.patches`, listed in ``patches`` (and in the results).
``device`` is set by the harness before ``prepare``: the CPU, or this rank's GPU (``cuda_patches``: the patches a
peer needs there; none does: on CUDA each runs unpatched, as its users run it, and the inputs arrive on the GPU).

Imports: torch, distattn, the peers' packages (lazily, in ``prepare``), ``bench.peers.workload`` and ``.patches``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.peers import patches
from bench.peers.workload import Workload, visible, work_area

__all__ = ["Refused", "Adapter", "ADAPTERS", "adapter"]


class Refused(Exception):
    """The system does not run this workload (its constraint, in its words where it has some)."""


class Adapter:
    name = ""
    package = ""  # the distribution whose version the row reports ("" : none needed)
    patches: tuple[str, ...] = ()  # names of bench.peers.patches functions this adapter applies (on CPU)
    cuda_patches: tuple[str, ...] = ()  # ... and on a GPU
    device = torch.device("cpu")  # where the harness runs this rank (set before ``prepare``)

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"
    forward_only = False  # the system has no backward here (its gradients are not compared)

    def version(self) -> str | None:
        """The installed version of ``package``, or ``None`` when it is not installed."""
        try:
            return importlib.metadata.version(self.package) if self.package else torch.__version__
        except importlib.metadata.PackageNotFoundError:
            return None

    def applies(self, w: Workload) -> bool:
        return True

    def refuses(self, w: Workload, device: str) -> str | None:
        """Why the system cannot run ``w`` on ``device``, known without starting it (its row's refused cell), or
        ``None``. Checked by the harness before any process starts; constraints met only inside ``prepare`` raise
        :class:`Refused` there."""
        return None

    def prepare(self, w: Workload) -> None:
        pass

    def contiguous_shard(self, w: Workload, full: dict) -> dict:
        rank, n = dist.get_rank(), w.tokens_per_rank
        self.rows = torch.arange(rank * n, (rank + 1) * n)
        return {k: t[:, rank * n:(rank + 1) * n].contiguous() for k, t in full.items()}

    def work(self, w: Workload) -> int:
        """Visible pairs x heads this rank computes: its query rows, all heads (sequence-split systems)."""
        return work_area(w, self.rows)


# -- distattn ------------------------------------------------------------------------------------------------
class DistAttn(Adapter):
    package = "distattn"

    def __init__(self, schedule: str):
        self.schedule = schedule
        self.name = f"distattn ({schedule})"

    def version(self):
        import distattn
        return distattn.__version__

    def applies(self, w):
        return self.schedule != "placed" or w.mask == "docs"  # the placement is for packed documents

    def prepare(self, w):
        import distattn
        self.da = distattn
        self.layout = None
        if self.schedule == "placed":
            from distattn.sharding import placement
            self.layout = placement(w.cu_seqlens(), w.tokens_per_rank)

    group = None  # the process group distattn is called with (None: the world; 2-D: its two groups)

    def degrees(self, w) -> tuple[int, int, str]:
        """``(U, R, the ring's schedule)``: no Ulysses level, every rank on the ring (the 2-D adapter overrides)."""
        return 1, w.world, self.schedule

    @property
    def ring_schedule(self) -> str:
        return self.schedule

    def shard(self, w, full):
        if w.mask == "docs":  # cu_seqlens as a user keeps them, made once (on the host, as distattn reads them)
            self.cu = torch.tensor(w.cu_seqlens(), dtype=torch.int32)
            self.max_len = int((self.cu[1:] - self.cu[:-1]).max())
        kw = {"layout": self.layout} if self.layout is not None else {"schedule": self.ring_schedule}
        pos = torch.arange(w.total)[None]
        self.rows = self.da.shard_sequence(pos, group=self.group, **kw)[0]
        return {k: self.da.shard_sequence(t, group=self.group, **kw).contiguous() for k, t in full.items()}

    def forward(self, q, k, v, w):
        kw = dict(causal=True, schedule=self.ring_schedule, group=self.group)
        if w.mask == "window":
            kw["window_size"] = (w.window, 0)
        if w.mask == "docs":
            return self.da.dist_flash_attn_varlen_func(q[0], k[0], v[0], self.cu, self.max_len, **kw)[None]
        return self.da.dist_flash_attn_func(q, k, v, **kw)

    def work(self, w):
        """From the plan the executor runs (``distattn.schedule``): each rank's tasks, helpers included."""
        import numpy as np

        from distattn.schedule import MaskSpec, make_plan
        mask = MaskSpec(causal=True, window=(w.window, 0) if w.mask == "window" else (-1, -1),
                        cu_seqlens=tuple(w.cu_seqlens()) if w.mask == "docs" else None)
        plan = make_plan(w.world, True, self.schedule, mask=None if mask.dense else mask, chunk=w.tokens_per_rank)
        rt = plan.run_table
        per_rank = np.zeros(w.world)
        for start, stop, cost in zip(rt.start, rt.stop, rt.cost):
            per_rank[start:stop] += cost
        # cost: units of one full n x n pair; the dense causal diagonal counts n(n+1)/2 / n^2 in the plan as 1/2
        return int(round(per_rank[dist.get_rank()] * w.tokens_per_rank ** 2 * w.heads_q * w.batch))


class DistAttn2D(DistAttn):
    """distattn's two-dimensional sequence parallelism (``distattn.ulysses``), called as its users call it: the
    groups from ``distattn.make_2d_groups(U)``, passed as ``group=(ulysses_group, ring_group)``. ``U`` is the largest
    divisor of P over which distattn can split the heads (kv heads replicated when fewer than U); the ring over the
    ``R = P / U`` others runs zigzag on dense masks and the placement on packed documents (``R = 1``: no ring)."""

    def __init__(self):
        self.schedule = "2d"
        self.name = "distattn (2-D)"

    def applies(self, w):
        return True

    def degrees(self, w) -> tuple[int, int, str]:
        """``(U, R, the ring's schedule)`` for ``w`` (no communication: the harness's cross-check reads it too)."""
        from distattn.schedule import ulysses_heads

        def splits(u):
            try:
                ulysses_heads(w.heads_q, w.heads_kv, u)
                return True
            except ValueError:
                return False

        u = max(u for u in range(1, w.world + 1) if w.world % u == 0 and splits(u))
        r = w.world // u
        return u, r, "balanced" if r == 1 else ("placed" if w.mask == "docs" else "zigzag")

    def prepare(self, w):
        import distattn
        self.da = distattn
        self.U, self.R, self._ring = self.degrees(w)
        self.group = distattn.make_2d_groups(self.U)  # a collective: every rank, in the same order
        self.layout = None
        if self._ring == "placed":
            from distattn.sharding import placement
            self.layout = placement(w.cu_seqlens(), w.tokens_per_rank, self.group)

    @property
    def ring_schedule(self) -> str:
        return self._ring

    def work(self, w):
        """Visible pairs of this rank's ring shard (all ``U * n`` of its rows) x its ``h_q / U`` query heads."""
        rows = None
        if self.R > 1:  # the ring shard: the rows of every rank of this rank's Ulysses group
            parts = [torch.empty_like(self.rows) for _ in range(self.U)]
            dist.all_gather(parts, self.rows, group=self.group[0])
            rows = torch.cat(parts)
        return work_area(w, rows) // self.U


# -- DeepSpeed-Ulysses -----------------------------------------------------------------------------------------
def _local_sdpa(w: Workload):
    """The local attention a DeepSpeed user hands ``DistributedAttention``: SDPA on the whole sequence, its heads."""
    seen = {"cpu": None if w.mask == "causal" else visible(w)}  # the mask, moved to a device once

    def attn(q, k, v, *args, **kwargs):  # (b, T, h/P, d) after the all-to-all
        if str(q.device) not in seen:
            seen[str(q.device)] = None if seen["cpu"] is None else seen["cpu"].to(q.device)
        mask = seen[str(q.device)]
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        gqa = qt.shape[1] != kt.shape[1]
        out = (F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=gqa) if mask is None else
               F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=gqa))
        return out.transpose(1, 2)

    return attn


class DeepSpeedUlysses(Adapter):
    name = "DeepSpeed-Ulysses"
    package = "deepspeed"
    patches = ("deepspeed_no_shm_build",)

    def prepare(self, w):
        import os
        os.environ.setdefault("DS_ACCELERATOR", "cpu" if self.on_cpu else "cuda")
        os.environ.setdefault("DS_BUILD_OPS", "0")
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention
        if w.heads_kv % w.world and w.world % w.heads_kv:
            raise Refused(f"heads_kv ({w.heads_kv}) and P ({w.world}): Ulysses splits kv heads over the ranks")
        with patches.deepspeed_no_shm_build() if self.on_cpu else contextlib.nullcontext():
            deepspeed.init_distributed(dist_backend="gloo")  # wraps torch's process group, made by the harness
        self.attn = DistributedAttention(_local_sdpa(w), dist.group.WORLD, scatter_idx=2, gather_idx=1)

    def shard(self, w, full):
        return self.contiguous_shard(w, full)

    def forward(self, q, k, v, w):
        return self.attn(q, k, v, 0)  # batch_dim_idx=0: (b, s, h, d)

    def work(self, w):
        return work_area(w) // w.world  # every token, 1/P of the heads


# -- PyTorch context parallel ------------------------------------------------------------------------------------
class TorchCP(Adapter):
    package = "torch"
    patches = ("torch_cp_cpu_sdpa",)

    def __init__(self, rotate: str):
        self.rotate = rotate
        self.name = f"PyTorch CP ({rotate})"

    def prepare(self, w):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel  # noqa: F401  (fails if moved)
        from torch.distributed.tensor.experimental._attention import set_rotate_method
        if w.mask != "causal":
            raise Refused("context_parallel's SDPA takes no attn_mask (its input_fn shards every tensor argument): "
                          "no packed documents, no sliding window")
        if w.tokens_per_rank % 2:
            raise Refused(f"causal load balancing needs the sequence ({w.total}) to be a multiple of 2P "
                          f"({2 * w.world})")
        if self.on_cpu:
            patches.torch_cp_cpu_sdpa()
        set_rotate_method(self.rotate)
        self.mesh = init_device_mesh(self.device.type, (w.world,))

    def shard(self, w, full):
        from torch.distributed.tensor.experimental import context_parallel
        # (b, h, T, d) as SDPA takes it; torchtitan's llama repeats k/v to h_q heads before SDPA (CP's ring moves
        # those). Sharded in place by the context manager, with its causal load balancer (head-tail chunks).
        rep = w.heads_q // w.heads_kv
        bufs = [full["q"].transpose(1, 2).contiguous(),
                full["k"].repeat_interleave(rep, dim=2).transpose(1, 2).contiguous(),
                full["v"].repeat_interleave(rep, dim=2).transpose(1, 2).contiguous(),
                full["dout"].transpose(1, 2).contiguous(), torch.arange(w.total, device=full["q"].device)]
        self.ctx = context_parallel(self.mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2, 0])
        self.ctx.__enter__()  # left by the harness's finish()
        self.rows = bufs[4].cpu().clone()
        self.rep = rep
        return {"q": bufs[0], "k": bufs[1], "v": bufs[2], "dout": bufs[3]}

    def forward(self, q, k, v, w):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def to_bshd(self, name, t):
        """(b, h, n, d) -> (b, n, h, d); dk/dv summed over the repeated heads (the chain rule of repeat_kv)."""
        t = t.transpose(1, 2)
        if name in ("dk", "dv") and self.rep > 1:
            b, n, h, d = t.shape
            t = t.reshape(b, n, h // self.rep, self.rep, d).sum(3)
        return t

    def finish(self):
        self.ctx.__exit__(None, None, None)


# -- USP (yunchang) -------------------------------------------------------------------------------------------------
class USP(Adapter):
    """``yunchang.LongContextAttention`` (Ulysses x ring), as its users set it up: ``set_seq_parallel_pg`` with the
    largest Ulysses degree the kv heads allow, the rest ring; its torch attention type (flash-attn is CUDA only)."""

    name = "USP (yunchang)"
    package = "yunchang"
    patches = ("yunchang_cpu_flash",)
    forward_only = True  # yunchang's torch attention has no backward ("Not implemented backward ...")

    def prepare(self, w):
        import yunchang
        from yunchang.kernels import AttnType
        if w.mask != "causal":
            raise Refused("USP takes causal and window_size but no document boundaries, and its torch attention "
                          "(the only one on CPU) ignores window_size: dense causal only here")
        ulysses = max(u for u in range(1, w.world + 1) if w.world % u == 0 and w.heads_kv % u == 0)
        yunchang.set_seq_parallel_pg(ulysses, w.world // ulysses, dist.get_rank(), w.world)
        self.degrees = (ulysses, w.world // ulysses)
        self.attn = yunchang.LongContextAttention(ring_impl_type="basic", attn_type=AttnType.TORCH_FLASH)

    def shard(self, w, full):
        return self.contiguous_shard(w, full)

    def forward(self, q, k, v, w):
        with patches.yunchang_cpu_flash() if self.on_cpu else contextlib.nullcontext():
            return self.attn(q, k, v, causal=True)  # (b, s/P, h, d)


# -- megatron-core (tensor + sequence parallel) -----------------------------------------------------------------------
class MegatronCore(Adapter):
    """megatron-core's attention core (``DotProductAttention``: its torch path) with tensor parallel = P and sequence
    parallel, set up as its users do (``parallel_state.initialize_model_parallel``, a ``TransformerConfig``), inside
    the communication of its attention layer with identity projections: the sequence-sharded q, k, v all-gathered
    along the sequence (``tensor_parallel.gather_from_sequence_parallel_region``, what its column-parallel QKV
    linear does to its input; backward: a reduce-scatter), this rank's heads (``h/P``, Megatron's split) attended
    over the whole sequence, and the output, placed at this rank's heads of a zero ``(T, b, h_q d)`` partial (what
    the row-parallel output linear makes of it), reduce-scattered back to the sequence shards
    (``reduce_scatter_to_sequence_parallel_region``; backward: an all-gather). Packed documents: the block-diagonal
    causal ``attention_mask`` Megatron's GPT dataset builds with ``reset_attention_mask=True`` (its non-TE path takes
    no ``packed_seq_params``). ``context_parallel=True``: megatron-core's context parallel, which needs
    TransformerEngine (its ``DotProductAttention`` refuses it: the row's refused cell)."""

    package = "megatron-core"
    patches = ("megatron_cpu_device", "megatron_cpu_masks")

    def __init__(self, context_parallel: bool = False):
        self.cp = context_parallel
        self.name = "megatron-core (CP)" if context_parallel else "megatron-core (TP+SP)"

    def prepare(self, w):
        from megatron.core import parallel_state
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.transformer_config import TransformerConfig
        self._patched = contextlib.ExitStack()  # held until finish(): the backward allocates too
        if self.on_cpu:
            self._patched.enter_context(patches.megatron_cpu_device())
            self._patched.enter_context(patches.megatron_cpu_masks())
        tp, cp = (1, w.world) if self.cp else (w.world, 1)
        dtype, why = w.torch_dtype, ""
        try:
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
            cfg = TransformerConfig(
                num_layers=1, hidden_size=w.heads_q * w.head_dim, num_attention_heads=w.heads_q,
                num_query_groups=w.heads_kv, kv_channels=w.head_dim, tensor_model_parallel_size=tp,
                context_parallel_size=cp, sequence_parallel=tp > 1, attention_dropout=0.0, hidden_dropout=0.0,
                add_bias_linear=False, use_cpu_initialization=True, masked_softmax_fusion=False,
                attention_softmax_in_fp32=True, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
                params_dtype=dtype, window_size=(w.window, 0) if w.mask == "window" else None)
            mask_type = AttnMaskType.arbitrary if w.mask == "docs" else AttnMaskType.causal
            if tp > 1 and w.heads_kv % tp:  # megatron's divide() says only "1 is not divisible by 2": say what
                why = (f"DotProductAttention splits num_query_groups ({w.heads_kv}) over tensor_model_parallel_size "
                       f"({tp}): ")
            self.core = DotProductAttention(cfg, layer_number=1, attn_mask_type=mask_type, attention_type="self")
            if not self.on_cpu:  # what a Megatron user's setup does on GPUs (its RNG tracker's seeds)
                from megatron.core import tensor_parallel
                tensor_parallel.model_parallel_cuda_manual_seed(1234)
        except (AssertionError, ValueError) as exc:
            self._patched.close()
            raise Refused(f"megatron-core {self.version()}: {why}{exc}") from exc
        # Megatron's masks: True = masked; the block-diagonal causal mask of packed documents, as its dataset builds it
        self.mask = None if w.mask != "docs" else ~visible(w)[None, None].to(self.device)
        self.tp_rank, self.tp = parallel_state.get_tensor_model_parallel_rank(), tp

    def shard(self, w, full):
        return self.contiguous_shard(w, full)

    def forward(self, q, k, v, w):
        from megatron.core import tensor_parallel as mtp
        b, n, hq, d = q.shape
        hkv = k.shape[2]
        qkv = torch.cat([t.transpose(0, 1).reshape(n, b, -1) for t in (q, k, v)], -1)  # (n, b, (hq + 2 hkv) d)
        qkv = mtp.gather_from_sequence_parallel_region(qkv)  # (T, b, (hq + 2 hkv) d), one all-gather
        T, r, hl, gl = qkv.shape[0], self.tp_rank, hq // self.tp, hkv // self.tp
        qf, kf, vf = qkv.split([hq * d, hkv * d, hkv * d], -1)
        ql = qf.view(T, b, hq, d)[:, :, r * hl:(r + 1) * hl]  # this rank's heads, the whole sequence
        kl, vl = (t.view(T, b, hkv, d)[:, :, r * gl:(r + 1) * gl] for t in (kf, vf))
        ctx = self.core(ql, kl, vl, self.mask)  # (T, b, hl d)
        partial = F.pad(ctx, (r * hl * d, (self.tp - 1 - r) * hl * d))  # (T, b, hq d): zero at the others' heads
        out = mtp.reduce_scatter_to_sequence_parallel_region(partial)  # (n, b, hq d)
        return out.view(n, b, hq, d).transpose(0, 1)

    def work(self, w):
        return work_area(w) // w.world  # every token, 1/P of the heads (computed densely: masked, not skipped)

    def finish(self):
        from megatron.core import parallel_state
        parallel_state.destroy_model_parallel()
        self._patched.close()


# -- ring-flash-attention --------------------------------------------------------------------------------------------
class RingFlashAttn(Adapter):
    """``ring_flash_attn`` (zhuzilin/ring-flash-attention) as its users call it: ``zigzag_ring_flash_attn_func`` on
    zigzag shards (chunks ``r`` and ``2P-1-r`` of ``2P``) for the dense masks, and on packed documents
    ``llama3_flash_attn_varlen_func`` on contiguous shards with the arguments of
    ``llama3_flash_attn_prepare_cu_seqlens`` (what its Hugging Face adapter does), ``heads_k_stride=1``. It needs
    flash-attn's CUDA build ("not installed" elsewhere), fp16 or bf16, and a GPU per rank with NCCL: its ring sends
    CUDA tensors point to point, which gloo cannot carry, so on this harness's ranks (gloo, sharing a GPU) it is a
    refused row. No sliding window: it hands ``window_size`` to each block's flash-attn call in the block's local
    positions (right only for ``(-1, -1)``). ``module``: the module the calls go to; the tests point it at distattn's
    drop-in of the same API (``distattn.compat.ring_flash_attn``, ``needs_flash_attn = False``), which runs on the
    CPU over gloo, to hold this adapter's sharding and arguments to fp64."""

    name = "ring-flash-attn"
    package = "ring-flash-attn"
    module = "ring_flash_attn"
    needs_flash_attn = True

    def refuses(self, w, device):
        if w.mask == "window":
            return ("ring-flash-attn hands window_size to every block's flash-attn call in the block's local positions "
                    "(right only for (-1, -1)): no sliding window")
        if not self.needs_flash_attn:
            return None
        if device != "cuda":
            return "flash-attn's kernels are CUDA only"
        if w.dtype not in ("bfloat16", "float16"):
            return f"flash-attn takes fp16 and bf16, not {w.dtype}"
        return ("its ring sends CUDA tensors point to point (batch_isend_irecv), which gloo cannot carry, and NCCL "
                "needs a GPU per rank: it needs P GPUs and NCCL, not ranks sharing a GPU over gloo")

    def prepare(self, w):
        import importlib
        if w.mask != "docs" and w.tokens_per_rank % 2:
            raise Refused(f"zigzag shards need an even number of tokens per rank (2P chunks), got {w.tokens_per_rank}")
        self.rfa = importlib.import_module(self.module)

    def shard(self, w, full):
        if w.mask == "docs":
            return self.contiguous_shard(w, full)
        rank, P, half = dist.get_rank(), w.world, w.tokens_per_rank // 2
        chunks = (rank, 2 * P - 1 - rank)
        self.rows = torch.cat([torch.arange(c * half, (c + 1) * half) for c in chunks])
        return {k: torch.cat([t[:, c * half:(c + 1) * half] for c in chunks], 1).contiguous() for k, t in full.items()}

    def forward(self, q, k, v, w):
        if w.mask != "docs":
            return self.rfa.zigzag_ring_flash_attn_func(q, k, v, causal=True)
        cu = torch.tensor(w.cu_seqlens(), dtype=torch.int32, device=q.device)
        cu_q, cu_k, max_q, max_k, k_slice = self.rfa.llama3_flash_attn_prepare_cu_seqlens(
            cu, causal=True, rank=dist.get_rank(), world_size=w.world)
        out = self.rfa.llama3_flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, max_q, max_k, heads_k_stride=1,
                                                     local_k_slice=k_slice, causal=True)
        return out[None]


ADAPTERS = {
    "distattn-balanced": lambda: DistAttn("balanced"),
    "distattn-zigzag": lambda: DistAttn("zigzag"),
    "distattn-placed": lambda: DistAttn("placed"),
    "distattn-2d": DistAttn2D,
    "deepspeed-ulysses": DeepSpeedUlysses,
    "torch-cp-alltoall": lambda: TorchCP("alltoall"),
    "torch-cp-allgather": lambda: TorchCP("allgather"),
    "usp": USP,
    "megatron-core": MegatronCore,
    "megatron-core-cp": lambda: MegatronCore(context_parallel=True),
    "ring-flash-attn": RingFlashAttn,
}


def adapter(key: str) -> Adapter:
    if key not in ADAPTERS:
        raise ValueError(f"unknown system {key!r}; choose from {sorted(ADAPTERS)}")
    return ADAPTERS[key]()
