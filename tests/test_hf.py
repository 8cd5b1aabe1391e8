"""Hugging Face integration (distattn.integrations.hf) against HF's own single-process eager attention.

Tiny random GQA models of three families (LLaMA 4/2 heads, Qwen2 4/1 with q/k/v biases, Mistral 4/2 with a
sliding window longer than the sequence), 2-3 layers. One spawn of 3 gloo ranks runs group sizes 1 and 2
(subgroups {0} and {0, 1}) and 3 (the default group); every case trains one step on its shard with
no checkpointing, HF's gradient checkpointing, and ours (``enable_remat_checkpointing``), and sends back the
loss, the parameter gradients summed over the group, and what the step counted. The parent process checks
them against the same model run on the full sequence in fp64 (the reference) and fp32 (plain PyTorch, the
baseline of the accuracy rule) with ``attn_implementation="eager"``.
"""

import functools
import re

import pytest
import torch

from attn_ref import assert_close_by_rule, magnitude_of
from dist_utils import run_distributed

transformers = pytest.importorskip("transformers")

from distattn._compat import hf_checkpointing_disable, hf_checkpointing_enable  # noqa: E402
from distattn import checkpoint as ck  # noqa: E402
from distattn import comm  # noqa: E402
from distattn.integrations import hf  # noqa: E402

TIMEOUT_S = 170  # three ranks importing transformers on a shared two-core machine, 27 training steps
GROUP_SIZES = (1, 2, 3)
MODES = ("none", "hf", "ours")
BATCH, SEQ, VOCAB = 2, 12, 64  # SEQ divides by every group size
FAMILIES = {  # name: (config class, model class, layers, heads_q, heads_kv, extra config)
    "llama": ("LlamaConfig", "LlamaForCausalLM", 2, 4, 2, {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", 3, 4, 1, {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", 2, 4, 2, {"sliding_window": 64}),
}


def make_model(family: str, attn: str = "eager", dtype=torch.float32):
    """The same tiny random model in every process (seeded init; larger init than HF's so attention is peaked)."""
    cfg_name, model_name, layers, h_q, h_kv, extra = FAMILIES[family]
    config = getattr(transformers, cfg_name)(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=h_q,
        num_key_value_heads=h_kv, max_position_embeddings=64, initializer_range=0.2, attn_implementation=attn,
        use_cache=False, **extra)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).to(dtype).train()


def make_ids():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def set_checkpointing(model, mode):
    hf_checkpointing_disable(model)
    if mode == "hf":  # HF's own: checkpoint at the layer input, recompute the whole layer
        hf_checkpointing_enable(model)
    elif mode == "ours":
        hf.enable_remat_checkpointing(model)


# -- spawned side -------------------------------------------------------------------------------------------
def _step(model, ids, group):
    import torch.distributed as dist

    model.zero_grad(set_to_none=True)
    batch = hf.shard_batch(ids, labels=ids, group=group)
    ck.reset_counters()
    comm.reset_counters()
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    loss = hf.causal_lm_loss(logits, batch["shift_labels"], group=group)
    loss.backward()
    counts = {"forward": ck.COUNTERS.forward, "backward": ck.COUNTERS.backward,
              "bytes": comm.COUNTERS.bytes_sent + comm.COUNTERS.bytes_recv}
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=group)  # each rank holds its share of the full-sequence gradient
        grads[name] = g
    return loss.detach(), grads, counts


