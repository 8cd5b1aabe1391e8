"""GPU tier, model level: the Hugging Face LLaMA path in bf16 with remat checkpointing against eager attention,
and ``distattn.memory``'s CUDA allocator deltas against the bytes the forward saves.

``pytest -m gpu``; skipped without CUDA. The distattn op runs on a process group, so each case runs in spawned
gloo ranks (``tests/dist_utils.py``) that all use ``cuda:0``; references run in this process on the same GPU.
"""
import pytest
import torch

from attn_ref import assert_close_by_rule, magnitude_of
from dist_utils import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
transformers = pytest.importorskip("transformers")

TIMEOUT_S = 120  # ranks sharing one GPU, compiling the Triton kernels on first use (seconds of work)
SEQ, VOCAB, LAYERS = 2048, 256, 2
# Allocator blocks are rounded to 512 B and the saved-tensor count is per storage: a few KiB apart in tens of MiB.
ALLOCATOR_RTOL = 0.03


def _model(dtype, attn="eager"):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         initializer_range=0.1, attn_implementation=attn, use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device="cuda", dtype=dtype).train()


def _ids():
    return torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))


def _hf_ranks(rank, world):
    import torch.distributed as dist

    from distattn import checkpoint as ck
    from distattn.integrations import hf

    torch.cuda.set_device(0)
    results = {}
    for mode in ("none", "remat"):
        model = hf.use_distattn(_model(torch.bfloat16, attn="sdpa"), backend="triton")
        if mode == "remat":
            hf.enable_remat_checkpointing(model)
        batch = hf.shard_batch(_ids().cuda(), labels=_ids().cuda())
        ck.reset_counters()
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = hf.causal_lm_loss(logits, batch["shift_labels"])
        loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad.float()
            dist.all_reduce(g)  # each rank holds its share of the full-sequence gradient
            grads[name] = g.cpu()
        results[mode] = {"loss": loss.detach().float().cpu(), "grads": grads,
                         "attn": (ck.COUNTERS.forward, ck.COUNTERS.backward)}
    return results


# CUDA-only: distattn/integrations/hf.py's attention on CUDA bf16 tensors (device type of the query for autocast),
# remat checkpointing with the compiled Triton kernels, and gradients through the gloo-staged exchange.
def test_hf_llama_bf16_remat_gradients_match_eager():
    spawned = run_distributed(_hf_ranks, 2, timeout=TIMEOUT_S)
    runs = []
    ids = _ids().cuda()
    for dtype in (torch.float64, torch.bfloat16):  # fp64 eager: reference; bf16 eager: plain PyTorch baseline
        model = _model(dtype)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        runs.append((loss.detach().float().cpu(), {n: p.grad.double().cpu() for n, p in model.named_parameters()}))
    (ref_loss, ref_grads), (base_loss, base_grads) = runs
    mag = magnitude_of(*ref_grads.values())
    for mode in ("none", "remat"):
        ours = spawned[0][mode]
        assert torch.equal(ours["loss"], spawned[1][mode]["loss"]), "the loss differs between ranks"
        assert spawned[0][mode]["attn"] == (LAYERS, LAYERS), f"{mode}: attention (forward, backward) runs per step"
        assert_close_by_rule(f"{mode} loss", ours["loss"].double(), base_loss.double(), ref_loss.double(),
                             torch.bfloat16)
        for name, ref in ref_grads.items():
            assert_close_by_rule(f"{mode} {name}", ours["grads"][name].double(), base_grads[name], ref,
                                 torch.bfloat16, magnitude=mag)


def _memory_ranks(rank, world):
    from transformers import LlamaConfig, LlamaModel

    from distattn.integrations import hf
    from distattn.memory import allocator_delta, saved_activations

    torch.cuda.set_device(0)
    config = LlamaConfig(vocab_size=32, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=8192,
                         attn_implementation="sdpa", use_cache=False)
    model = hf.use_distattn(LlamaModel(config).to(device="cuda", dtype=torch.bfloat16).train(), backend="triton")
    out = {}
    for mode in ("none", "remat"):
        if mode == "remat":
            hf.enable_remat_checkpointing(model)
        embeds = torch.randn(1, 8192, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        positions = torch.arange(8192, device="cuda")[None]
        with allocator_delta() as delta, saved_activations(ignore=[*model.parameters(), embeds]) as acc:
            hidden = model(inputs_embeds=embeds, position_ids=positions).last_hidden_state
        out[mode] = {"current": delta.delta["current"], "peak": delta.delta["peak"], "saved": acc.bytes,
                     "output": hidden.numel() * hidden.element_size()}
        hidden.float().square().mean().backward()
        del hidden
        model.zero_grad(set_to_none=True)
    return out


# CUDA-only: distattn/memory/measure.py AllocatorDelta (torch.cuda.memory_stats, synchronize, reset_peak) and
# warm_cuda_libraries (the cuBLAS handle and workspaces made before the region).
def test_allocator_delta_equals_saved_bytes_of_a_forward():
    (res,) = run_distributed(_memory_ranks, 1, timeout=TIMEOUT_S)
    for mode, r in res.items():
        kept = r["current"] - r["output"]  # what stays allocated after the forward, less its output
        assert kept == pytest.approx(r["saved"], rel=ALLOCATOR_RTOL), (mode, r)
        assert r["peak"] >= r["current"] > 0, (mode, r)
    assert res["remat"]["saved"] < res["none"]["saved"], res


# CUDA-only: the planner's --gpu-mem default reads torch.cuda.mem_get_info (no CPU equivalent)
def test_planner_gpu_memory_defaults_to_what_this_gpu_reports():
    """``python -m distattn.memory plan`` without ``--gpu-mem``: each GPU's memory is this device's total, named."""
    import argparse

    from distattn.memory.cli import GIB, _gpu_mem

    gib, source = _gpu_mem(argparse.Namespace(gpu_mem=None, gpu="h100"))
    assert gib == torch.cuda.mem_get_info()[1] / GIB
    assert source == f"reported by {torch.cuda.get_device_name()}"
    assert _gpu_mem(argparse.Namespace(gpu_mem=40.0, gpu="h100")) == (40.0, "--gpu-mem")
