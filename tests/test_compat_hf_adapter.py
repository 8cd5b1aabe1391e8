"""Migrating a Hugging Face model from ring-flash-attention's adapter: ``distattn.compat.ring_flash_attn.adapters.
hf_adapter`` as Axolotl and other trainers use it, on spawned gloo ranks.

A tiny LLaMA is loaded the ways a migrating user loads it (``AutoModelForCausalLM.from_config`` and
``from_pretrained`` with ``attn_implementation=``) after ``substitute_hf_flash_attn``; its logits on a packed stream
of documents split over the ranks are held to the same model with transformers' SDPA and eager attention, each
document on its own in one process. The flash-attn package is absent here, so the literal ``"flash_attention_2"``
is checked where transformers dispatches it (its AttentionInterface), and a test notices the day transformers loads
that name without the package; the GPU tier loads it by name where flash-attn is installed.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dist_utils import run_distributed

TIMEOUT_S = 240  # spawned ranks on a shared two-core machine
DOCS = (7, 12, 1, 9)  # 29 tokens: padded to a multiple of P by extending the last document (OpenRLHF's convention)
VOCAB = 40
LOGITS_ATOL = 2e-5  # fp32 through two tiny layers: measured <= 1e-7; one document too many in the mask: ~2e-1
HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       attention_dropout=0.0)


def _stream(world):
    """The packed stream (ids, position ids, global cu_seqlens) and the documents, the same on every rank."""
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, VOCAB, (n,), generator=g) for n in DOCS]
    total = sum(DOCS)
    pad = -total % world
    ids = torch.cat(docs + [torch.zeros(pad, dtype=torch.long)])
    lens = list(DOCS[:-1]) + [DOCS[-1] + pad]
    pos = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return docs, ids, pos, cu, total


def _one_process(model, docs, impl):
    """Every document through the model on its own, with transformers' attention ``impl``."""
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return torch.cat([model(input_ids=d[None]).logits[0] for d in docs])


def _sharded_logits(model, ids, pos, rank, world):
    n = ids.shape[0] // world
    shard = slice(rank * n, (rank + 1) * n)
    with torch.no_grad():
        return model(input_ids=ids[None, shard], position_ids=pos[None, shard]).logits[0], shard


def _err(logits, ref, shard, total):
    real = torch.arange(shard.start, shard.stop) < total  # the padding's logits are ignored
    ref = torch.cat([ref, ref.new_zeros(shard.stop, VOCAB)])[shard]
    return (logits[real] - ref[real]).abs().max().item()


# -- loading by name, after the substitution ----------------------------------------------------------------------
def _loaded_by_name(rank, world, folder):
    import transformers
    from transformers import AutoModelForCausalLM

    from distattn.compat.ring_flash_attn.adapters import hf_adapter as a

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(_config(), attn_implementation="sdpa")
    if rank == 0:
        base.save_pretrained(folder)
    docs, ids, pos, cu, total = _stream(world)
    refs = {impl: _one_process(base, docs, impl) for impl in ("sdpa", "eager")}
    a.substitute_hf_flash_attn(None, 1)  # before the model is loaded, as Axolotl does
    a.update_ring_flash_attn_params(cu, None)
    interface = transformers.AttentionInterface()
    dispatched = {name: interface.get_interface(name, None) is a.flash_attention_forward
                  for name in ("flash_attention_2", "flash_attention_3", a.HF_IMPLEMENTATION)}
    import torch.distributed as dist

    dist.barrier()  # rank 0 has saved the weights
    errors = {}
    for how, load in (("from_config", lambda: AutoModelForCausalLM.from_config(
                          _config(), attn_implementation=a.HF_IMPLEMENTATION)),
                      ("from_pretrained", lambda: AutoModelForCausalLM.from_pretrained(
                          folder, attn_implementation=a.HF_IMPLEMENTATION))):
        model = load()
        model.load_state_dict(base.state_dict())
        logits, shard = _sharded_logits(model, ids, pos, rank, world)
        for impl, ref in refs.items():
            errors[how, impl] = _err(logits, ref, shard, total)
    return dispatched, errors


def test_loaded_with_the_adapter_name_matches_sdpa_and_eager(tmp_path):
    for dispatched, errors in run_distributed(_loaded_by_name, 2, str(tmp_path), timeout=TIMEOUT_S):
        assert all(dispatched.values()), dispatched  # what a model loaded by either name calls at forward time
        assert max(errors.values()) <= LOGITS_ATOL, errors


@pytest.mark.skipif(HAS_FLASH_ATTN, reason="flash-attn is installed: transformers accepts the name")
def test_transformers_still_refuses_the_flash_name_without_flash_attn():
    """transformers gates ``flash_attention_2`` on the flash-attn distribution and a CUDA device, consulting no
    registry (hf_adapter's doc). This fails the day a release lets a registered function through: then load by that
    name in test_loaded_with_the_adapter_name_matches_sdpa_and_eager and in the README."""
    from transformers import AutoModelForCausalLM

    from distattn.compat.ring_flash_attn.adapters import hf_adapter as a

    a.substitute_hf_flash_attn(None, 1)
    with pytest.raises(ImportError, match="FlashAttention2"):
        AutoModelForCausalLM.from_config(_config(), attn_implementation="flash_attention_2")
    # the adapter's own name is the public way in: an ordinary registered function, no flash-attn check
    model = AutoModelForCausalLM.from_config(_config(), attn_implementation=a.HF_IMPLEMENTATION)
    assert model.config._attn_implementation == a.HF_IMPLEMENTATION  # read only to check the load


