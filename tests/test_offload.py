"""Offloaded checkpoints (distattn.offload): same math as on the device, every kept byte accounted, prefetch order.

One spawn of 3 gloo ranks covers group sizes 1 and 2 (subgroups {0} and {0, 1}) and 3 (the default group). Per
group size, a stack of user-written blocks (``remat_checkpoint`` / ``full_checkpoint``) and tiny Hugging Face
``LlamaForCausalLM`` models (hidden 64, 3 layers; GQA 4/2 and MHA 4/4 in fp32, GQA in bf16) train one step with
and without offload:

  * loss and every gradient are bit-identical (offloading copies values, it computes nothing);
  * after forward, each layer's accounting holds exactly what the checkpoint keeps — ``x (b, n, hidden)``, and
    for remat ``out (b, n, h_q, d)`` + ``lse (b, h_q, n)`` fp32 — on the host, and the originals' device storage
    is gone (measured by weak reference); ``offload_bytes`` equals the accounting and the traffic counted;
  * backward fetches the last layer on demand, and every other layer is prefetched when the layer after it
    starts its backward, before that layer's tensors are used;
  * offloaded remat still runs attention's forward once per layer.
On CPU the host buffers are plain memory (pinning needs CUDA); the copies, the accounting and the order are real.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from dist_utils import run_distributed

import distattn
from distattn import checkpoint as ck
from distattn._compat import check_hf_offload, hf_checkpointing_enable, hf_offload_supported

HF_OFFLOAD = hf_offload_supported()  # transformers' layers that offloaded checkpoints can wrap (distattn._compat)
needs_hf_offload = pytest.mark.skipif(not HF_OFFLOAD, reason="offloaded checkpoints on HF layers need "
                                      "transformers >= 5.23 (distattn._compat.HF_OFFLOAD_MIN)")
from distattn import offload as off

TIMEOUT_S = 240  # three ranks importing transformers on a shared two-core machine, 3 x (2 x 4 + 2 x 4) steps
GROUP_SIZES = (1, 2, 3)
BATCH, N_PER_RANK, HIDDEN, HEADS_Q, HEADS_KV, HEAD_DIM, BLOCKS = 2, 4, 32, 4, 2, 8, 3
HF_HIDDEN, HF_LAYERS, HF_SEQ, VOCAB = 64, 3, 12, 64  # HF_SEQ divides by every group size
HF_HEADS = {"gqa": (4, 2, torch.float32), "mha": (4, 4, torch.float32), "gqa-bf16": (4, 2, torch.bfloat16)}
MODES = ("remat", "remat-offload", "full", "full-offload", "remat-offload-tiled", "full-offload-tiled")
MLP_TILE = 5  # tokens per tile of the tiled MLP in the "-tiled" modes (shards of 12, 6, 4 tokens)


from test_checkpoint import Block  # noqa: E402 - the same pre-norm block and shapes (HIDDEN, HEADS_Q, ...)


def _summary(offload):
    """What the accounting says right after forward (the originals' storage measured now)."""
    return [{"what": [k.what for k in layer.kept], "shapes": [k.shape for k in layer.kept],
             "dtypes": [k.dtype for k in layer.kept], "host": layer.host_bytes, "device": layer.device_bytes}
            for layer in offload.layers]


def _traffic(offload):
    return {"events": list(offload.events), "to_host": offload.bytes_to_host, "to_device": offload.bytes_to_device}


# -- spawned side -------------------------------------------------------------------------------------------
def _blocks_case(group):
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(group) for _ in range(BLOCKS))
    world = distattn.sharding.group_size(group)
    x_full = torch.randn(BATCH, world * N_PER_RANK, HIDDEN, generator=torch.Generator().manual_seed(1))
    x_shard = distattn.shard_sequence(x_full, group=group)
    res = {}
    for mode in MODES:
        remat = mode.startswith("remat")
        offload = off.CheckpointOffload(remat=remat) if mode.endswith("offload") else None
        blocks.zero_grad(set_to_none=True)
        x = x_shard.clone().requires_grad_()
        ck.reset_counters()
        h = x
        for block in blocks:
            h = (ck.remat_checkpoint if remat else ck.full_checkpoint)(block, h, offload=offload)
        kept = _summary(offload) if offload else None
        h.square().sum().backward()
        res[mode] = {"grads": [x.grad] + [p.grad for p in blocks.parameters()], "forward": ck.COUNTERS.forward,
                     "kept": kept, **(_traffic(offload) if offload else {})}
    return res