def _layer_memory(model, ids, group):
    """Bytes layer 0 keeps for backward, and (no checkpointing) the same seen through saved-tensor hooks."""
    batch = hf.shard_batch(ids, group=group)
    layer = model.model.layers[0]
    x = model.model.embed_tokens(batch["input_ids"]).detach().requires_grad_()
    cos_sin = model.model.rotary_emb(x, position_ids=batch["position_ids"])
    hooked = {}
    external = {t.untyped_storage().data_ptr() for t in (x, *cos_sin, *model.parameters())}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in external:
            hooked[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, kept = ck.retained_bytes(layer, x, attention_mask=None, position_embeddings=cos_sin,
                                    position_ids=batch["position_ids"])
    y.sum().backward()  # same backward on every rank: the op's communication stays in lockstep
    return {"kept": kept, "hooked": sum(hooked.values()), "input": x.numel() * x.element_size()}


def _hf_cases(rank, world_size):
    import torch.distributed as dist

    groups = {1: dist.new_group([0]), 2: dist.new_group([0, 1]), 3: None}  # new_group: every rank calls it
    ids = make_ids()
    results = {}
    for size in GROUP_SIZES:
        if rank >= size:
            continue
        group = groups[size]
        for family in FAMILIES:
            model = hf.use_distattn(make_model(family, attn="sdpa"), group=group)
            for mode in MODES:
                set_checkpointing(model, mode)
                loss, grads, counts = _step(model, ids, group)
                memory = _layer_memory(model, ids, group)
                if rank == 0:
                    results[(size, family, mode)] = {"loss": loss, "grads": grads, **counts, **memory}
                else:  # the loss value must agree on every rank; counts are per rank
                    results[(size, family, mode)] = {"loss": loss, **counts}
    return results


@pytest.fixture(scope="module")
def spawned():
    return run_distributed(_hf_cases, 3, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def references():
    """family -> (fp64 reference, fp32 eager baseline), each (loss, {name: grad}): HF's own loss and attention."""
    out = {}
    ids = make_ids()
    for family in FAMILIES:
        runs = []
        for dtype in (torch.float64, torch.float32):
            model = make_model(family, attn="eager", dtype=dtype)
            loss = model(input_ids=ids, labels=ids).loss  # HF shifts the labels itself
            loss.backward()
            runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        out[family] = runs
    return out


# -- checks -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("size", GROUP_SIZES)
def test_loss_and_gradients_match_single_process_eager(spawned, references, size, family, mode):
    ours = spawned[0][(size, family, mode)]
    (ref_loss, ref_grads), (base_loss, base_grads) = references[family]
    assert_close_by_rule("loss", ours["loss"], base_loss, ref_loss, torch.float32)
    mag = magnitude_of(*ref_grads.values())  # one floor for all gradients: some entries are ~0 by symmetry
    assert ours["grads"].keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert_close_by_rule(f"{family} {mode} P={size} {name}", ours["grads"][name], base_grads[name], ref,
                             torch.float32, magnitude=mag)
    for rank, res in enumerate(spawned):  # the same loss bits on every rank of the group
        if (size, family, mode) in res:
            assert torch.equal(res[(size, family, mode)]["loss"], ours["loss"]), f"rank {rank}"


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("size", GROUP_SIZES)
def test_checkpointing_changes_no_gradient_bit(spawned, size, family):
    runs = {mode: spawned[0][(size, family, mode)] for mode in MODES}
    for mode in ("hf", "ours"):
        differ = [n for n, g in runs[mode]["grads"].items() if not torch.equal(g, runs["none"]["grads"][n])]
        assert not differ, f"{family} P={size}: {mode} checkpointing changed the gradients of {differ}"


@pytest.mark.parametrize("size", GROUP_SIZES)
def test_attention_forward_runs_once_per_layer_with_ours(spawned, size):
    for rank, res in enumerate(spawned):
        for family, (_, _, layers, *_) in FAMILIES.items():
            if (size, family, "none") not in res:
                continue
            counts = {mode: (res[(size, family, mode)]["forward"], res[(size, family, mode)]["backward"])
                      for mode in MODES}
            assert counts == {"none": (layers, layers), "hf": (2 * layers, layers), "ours": (layers, layers)}, \
                f"rank {rank}, {family} P={size}: (attention forward, backward) executions per step {counts}"
            moved = {mode: res[(size, family, mode)]["bytes"] for mode in MODES}
            assert moved["ours"] == moved["none"], f"rank {rank}, {family} P={size}: bytes moved {moved}"
            if size > 1:
                assert moved["hf"] > moved["none"], f"rank {rank}, {family} P={size}: bytes moved {moved}"


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("size", GROUP_SIZES)
def test_saved_bytes_per_layer(spawned, size, family):
    _, _, _, h_q, _, _ = FAMILIES[family]
    runs = {mode: spawned[0][(size, family, mode)] for mode in MODES}
    tokens = BATCH * SEQ // size
    out_bytes, lse_bytes = tokens * 32 * 4, tokens * h_q * 4  # out (b, n, h_q, d) = hidden 32; lse fp32
    # The layer input (created before the layer) is held by every variant and not counted by retained_bytes.
    assert runs["ours"]["kept"] == out_bytes + lse_bytes, runs["ours"]
    assert runs["hf"]["kept"] == 0, runs["hf"]
    assert runs["none"]["kept"] > 4 * (out_bytes + lse_bytes), runs["none"]
    # Cross-check of the measurement: without checkpointing, what autograd saved (seen by saved-tensor hooks)
    # is exactly what stays alive.
    assert runs["none"]["kept"] == runs["none"]["hooked"], runs["none"]


# -- single-process checks (no process group needed) ----------------------------------------------------------
def test_shard_batch_shifts_labels_on_the_full_sequence():
    ids = torch.arange(12).view(2, 6)
    labels = ids.clone()
    labels[0, 3] = -100
    full = hf.shard_batch(ids, labels=labels)
    assert torch.equal(full["input_ids"], ids)
    assert torch.equal(full["position_ids"], torch.arange(6).expand(2, 6))
    assert full["shift_labels"].tolist() == [[1, 2, -100, 4, 5, -100], [7, 8, 9, 10, 11, -100]]
    assert "shift_labels" not in hf.shard_batch(ids)


def test_shard_batch_validates():
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, seq\)"):
        hf.shard_batch(torch.zeros(6, dtype=torch.long))
    with pytest.raises(ValueError, match="must have the shape of input_ids"):
        hf.shard_batch(torch.zeros(1, 6, dtype=torch.long), labels=torch.zeros(1, 5, dtype=torch.long))


def test_causal_lm_loss_matches_hf_loss_on_one_process():
    from transformers.loss.loss_utils import ForCausalLMLoss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 11, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (2, 7), generator=g)
    labels[1, :4] = -100
    ours = hf.causal_lm_loss(logits, hf.shard_batch(labels, labels=labels)["shift_labels"])
    theirs = ForCausalLMLoss(logits, labels, vocab_size=11)
    torch.testing.assert_close(ours, theirs)
    (g_ours,) = torch.autograd.grad(ours, logits)
    (g_theirs,) = torch.autograd.grad(theirs, logits)
    torch.testing.assert_close(g_ours, g_theirs)


