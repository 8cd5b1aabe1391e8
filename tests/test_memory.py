"""distattn.memory: measurement (saved_activations), the byte-exact model, published figures, the planner CLI.

Agreement tests measure, on CPU, what a forward saves for backward and compare it with the model's explicit
tensor list *allocation by allocation* (sorted ``(nbytes, dtype)``): tiny HF ``LlamaDecoderLayer``s (GQA and
MHA, SwiGLU / GELU / ReLU gated MLPs, eager and sdpa attention, fp32 and bf16 autocast, no checkpointing,
full checkpointing, checkpointing of the attention core only), whole ``LlamaForCausalLM`` forwards with the
loss, distattn's registered op on one gloo rank (none / full / remat), and a GPT-style block (LayerNorm,
GELU/ReLU, dropout; fp32, autocast, pure bf16).
"""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from dist_utils import run_distributed
from distattn._compat import hf_checkpointing_enable
from distattn.checkpoint import retained_bytes
from distattn.memory import model as mm
from distattn.memory import saved_activations

transformers = pytest.importorskip("transformers")
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import eager_attention_forward  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

GIB = 2 ** 30


def _sig(tensors):
    return sorted(((t.nbytes, t.dtype) for t in tensors), key=lambda x: (x[0], str(x[1])))


def _amp(precision):
    if precision == "amp-bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def _to(model, precision):
    """fp32 parameters (fp32, autocast) or a bf16 model (what FSDP2's mixed precision computes with)."""
    return model.to(torch.bfloat16 if precision == "bf16" else torch.float32)


# -- measurement primitives -----------------------------------------------------------------------------
def test_one_count_per_storage_and_ignore():
    lin = nn.Linear(8, 24, bias=False)
    x = torch.randn(4, 8, requires_grad=True)
    with saved_activations(ignore=lin.parameters(), model=lin) as acc:
        qkv = lin(x)                       # saves x (and the weight: ignored)
        q, k, v = qkv.split(8, dim=-1)     # three views of one allocation
        y = (q * k).sum() + (k * v.t().t()).sum()  # mul saves q, k, k, v: all views of qkv
    assert acc.bytes == x.numel() * 4 + qkv.numel() * 4
    assert acc.by_module() == {"Linear": x.numel() * 4, "": qkv.numel() * 4}  # root module: its class name
    assert acc.by_producer() == {"leaf": x.numel() * 4, "SplitBackward0": qkv.numel() * 4}
    del y


def test_checkpoint_regions_keep_their_inputs_and_caches():
    """Plain checkpoint: its inner saves are hidden (recomputed), its input is kept; reentrant: the same;
    selective: the cached op outputs too. Cross-checked with distattn.checkpoint.retained_bytes."""
    w = torch.randn(16, 16, requires_grad=True)

    def f(x):
        return torch.tanh(x @ w) @ w

    x = torch.randn(8, 16, requires_grad=True)
    with saved_activations(ignore=[w]) as acc:
        y_none = f(x)
    assert acc.bytes == 2 * x.numel() * 4  # mm saves x; tanh saves its output, which the 2nd mm saves again
    for reentrant in (False, True):
        with saved_activations(ignore=[w]) as acc:
            y = checkpoint(f, x, use_reentrant=reentrant)
        assert acc.bytes == x.numel() * 4, reentrant
        assert [r.shape for r in acc.records] == [(8, 16)]

    policy = lambda ctx, op, *a, **k: (CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.tanh.default  # noqa: E731
                                       else CheckpointPolicy.PREFER_RECOMPUTE)
    ctx_fn = lambda: create_selective_checkpoint_contexts(policy)  # noqa: E731
    sac = lambda x: checkpoint(f, x, use_reentrant=False, context_fn=ctx_fn)  # noqa: E731
    with saved_activations(ignore=[w]) as acc:
        y = sac(x)
    assert acc.bytes == 2 * x.numel() * 4
    assert acc.by_producer() == {"leaf": x.numel() * 4, "aten.tanh.default": x.numel() * 4}
    _, kept = retained_bytes(sac, x)  # counts what was born inside: the cached tanh output
    assert kept == x.numel() * 4
    # the patched checkpoint generator is restored
    import torch.utils.checkpoint as tuc
    assert tuc._checkpoint_without_reentrant_generator.__module__ == "torch.utils.checkpoint"
    del y, y_none