def _make_llama(heads_q, heads_kv):
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HF_HIDDEN, intermediate_size=2 * HF_HIDDEN,
                                      num_hidden_layers=HF_LAYERS, num_attention_heads=heads_q,
                                      num_key_value_heads=heads_kv, max_position_embeddings=64, use_cache=False,
                                      initializer_range=0.2, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def _hf_step(model, ids, group, offload):
    from distattn.integrations import hf

    model.zero_grad(set_to_none=True)
    batch = hf.shard_batch(ids, labels=ids, group=group)
    ck.reset_counters()
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    loss = hf.causal_lm_loss(logits, batch["shift_labels"], group=group)
    kept = _summary(offload) if offload else None
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad for n, p in model.named_parameters()},
            "forward": ck.COUNTERS.forward, "kept": kept, **(_traffic(offload) if offload else {})}


def _hf_case(group):
    from distattn.integrations import hf

    ids = torch.randint(0, VOCAB, (BATCH, HF_SEQ), generator=torch.Generator().manual_seed(1))
    res = {}
    for kind, (heads_q, heads_kv, dtype) in HF_HEADS.items():
        for mode in (m for m in MODES if HF_OFFLOAD or "offload" not in m):
            model = hf.use_distattn(_make_llama(heads_q, heads_kv).to(dtype), group=group)
            offload = None
            if mode.endswith("-tiled"):  # issue 22: tiles inside offloaded checkpoints
                hf.tile_mlp(model, MLP_TILE)
            if mode == "remat":
                hf.enable_remat_checkpointing(model)
            elif mode.startswith("remat-offload"):
                offload = off.CheckpointOffload(remat=True)
                hf.enable_remat_checkpointing(model, offload=offload)
            elif mode == "full":
                hf_checkpointing_enable(model)
            else:
                offload = hf.offload_checkpoints(model)
            res[(kind, mode)] = _hf_step(model, ids, group, offload)
    return res


def _offload_cases(rank, world_size):
    import torch.distributed as dist

    groups = {1: dist.new_group([0]), 2: dist.new_group([0, 1]), 3: None}  # new_group: every rank calls it
    results = {}
    for size in GROUP_SIZES:
        if rank < size:
            results[size] = {"blocks": _blocks_case(groups[size]), "hf": _hf_case(groups[size])}
    return results


@pytest.fixture(scope="module")
def spawned():
    pytest.importorskip("transformers")
    return run_distributed(_offload_cases, 3, timeout=TIMEOUT_S)


def _ranks(spawned, size):
    return [(r, res[size]) for r, res in enumerate(spawned) if size in res]


def _hf_results(spawned, size):
    for rank, res in _ranks(spawned, size):
        for kind in HF_HEADS:
            yield rank, kind, res["hf"]


# -- the same math ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", GROUP_SIZES)
@pytest.mark.parametrize("kind", ("remat", "full"))
def test_blocks_offloaded_gradients_are_bit_identical(spawned, size, kind):
    for rank, res in _ranks(spawned, size):
        base, got = res["blocks"][kind], res["blocks"][f"{kind}-offload"]
        for i, (a, b) in enumerate(zip(base["grads"], got["grads"], strict=True)):
            assert torch.equal(a, b), f"group {size} rank {rank} {kind}: gradient {i} differs with offload"