def test_causal_lm_loss_with_no_target_is_zero_not_nan():
    logits = torch.randn(1, 3, 5, requires_grad=True)
    loss = hf.causal_lm_loss(logits, torch.full((1, 3), -100))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_causal_lm_loss_validates_shapes():
    with pytest.raises(ValueError, match="logits must be"):
        hf.causal_lm_loss(torch.randn(1, 3, 5), torch.zeros(1, 4, dtype=torch.long))


def test_use_distattn_validates():
    model = make_model("llama")
    with pytest.raises(ValueError, match=r"schedule='zigzig' is not one of \('ring', 'balanced', 'zigzag', 'placed', 'auto'\)"):
        hf.use_distattn(model, schedule="zigzig")
    with pytest.raises(ValueError, match=r"schedule='zig' is not one of .*the same to use_distattn and shard_batch"):
        hf.shard_batch(make_ids(), schedule="zig")
    with pytest.raises(TypeError, match=r"group=\(ulysses_group, ring_group\) must be a pair"):
        hf.use_distattn(model, group=(None, None, None))
    with pytest.raises(ValueError, match="backend='cuda' is unknown"):
        hf.use_distattn(model, backend="cuda")
    with pytest.raises(TypeError, match="is not a transformers PreTrainedModel"):
        hf.use_distattn(torch.nn.Linear(2, 2))


