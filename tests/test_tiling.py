"""Sequence-tiled loss and MLP (distattn.tiling, distattn.integrations.hf.tile_loss / tile_mlp).

Every tiled result is checked against the untiled computation: fp32 by the accuracy rule against an fp64
reference (per-token results are the same formula, but a BLAS matmul over a tile may block its rows
differently from one over the shard, and parameter gradients sum over tiles), bf16 autocast by the same rule.
The saved-tensor hooks measure what the tiled forward keeps (no ``(tokens, vocab)`` or ``(tokens, ffn)``
tensor) and what each tile's recompute keeps in backward, and both equal the byte model.
"""

import re

import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from attn_ref import assert_close_by_rule, magnitude_of
from dist_utils import run_distributed

from distattn.tiling import check_tile, tiled_head_loss_sum, tiled_loss_bytes, tiled_mlp, tiled_mlp_bytes

transformers = pytest.importorskip("transformers")

from distattn.integrations import hf  # noqa: E402

TIMEOUT_S = 240  # three ranks importing transformers on a shared two-core machine, 2 group sizes x 3 modes
VALUE_RTOL = 1e-6  # a loss sum in fp32 over tiles vs over the shard: a few ulps of summation order


# -- helpers ------------------------------------------------------------------------------------------------
def _loss_inputs(shape, hidden, vocab, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, hidden, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.3).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, shape, generator=g)
    labels.view(-1)[::5] = -100  # every fifth row ignored
    return h, w, labels


def _untiled_sum(h, w, labels, dtype=None):
    hh, ww = (h, w) if dtype is None else (h.to(dtype), w.to(dtype))
    return F.cross_entropy(F.linear(hh, ww).float().flatten(0, -2), labels.flatten(), ignore_index=-100,
                           reduction="sum")


def _grads(out, tensors, scale=0.37):
    return torch.autograd.grad(out * scale, tensors)


class _Saved:
    """Saved-tensor hook: every tensor packed, deduplicated by storage, minus the given (parameter) storages."""

    def __init__(self, exclude=()):
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.tensors = {}

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.exclude:
            self.tensors[ptr] = t
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    @property
    def bytes(self):
        return sum(t.untyped_storage().nbytes() for t in self.tensors.values())

    def shapes(self):
        return [tuple(t.shape) for t in self.tensors.values()]


# -- validation ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -3, 2.5, "64", True, None, torch.tensor(4.0)])
def test_tile_size_must_be_a_positive_int(bad):
    assert check_tile(torch.tensor(5)) == 5 and check_tile(7) == 7
    with pytest.raises(ValueError, match=f"tile size must be a positive.*{re.escape(repr(bad))}" if not isinstance(bad, int)
                       or isinstance(bad, bool) else f"positive number of tokens, got {bad}"):
        check_tile(bad)
    h, w, labels = _loss_inputs((5,), 4, 7)
    with pytest.raises(ValueError, match="tokens size must be a positive"):
        tiled_head_loss_sum(h, w, labels, tokens=bad)
    with pytest.raises(ValueError, match="tokens size must be a positive"):
        tiled_mlp(torch.nn.Linear(4, 4), h, [], tokens=bad)


def test_hf_hooks_validate():
    model = _tiny_llama()
    with pytest.raises(ValueError, match="tile_mlp tokens size must be a positive number of tokens, got 0"):
        hf.tile_mlp(model, 0)
    with pytest.raises(ValueError, match="tile_loss tokens size must be a positive int.*'8'"):
        hf.tile_loss(model, "8")
    with pytest.raises(ValueError, match="no submodule named 'mlp'"):
        hf.tile_mlp(torch.nn.Linear(2, 2), 8)
    with pytest.raises(ValueError, match="labels \\(batch, n\\)"):
        hf.tiled_causal_lm_loss(torch.zeros(1, 4, 8), torch.zeros(5, 8), torch.zeros(1, 3, dtype=torch.long),
                                tokens=2)


# -- loss ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape, vocab, tile", [((37,), 1001, 8), ((2, 19), 257, 5), ((3, 7), 100, 1),
                                                ((1, 13), 31, 64)])  # odd counts; V not a multiple; tile > N
def test_tiled_loss_matches_untiled_fp32(shape, vocab, tile):
    h, w, labels = _loss_inputs(shape, 24, vocab)
    ref = _untiled_sum(h.double(), w.double(), labels)
    base = _untiled_sum(h, w, labels)
    ours = tiled_head_loss_sum(h, w, labels, tokens=tile)
    assert ours.dtype == torch.float32
    assert abs(ours.item() - base.item()) <= VALUE_RTOL * abs(base.item())
    ref_g = _grads(ref, (h, w))
    for name, o, b, r in zip(("hidden", "weight"), _grads(ours, (h, w)), _grads(base, (h, w)), ref_g):
        assert_close_by_rule(name, o, b, r, torch.float32)