# -- the names Axolotl imports, with their meaning ----------------------------------------------------------------
def _axolotl_way(rank, world):
    """Axolotl's varlen path, written from its description: replace create_ring_flash_attention_forward on the
    module with a forward that reads DATA_PARAMS and calls llama3_flash_attn_varlen_func, substitute, update."""
    from transformers import AutoModelForCausalLM

    import distattn.compat.ring_flash_attn as rfa
    import distattn.compat.ring_flash_attn.adapters.hf_adapter as hf_adapter
    from distattn.compat.ring_flash_attn.adapters.hf_adapter import DATA_PARAMS, check_params

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(), attn_implementation="sdpa")
    docs, ids, pos, cu, total = _stream(world)
    ref = _one_process(model, docs, "sdpa")
    calls = []

    def create(process_group, heads_k_stride):
        def forward(query_states, key_states, value_states, attention_mask, query_length, is_causal, dropout=0.0,
                    position_ids=None, softmax_scale=None, sliding_window=None, use_top_left_mask=False,
                    softcap=None, deterministic=None, **kwargs):
            calls.append(query_states.shape)
            out = rfa.llama3_flash_attn_varlen_func(
                query_states[0], key_states[0], value_states[0], DATA_PARAMS["cu_seqlens_q"],
                DATA_PARAMS["cu_seqlens_k"], DATA_PARAMS["max_seqlen_q"], DATA_PARAMS["max_seqlen_k"],
                heads_k_stride, DATA_PARAMS["local_k_slice"], dropout_p=dropout, softmax_scale=softmax_scale,
                causal=is_causal, group=process_group)
            return out[None]

        return [forward]

    results = {"check_params": (check_params(create, lambda a, b: 0), check_params(create, lambda a: 0))}
    default = hf_adapter.create_ring_flash_attention_forward
    hf_adapter.create_ring_flash_attention_forward = create
    try:
        hf_adapter.substitute_hf_flash_attn(process_group=None, heads_k_stride=1)
    finally:
        hf_adapter.create_ring_flash_attention_forward = default
    rfa.update_ring_flash_attn_params(cu, None)
    results["data_params"] = _same_view(DATA_PARAMS, rfa.llama3_flash_attn_prepare_cu_seqlens(cu, True, rank, world))
    model.set_attn_implementation(hf_adapter.HF_IMPLEMENTATION)
    logits, shard = _sharded_logits(model, ids, pos, rank, world)
    results["replacement_ran"] = len(calls) == 2  # once per layer
    results["err"] = _err(logits, ref, shard, total)
    # a caller writing DATA_PARAMS itself (new tensors, the same view): the default forward reads them
    hf_adapter.substitute_hf_flash_attn(None, 1)
    view = rfa.llama3_flash_attn_prepare_cu_seqlens(cu.clone(), True, rank, world)
    DATA_PARAMS.update(zip(("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "local_k_slice"), view))
    logits, _ = _sharded_logits(model, ids, pos, rank, world)
    results["err_written"] = _err(logits, ref, shard, total)
    # switched off: the names run transformers' own flash attention again (it needs flash-attn: refused here)
    hf_adapter.use_ring_attn(False)
    try:
        off = hf_adapter.flash_attention_forward(model.model.layers[0].self_attn, *(torch.zeros(1, 4, 3, 8),) * 3,
                                                 None)
        results["off"] = "ran: " + str(type(off))
    except Exception as err:  # noqa: BLE001  (transformers' own error, whatever its type)
        results["off"] = str(err)
    finally:
        hf_adapter.use_ring_attn(True)
    return results


def _same_view(params, view):
    keys = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "local_k_slice")
    return all(torch.equal(params[k], v) if isinstance(v, torch.Tensor) else params[k] == v
               for k, v in zip(keys, view))


def test_axolotl_names_keep_their_meaning():
    for r in run_distributed(_axolotl_way, 3, timeout=TIMEOUT_S):
        assert r["check_params"] == (True, False)
        assert r["data_params"]  # ring-flash-attention's llama3 view of this rank
        assert r["replacement_ran"]  # substitute_hf_flash_attn ran the module's replaced forward
        assert r["err"] <= LOGITS_ATOL and r["err_written"] <= LOGITS_ATOL, r
        assert "flash" in r["off"].lower() and not r["off"].startswith("ran"), r["off"]


# -- GPU tier: the literal name, where flash-attn is installed -----------------------------------------------------
def _flash_name_on_cuda(rank, world):
    from transformers import AutoModelForCausalLM

    from distattn.compat.ring_flash_attn.adapters import hf_adapter as a

    torch.cuda.set_device(rank % torch.cuda.device_count())
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(_config(), attn_implementation="sdpa").cuda()
    docs, ids, pos, cu, total = _stream(world)
    ref = _one_process(base, [d.cuda() for d in docs], "sdpa").cpu()
    a.substitute_hf_flash_attn(None, 1)
    model = AutoModelForCausalLM.from_config(_config(), attn_implementation="flash_attention_2").cuda()
    model.load_state_dict(base.state_dict())
    a.update_ring_flash_attn_params(cu, None)
    logits, shard = _sharded_logits(model, ids.cuda(), pos.cuda(), rank, world)
    return _err(logits.cpu(), ref, shard, total)


# CUDA-only: transformers loads attn_implementation="flash_attention_2" only with flash-attn and a CUDA device
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FLASH_ATTN, reason="needs the flash-attn package (transformers checks it by name)")
def test_flash_attention_2_by_name_on_cuda():
    assert max(run_distributed(_flash_name_on_cuda, 2, timeout=TIMEOUT_S)) <= 1e-4  # fp32, two kernels' sums