def test_use_distattn_switches_the_model_and_builds_no_mask():
    model = hf.use_distattn(make_model("llama"), schedule="ring")
    name = model.config._attn_implementation
    assert name.startswith(hf.ATTN_IMPLEMENTATION) and "ring" in name
    assert model.config.use_cache is False
    assert hf.use_distattn(make_model("llama")).config._attn_implementation == hf.ATTN_IMPLEMENTATION
    from transformers.masking_utils import create_causal_mask

    embeds = torch.zeros(1, 6, 32)
    assert create_causal_mask(config=model.config, inputs_embeds=embeds, attention_mask=None,
                              past_key_values=None, position_ids=torch.arange(6)[None]) is None


def test_enable_remat_checkpointing_needs_distattn():
    with pytest.raises(ValueError, match="call use_distattn"):
        hf.enable_remat_checkpointing(make_model("llama"))


class _Module:
    is_causal = True


@pytest.mark.parametrize("kwargs,match", [
    ({"attention_mask": torch.ones(1, 1, 4, 4)}, r"takes no prepared attention mask .*shard_batch\(input_ids, labels, attention_mask=mask\) packs"),
    ({"dropout": 0.1}, r"attention dropout \(0.1\) .*config.attention_dropout = 0.0"),
    ({"cu_seq_lens_q": torch.tensor([0, 4])}, "pass cu_seq_lens_q and cu_seq_lens_k equal"),
])
def test_attention_function_refuses_what_it_cannot_compute(kwargs, match):
    q = torch.randn(1, 4, 4, 8)  # (b, h, n, d) as transformers passes it
    kwargs = {"attention_mask": None, **kwargs}
    with pytest.raises(ValueError, match=match):
        hf.distattn_attention_forward(_Module(), q, q, q, options=hf._DEFAULT_OPTIONS, **kwargs)


# -- autocast: HF's RoPE hands over fp32 q/k and a bf16 v ------------------------------------------------------
# bf16 keeps 8 mantissa bits: a 2-layer model's loss moves by well under 1% between fp32 and bf16 autocast.
AUTOCAST_LOSS_RTOL = 2e-2


def _autocast_worker(rank, world):
    from transformers import LlamaConfig, LlamaForCausalLM

    from distattn.integrations.hf import causal_lm_loss, shard_batch, use_distattn

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    use_distattn(model)
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(1))
    batch = shard_batch(ids, ids)
    losses = []
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = causal_lm_loss(logits.float(), batch["shift_labels"])
        loss.backward()
        losses.append(loss.item())
    return losses


def test_bf16_autocast_runs_and_matches_fp32_loss():
    for fp32_loss, bf16_loss in run_distributed(_autocast_worker, 2, timeout=120):
        assert abs(bf16_loss - fp32_loss) <= AUTOCAST_LOSS_RTOL * abs(fp32_loss)


# -- masks through a real model forward: padding raises on every rank, an all-ones mask is a no-op --------------
MASK_SEQ = 16  # divides by 1 and 2
PADDING_ERROR = r"cannot apply a padding attention_mask.*zeros on some rank.*packs the rows padding-free"


def _forward_or_error(model, ids, group, **kwargs):
    """``(logits, None)`` of a real forward on this rank's shard, or ``(None, message)`` if it raised ValueError."""
    batch = hf.shard_batch(ids, group=group)
    try:
        with torch.no_grad():
            return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], **kwargs).logits, None
    except ValueError as err:
        return None, str(err)