def test_tiled_loss_with_a_head_bias():
    h, w, labels = _loss_inputs((2, 9), 12, 53)
    b = torch.randn(53, generator=torch.Generator().manual_seed(9), requires_grad=True)

    def untiled(hh, ww, bb):
        return F.cross_entropy(F.linear(hh, ww, bb).flatten(0, 1), labels.flatten(), reduction="sum")

    ref = untiled(h.double(), w.double(), b.double())
    base, ours = untiled(h, w, b), tiled_head_loss_sum(h, w, labels, tokens=4, bias=b)
    assert abs(ours.item() - base.item()) <= VALUE_RTOL * abs(base.item())
    for name, o, bb, r in zip(("hidden", "weight", "bias"), _grads(ours, (h, w, b)), _grads(base, (h, w, b)),
                              _grads(ref, (h, w, b))):
        assert_close_by_rule(name, o, bb, r, torch.float32)


def test_tiled_loss_bf16_autocast_by_the_accuracy_rule():
    h, w, labels = _loss_inputs((2, 23), 32, 509)  # fp32 leaves, bf16 matmuls: the autocast training case
    ref = _untiled_sum(h.double(), w.double(), labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        base = _untiled_sum(h, w, labels)
        ours = tiled_head_loss_sum(h, w, labels, tokens=6)
    # the value: the untiled one's error at most doubled (+ fp32 rounding of the sum)
    assert abs(ours.item() - ref.item()) <= 2 * abs(base.item() - ref.item()) + VALUE_RTOL * abs(ref.item())
    for name, o, b, r in zip(("hidden", "weight"), _grads(ours, (h, w)), _grads(base, (h, w)), _grads(ref, (h, w))):
        assert o.dtype == torch.float32
        assert_close_by_rule(name, o, b, r, torch.bfloat16)


def test_tiled_loss_bf16_parameters_give_bf16_gradients():
    h, w, labels = _loss_inputs((29,), 16, 211, dtype=torch.bfloat16)
    ref = _untiled_sum(h.double(), w.double(), labels)
    base, ours = _untiled_sum(h, w, labels), tiled_head_loss_sum(h, w, labels, tokens=4)
    for name, o, b, r in zip(("hidden", "weight"), _grads(ours, (h, w)), _grads(base, (h, w)), _grads(ref, (h, w))):
        assert o.dtype == torch.bfloat16
        assert_close_by_rule(name, o, b, r, torch.bfloat16)


def test_tied_embedding_gradient_adds_up():
    emb = torch.nn.Embedding(97, 16)
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(3))
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100

    def run(tiled):
        emb.zero_grad()
        hidden = torch.tanh(emb(ids))  # the embedding feeds the tokens AND is the head
        if tiled:
            loss = hf.tiled_causal_lm_loss(hidden, emb.weight, labels, tokens=3)
        else:
            loss = hf.causal_lm_loss(F.linear(hidden, emb.weight), labels)
        loss.backward()
        return loss.detach(), emb.weight.grad.clone()

    (lt, gt), (lu, gu) = run(True), run(False)
    emb.double()
    lr, gr = run(False)
    assert abs(lt.item() - lu.item()) <= VALUE_RTOL * abs(lu.item())
    assert_close_by_rule("tied embedding", gt, gu, gr, torch.float32)


def test_all_targets_ignored_gives_zero_and_zero_gradients():
    h, w, labels = _loss_inputs((1, 9), 8, 13)
    labels.fill_(-100)
    loss = hf.tiled_causal_lm_loss(h, w, labels, tokens=4)
    gh, gw = torch.autograd.grad(loss, (h, w))
    assert loss.item() == 0.0 and not gh.any() and not gw.any()


