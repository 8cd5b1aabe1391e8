"""DeepSpeed-Ulysses itself (``deepspeed.sequence.layer.DistributedAttention``) as a sequence-parallel method, to hold
the home-made :class:`bench.baselines.ulysses.Ulysses` (distattn's two-dimensional path with ``U = P``, ``R = 1``)
to the real one (issue 37, part 3; ``tests/test_baselines_real.py``).

The projections, RoPE and MLP are the shared body (:class:`~bench.baselines.base.SequenceParallelMethod`); the core
is DeepSpeed's ``DistributedAttention`` over the method's group, called as its users call it: ``(b, n, h, d)`` in,
``scatter_idx=2, gather_idx=1``, with the local attention a user hands it (SDPA over the whole sequence and this
rank's heads, GQA by SDPA's ``enable_gqa``). On CPU ``deepspeed.init_distributed`` adopts torch's process group with
the shared-memory op's JIT build skipped (``bench.peers.patches.deepspeed_no_shm_build``: Ulysses never uses it).
Not in :data:`bench.baselines.METHODS` (``deepspeed`` is the optional ``[peers]`` extra): :data:`PEER_METHODS`.

What the test found (P = 2, 3 heads groups, fp32): the same outputs and gradients within the accuracy rule, and not
the same bytes: DeepSpeed keeps the head-sharded q, k, v and out for its backward (autograd saves the all-to-all
outputs) and sends 4 tensors each way; the home-made one (the library's Ulysses) keeps no head-sharded copies and
sends q, k, v, dout, lse and delta again in the backward: more bytes, less memory.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.baselines.base import SequenceParallelMethod

__all__ = ["DeepSpeedUlysses", "PEER_METHODS"]


def _local_sdpa(causal: bool):
    def attn(q, k, v, *args, **kwargs):  # (b, N, h/P, d) after DeepSpeed's all-to-all
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=qt.shape[1] != kt.shape[1])
        return out.transpose(1, 2)

    return attn


class DeepSpeedUlysses(SequenceParallelMethod):
    name = "deepspeed-ulysses"

    def __init__(self):
        self._attn = {}

    def check(self, shape, world):
        if shape.heads_q % world or shape.heads_kv % world:
            raise ValueError(f"DeepSpeed-Ulysses cannot run heads {shape.heads_q}/{shape.heads_kv} on {world} "
                             f"ranks: its all-to-all splits the query and the kv heads over the ranks")

    def core(self, q, k, v, *, group, causal, backend):
        key = (id(group), causal)
        if key not in self._attn:
            os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
            import deepspeed
            from deepspeed.sequence.layer import DistributedAttention

            from bench.peers.patches import deepspeed_no_shm_build
            with deepspeed_no_shm_build():
                deepspeed.init_distributed(dist_backend=dist.get_backend())
            self._attn[key] = DistributedAttention(_local_sdpa(causal), group or dist.group.WORLD,
                                                   scatter_idx=2, gather_idx=1)
        return self._attn[key](q, k, v, 0)  # batch_dim_idx=0: (b, s, h, d)


PEER_METHODS = {"deepspeed-ulysses": DeepSpeedUlysses()}
