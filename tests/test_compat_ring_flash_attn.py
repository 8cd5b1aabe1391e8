"""distattn.compat.ring_flash_attn on spawned gloo ranks: ring-flash-attention's own test shapes through every compat
function, against the fp64 reference of the whole sequence (the accuracy rule, tests/attn_ref.py).

The shards are made here, independently of the module, the way ring-flash-attention's tests make them: contiguous
chunks, zigzag chunks r and 2P-1-r, stripes (token i on rank i % P), every document cut per rank (its varlen tests),
llama3's contiguous shards with llama3_flash_attn_prepare_cu_seqlens. Each rank checks its out, lse, dq, dk, dv.
Shapes: ring-flash-attention's nheads 5 and its varlen cu_seqlens [0, 120, 1248, 4232] / [0, 128, 1248, 4240],
scaled down for CPU (d 8, lengths / 10 rounded to what the layout needs), plus distattn's extras (GQA, windows,
softcap, llama3 documents of any length). All cases of one world size run in one spawn (the refused arguments ride
with P = 2); the HF adapter runs a tiny LlamaForCausalLM against one-process logits and summed gradients.
"""

from __future__ import annotations

import pytest
import torch

from attn_ref import assert_all_close_by_rule, band_mask, make_qkv, masked_reference_grads, varlen_mask
from dist_utils import run_distributed

TIMEOUT_S = 240  # four ranks on a shared two-core machine; the library's own waits are the thing under test
WORLD_SIZES = (1, 2, 3, 4)
HEADS, DIM = 5, 8  # ring-flash-attention's tests: nheads 5, d 128 (d scaled down for CPU)
RING_VARLEN = (12, 113, 298)  # its ring varlen documents 120, 1128, 2984, / 10
ZIGZAG_VARLEN = (13, 112, 299)  # its zigzag varlen documents 128, 1120, 2992, / 10