def test_tiled_loss_keeps_no_logits_and_matches_the_byte_model():
    n, hidden, vocab, tile = 30, 16, 501, 7
    h, w, labels = _loss_inputs((n,), hidden, vocab)
    untiled = _Saved(exclude=(w,))
    with untiled.hooks():
        _untiled_sum(h, w, labels)
    assert (n, vocab) in untiled.shapes()  # the thing tiling removes
    saved = _Saved(exclude=(w,))
    with saved.hooks():
        loss = tiled_head_loss_sum(h, w, labels, tokens=tile)
    assert not [s for s in saved.shapes() if vocab in s], saved.shapes()
    model = tiled_loss_bytes(n, hidden, vocab, tile, 4)
    assert saved.bytes == model.saved == n * hidden * 4 + n * 8
    in_backward = _Saved(exclude=(w, h))
    with in_backward.hooks():
        loss.backward()
    assert in_backward.bytes == model.tile_saved == 0  # the loss tiles are differentiated by hand: no graph
    assert model.tile_working < n * vocab * 4  # one tile's (t, V) buffers: less than one fp32 (N, V) logits


class _LivePeak(TorchDispatchMode):
    """Largest sum of live storages born while the mode is on, sampled after every op (CPU: no allocator stats)."""

    def __init__(self):
        super().__init__()
        self.born, self.peak = {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.born[t.untyped_storage().data_ptr()] = (StorageWeakRef(t.untyped_storage()),
                                                             t.untyped_storage().nbytes())
        self.peak = max(self.peak, sum(n for ref, n in self.born.values() if not ref.expired()))
        return out


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("n, vocab, tile", [(40, 301, 8), (23, 97, 64), (64, 37, 16)])
def test_tiled_loss_backward_peak_matches_the_byte_model(n, vocab, tile, autocast):
    hidden = 16
    h, w, labels = _loss_inputs((n,), hidden, vocab)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = tiled_head_loss_sum(h, w, labels, tokens=tile)
    model = tiled_loss_bytes(n, hidden, vocab, tile, 4, compute_bytes=2 if autocast else 4, weight_bytes=4)
    with _LivePeak() as live:
        loss.backward()
    t = min(tile, n)
    expected = n * hidden * 4 + model.backward_fixed + model.tile_working  # dhidden + dW accumulator + one tile
    # what the model leaves out: the tile's (t, h) input cast or dhidden slice before it is copied in, and
    # per-row vectors (targets, row indices, masks: at most 64 bytes a row)
    assert expected <= live.peak <= expected + t * hidden * 4 + 64 * t, (live.peak, expected)


# -- MLP ----------------------------------------------------------------------------------------------------
def _llama_mlp(hidden=24, ffn=56):
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    return LlamaMLP(transformers.LlamaConfig(hidden_size=hidden, intermediate_size=ffn, hidden_act="silu",
                                                num_attention_heads=4, num_key_value_heads=4))


def _gpt_mlp(hidden=24, ffn=56):
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=hidden, n_head=4, resid_pdrop=0.0, activation_function="gelu_pytorch_tanh")
    mlp = GPT2MLP(ffn, config)
    for p in mlp.parameters():  # Conv1D biases start at 0: make them count
        torch.nn.init.normal_(p, std=0.2)
    return mlp


MLPS = {"llama": _llama_mlp, "gpt": _gpt_mlp}


def _mlp_grads(mlp, x, g, tiled_tokens=None):
    params = list(mlp.parameters())
    if tiled_tokens is None:
        y = mlp(x)
    else:
        y = tiled_mlp(mlp.forward, x, params, tokens=tiled_tokens)
    return (y, *torch.autograd.grad(y, [x, *params], g))


@pytest.mark.parametrize("kind", MLPS)
@pytest.mark.parametrize("shape, tile", [((2, 17), 5), ((31,), 8), ((1, 9), 100)])
def test_tiled_mlp_matches_untiled_fp32(kind, shape, tile):
    mlp = MLPS[kind]()
    x = torch.randn(*shape, 24, generator=torch.Generator().manual_seed(1), requires_grad=True)
    g = torch.randn(*shape, 24, generator=torch.Generator().manual_seed(2))
    base = _mlp_grads(mlp, x, g)
    ours = _mlp_grads(mlp, x, g, tile)
    ref = _mlp_grads(mlp.double(), x.double().detach().requires_grad_(), g.double())
    names = ["out", "x"] + [n for n, _ in mlp.named_parameters()]
    for name, o, b, r in zip(names, ours, base, ref):
        assert o.dtype == torch.float32
        assert_close_by_rule(name, o, b, r, torch.float32)