@needs_hf_offload
@pytest.mark.parametrize("size", GROUP_SIZES)
@pytest.mark.parametrize("kind", ("remat", "full"))
def test_hf_offloaded_loss_and_gradients_are_bit_identical(spawned, size, kind):
    for rank, heads, res in _hf_results(spawned, size):
        base, got = res[(heads, kind)], res[(heads, f"{kind}-offload")]
        assert torch.equal(base["loss"], got["loss"]), f"group {size} rank {rank} {heads} {kind}: loss differs"
        assert base["grads"].keys() == got["grads"].keys()
        for name in base["grads"]:
            assert torch.equal(base["grads"][name], got["grads"][name]), f"{heads} {kind} rank {rank}: {name}"


@pytest.mark.parametrize("size", GROUP_SIZES)
def test_offloaded_remat_runs_attention_forward_once_per_layer(spawned, size):
    for rank, res in _ranks(spawned, size):
        assert res["blocks"]["remat-offload"]["forward"] == BLOCKS
        assert res["blocks"]["full-offload"]["forward"] == 2 * BLOCKS  # layer-boundary: recomputed too
        for heads in HF_HEADS if HF_OFFLOAD else ():
            assert res["hf"][(heads, "remat-offload")]["forward"] == HF_LAYERS


# -- the accounting -----------------------------------------------------------------------------------------
def _promised(b, n, hidden, heads_q, head_dim, remat, act_bytes=4):
    """The tensors the checkpoint promises to keep (distattn.checkpoint's docstring)."""
    kept = [("input", (b, n, hidden), b * n * hidden * act_bytes)]
    if remat:
        kept += [("attn_out", (b, n, heads_q, head_dim), b * n * heads_q * head_dim * act_bytes),
                 ("attn_lse", (b, heads_q, n), b * heads_q * n * 4)]
    return kept


def _check_layers(kept, promised, layers, where, held=0):
    """``held``: bytes of layer 0's input that the caller itself keeps alive (a leaf it wants the grad of)."""
    assert len(kept) == layers, where
    for i, layer in enumerate(kept):
        assert layer["what"] == [p[0] for p in promised], f"{where} layer {i}"
        assert layer["shapes"] == [p[1] for p in promised], f"{where} layer {i}"
        assert layer["dtypes"][-1] == torch.float32 or not promised[-1][0] == "attn_lse", f"{where}: lse is fp32"
        assert layer["host"] == sum(p[2] for p in promised), f"{where} layer {i}: host bytes"
        alive = held if i == 0 else 0
        assert layer["device"] == alive, f"{where} layer {i}: {layer['device']} bytes of originals still alive"


@pytest.mark.parametrize("size", GROUP_SIZES)
@pytest.mark.parametrize("kind", ("remat", "full"))
def test_blocks_accounting_is_exactly_what_the_checkpoint_keeps(spawned, size, kind):
    promised = _promised(BATCH, N_PER_RANK, HIDDEN, HEADS_Q, HEAD_DIM, kind == "remat")
    for rank, res in _ranks(spawned, size):
        _check_layers(res["blocks"][f"{kind}-offload"]["kept"], promised, BLOCKS, f"blocks {kind} rank {rank}",
                      held=promised[0][2])  # the test holds x for x.grad; later inputs are gone


@needs_hf_offload
@pytest.mark.parametrize("size", GROUP_SIZES)
@pytest.mark.parametrize("kind", ("remat", "full"))
def test_hf_accounting_is_exactly_what_the_checkpoint_keeps(spawned, size, kind):
    n = HF_SEQ // size
    for rank, heads, res in _hf_results(spawned, size):
        heads_q, _, dtype = HF_HEADS[heads]
        promised = _promised(BATCH, n, HF_HIDDEN, heads_q, HF_HIDDEN // heads_q, kind == "remat",
                             act_bytes=dtype.itemsize)
        _check_layers(res[(heads, f"{kind}-offload")]["kept"], promised, HF_LAYERS, f"hf {heads} {kind} rank {rank}")