def _mask_cases(rank, world_size):
    import torch.distributed as dist

    from distattn.sharding import shard_sequence

    groups = {1: dist.new_group([0]), 2: None}  # new_group: every rank calls it
    ids = torch.randint(0, VOCAB, (BATCH, MASK_SEQ), generator=torch.Generator().manual_seed(2))
    padded_8 = torch.ones(BATCH, MASK_SEQ, dtype=torch.long)
    padded_8[0, :8] = 0  # left padding of row 0: on 2 ranks, all of it is in rank 0's shard
    padded_last = torch.ones(BATCH, MASK_SEQ, dtype=torch.long)
    padded_last[1, -1] = 0  # one right-padded token: on 2 ranks, in rank 1's shard only
    results = {}
    for size, group in groups.items():
        if rank >= size:
            continue
        for family in ("llama", "mistral"):  # mistral: the sliding-window mask function (window > sequence)
            model = hf.use_distattn(make_model(family, attn="sdpa"), group=group)
            shard = functools.partial(shard_sequence, dim=1, group=group)
            cases = {
                "none": {},
                "ones": {"attention_mask": shard(torch.ones(BATCH, MASK_SEQ, dtype=torch.long))},
                "padded_8": {"attention_mask": shard(padded_8)},
                "padded_last": {"attention_mask": shard(padded_last)},
                "4d": {"attention_mask": torch.zeros(BATCH, 1, MASK_SEQ // size, MASK_SEQ // size)},
            }
            for case, kwargs in cases.items():  # every case on every rank, in lockstep: none may hang
                results[(size, family, case)] = _forward_or_error(model, ids, group, **kwargs)
    return results


@pytest.fixture(scope="module")
def masked():
    return run_distributed(_mask_cases, 2, timeout=120)


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("size", [1, 2])
def test_padding_mask_raises_on_every_rank_through_model_forward(masked, size, family):
    for rank in range(size):
        for case in ("padded_8", "padded_last"):
            logits, error = masked[rank][(size, family, case)]
            assert logits is None, f"rank {rank} {case}: a padding mask was silently ignored"
            assert re.search(PADDING_ERROR, error), error
        logits, error = masked[rank][(size, family, "4d")]
        assert logits is None and re.search(r"takes no prepared attention mask", error), error


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("size", [1, 2])
def test_all_ones_mask_equals_no_mask_through_model_forward(masked, size, family):
    for rank in range(size):
        (no_mask, err_none), (ones, err_ones) = (masked[rank][(size, family, c)] for c in ("none", "ones"))
        assert err_none is None and err_ones is None, (err_none, err_ones)
        assert torch.equal(ones, no_mask), f"rank {rank}: an all-ones mask changed the logits"


def test_dropout_error_names_the_models_config_field():
    """Checked before any communication, so an in-process forward without a process group reaches it."""
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=64, attn_pdrop=0.1,
        bos_token_id=0, eos_token_id=0))
    ids = make_ids()
    with pytest.raises(ValueError, match=r"attention dropout \(0.1\) .*config.attn_pdrop = 0.0"):
        hf.use_distattn(gpt2).train()(input_ids=ids)
    llama = make_model("llama")
    llama.config.attention_dropout = 0.2  # the config field read at build time: rebuild with it
    llama = transformers.LlamaForCausalLM(llama.config).train()
    with pytest.raises(ValueError, match=r"attention dropout \(0.2\) .*config.attention_dropout = 0.0"):
        hf.use_distattn(llama)(input_ids=ids)


# -- Gemma-2: attention logit soft-capping goes through distattn's softcap ----------------------------------------
SOFTCAP = 1.0  # small, so that capping changes the scores of this tiny random model (|scores| reach ~2)


def make_gemma2(attn: str, dtype=torch.float32, softcap=SOFTCAP):
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=64, initializer_range=0.2,
        attn_logit_softcapping=softcap, attn_implementation=attn, use_cache=False)
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(config).to(dtype).train()