@pytest.mark.parametrize("kind", MLPS)
def test_tiled_mlp_bf16_autocast_by_the_accuracy_rule(kind):
    mlp = MLPS[kind]()
    x = torch.randn(3, 11, 24, generator=torch.Generator().manual_seed(1), requires_grad=True)
    g = torch.randn(3, 11, 24, generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        base = _mlp_grads(mlp, x, g)
        ours = _mlp_grads(mlp, x, g, 4)
    ref = _mlp_grads(mlp.double(), x.double().detach().requires_grad_(), g.double())
    names = ["out", "x"] + [n for n, _ in mlp.named_parameters()]
    for name, o, b, r in zip(names, ours, base, ref):
        assert o.dtype == b.dtype
        assert_close_by_rule(name, o, b, r, torch.bfloat16, magnitude=magnitude_of(r))


@pytest.mark.parametrize("kind, model_kind", [("llama", "swiglu"), ("gpt", "gelu")])
@pytest.mark.parametrize("autocast", [False, True])
def test_tiled_mlp_keeps_only_its_input_and_matches_the_byte_model(kind, model_kind, autocast):
    n, hidden, ffn, tile = 30, 24, 56, 6  # n divides by the tile: every tile's recompute keeps the same
    mlp = MLPS[kind](hidden, ffn)
    params = list(mlp.parameters())
    x = torch.randn(n, hidden, requires_grad=True)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    untiled, saved = _Saved(exclude=params), _Saved(exclude=params)
    with ctx, untiled.hooks():
        mlp(x)
    assert (n, ffn) in untiled.shapes()
    with ctx, saved.hooks():
        y = tiled_mlp(mlp.forward, x, params, tokens=tile)
    assert saved.shapes() == [(n, hidden)]
    model = tiled_mlp_bytes(n, hidden, ffn, tile, 4, kind=model_kind, compute_bytes=2 if autocast else 4,
                            param_bytes=4)
    assert saved.bytes == model.saved
    backward = _Saved(exclude=params + [x])  # what the tiles' recomputes keep: a hook inside the backward
    with backward.hooks():
        y.backward(torch.ones_like(y))
    casts = (3 if model_kind == "swiglu" else 2) * hidden * ffn * 2 if autocast else 0  # bf16 weights, once
    assert backward.bytes == (n // tile) * model.tile_saved + casts
    assert casts <= model.backward_fixed
    assert not [s for s in backward.shapes() if n in s], backward.shapes()  # never a (n, ffn) tensor


@pytest.mark.parametrize("kind, model_kind", [("llama", "swiglu"), ("gpt", "gelu")])
@pytest.mark.parametrize("autocast", [False, True])
def test_tiled_mlp_backward_peak_within_the_byte_model(kind, model_kind, autocast):
    n, hidden, ffn, tile = 30, 24, 56, 6
    mlp = MLPS[kind](hidden, ffn)
    params = list(mlp.parameters())
    x = torch.randn(n, hidden, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = tiled_mlp(mlp.forward, x, params, tokens=tile)
    grad = torch.ones_like(y)
    model = tiled_mlp_bytes(n, hidden, ffn, tile, 4, kind=model_kind, compute_bytes=2 if autocast else 4,
                            param_bytes=4)
    with _LivePeak() as live:
        y.backward(grad)
    n_params = sum(p.numel() for p in params)
    predicted = n * hidden * 4 + model.backward_fixed + model.tile_working
    if autocast:  # the casts' moments are bounded (within 10% here), not followed op by op
        assert n * hidden * 4 + 2 * n_params * 4 <= live.peak <= predicted <= 1.1 * live.peak
    else:  # the step's byte model (distattn.memory.techniques) uses these moments as they are: exact
        assert live.peak == predicted


# -- Hugging Face models ------------------------------------------------------------------------------------
def _tiny_llama(tie=False, attn="sdpa"):
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=tie, use_cache=False, attn_implementation=attn)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def _hf_step(model, batch, group=None, tiled=False):
    model.zero_grad(set_to_none=True)
    if tiled:
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                    shift_labels=batch["shift_labels"])
        assert out.logits is None
        loss = out.loss
    else:
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = hf.causal_lm_loss(logits, batch["shift_labels"], group=group)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _hf_checkpointing(model, reentrant):
    """transformers' own layer checkpointing (``reentrant=None``: off), by its current name."""
    from distattn._compat import hf_checkpointing_disable, hf_checkpointing_enable

    if reentrant is None:
        hf_checkpointing_disable(model)
    else:
        hf_checkpointing_enable(model, {"use_reentrant": reentrant})


def _set_tiling(model, tokens, group=None):
    hf.tile_mlp(model, tokens)
    hf.tile_loss(model, tokens, group=group)


def _compare(tiled, untiled, fp64=None):
    (lt, gt), (lu, gu) = tiled, untiled
    assert abs(lt.item() - lu.item()) <= VALUE_RTOL * abs(lu.item()), (lt, lu)
    assert gt.keys() == gu.keys()
    for name in gu:
        if fp64 is None:  # same process, same numbers: near-exact (tile sums reorder a few fp32 additions)
            scale = max(magnitude_of(gu[name]), 1e-3)
            assert (gt[name] - gu[name]).abs().max().item() <= 1e-5 * scale, name
        else:
            assert_close_by_rule(name, gt[name], gu[name], fp64[1][name], torch.float32)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("checkpointing", ["none", "hf", "hf-reentrant"])
def test_hf_llama_tiled_matches_untiled_one_process(tie, checkpointing):
    ids = torch.randint(0, 1000, (2, 21), generator=torch.Generator().manual_seed(4))
    batch = {"input_ids": ids, "position_ids": torch.arange(21).expand(2, 21),  # one process, no group
             "shift_labels": F.pad(ids[:, 1:], (0, 1), value=-100)}
    model = _tiny_llama(tie)
    if checkpointing != "none":  # reentrant: the forward runs without grad, the MLPs tile in the recompute
        _hf_checkpointing(model, reentrant=checkpointing == "hf-reentrant")
    untiled = _hf_step(model, batch)
    _set_tiling(model, 8)
    tiled = _hf_step(model, batch, tiled=True)
    _set_tiling(model, None)
    again = _hf_step(model, batch)  # undone: the class's forward again
    model.double()
    fp64 = _hf_step(model, batch)
    _compare(tiled, untiled, fp64)
    assert torch.equal(again[0], untiled[0])


def test_hf_tile_loss_refuses_soft_capped_logits():
    config = transformers.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                       final_logit_softcapping=30.0)
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        hf.tile_loss(transformers.Gemma2ForCausalLM(config), 8)