@needs_hf_offload
@pytest.mark.parametrize("size", GROUP_SIZES)
@pytest.mark.parametrize("kind", ("remat", "full"))
def test_byte_model_equals_the_accounting(spawned, size, kind):
    n = HF_SEQ // size
    for rank, heads, res in _hf_results(spawned, size):
        heads_q, _, dtype = HF_HEADS[heads]
        got = res[(heads, f"{kind}-offload")]
        model = off.offload_bytes(batch=BATCH, tokens=n, hidden=HF_HIDDEN, heads_q=heads_q,
                                  head_dim=HF_HIDDEN // heads_q, layers=HF_LAYERS, remat=kind == "remat", act_bytes=dtype.itemsize)
        assert [layer["host"] for layer in got["kept"]] == [model.per_layer] * HF_LAYERS
        assert sum(layer["host"] for layer in got["kept"]) == model.host_per_step
        assert [layer["device"] for layer in got["kept"]] == [model.device_per_layer] * HF_LAYERS
        assert got["to_host"] + got["to_device"] == model.traffic_per_step, f"{heads} {kind} rank {rank}"
        assert got["to_host"] == got["to_device"]


@needs_hf_offload
@pytest.mark.parametrize("size", GROUP_SIZES)
@pytest.mark.parametrize("kind", ("remat", "full"))
def test_planner_equals_the_accounting_with_and_without_tiles(spawned, size, kind):
    """The planner's host bytes (``distattn.memory.techniques``) are the bytes measured per layer, and tiling the
    MLP inside the checkpoint keeps exactly the same (its tiles exist only while the layer is recomputed)."""
    from distattn.memory.model import spec_from_hf_config
    from distattn.memory.techniques import Techniques, technique_peak

    for rank, heads, res in _hf_results(spawned, size):
        heads_q, heads_kv, dtype = HF_HEADS[heads]
        spec = spec_from_hf_config(dict(hidden_size=HF_HIDDEN, intermediate_size=2 * HF_HIDDEN,
                                        num_hidden_layers=HF_LAYERS, num_attention_heads=heads_q,
                                        num_key_value_heads=heads_kv, vocab_size=VOCAB))
        precision = "fp32" if dtype == torch.float32 else "bf16"
        for tiled in (None, MLP_TILE):
            got = res[(heads, f"{kind}-offload" + ("-tiled" if tiled else ""))]
            # CPU: plain host memory (pinned needs CUDA), so no power-of-two rounding of the blocks
            peak = technique_peak(spec, BATCH, HF_SEQ, sp=size, precision=precision, strategy=kind,
                                  tech=Techniques(mlp_tile=tiled, offload_checkpoints=True), pinned=False)
            assert sum(layer["host"] for layer in got["kept"]) == peak.host["checkpoints"], (heads, kind, rank)
            assert all(layer["device"] == 0 for layer in got["kept"]), (heads, kind, rank)
            assert got["to_host"] + got["to_device"] == peak.traffic, (heads, kind, rank)


@needs_hf_offload
@pytest.mark.parametrize("size", GROUP_SIZES)
def test_tiled_mlp_inside_offloaded_checkpoints_gives_the_same_gradients(spawned, size):
    for rank, heads, res in _hf_results(spawned, size):
        for kind in ("remat", "full"):
            a, b = res[(heads, f"{kind}-offload")], res[(heads, f"{kind}-offload-tiled")]
            tol = 1e-5 if HF_HEADS[heads][2] == torch.float32 else 2e-2  # tiles reorder sums; bf16 rounds
            assert torch.allclose(a["loss"].float(), b["loss"].float(), rtol=tol, atol=tol), (heads, kind, rank)
            for name, g in a["grads"].items():
                assert torch.allclose(g.float(), b["grads"][name].float(), rtol=tol, atol=tol), (heads, kind, name)


# -- the order ----------------------------------------------------------------------------------------------
def _expected_backward_events(layers):
    """The last layer is fetched on demand; each layer's backward first starts the copy of the layer before."""
    want = [("fetch", layers - 1)]
    for i in range(layers - 1, -1, -1):
        if i > 0:
            want.append(("prefetch", i - 1))
        want.append(("use", i))
    return want


@pytest.mark.parametrize("size", GROUP_SIZES)
def test_backward_prefetches_the_previous_layer_before_using_its_own(spawned, size):
    for rank, res in _ranks(spawned, size):
        runs = [(BLOCKS, res["blocks"][m]) for m in ("remat-offload", "full-offload")]
        runs += [(HF_LAYERS, res["hf"][(h, m)]) for h in HF_HEADS for m in ("remat-offload", "full-offload")
                 if HF_OFFLOAD]
        for layers, run in runs:
            events = run["events"]
            offloads = [e for e in events if e[0] == "offload"]
            # forward: every layer's tensors go out in layer order, before any comes back
            assert [i for _, i in offloads] == sorted(i for _, i in offloads)
            assert events[:len(offloads)] == offloads
            assert events[len(offloads):] == _expected_backward_events(layers), f"rank {rank}: {events}"


# -- in one process: no attention, no process group -----------------------------------------------------------
def _mlp_stack(layers=3, width=16):
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers))