def test_dead_storages_are_not_counted():
    x = torch.randn(32, requires_grad=True)
    with saved_activations() as acc:
        y = torch.sin(x * 2)
    assert acc.bytes == 32 * 4  # a product with a Python number saves nothing; sin saves its input x * 2
    del y
    assert acc.bytes == 0


def test_allocator_delta_needs_cuda():
    from distattn.memory import allocator_delta
    if torch.cuda.is_available():
        pytest.skip("CUDA present: covered by the GPU benchmark")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        with allocator_delta():
            pass


# -- HF LLaMA layers ------------------------------------------------------------------------------------
def _selective(base):
    """An attention function that checkpoints the attention core only (q, k, v in; output kept)."""
    def fn(module, query, key, value, attention_mask, **kwargs):
        core = lambda q, k, v: base(module, q, k, v, attention_mask, **kwargs)[0]  # noqa: E731
        return checkpoint(core, query, key, value, use_reentrant=False), None
    return fn


AttentionInterface.register("eager_selective", _selective(eager_attention_forward))
AttentionInterface.register("sdpa_selective", _selective(sdpa_attention_forward))

LLAMA_SHAPES = [  # hidden, heads, kv_heads, ffn, batch, seq
    dict(h=64, a=4, kv=2, f=96, b=2, n=24),
    dict(h=48, a=3, kv=3, f=80, b=1, n=40),
    dict(h=64, a=8, kv=1, f=160, b=3, n=10),
]


def _llama(shape, act="silu", impl="sdpa", layers=1, vocab=120):
    cfg = LlamaConfig(hidden_size=shape["h"], intermediate_size=shape["f"], num_hidden_layers=layers,
                      num_attention_heads=shape["a"], num_key_value_heads=shape["kv"], vocab_size=vocab,
                      hidden_act=act, attn_implementation=impl)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).train()


def _spec(shape, act="silu"):
    return mm.LayerSpec(hidden=shape["h"], heads=shape["a"], kv_heads=shape["kv"], ffn=shape["f"], act=act)


def _measure_layer(model, shape, precision, strategy):
    b, n = shape["b"], shape["n"]
    layer = model.model.layers[0]
    x = torch.randn(b, n, shape["h"], dtype=next(model.parameters()).dtype, requires_grad=True)
    pos = torch.arange(n)[None].expand(b, n)
    cos, sin = model.model.rotary_emb(x, pos)
    fn = lambda x: layer(x, attention_mask=None, position_embeddings=(cos, sin), position_ids=pos)  # noqa: E731
    if strategy == "full":
        fn = (lambda f: (lambda x: checkpoint(f, x, use_reentrant=False)))(fn)
    with _amp(precision), saved_activations(ignore=[*model.parameters(), cos, sin], model=model) as acc:
        y = fn(x)
    return acc, y


@pytest.mark.parametrize("shape", LLAMA_SHAPES, ids=lambda s: f"h{s['h']}a{s['a']}kv{s['kv']}")
def test_llama_layer_matches_model_exactly(shape):
    for act in ("silu", "gelu", "relu"):
        model, spec = _llama(shape, act), _spec(shape, act)
        for impl in ("eager", "sdpa"):
            for strategy in ("none", "full", "selective"):
                # the layers read the shared config at every forward
                model.config._attn_implementation = f"{impl}_selective" if strategy == "selective" else impl
                for precision in ("fp32", "amp-bf16", "bf16"):
                    acc, _ = _measure_layer(_to(model, precision), shape, precision, strategy)
                    want = mm.layer_saved_tensors(spec, shape["b"], shape["n"], impl=impl, precision=precision,
                                                  strategy=strategy, device="cpu")
                    assert acc.signature() == _sig(want), (act, impl, strategy, precision, acc.records)
                    assert acc.bytes == sum(t.nbytes for t in want)


