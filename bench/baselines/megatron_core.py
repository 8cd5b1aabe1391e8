"""megatron-core's own attention and MLP blocks with tensor + sequence parallelism, to hold the home-made
:class:`bench.baselines.megatron.MegatronTPSP` to the real one (issue 37; ``tests/test_baselines_real.py``).

Legend: ``b`` batch, ``n`` tokens per rank, ``N = P*n``, ``H`` hidden, ``g`` query heads per kv head, ``d`` head dim.

The blocks are megatron-core's ``SelfAttention`` and ``MLP`` from its local GPT layer spec
(``get_gpt_layer_local_spec``: column-parallel QKV, ``DotProductAttention``, row-parallel output; column-parallel fc1
with SwiGLU, row-parallel fc2; no TransformerEngine), each built by ``build_module`` from a
``TransformerConfig`` with ``tensor_model_parallel_size = P`` and ``sequence_parallel=True`` after
``parallel_state.initialize_model_parallel``, fed sequence-first ``(n, b, H)`` shards and megatron-core's own RoPE
(``RotaryEmbedding`` over the whole sequence, as ``GPTModel`` computes it under sequence parallelism). The weights
are the home-made method's, in Megatron's layout: the fused QKV rows interleaved per kv group (``g`` query heads,
then k, then v, the order ``get_query_key_value_tensors`` splits), cut in ``P`` row blocks; the output projection cut
in ``P`` column blocks; fc1 is this rank's gate rows then its up rows (Megatron's SwiGLU ``chunk(2)``), fc2 its
column block of ``W_down``. They enter through ``torch.func.functional_call``, so their gradients are the caller's.
The full layer is the home-made pre-norm layer around the two blocks (its RMSNorms are per token: no communication).

On CPU it holds the two megatron-core patches of ``bench.peers.patches`` (``megatron_cpu_device``,
``megatron_cpu_masks``) from its first call until :meth:`MegatronCoreTPSP.close`: the backward allocates on
``torch.cuda.current_device()`` too. ``use_cpu_initialization=True`` spares its CUDA RNG tracker (the weights are
replaced anyway). Not in :data:`bench.baselines.METHODS` (megatron-core is installed beside the ``[peers]`` extra:
setup.py's note): :data:`PEER_METHODS`.

What the test found (P = 2 and 4, MHA and GQA, the attention layer and the full layer, causal, fp32): the same
outputs and gradients within the accuracy rule, and the same bytes, 2 collectives forward and 3 backward of
``(b, n, H)`` per block (the input all-gathered again for the column-parallel weight gradient), the count
``bench/model.py`` gives the home-made one; except with fewer kv heads than ranks (GQA, 2 kv heads at P = 4):
megatron-core all-gathers its fused QKV output along the last dim to give each rank its whole kv group (and
reduce-scatters its gradient), ``2 (P-1) n b (h_q + 2 h_kv) d`` elements more per rank (1.80x the attention layer's
bytes there, 1.40x the full layer's), where the home-made one projects the shared kv heads on each rank that reads
them.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from bench.baselines.base import Method

__all__ = ["MegatronCoreTPSP", "PEER_METHODS", "megatron_qkv_rows"]


def megatron_qkv_rows(heads_q: int, heads_kv: int, d: int) -> torch.Tensor:
    """Rows of ``cat([wq, wk, wv])`` in megatron-core's fused QKV order: per kv group, its ``g`` query heads, k, v."""
    g = heads_q // heads_kv
    k0 = heads_q * d  # where wk's rows start in cat([wq, wk, wv]); wv's after them
    v0 = k0 + heads_kv * d
    rows = []
    for j in range(heads_kv):
        rows.append(torch.arange(j * g * d, (j + 1) * g * d))
        rows.append(torch.arange(k0 + j * d, k0 + (j + 1) * d))
        rows.append(torch.arange(v0 + j * d, v0 + (j + 1) * d))
    return torch.cat(rows)