def test_device_bytes_measure_originals_still_alive():
    """The accounting's device bytes are measured: a reference the caller keeps shows up, and goes away."""
    stack, offload = _mlp_stack(), off.CheckpointOffload(remat=False)
    x = torch.randn(2, 5, 16, requires_grad=True)
    hs, h = [], x
    for layer in stack:
        h = ck.full_checkpoint(layer, h, offload=offload)
        hs.append(h)  # keeps every layer output alive: the next layer's input stays in "device" memory
    nbytes = 2 * 5 * 16 * 4
    assert [layer.device_bytes for layer in offload.layers] == [nbytes] * 3  # x itself, and two kept outputs
    assert [layer.host_bytes for layer in offload.layers] == [nbytes] * 3
    del hs
    h.sum().backward()  # the last output is freed by backward; the others by `del`, x by the test below
    assert [layer.device_bytes for layer in offload.layers][1:] == [0, 0]


def test_second_backward_with_retain_graph_fetches_again():
    stack, offload = _mlp_stack(), off.CheckpointOffload(remat=False)
    x = torch.randn(2, 5, 16, requires_grad=True)
    h = x
    for layer in stack:
        h = ck.full_checkpoint(layer, h, offload=offload)
    h.sum().backward(retain_graph=True)
    first = x.grad.clone()
    h.sum().backward()
    assert torch.equal(x.grad, 2 * first)


def test_a_new_step_restarts_the_accounting_and_host_memory_is_freed():
    stack, offload = _mlp_stack(), off.CheckpointOffload(remat=False)
    for _ in range(2):
        h = torch.randn(2, 5, 16, requires_grad=True)
        for layer in stack:
            h = ck.full_checkpoint(layer, h, offload=offload)
        assert len(offload.layers) == 3 and offload.live_host_bytes == 3 * 2 * 5 * 16 * 4
        h.sum().backward()
        del h
    assert offload.live_host_bytes == 0  # the graph is gone, so are its host copies


def test_host_limit_is_a_clear_error():
    offload = off.CheckpointOffload(remat=False, host_limit_bytes=2 * 5 * 16 * 4)  # one layer's input
    h = torch.randn(2, 5, 16, requires_grad=True)
    stack = _mlp_stack()
    h = ck.full_checkpoint(stack[0], h, offload=offload)
    with pytest.raises(MemoryError, match=r"would exceed host_limit_bytes=640"):
        ck.full_checkpoint(stack[1], h, offload=offload)
    with pytest.raises(ValueError, match=r"host_limit_bytes must be > 0, got 0"):
        off.CheckpointOffload(host_limit_bytes=0)