@pytest.mark.parametrize("precision", ["fp32", "amp-bf16", "bf16"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_whole_llama_forward_with_loss_matches_model(impl, precision):
    shape = LLAMA_SHAPES[0]
    model = _to(_llama(shape, impl=impl, layers=2), precision)
    ms = mm.ModelSpec(layer=_spec(shape), layers=2, vocab=120)
    ids = torch.randint(0, 120, (shape["b"], shape["n"]))
    with _amp(precision), saved_activations(ignore=model.parameters(), model=model) as acc:
        out = model(input_ids=ids, labels=ids)
    want = 2 * mm.layer_saved_tensors(ms.layer, shape["b"], shape["n"], impl=impl, precision=precision,
                                      device="cpu") + mm.model_saved_tensors(ms, shape["b"], shape["n"],
                                                                             precision=precision)
    assert acc.signature() == _sig(want)
    assert acc.bytes == mm.activation_bytes(ms, shape["b"], shape["n"], impl=impl, precision=precision) or \
        impl == "eager"  # activation_bytes is the CUDA model; identical for these (no dropout) settings
    assert sum(out.logits.shape) > 0


@pytest.mark.parametrize("impl, precision", [("eager", "fp32"), ("sdpa", "amp-bf16")])
def test_whole_llama_with_hf_gradient_checkpointing_matches_model(impl, precision):
    """HF's per-layer checkpointing (full): each layer keeps its input; the partial-bound keyword arguments
    (cos/sin, position_ids, eager's 4-D mask) are kept by the checkpoints and counted once."""
    shape = LLAMA_SHAPES[0]
    model = _llama(shape, impl=impl, layers=2)
    hf_checkpointing_enable(model, {"use_reentrant": False})  # the name differs across transformers 5.x
    model.config.use_cache = False
    ms = mm.ModelSpec(layer=_spec(shape), layers=2, vocab=120)
    ids = torch.randint(0, 120, (shape["b"], shape["n"]))
    with _amp(precision), saved_activations(ignore=model.parameters(), model=model) as acc:
        out = model(input_ids=ids, labels=ids)
    want = 2 * mm.layer_saved_tensors(ms.layer, shape["b"], shape["n"], impl=impl, precision=precision, strategy="full",
                                      device="cpu") + mm.model_saved_tensors(ms, shape["b"], shape["n"], impl=impl,
                                                                             precision=precision, strategy="full")
    assert acc.signature() == _sig(want)
    assert acc.bytes == mm.activation_bytes(ms, shape["b"], shape["n"], impl=impl, precision=precision, strategy="full")
    del out


# -- distattn's registered op (1 gloo rank) -------------------------------------------------------------
def _distattn_ranks(rank, world_size):
    from distattn.integrations import hf
    from distattn.checkpoint import remat_checkpoint

    results = []
    for shape in LLAMA_SHAPES[:1]:
        model = _llama(shape)
        hf.use_distattn(model, backend="torch")
        layer = model.model.layers[0]
        b, n = shape["b"], shape["n"]
        for precision in ("fp32", "amp-bf16", "bf16"):
            _to(model, precision)
            for strategy in ("none", "full", "remat"):
                x = torch.randn(b, n, shape["h"], dtype=next(model.parameters()).dtype, requires_grad=True)
                pos = torch.arange(n)[None].expand(b, n)
                cos, sin = model.model.rotary_emb(x, pos)
                fn = lambda x: layer(x, attention_mask=None,  # noqa: E731,B023
                                     position_embeddings=(cos, sin), position_ids=pos)  # noqa: B023
                run = {"none": fn, "full": lambda x: checkpoint(fn, x, use_reentrant=False),  # noqa: B023
                       "remat": lambda x: remat_checkpoint(fn, x)}[strategy]  # noqa: B023
                with _amp(precision), saved_activations(ignore=[*model.parameters(), cos, sin]) as acc:
                    y = run(x)
                with _amp(precision):
                    _, kept = retained_bytes(run, x)
                want = mm.layer_saved_tensors(_spec(shape), b, n, impl="distattn", precision=precision,
                                              strategy=strategy, device="cpu")
                x_saved = any(r.producer == "leaf" and r.shape == tuple(x.shape) and r.dtype == x.dtype
                              for r in acc.records)  # a bf16 model's RMSNorm saves an fp32 copy instead
                results.append((precision, strategy, acc.signature(), _sig(want), acc.bytes, kept,
                                x.numel() * x.element_size() * x_saved))
                del y
    # a whole model with enable_remat_checkpointing: every layer keeps x, out, lse
    shape = LLAMA_SHAPES[0]
    model = _llama(shape, layers=2)
    hf.use_distattn(model, backend="torch")
    hf.enable_remat_checkpointing(model)
    ms = mm.ModelSpec(layer=_spec(shape), layers=2, vocab=120)
    ids = torch.randint(0, 120, (shape["b"], shape["n"]))
    for precision in ("fp32", "amp-bf16", "bf16"):
        _to(model, precision)
        with _amp(precision), saved_activations(ignore=model.parameters()) as acc:
            out = model(input_ids=ids, labels=ids)  # one rank: HF's own loss over the whole sequence
        want = 2 * mm.layer_saved_tensors(ms.layer, shape["b"], shape["n"], impl="distattn", precision=precision,
                                          strategy="remat", device="cpu") + \
            mm.model_saved_tensors(ms, shape["b"], shape["n"], impl="distattn", precision=precision, strategy="remat")
        results.append((precision, "remat (whole model)", acc.signature(), _sig(want), acc.bytes, None, None))
        del out
    return results


def test_distattn_op_and_remat_keep_exactly_the_predicted_bytes():
    (results,) = run_distributed(_distattn_ranks, 1, timeout=120)
    for precision, strategy, got, want, got_bytes, kept, x_bytes in results:
        assert got == want, (precision, strategy)
        # retained_bytes (born inside, alive after) = saved minus the input x (under autocast it also sees
        # autocast's weight cache, alive until the autocast region ends)
        if precision != "amp-bf16" and kept is not None:
            assert kept == got_bytes - x_bytes, (strategy, kept, got_bytes)


# -- the GPT-style layer of the published derivations ---------------------------------------------------
class GPTBlock(nn.Module):
    """Pre-LN GPT block: LayerNorm, fused qkv, (eager | sdpa) causal attention, dropout, GELU/ReLU MLP."""

    def __init__(self, h, a, f, act, impl, p=0.0, selective=False):
        super().__init__()
        self.a, self.impl, self.p, self.selective = a, impl, p, selective
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, f), nn.Linear(f, h)
        self.act = nn.GELU() if act == "gelu" else nn.ReLU()

    def core(self, q, k, v, mask):
        if self.impl == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        att = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        return F.dropout(att.masked_fill(mask, float("-inf")).softmax(-1), self.p, self.training) @ v

    def forward(self, x, mask):
        b, n, h = x.shape
        q, k, v = (t.view(b, n, self.a, h // self.a).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(h, -1))
        y = (checkpoint(self.core, q, k, v, mask, use_reentrant=False) if self.selective
             else self.core(q, k, v, mask))
        x = x + F.dropout(self.proj(y.transpose(1, 2).reshape(b, n, h)), self.p, self.training)
        return x + F.dropout(self.fc2(self.act(self.fc1(self.ln2(x)))), self.p, self.training)


@pytest.mark.parametrize("precision", ["fp32", "amp-bf16", "bf16"])
def test_gpt_block_matches_model_exactly(precision):
    h, a, f, b, n = 32, 4, 128, 2, 12
    mask = torch.ones(n, n, dtype=torch.bool).triu(1)
    for act in ("gelu", "relu"):
        for impl, p, selective in (("eager", 0.0, False), ("eager", 0.1, False), ("sdpa", 0.1, False),
                                   ("eager", 0.1, True)):
            blk = GPTBlock(h, a, f, act, impl, p, selective)
            x = torch.randn(b, n, h, requires_grad=True)
            if precision == "bf16":
                blk, x = blk.bfloat16(), x.detach().bfloat16().requires_grad_()
            with _amp(precision), saved_activations(ignore=[*blk.parameters(), mask]) as acc:
                y = blk(x, mask)
            spec = mm.LayerSpec(family="gpt", hidden=h, heads=a, ffn=f, act=act, attn_dropout=p > 0 and impl == "eager",
                                resid_dropout=p > 0)
            want = mm.layer_saved_tensors(spec, b, n, impl=impl, precision=precision, device="cpu",
                                          strategy="selective" if selective else "none")
            assert acc.signature() == _sig(want), (act, impl, p, selective, acc.records)
            del y


# -- published figures ----------------------------------------------------------------------------------
def test_korthikanti_formula_is_the_model_on_cuda():
    """Checkpointing notes / padding-free note: a 16-bit GPT layer with dropout keeps sbh(34 + 5as/h) bytes
    (LayerNorm statistics aside): the model's CUDA tensor list minus the 4 fp32 (b, s) statistics."""
    for s, b, h, a in ((2048, 1, 6144, 48), (1024, 4, 768, 12)):
        spec = mm.LayerSpec(family="gpt", hidden=h, heads=a, ffn=4 * h, act="gelu", attn_dropout=True,
                            resid_dropout=True)
        tensors = mm.layer_saved_tensors(spec, b, s, impl="eager", precision="bf16", device="cuda")
        stats = sum(t.nbytes for t in tensors if t.name.endswith((".mean", ".rstd")))
        assert stats == 4 * 4 * b * s
        assert sum(t.nbytes for t in tensors) - stats == mm.korthikanti_layer_bytes(s, b, h, a)
        full = mm.layer_saved_tensors(spec, b, s, impl="eager", precision="bf16", strategy="full")
        assert sum(t.nbytes for t in full) == mm.korthikanti_layer_bytes(s, b, h, a, mode="full")


def test_padding_free_note_table_20b():
    """The padding-free note's per-layer table (20B model: h=6144, a=48, f=24576; batch 8 of lengths uniform
    in 1..N; "GB" there is GiB): naive / FlashAttention / padding-free per N."""
    table = {512: (1.085, 0.721, 0.411), 1024: (2.919, 1.441, 0.821), 2048: (8.837, 2.882, 1.642),
             4096: (29.674, 5.763, 3.283), 8192: (107.347, 11.524, 6.566), 16384: (406.693, 23.048, 13.132),
             32768: (1581.386, 46.096, 26.263)}
    for N, row in table.items():
        got = [mm.expected_padding_bytes(N, 8, 6144, 48, impl) / GIB for impl in ("naive", "flash", "padding_free")]
        assert got == pytest.approx(row, abs=1.5e-3), N


def test_deep_dive_mlp_gelu_relu_bytes():
    """The activation-memory deep dive: bf16 MLP (d=1024, 4d hidden) on batch 2 x 4096 tokens saves
    150,994,944 bytes with GELU and 83,886,080 with ReLU (ratio 5/9). The model's MLP entries give the same;
    measured on CPU at a small shape with the same formula (18 vs 10 bytes per b*s*d)."""
    def mlp_bytes(act, b, s, d, device):
        spec = mm.LayerSpec(family="gpt", hidden=d, heads=8, ffn=4 * d, act=act)
        tensors = mm.layer_saved_tensors(spec, b, s, impl="sdpa", precision="bf16", device=device)
        return sum(t.nbytes for t in tensors if t.name.startswith(("fc1", "fc2")))

    assert mlp_bytes("gelu", 2, 4096, 1024, "cuda") == 150_994_944
    assert mlp_bytes("relu", 2, 4096, 1024, "cuda") == 83_886_080
    b, s, d = 2, 16, 32
    for act in ("gelu", "relu"):
        mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU() if act == "gelu" else nn.ReLU(),
                            nn.Linear(4 * d, d)).bfloat16()
        x = torch.randn(b, s, d, dtype=torch.bfloat16, requires_grad=True)
        with saved_activations(ignore=mlp.parameters()) as acc:
            y = mlp(x)
        assert acc.bytes == mlp_bytes(act, b, s, d, "cpu") == (18 if act == "gelu" else 10) * b * s * d
        del y


def test_memory_arithmetic_gpt2_small():
    """The memory-arithmetic post (nanoGPT GPT-2 small, batch 12 x 1024, fp16 autocast): N = 124,373,760;
    steady state 547,826,688 (weights + mask buffers) + 497,495,040 (grads) + 994,990,080 (Adam) +
    17,039,360 (cuBLAS) + 196,608 (inputs) = 2,057,547,776 bytes; activations 17.429 GB by its formula and
    peak 21.648 GB. Its snapshot shows 17.673 GB of activations, ~250 MB it could not attribute: the model's
    autocast half weight copies (and LayerNorm statistics) are that gap, to within 0.1% of the snapshot."""
    m = mm.PRESETS["gpt2-small"]
    assert m.params == 124_373_760
    steady = mm.nanogpt_steady_state_bytes(m, 12, 1024)
    assert (steady["model"], steady["grads"], steady["adam"], steady["cublas"], steady["inputs"]) == \
        (547_826_688, 497_495_040, 994_990_080, 17_039_360, 196_608)
    total = sum(v for k, v in steady.items() if k != "params")
    assert total == 2_057_547_776
    acts = mm.nanogpt_activation_bytes(m, 12, 1024)
    assert round(acts / GIB, 3) == 17.429
    nl = 12 * 1024 * m.vocab
    assert round((total + acts + 4 * nl) / GIB, 3) == 21.648
    # The per-layer part of the post's formula is the model's CUDA list (eager, amp-fp16, no dropout) less the
    # LayerNorm statistics and the half weight copies, which the post leaves out.
    layer = mm.layer_saved_tensors(m.layer, 12, 1024, impl="eager", precision="amp-fp16")
    extra = [t for t in layer if "half copy" in t.name and "weight" in t.name or t.name.endswith((".mean", ".rstd"))]
    ne, na = 12 * 1024 * 768, 12 * 12 * 1024 ** 2
    # the model keeps q, k^T, v as three copies (6 Ne) where the post counts Q, K and V: the same bytes
    assert sum(t.nbytes for t in layer) - sum(t.nbytes for t in extra) == 36 * ne + 6 * na
    explained = acts + m.layers * sum(t.nbytes for t in extra) + m.vocab * 768 * 2 + 2 * 4 * 12 * 1024
    assert abs(explained / GIB - 17.673) / 17.673 < 1e-3


# -- planner --------------------------------------------------------------------------------------------
def _cli(*args, subprocess_run=False):
    """Run the CLI in-process (fast), or through ``python -m distattn.memory`` (the real entry point)."""
    if subprocess_run:
        return subprocess.run([sys.executable, "-m", "distattn.memory", *args], capture_output=True, text=True,
                              timeout=120)
    import contextlib
    import io
    import types
    from distattn.memory.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return types.SimpleNamespace(returncode=rc, stdout=out.getvalue(), stderr=err.getvalue())


def test_plan_cli_table_and_plot(tmp_path):
    plot = tmp_path / "mem.png"
    r = _cli("plan", "--model", "llama-7b", "--gpus", "8", "--gpu-mem", "80", "--plot", str(plot), subprocess_run=True)
    assert r.returncode == 0, r.stderr
    rows = {line.split("  ")[0].strip(): line for line in r.stdout.splitlines()[2:] if line.strip()}
    assert {"distattn SP=8, no checkpointing", "distattn SP=8, remat checkpointing",
            "Megatron TP+SP=8, selective recompute", "1 GPU FlashAttention, full checkpointing"} <= set(rows)
    assert "does not fit" in rows["1 GPU FlashAttention, full checkpointing"]
    try:
        import matplotlib  # noqa: F401
        assert plot.stat().st_size > 0
    except ImportError:
        assert "plot skipped" in r.stdout


def test_plan_cli_hf_config_and_flags(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                   num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)))
    r = _cli("plan", "--model", str(cfg), "--gpus", "4", "--gpu-mem", "24", "--strategy", "remat", "--strategy", "full")
    assert r.returncode == 0, r.stderr
    assert "config: 1.10 B parameters" in r.stdout and "heads 32/4" in r.stdout
    assert len(r.stdout.splitlines()) == 4
    r = _cli("plan", "--model", "llama-7b", "--gqa", "8", "--layers", "4", "--strategy", "none")
    assert r.returncode == 0 and "heads 32/8" in r.stdout and "4 layers" in r.stdout