class MegatronCoreTPSP(Method):
    """megatron-core ``SelfAttention``, TP = P with sequence parallelism (see the module docstring)."""

    name = "megatron-core"

    def __init__(self):
        self._blocks = {}
        self._patched = None

    def check(self, shape, world):
        self._config(shape, world, True)  # megatron-core's own ValueError (heads, query groups vs P)
        if shape.ffn % world:  # its ColumnParallelLinear's divide() would assert "20 is not divisible by 8"
            raise ValueError(f"megatron-core cannot split ffn_hidden_size ({shape.ffn}) over "
                             f"tensor_model_parallel_size ({world}): it must be a multiple")

    def _config(self, shape, world, causal):  # RoPE base: RotaryEmbedding's own argument
        from megatron.core.transformer.transformer_config import TransformerConfig
        return TransformerConfig(
            num_layers=1, hidden_size=shape.hidden, num_attention_heads=shape.heads_q,
            num_query_groups=shape.heads_kv, kv_channels=shape.head_dim, tensor_model_parallel_size=world,
            sequence_parallel=world > 1, add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0,
            use_cpu_initialization=True, masked_softmax_fusion=False, apply_rope_fusion=False,
            gradient_accumulation_fusion=False, bias_dropout_fusion=False, ffn_hidden_size=shape.ffn,
            gated_linear_unit=True, activation_func=torch.nn.functional.silu, bias_activation_fusion=False)

    def shard(self, w_full, shape, rank, world):
        d = shape.head_dim
        rows = megatron_qkv_rows(shape.heads_q, shape.heads_kv, d).chunk(world)[rank]  # column-parallel: row block
        cols = torch.arange(shape.heads_q * d).chunk(world)[rank]  # row-parallel: column block
        f_rows = torch.arange(shape.ffn).chunk(world)[rank]
        fc1_rows = torch.cat([f_rows, shape.ffn + f_rows])  # rows of cat([w_gate, w_up]): this rank's gate, its up
        wqkv = torch.cat([w_full["wq"], w_full["wk"], w_full["wv"]])
        w_gate_up = torch.cat([w_full["w_gate"], w_full["w_up"]])
        placement = {"wqkv": (0, rows), "wo": (1, cols), "w_gate_up": (0, fc1_rows), "w_down": (1, f_rows),
                     "norm1": None, "norm2": None}
        full = {"wqkv": wqkv, "wo": w_full["wo"], "w_gate_up": w_gate_up, "w_down": w_full["w_down"],
                "norm1": w_full["norm1"], "norm2": w_full["norm2"]}
        params = {k: full[k] if where is None else full[k].index_select(*where).contiguous()
                  for k, where in placement.items()}
        return params, placement

    def _block(self, shape, world, causal):
        key = (shape, world, causal)
        if key in self._blocks:
            return self._blocks[key]
        from megatron.core import parallel_state
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.spec_utils import build_module

        from bench.peers.patches import megatron_cpu_device, megatron_cpu_masks
        if self._patched is None and not torch.cuda.is_available():
            self._patched = contextlib.ExitStack()
            self._patched.enter_context(megatron_cpu_device())
            self._patched.enter_context(megatron_cpu_masks())
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        if parallel_state.get_tensor_model_parallel_world_size() != world:
            raise ValueError(f"megatron-core's tensor-parallel group has "
                             f"{parallel_state.get_tensor_model_parallel_world_size()} ranks, this call {world}")
        config = self._config(shape, world, causal)
        spec = get_gpt_layer_local_spec().submodules.self_attention  # its params: attn_mask_type causal
        if not causal:  # padding with no mask given: nothing masked
            spec = dataclasses.replace(spec, params={**spec.params, "attn_mask_type": AttnMaskType.padding})
        block = build_module(spec, config=config, layer_number=1)
        # the spec's mlp is a builder taking the layer's process groups, called as TransformerLayer calls it
        mlp = get_gpt_layer_local_spec().submodules.mlp(
            config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups(), is_mtp_layer=False)
        rope = RotaryEmbedding(kv_channels=shape.head_dim, rotary_percent=1.0, rotary_base=int(shape.rope_base),
                               use_cpu_initialization=True)
        self._blocks[key] = (block, mlp, rope)
        return self._blocks[key]

    def attention(self, x_bnH, p, shape, *, group=None, causal=True, backend=None):
        if group is not None and dist.get_world_size(group) != dist.get_world_size():
            raise ValueError("MegatronCoreTPSP runs on megatron-core's own groups: the whole world (group=None)")
        world = dist.get_world_size()
        block, _, rope = self._block(shape, world, causal)
        emb = rope(x_bnH.shape[1] * world).to(x_bnH.device)  # (N, 1, 1, d): the whole sequence, as GPTModel under SP
        x_nbH = x_bnH.transpose(0, 1)  # megatron-core is sequence-first
        y_nbH, _ = torch.func.functional_call(block, {"linear_qkv.weight": p["wqkv"], "linear_proj.weight": p["wo"]},
                                              (x_nbH, None), {"rotary_pos_emb": emb})
        return y_nbH.transpose(0, 1)

    def mlp(self, u_bnH, p, shape, *, group=None):
        if group is not None and dist.get_world_size(group) != dist.get_world_size():
            raise ValueError("MegatronCoreTPSP runs on megatron-core's own groups: the whole world (group=None)")
        _, mlp, _ = self._block(shape, dist.get_world_size(), True)
        y_nbH, _ = torch.func.functional_call(mlp, {"linear_fc1.weight": p["w_gate_up"],
                                                    "linear_fc2.weight": p["w_down"]}, (u_bnH.transpose(0, 1),))
        return y_nbH.transpose(0, 1)

    def close(self):
        """Leave megatron-core's groups and the CPU patches (after the last backward)."""
        from megatron.core import parallel_state
        parallel_state.destroy_model_parallel()
        self._blocks.clear()
        if self._patched is not None:
            self._patched.close()
            self._patched = None


PEER_METHODS = {"megatron-core": MegatronCoreTPSP()}