def _gemma2_step(rank, world_size):
    import torch.distributed as dist

    model = hf.use_distattn(make_gemma2("eager"))
    batch = hf.shard_batch(make_ids(), labels=make_ids())
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    loss = hf.causal_lm_loss(logits, batch["shift_labels"])
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)
        grads[name] = p.grad
    return loss.detach(), grads


def test_gemma2_softcap_matches_single_process_eager():
    runs = []
    for dtype, softcap in ((torch.float64, SOFTCAP), (torch.float32, SOFTCAP), (torch.float32, None)):
        model = make_gemma2("eager", dtype, softcap)
        loss = model(input_ids=make_ids(), labels=make_ids()).loss
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ref_loss, ref_grads), (base_loss, base_grads), (uncapped_loss, _) = runs
    assert abs(ref_loss - uncapped_loss) > 1e-3, "soft-capping must matter in this test"
    ours_loss, ours_grads = run_distributed(_gemma2_step, 2, timeout=120)[0]
    assert_close_by_rule("gemma2 loss", ours_loss, base_loss, ref_loss, torch.float32)
    mag = magnitude_of(*ref_grads.values())
    for name, ref in ref_grads.items():
        assert_close_by_rule(f"gemma2 {name}", ours_grads[name], base_grads[name], ref, torch.float32, magnitude=mag)


# -- layouts and groups: zigzag on 2 and 3 ranks, two-dimensional (Ulysses 2 x ring 2), a mismatch -------------
LAYOUT_CASES = {  # name: (ranks, schedule, two-dimensional group as "pair" / "mesh" / None)
    "zigzag P=2": (2, "zigzag", None),
    "zigzag P=3": (3, "zigzag", None),
    "2d U=2 R=2 balanced": (4, "balanced", "pair"),
    "2d U=2 R=2 zigzag": (4, "zigzag", "mesh"),
}
LAYOUT_SEQ = 24  # divides by 2 x every group size (zigzag: two chunks per rank)
MISMATCH = r"not sharded with the layout of the model's attention schedule='{}' .*shard_batch\(\.\.\., group=group, " \
           r"schedule='{}'\)"


def make_layout_ids():
    return torch.randint(0, VOCAB, (BATCH, LAYOUT_SEQ), generator=torch.Generator().manual_seed(3))


def _layout_step(model, ids, group, schedule):
    """One step on this rank's shard; loss, gradients summed over every rank of the (sub)group, the shard."""
    import torch.distributed as dist

    from distattn.topology import split

    model.zero_grad(set_to_none=True)
    batch = hf.shard_batch(ids, labels=ids, group=group, schedule=schedule)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    loss = hf.causal_lm_loss(logits, batch["shift_labels"], group=group)
    loss.backward()
    ulysses_group, ring_group = split(group)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        if ulysses_group is not None:
            dist.all_reduce(g, group=ulysses_group)
        dist.all_reduce(g, group=ring_group)
        grads[name] = g
    return {"loss": loss.detach(), "grads": grads, "position_ids": batch["position_ids"],
            "shift_labels": batch["shift_labels"]}


def _mismatch(model, ids, group, schedule):
    """The message of the ValueError a forward on a batch sharded with ``schedule`` raises (None: no error)."""
    batch = hf.shard_batch(ids, group=group, schedule=schedule)
    try:
        with torch.no_grad():
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    except ValueError as err:
        return str(err)
    return None