def test_plan_cli_takes_a_checkpoint_directory_as_train_py_does(tmp_path):
    """--model DIR reads DIR/config.json (launch/train.py --model DIR takes the same folder); tiny models are
    counted in M/K, not "0.00 B"."""
    ckpt = tmp_path / "my-tiny"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                      num_attention_heads=4, vocab_size=256)))
    by_dir = _cli("plan", "--model", str(ckpt), "--gpus", "2", "--gpu-mem", "8", "--strategy", "remat")
    by_file = _cli("plan", "--model", str(ckpt / "config.json"), "--gpus", "2", "--gpu-mem", "8", "--strategy", "remat")
    assert by_dir.returncode == 0, by_dir.stderr
    assert by_dir.stdout.replace("my-tiny:", "config:", 1) == by_file.stdout
    # 2 x 256 x 64 embeddings + 2 x (4 x 64 x 64 + 3 x 64 x 128 + 2 x 64) + 64 = 115008
    assert by_dir.stdout.startswith("my-tiny: 115 K parameters, 2 layers") and "0.00 B" not in by_dir.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _cli("plan", "--model", str(empty))
    assert r.returncode == 2 and f"--model {empty}: the directory has no config.json" in r.stderr


def test_plan_cli_gpu_mem_below_the_reserve_names_the_reserve():
    r = _cli("plan", "--gpu-mem", "0.5")
    assert r.returncode == 2 and "-0.5" not in r.stderr
    assert ("--gpu-mem 0.5 GiB leaves nothing after --reserve 2 GiB" in r.stderr and
            "or a smaller --reserve" in r.stderr), r.stderr
    r = _cli("plan", "--model", "llama-7b", "--gpus", "2", "--gpu-mem", "40", "--strategy", "full")
    assert "more than the 38.0 GiB available per GPU (40 GiB less --reserve 2)" in r.stderr