def test_tile_mlp_refuses_dropout_in_training():
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, resid_pdrop=0.1)
    model = hf.tile_mlp(transformers.GPT2LMHeadModel(config).train(), 4)
    with pytest.raises(ValueError, match="dropout in training"):
        model(input_ids=torch.zeros(1, 5, dtype=torch.long))


# -- distributed: P = 2 and 3 over gloo ---------------------------------------------------------------------
def _dist_cases(rank, world_size):
    import torch.distributed as dist

    groups = {2: dist.new_group([0, 1]), 3: None}
    ids = torch.randint(0, 1000, (2, 30), generator=torch.Generator().manual_seed(5))
    out = {}
    for size, group in groups.items():
        if rank >= size:
            continue
        batch = hf.shard_batch(ids, labels=ids, group=group)
        # the loss alone: random hidden states of this rank's shard, tiles that straddle nothing in particular
        h, w, _ = _loss_inputs(batch["shift_labels"].shape, 32, 1000, seed=rank)
        labels = batch["shift_labels"]
        lu = hf.causal_lm_loss(F.linear(h, w), labels, group=group)
        lt = hf.tiled_causal_lm_loss(h, w, labels, group=group, tokens=7)
        out[(size, "loss")] = (lt.detach(), lu.detach(), _grads(lt, (h, w)), _grads(lu, (h, w)))
        model = hf.use_distattn(_tiny_llama(), group=group)
        for mode in ("none", "hf", "remat"):
            if mode == "hf":
                _hf_checkpointing(model, reentrant=False)
            if mode == "remat":
                _hf_checkpointing(model, reentrant=None)
                hf.enable_remat_checkpointing(model)
            _set_tiling(model, None)
            untiled = _hf_step(model, batch, group)
            _set_tiling(model, 4, group)
            out[(size, mode)] = (_hf_step(model, batch, group, tiled=True), untiled)
    return out


@pytest.fixture(scope="module")
def spawned():
    return run_distributed(_dist_cases, 3, timeout=TIMEOUT_S)


@pytest.mark.parametrize("size", [2, 3])
def test_distributed_tiled_loss_equals_causal_lm_loss(spawned, size):
    values = []
    for rank in range(size):
        lt, lu, gt, gu = spawned[rank][(size, "loss")]
        assert abs(lt.item() - lu.item()) <= VALUE_RTOL * abs(lu.item())
        for o, b in zip(gt, gu):  # same formula per row; a weight-gradient sum over tiles reorders additions
            assert (o - b).abs().max().item() <= 1e-6 * max(magnitude_of(b), 1e-3)
        values.append(lt.item())
    assert len(set(values)) == 1  # one global mean on every rank, bit for bit


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("mode", ["none", "hf", "remat"])
def test_distributed_hf_llama_tiled_matches_untiled(spawned, size, mode):
    for rank in range(size):
        tiled, untiled = spawned[rank][(size, mode)]
        _compare(tiled, untiled)