def test_pinned_memory_asked_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(off, "pinned_memory_available", lambda: False)
    with pytest.raises(ValueError, match=r"pin_memory=True needs pinned host memory.*pin_memory=False"):
        off.CheckpointOffload(pin_memory=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # CUDA present, pinning refused
    with pytest.raises(ValueError, match=r"on CUDA needs pinned host memory.*ulimit -l"):
        off.CheckpointOffload()


def test_cpu_uses_plain_host_memory():
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    assert off.CheckpointOffload().pin_memory is False


def test_offloader_kind_must_match_the_checkpoint():
    layer = _mlp_stack(1)[0]
    x = torch.randn(2, 16, requires_grad=True)
    with pytest.raises(ValueError, match=r"remat_checkpoint\(offload=...\) needs CheckpointOffload\(remat=True\)"):
        ck.remat_checkpoint(layer, x, offload=off.CheckpointOffload(remat=False))
    with pytest.raises(ValueError, match=r"full_checkpoint\(offload=...\) needs CheckpointOffload\(remat=False\)"):
        ck.full_checkpoint(layer, x, offload=off.CheckpointOffload(remat=True))
    with pytest.raises(RuntimeError, match=r"context_fn runs only inside CheckpointOffload.region"):
        off.CheckpointOffload(remat=True).context_fn()


def test_host_memory_check():
    available = off.host_memory_available()
    assert available > 0
    off.check_host_memory(1, limit=1)
    with pytest.raises(ValueError, match=r"needs 2\.00 GiB of host memory but the limit given is 1\.00 GiB"):
        off.check_host_memory(2 << 30, limit=1 << 30)
    with pytest.raises(ValueError, match=r"but MemAvailable in /proc/meminfo is"):
        off.check_host_memory(available + (1 << 40))
    with pytest.raises(ValueError, match=r"limit must be > 0 bytes, got -1"):
        off.check_host_memory(1, limit=-1)


def test_byte_model_formulas():
    full = off.offload_bytes(batch=1, tokens=1000, hidden=4096, heads_q=32, head_dim=128, layers=32, remat=False)
    assert full.per_layer == 1000 * 4096 * 2 and full.host_per_step == 32 * full.per_layer
    assert full.traffic_per_step == 2 * full.host_per_step and full.device_transient == 2 * full.per_layer
    remat = off.offload_bytes(batch=1, tokens=1000, hidden=4096, heads_q=32, head_dim=128, layers=32, remat=True)
    assert remat.per_layer == full.per_layer + 1000 * 32 * 128 * 2 + 32 * 1000 * 4
    assert off.format_bytes(3 << 29) == "1.50 GiB" and off.format_bytes(12 << 20) == "12.00 MiB"
    assert off.optimizer_offload_bytes(10, 3) == {"host": 64, "h2d_per_step": 32, "d2h_per_step": 16}


# CUDA-only: distattn/offload.py's side streams, pinned host buffers and events (CheckpointOffload on CUDA).
@pytest.mark.gpu  # the side streams, pinned buffers and events exist only on CUDA
def test_cuda_offload_same_gradients_pinned_host_and_freed_device():
    torch.manual_seed(0)
    width, layers = 1024, 4
    stack = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)).cuda()
    x0 = torch.randn(8, 512, width, device="cuda")
    grads = {}
    for name in ("plain", "offload"):
        offload = off.CheckpointOffload(remat=False) if name == "offload" else None
        stack.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        h = x
        for layer in stack:
            h = ck.full_checkpoint(layer, h, offload=offload)
        if offload is not None:
            torch.cuda.synchronize()
            assert offload.pin_memory
            assert [layer.device_bytes for layer in offload.layers][1:] == [0] * (layers - 1)
            assert offload.host_bytes == layers * x0.numel() * 4
        h.square().sum().backward()
        torch.cuda.synchronize()
        grads[name] = [x.grad] + [p.grad for p in stack.parameters()]
        if offload is not None:
            assert offload.events[layers:] == _expected_backward_events(layers)
    for a, b in zip(grads["plain"], grads["offload"], strict=True):
        assert torch.equal(a, b)


def test_hf_offload_is_refused_clearly_where_transformers_cannot_run_it():
    if HF_OFFLOAD:
        check_hf_offload()  # supported: no error
        return
    with pytest.raises(ValueError, match="offloaded checkpoints on Hugging Face models need transformers >= 5.23"):
        check_hf_offload()