@pytest.mark.parametrize("args, message", [
    (("plan", "--model", "llama-9b"), "unknown model preset 'llama-9b'; known presets: tiny"),
    (("plan", "--model", "llama-7b", "--gpus", "2", "--gpu-mem", "40", "--strategy", "full"),
     "weights, gradients and AdamW states alone"),
    (("plan", "--model", "/nonexistent/config.json"), "cannot read HF config"),
    (("plan", "--gpus", "0"), "must be positive"),
    (("plan", "--tp", "3"), "--tp 3 must divide"),
    (("plan", "--strategy", "bogus"), "invalid choice"),
    ((), "a command is required"),
])
def test_plan_cli_bad_input_is_one_line_exit_2(args, message):
    r = _cli(*args)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_predicted_peak_and_check_fits_for_launch():
    from distattn.memory.plan import check_fits, predicted_peak_bytes
    fields = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=32, vocab_size=32000)
    peak = predicted_peak_bytes(fields, batch=1, seq_len=65536, sp_size=8, shard_size=8, remat=True)
    assert peak.total == predicted_peak_bytes("llama-7b", batch=1, seq_len=65536, sp_size=8, shard_size=8,
                                              remat=True).total
    assert peak.total < predicted_peak_bytes(fields, batch=1, seq_len=65536, sp_size=8, shard_size=8).total
    assert check_fits(fields, device_bytes=80 * GIB, batch=1, seq_len=65536, sp_size=8, shard_size=8,
                      remat=True) == peak
    with pytest.raises(ValueError, match=r"predicted peak .* GiB per rank .* exceeds the 40.00 GiB available; use"):
        check_fits(fields, device_bytes=40 * GIB, batch=1, seq_len=1 << 20, sp_size=8, shard_size=8)