def _round(lengths, unit):
    return [-(-x // unit) * unit for x in lengths]


# -- the layouts, written from ring-flash-attention's tests' extract_local -------------------------------------
def _contiguous(x, r, p, dim):
    return x.chunk(p, dim)[r]


def _zigzag(x, r, p, dim):
    c = x.chunk(2 * p, dim)
    return torch.cat([c[r], c[2 * p - 1 - r]], dim)


def _stripe(x, r, p, dim):
    return x.index_select(dim, torch.arange(r, x.shape[dim], p))


def _per_document(pieces):
    def take(x, r, p, dim, cu):
        parts = []
        for a, b in zip(cu, cu[1:]):
            c = x.narrow(dim, a, b - a).chunk(pieces * p, dim)
            parts += [c[r]] + ([c[2 * p - 1 - r]] if pieces == 2 else [])
        return torch.cat(parts, dim)
    return take


def _cu(lengths):
    cu = [0]
    for x in lengths:
        cu.append(cu[-1] + x)
    return cu


# -- one case: reference, shards, the compat call, the check ---------------------------------------------------
def _run(m, rank, world, name, *, pack=None, causal=True, window=(-1, -1), softcap=0.0, heads=HEADS, heads_kv=HEADS,
         dtype=torch.float32, seqlen=None, lengths=None, batch=1, seed=0, device="cpu", backend=None):
    varlen = lengths is not None
    total = sum(lengths) if varlen else seqlen
    q, k, v, dout = make_qkv(1 if varlen else batch, total, total, heads, heads_kv, DIM, dtype, seed=seed)
    mask = (varlen_mask(lengths, lengths, causal=causal, window=window) if varlen
            else band_mask(total, total, causal=causal, window=window))
    ref = masked_reference_grads(q, k, v, dout, mask, torch.float64, softcap=softcap)
    base = masked_reference_grads(q, k, v, dout, mask, dtype, softcap=softcap)
    cu = _cu(lengths) if varlen else None
    layout = {"ring": _contiguous, "zigzag_ring": _zigzag, "stripe": _stripe, "llama3": _contiguous,
              "ring_varlen": _per_document(1), "zigzag_ring_varlen": _per_document(2)}[name]
    seq_dim = 0 if varlen else 1

    def take(x, dim=seq_dim):
        if varlen and name != "llama3":
            return layout(x, rank, world, dim, cu)
        return layout(x, rank, world, dim)

    def local(x):  # (1, T, h, d) -> (T, h, d) for the varlen functions
        return take(x[0] if varlen else x)

    ql, kl, vl, dl = (local(t).detach().to(device) for t in (q, k, v, dout))
    if pack == "qkv":
        leaf = torch.stack([ql, kl, vl], dim=-3).requires_grad_()
        tensors, grads = (leaf,), lambda: leaf.grad.unbind(-3)
    elif pack == "kv":
        ql.requires_grad_()
        kv = torch.stack([kl, vl], dim=-3).requires_grad_()
        tensors, grads = (ql, kv), lambda: (ql.grad, *kv.grad.unbind(-3))
    else:
        for t in (ql, kl, vl):
            t.requires_grad_()
        tensors, grads = (ql, kl, vl), lambda: (ql.grad, kl.grad, vl.grad)
    fn = getattr(m, {"ring": "ring_flash_attn", "zigzag_ring": "zigzag_ring_flash_attn", "stripe": "stripe_flash_attn",
                     "ring_varlen": "ring_flash_attn_varlen", "zigzag_ring_varlen": "zigzag_ring_flash_attn_varlen",
                     "llama3": "llama3_flash_attn_varlen"}[name] + (f"_{pack}packed" if pack else "") + "_func")
    opts = dict(causal=causal, window_size=window, return_attn_probs=True, softcap=softcap, backend=backend)
    if name == "llama3":
        cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
        args = m.llama3_flash_attn_prepare_cu_seqlens(cu_t, causal, rank, world)
        args = args[:4] + (1,) + args[4:]  # heads_k_stride after the max_seqlens, local_k_slice last
    elif varlen:
        local_cu = torch.tensor(cu, dtype=torch.int32, device=device) // world  # ring-flash-attention's local ones
        args = (local_cu, int((local_cu[1:] - local_cu[:-1]).max()))
    else:
        args = ()
    out, lse, probs = fn(*tensors, *args, **opts)
    assert probs is None
    out.backward(dl)
    lse_ref = [take(x[0] if varlen else x, 1 if varlen else 2) for x in (ref[1], base[1])]
    ours = [t.detach().cpu() for t in (out, lse, *grads())]
    refs = [take(x[0]) if varlen else take(x) for x in (ref[0], ref[2], ref[3], ref[4])]
    bases = [take(x[0]) if varlen else take(x) for x in (base[0], base[2], base[3], base[4])]
    assert_all_close_by_rule(["out", "lse", "dq", "dk", "dv"], ours, [bases[0], lse_ref[1], *bases[1:]],
                             [refs[0], lse_ref[0], *refs[1:]], dtype)
    return f"{name}/{pack}"


def _cases(world):
    two = 2 * world
    ring_docs = _round(RING_VARLEN, world)
    zigzag_docs = _round(ZIGZAG_VARLEN, two)
    any_docs = [5, 1, 23, 9, 2, 17]  # llama3: documents of any length; the stream padded to a multiple of P
    any_docs[-1] += -sum(any_docs) % world
    seq = 6 * two  # its dense tests use 3816-3824 tokens; a multiple of 2P here
    yield "ring", dict(seqlen=seq)
    yield "ring", dict(seqlen=seq, pack="qkv", batch=2, causal=False)
    yield "ring", dict(seqlen=seq, pack="kv", heads=6, heads_kv=2, window=(5, 0), softcap=1.5)  # GQA, window, cap
    yield "zigzag_ring", dict(seqlen=seq)
    yield "zigzag_ring", dict(seqlen=seq, pack="qkv", dtype=torch.bfloat16)
    yield "zigzag_ring", dict(seqlen=seq, pack="kv", heads=6, heads_kv=3, window=(7, 0))
    yield "stripe", dict(seqlen=seq + world)  # stripe needs only a multiple of P
    yield "stripe", dict(seqlen=seq, pack="qkv", window=(4, 0), softcap=2.0)
    yield "stripe", dict(seqlen=seq, pack="kv", heads=4, heads_kv=1, causal=False)
    yield "ring_varlen", dict(lengths=ring_docs)
    yield "ring_varlen", dict(lengths=ring_docs, pack="qkv", causal=False)
    yield "ring_varlen", dict(lengths=ring_docs, pack="kv", heads=6, heads_kv=2, window=(9, 0))
    yield "zigzag_ring_varlen", dict(lengths=zigzag_docs)
    yield "zigzag_ring_varlen", dict(lengths=zigzag_docs, pack="qkv", softcap=1.0)
    yield "zigzag_ring_varlen", dict(lengths=zigzag_docs, pack="kv", heads=4, heads_kv=2)
    yield "llama3", dict(lengths=ring_docs)
    yield "llama3", dict(lengths=any_docs, pack="qkv", causal=False)
    yield "llama3", dict(lengths=any_docs, pack="kv", heads=6, heads_kv=2, window=(6, 0), softcap=1.5)


def _cases_for(world):
    """Every case at P = 2 and 3; one case per layout at P = 1 and 4 (the test-time budget: the packed forms are
    five-line wrappers over the same call)."""
    return [(name, kw) for name, kw in _cases(world) if world in (2, 3) or "pack" not in kw]


def _all_functions(rank, world):
    import distattn.compat.ring_flash_attn as m

    torch.manual_seed(0)
    done = [_run(m, rank, world, name, seed=i, **kw) for i, (name, kw) in enumerate(_cases_for(world))]
    if world == 2:  # the refused arguments ride along with this spawn (test time)
        done.append(f"refused: {_errors(rank, world)}")
    return done


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_every_function_matches_the_reference(world):
    results = run_distributed(_all_functions, world, timeout=TIMEOUT_S)
    assert all(r == results[0] for r in results)
    assert len(results[0]) == len(_cases_for(world)) + (world == 2)
    assert world != 2 or results[0][-1] == "refused: True"


def _on_cuda(rank, world):
    import distattn.compat.ring_flash_attn as m

    cases = [("stripe", dict(seqlen=8 * world)), ("ring_varlen", dict(lengths=_round(RING_VARLEN, world), pack="kv")),
             ("zigzag_ring_varlen", dict(lengths=_round(ZIGZAG_VARLEN, 2 * world))),
             ("llama3", dict(lengths=[5, 1, 23, 9 + -38 % world]))]
    return [_run(m, rank, world, name, device="cuda", backend="torch", **kw) for name, kw in cases]


# CUDA-only: _relayout._move's staging of CUDA tensors through host memory for a gloo all-to-all
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_moved_layouts_on_cuda_over_gloo():
    """CUDA tensors through the all-to-all on gloo (staged through host memory) and the llama3 gather; the ranks
    share cuda:0 (NCCL refuses two ranks on one device), the torch backend (the kernels are tested elsewhere)."""
    assert len(run_distributed(_on_cuda, 2, timeout=TIMEOUT_S)[0]) == 4


# -- llama3's helper, worked by hand ---------------------------------------------------------------------------
def test_llama3_prepare_cu_seqlens_by_hand():
    from distattn.compat.ring_flash_attn import llama3_flash_attn_prepare_cu_seqlens as prepare

    cu = torch.tensor([0, 3, 10, 12], dtype=torch.int32)  # 12 tokens on 3 ranks: [0,4) [4,8) [8,12)
    q, k, mq, mk, sl = prepare(cu, True, 1, 3)  # rank 1: tokens 4..7, all in document [3, 10)
    assert q.tolist() == [0, 4] and k.tolist() == [0, 5] and (mq, mk, sl) == (4, 5, slice(3, 8))
    q, k, mq, mk, sl = prepare(cu, False, 1, 3)  # not causal: the keys run to the document's end
    assert q.tolist() == [0, 4] and k.tolist() == [0, 7] and (mq, mk, sl) == (4, 7, slice(3, 10))
    q, k, mq, mk, sl = prepare(cu, True, 2, 3)  # rank 2: tokens 8..11: documents [3, 10) and [10, 12)
    assert q.tolist() == [0, 2, 4] and k.tolist() == [0, 7, 9] and (mq, mk, sl) == (2, 7, slice(3, 12))
    assert q.dtype == torch.int32
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] = 12 tokens cannot be split evenly over 5 ranks"):
        prepare(cu, True, 0, 5)


# -- refused arguments: the same clear error on every rank, and the ranks stay in step (run at P = 2) -----------
def _errors(rank, world):
    import distattn.compat.ring_flash_attn as m

    q, k, v, _ = make_qkv(1, 4 * world, 4 * world, 2, 2, DIM, torch.float32)
    ql, kl, vl = (_contiguous(t, rank, world, 1) for t in (q, k, v))
    refused = [
        (r"dropout_p=0.1: distattn does not implement attention dropout",
         lambda: m.ring_flash_attn_func(ql, kl, vl, 0.1)),
        (r"alibi_slopes", lambda: m.stripe_flash_attn_func(ql, kl, vl, alibi_slopes=torch.ones(2))),
        # only rank 1's input is bad: every rank raises (naming rank 1) before the exchange, none waits for it
        (r"(?s)rank\(s\) \[1\].*rank 1: dropout_p=0.1",
         lambda: m.stripe_flash_attn_func(ql, kl, vl, 0.1 if rank == 1 else 0.0)),
        (r"document 0 has 3 tokens on this rank.*multiple of 2 x world_size",
         lambda: m.zigzag_ring_flash_attn_varlen_func(ql[0], kl[0], vl[0], torch.tensor([0, 3, 4], dtype=torch.int32),
                                                      3, causal=True)),
        (r"heads_k_stride \(3\) must divide the key/value heads \(2\)", lambda: m.llama3_flash_attn_varlen_func(
            ql[0], kl[0], vl[0], *m.llama3_flash_attn_prepare_cu_seqlens(torch.tensor([0, 4 * world]), True, rank,
                                                                          world)[:4], 3, slice(0, 4 * (rank + 1)))),
        # llama3 arguments prepared for causal=False, called with causal=True: rebuilt, checked, refused everywhere
        (r"not what llama3_flash_attn_prepare_cu_seqlens\(cu_seqlens, causal=True, rank, world_size\) gives",
         lambda: m.llama3_flash_attn_varlen_func(ql[0], kl[0], vl[0], *_llama3_args(m, [0, 3, 4 * world], False, rank,
                                                                                     world), causal=True)),
    ]
    for pattern, call in refused:
        with pytest.raises(ValueError, match=pattern):
            call()
    with pytest.raises(TypeError, match="one flat process group"):
        m.ring_flash_attn_func(ql, kl, vl, group=(None, None))
    out = m.stripe_flash_attn_func(ql, kl, vl, causal=True)  # the next call on every rank pairs up as usual
    return bool(torch.isfinite(out).all())


def _llama3_args(m, cu, causal, rank, world):
    a = m.llama3_flash_attn_prepare_cu_seqlens(torch.tensor(cu), causal, rank, world)
    return a[:4] + (1,) + a[4:]


# -- the Hugging Face adapter as Axolotl and OpenRLHF call it ---------------------------------------------------
HF_DOCS = (7, 12, 1, 9)  # 29 tokens: odd, so the stream is padded to a multiple of P as OpenRLHF pads it
VOCAB = 40
LOGITS_ATOL = 2e-5  # fp32 through two tiny layers: measured <= 1e-7; one document too many in the mask: ~2e-1
GRAD_RTOL = 1e-4  # relative to each gradient's largest entry (fp32, sums over 3 ranks in another order)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0)
    return LlamaForCausalLM(cfg)


def _hf_adapter(rank, world):
    import torch.distributed as dist

    import distattn.compat.ring_flash_attn as m

    model = _tiny_llama()
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, VOCAB, (n,), generator=g) for n in HF_DOCS]
    total = sum(HF_DOCS)
    weight = torch.randn(total, VOCAB, generator=g)
    # one process: every document through the model on its own
    ref = torch.cat([model(input_ids=d[None]).logits[0] for d in docs])
    (ref * weight).sum().backward()
    ref_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    # the packed stream, padded to a multiple of P by extending the last document (OpenRLHF's convention)
    pad = -total % world
    ids = torch.cat(docs + [torch.zeros(pad, dtype=torch.long)])
    lens = list(HF_DOCS[:-1]) + [HF_DOCS[-1] + pad]
    pos = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor(_cu(lens), dtype=torch.int32)
    m.substitute_hf_flash_attn(None, 1)
    # transformers refuses the name flash_attention_2 without the flash-attn package (CPU here): the adapter's own
    # name, through transformers' public switch (tests/test_compat_hf_adapter.py: loading by either name)
    from distattn.compat.ring_flash_attn.adapters.hf_adapter import HF_IMPLEMENTATION

    model.set_attn_implementation(HF_IMPLEMENTATION)
    m.update_ring_flash_attn_params(cu, None)
    n = (total + pad) // world
    shard = slice(rank * n, (rank + 1) * n)
    logits = model(input_ids=ids[None, shard], position_ids=pos[None, shard]).logits[0]
    real = torch.arange(rank * n, (rank + 1) * n) < total  # the padding's logits are ignored, as OpenRLHF does
    ref, weight = (torch.cat([t, t.new_zeros(pad, VOCAB)]) for t in (ref.detach(), weight))
    err = (logits[real] - ref[shard][real]).abs().max().item()
    assert err <= LOGITS_ATOL, f"logits differ from one process by {err:.2e}"
    (logits[real] * weight[shard][real]).sum().backward()
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)  # each rank holds its share of the full-sequence gradient
        scale = ref_grads[name].abs().max().item()
        assert (p.grad - ref_grads[name]).abs().max().item() <= GRAD_RTOL * max(scale, 1e-6), name
    return err


def test_hf_adapter_matches_one_process():
    errors = run_distributed(_hf_adapter, 3, timeout=TIMEOUT_S)
    assert len(errors) == 3