def _layout_cases(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from distattn.sharding import positions
    from distattn.topology import make_2d_groups

    flat = {2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2]), 4: None}  # new_group: every rank calls it
    two_d = {"pair": make_2d_groups(2),
             "mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))}
    ids = make_layout_ids()
    results = {}
    for name, (size, schedule, kind) in LAYOUT_CASES.items():
        if rank >= size:
            continue
        group = two_d[kind] if kind else flat[size]
        model = hf.use_distattn(make_model("llama", attn="sdpa"), group=group, schedule=schedule)
        res = _layout_step(model, ids, group, schedule)
        res["expected_positions"] = positions(LAYOUT_SEQ // size, group, schedule)
        results[name] = res
    # the guard: a batch sharded with another layout raises at the first forward, on every rank
    if rank < 2:
        zigzag = hf.use_distattn(make_model("llama", attn="sdpa"), group=flat[2], schedule="zigzag")
        results["zigzag model, balanced batch"] = _mismatch(zigzag, ids, flat[2], "balanced")
        ring = hf.use_distattn(make_model("llama", attn="sdpa"), group=flat[2], schedule="ring")
        results["ring model, zigzag batch"] = _mismatch(ring, ids, flat[2], "zigzag")
    two_d_model = hf.use_distattn(make_model("llama", attn="sdpa"), group=two_d["pair"], schedule="zigzag")
    results["2d zigzag model, flat zigzag batch"] = _mismatch(two_d_model, ids, None, "zigzag")
    try:  # heads that cannot be split over the Ulysses group: refused by use_distattn, no communication
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=3, num_key_value_heads=3)
        hf.use_distattn(transformers.LlamaForCausalLM(config), group=two_d["pair"])
        results["odd heads"] = None
    except ValueError as err:
        results["odd heads"] = str(err)
    return results


@pytest.fixture(scope="module")
def layouts():
    return run_distributed(_layout_cases, 4, timeout=TIMEOUT_S)


@pytest.mark.parametrize("name", list(LAYOUT_CASES))
def test_layouts_and_2d_groups_match_single_process_eager(layouts, references, name):
    size, schedule, _ = LAYOUT_CASES[name]
    ids = make_layout_ids()
    runs = []
    for dtype in (torch.float64, torch.float32):  # the references fixture's model on this test's sequence
        model = make_model("llama", attn="eager", dtype=dtype)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ref_loss, ref_grads), (base_loss, base_grads) = runs
    shifted = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    mag = magnitude_of(*ref_grads.values())
    for rank in range(size):
        ours = layouts[rank][name]
        want = ours["expected_positions"]
        assert torch.equal(ours["position_ids"], want.expand(BATCH, -1)), f"rank {rank}: global positions"
        assert torch.equal(ours["shift_labels"], shifted[:, want]), f"rank {rank}: labels shifted before sharding"
        assert_close_by_rule(f"{name} loss", ours["loss"], base_loss, ref_loss, torch.float32)
        for n, ref in ref_grads.items():
            assert_close_by_rule(f"{name} rank {rank} {n}", ours["grads"][n], base_grads[n], ref, torch.float32,
                                 magnitude=mag)
    if schedule == "zigzag":  # not a contiguous split: rank 0 holds two separate pieces
        assert int((torch.diff(layouts[0][name]["expected_positions"]) != 1).sum()) == 1
    if name.startswith("zigzag"):  # flat: rank 0 holds the first and the last of 2P chunks
        c = LAYOUT_SEQ // (2 * size)
        want = list(range(c)) + list(range(LAYOUT_SEQ - c, LAYOUT_SEQ))
        assert layouts[0][name]["position_ids"][0].tolist() == want


@pytest.mark.parametrize("case,schedule", [("zigzag model, balanced batch", "zigzag"),
                                           ("ring model, zigzag batch", "ring"),
                                           ("2d zigzag model, flat zigzag batch", "zigzag")])
def test_a_batch_sharded_with_another_layout_raises_on_every_rank(layouts, case, schedule):
    ranks = 4 if case.startswith("2d") else 2
    for rank in range(ranks):
        error = layouts[rank][case]
        assert error is not None, f"rank {rank}: {case} ran silently"
        assert re.search(MISMATCH.format(schedule, schedule), error), error
    if case.startswith("2d"):
        assert "2 per Ulysses group" in layouts[0][case]


def test_heads_that_cannot_split_over_ulysses_are_refused(layouts):
    for res in layouts:
        assert res["odd heads"] is not None and re.search(
            r"two-dimensional group: 3 query heads cannot be split over ulysses=2 ranks", res["odd heads"])