def test_model_rejects_bad_arguments():
    spec = _spec(LLAMA_SHAPES[0])
    with pytest.raises(ValueError, match="strategy='remat' keeps the outputs of distattn's registered op"):
        mm.layer_saved_tensors(spec, 1, 16, impl="sdpa", strategy="remat")
    with pytest.raises(ValueError, match=r"seq \(10\) must be a multiple of the sequence-parallel degree sp \(4\)"):
        mm.layer_saved_tensors(spec, 1, 10, sp=4)
    with pytest.raises(ValueError, match="heads .* multiple of kv_heads"):
        mm.LayerSpec(hidden=64, heads=4, kv_heads=3, ffn=8)


def test_sequence_parallel_divides_per_rank_bytes():
    m = mm.PRESETS["llama-7b"]
    one = mm.activation_bytes(m, 1, 8192, impl="distattn", strategy="remat")
    eight = mm.activation_bytes(m, 1, 8192, impl="distattn", strategy="remat", sp=8)
    # every tensor is split 8 ways but the lm_head's half weight copy and the loss's scalar weight
    assert eight * 8 - 7 * (m.vocab * 4096 * 2 + 4) == one
    # remat keeps x (fp32) + out (bf16) + lse (fp32 per head) per token per layer
    assert sum(t.nbytes for t in mm.layer_saved_tensors(m.layer, 1, 8192, impl="distattn", strategy="remat", sp=8)) \
        == 1024 * (4096 * 4 + 4096 * 2 + 32 * 4)
