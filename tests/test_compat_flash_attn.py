"""distattn.compat.flash_attn: flash-attn's module paths (``flash_attn``, ``flash_attn.flash_attn_interface``,
``flash_attn.bert_padding``) against flash-attn's documented behaviour, on CPU references.

``flash_attn_with_kvcache`` is held to attention over each row's cache after the append, written here from
flash-attn's docstring and its test's reference (tests/test_flash_attn.py::test_flash_attn_kvcache): the fp64
masked reference and SDPA in fp32 on the concatenated cache (the accuracy rule's baseline), the rotary embedding
written as a complex rotation, the cache contents after the in-place append, paged caches through their block
table. ``bert_padding`` is checked by hand and by round trips.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

import distattn
from attn_ref import assert_close_by_rule, band_mask, masked_attention
from distattn.compat import flash_attn as fa
from distattn.compat.flash_attn import bert_padding as bp
from distattn.compat.flash_attn import flash_attn_interface as fai

F32 = torch.float32
H, H_KV, D = 6, 2, 16  # GQA (flash-attn's test: nheads 6, nheads_k 3 or 1)
ROTARY_ATOL = 1e-6  # a rotated key in fp32 vs the fp64 complex rotation rounded to fp32: |k| <~ 5, a few ulp

# flash-attn 2.x's flash_attn_with_kvcache: names, order, defaults (flash_attn/flash_attn_interface.py)
KVCACHE_SIGNATURE = [("q", None), ("k_cache", None), ("v_cache", None), ("k", None), ("v", None),
                     ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None),
                     ("cache_leftpad", None), ("block_table", None), ("softmax_scale", None), ("causal", False),
                     ("window_size", (-1, -1)), ("softcap", 0.0), ("rotary_interleaved", True),
                     ("alibi_slopes", None), ("num_splits", 0), ("return_softmax_lse", False)]


def test_module_paths_hand_on_distattns_functions():
    for name in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
                 "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func"):
        assert getattr(fa, name) is getattr(fai, name) is getattr(distattn, name)  # signatures: test_flash_attn_family
    assert fa.flash_attn_with_kvcache is fai.flash_attn_with_kvcache
    params = list(inspect.signature(fa.flash_attn_with_kvcache).parameters.values())
    positional = [(p.name, None if p.default is p.empty else p.default) for p in params
                  if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == KVCACHE_SIGNATURE
    assert set(bp.__all__) >= {"unpad_input", "pad_input", "index_first_axis", "index_put_first_axis"}


# -- flash_attn_with_kvcache ------------------------------------------------------------------------------------
def _rotate_ref(x, cos, sin, positions, interleaved):
    """Rotary as a complex rotation by (cos + i sin) at ``positions (b, s)``: pairs (2i, 2i+1) or (i, i + r/2)."""
    half = cos.shape[1]
    xr = x[..., :2 * half].double()
    re, im = (xr[..., 0::2], xr[..., 1::2]) if interleaved else (xr[..., :half], xr[..., half:])
    turn = torch.complex(cos.double(), sin.double())[positions].unsqueeze(2)  # (b, s, 1, r/2)
    z = torch.complex(re, im) * turn
    rot = torch.stack((z.real, z.imag), -1).flatten(-2) if interleaved else torch.cat((z.real, z.imag), -1)
    return torch.cat((rot.to(x.dtype), x[..., 2 * half:]), -1)


def _case(seed, b=3, s_q=2, s_new=2, s_cache=24, paged=None, batch_idx=False, leftpad=False, rotary=None,
          causal=True, new_kv=True):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    b_cache = 2 * b if batch_idx else b
    k_cache, v_cache = rnd(b_cache, s_cache, H_KV, D), rnd(b_cache, s_cache, H_KV, D)
    lens = torch.randint(s_q, s_cache - s_new + 1, (b,), generator=g, dtype=torch.int32)  # no empty query row
    args = dict(cache_seqlens=lens, causal=causal)
    case = dict(q=rnd(b, s_q, H, D), lens=lens, rows=torch.arange(b), lo=torch.zeros(b, dtype=torch.int32))
    if new_kv:
        args.update(k=rnd(b, s_new, H_KV, D), v=rnd(b, s_new, H_KV, D))
    if batch_idx:
        case["rows"] = torch.randperm(b_cache, generator=g)[:b]
        args["cache_batch_idx"] = case["rows"].to(torch.int32)
    if leftpad:  # keys start inside the cache, leaving at least s_q - s_new keys so no query row is empty
        case["lo"] = torch.stack([torch.randint(0, int(n) - s_q + s_new + 1 if new_kv else int(n) - s_q + 1, (1,),
                                                generator=g)[0] for n in lens]).to(torch.int32)
        args["cache_leftpad"] = case["lo"]
    if rotary is not None:
        angle = torch.rand(s_cache, 6, generator=g) * 6.28  # rotary_dim 12 of head_dim 16: the rest passes
        args.update(rotary_cos=angle.cos(), rotary_sin=angle.sin(), rotary_interleaved=rotary == "interleaved")
    case.update(k_cache=k_cache, v_cache=v_cache, args=args)
    if paged:  # the same logical rows, scattered over shuffled pages of size `paged`
        per_row = s_cache // paged
        order = torch.randperm(b * per_row, generator=g)
        pages = torch.empty(b * per_row, paged, H_KV, D), torch.empty(b * per_row, paged, H_KV, D)
        for t, pool in zip((k_cache, v_cache), pages):
            pool[order] = t.reshape(b * per_row, paged, H_KV, D)
        case.update(pages=pages, args={**args, "block_table": order.reshape(b, per_row).to(torch.int32)})
    return case


def _expected(case):
    """Each row's cache after the append (rotated keys), and attention of the (rotated) queries to it."""
    a, q = case["args"], case["q"]
    k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
    lens, rows, lo = case["lens"].long(), case["rows"], case["lo"].long()
    k, v = a.get("k"), a.get("v")
    if a.get("rotary_cos") is not None:
        window = a.get("window_size", (-1, -1))
        q_pos = lens[:, None] + (torch.arange(q.shape[1]) if a["causal"] or window != (-1, -1) else 0)
        q = _rotate_ref(q, a["rotary_cos"], a["rotary_sin"], q_pos.expand(-1, q.shape[1]), a["rotary_interleaved"])
        k = _rotate_ref(k, a["rotary_cos"], a["rotary_sin"], lens[:, None] + torch.arange(k.shape[1]),
                        a["rotary_interleaved"])
    s_new = 0 if k is None else k.shape[1]
    for i in range(q.shape[0]):
        if k is not None:
            k_cache[rows[i], lens[i]:lens[i] + s_new], v_cache[rows[i], lens[i]:lens[i] + s_new] = k[i], v[i]
    outs = {F32: [], torch.float64: []}
    for i in range(q.shape[0]):
        keys = slice(int(lo[i]), int(lens[i]) + s_new)
        kk, vv = k_cache[rows[i], keys][None], v_cache[rows[i], keys][None]
        mask = band_mask(q.shape[1], kk.shape[1], causal=a["causal"], window=a.get("window_size", (-1, -1)))
        scale, cap = a.get("softmax_scale"), a.get("softcap", 0.0)
        outs[torch.float64].append(masked_attention(q[i:i + 1], kk, vv, mask, scale=scale, softcap=cap)[0])
        if cap:  # SDPA has no soft-capping: plain PyTorch in fp32 is the baseline there
            outs[F32].append(masked_attention(q[i:i + 1], kk, vv, mask, scale=scale, softcap=cap, dtype=F32)[0])
            continue
        qs, ks, vs = (t.transpose(1, 2) for t in (q[i:i + 1], kk, vv))  # SDPA on the concatenated cache
        outs[F32].append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                                        enable_gqa=True).transpose(1, 2))
    return torch.cat(outs[torch.float64]), torch.cat(outs[F32]), k_cache, v_cache


def _run(case):
    args = dict(case["args"])
    if "pages" in case:
        k_pool, v_pool = (t.clone() for t in case["pages"])
        out = fa.flash_attn_with_kvcache(case["q"], k_pool, v_pool, **args)
        table = args["block_table"].long()
        unpage = lambda pool: pool[table.flatten()].reshape(table.shape[0], -1, H_KV, D)  # noqa: E731
        return out, unpage(k_pool), unpage(v_pool)
    k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
    return fa.flash_attn_with_kvcache(case["q"], k_cache, v_cache, **args), k_cache, v_cache


KV_CASES = {
    "decode": dict(s_q=1, s_new=1),
    "prefill-chunk": dict(s_q=4, s_new=4),
    "no-new-kv": dict(new_kv=False),
    "not-causal": dict(causal=False),
    "rotary-interleaved": dict(rotary="interleaved"),
    "rotary-neox": dict(rotary="neox", s_q=3, s_new=3),
    "rotary-not-causal": dict(rotary="interleaved", causal=False),
    "batch-idx": dict(batch_idx=True, rotary="neox"),
    "leftpad": dict(leftpad=True, rotary="interleaved"),
    "leftpad-no-new": dict(leftpad=True, new_kv=False),
    "paged-4": dict(paged=4, rotary="neox"),
    "paged-8-no-new": dict(paged=8, new_kv=False),
}


@pytest.mark.parametrize("name", list(KV_CASES))
@pytest.mark.parametrize("extra", [{}, {"window_size": (3, 0)}, {"softcap": 2.0, "softmax_scale": 0.4}],
                         ids=["plain", "window", "softcap"])
def test_with_kvcache_matches_attention_over_the_appended_cache(name, extra):
    case = _case(len(name), **KV_CASES[name])
    case["args"].update(extra)
    if "window_size" in extra and not case["args"]["causal"]:
        case["args"]["window_size"] = (3, 2)
    ref, base, k_ref, v_ref = _expected(case)
    out, k_cache, v_cache = _run(case)
    assert_close_by_rule(f"{name} out", out, base, ref, F32)
    rows = case["rows"] if "pages" not in case else torch.arange(case["q"].shape[0])
    # appended in place (rotated keys: fp32 against the fp64 rotation, ROTARY_ATOL); v and the rest exactly
    torch.testing.assert_close(k_cache[rows], k_ref[case["rows"]], atol=ROTARY_ATOL, rtol=0)
    assert torch.equal(v_cache[rows], v_ref[case["rows"]])
    untouched = torch.ones(len(rows), k_cache.shape[1], dtype=torch.bool)
    if "k" in case["args"]:
        for i, n in enumerate(case["lens"].tolist()):
            untouched[i, n:n + case["args"]["k"].shape[1]] = False
    assert torch.equal(k_cache[rows][untouched], case["k_cache"][case["rows"]][untouched])


def test_with_kvcache_lse_int_seqlens_and_empty_rows():
    g = torch.Generator().manual_seed(3)
    q, kc, vc = torch.randn(2, 3, H, D, generator=g), torch.randn(2, 8, H_KV, D, generator=g), torch.randn(
        2, 8, H_KV, D, generator=g)
    out, lse = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=5, causal=True, return_softmax_lse=True)
    ref_out, ref_lse = masked_attention(q, kc[:, :5], vc[:, :5], band_mask(3, 5, causal=True))
    assert lse.shape == (2, H, 3) and lse.dtype == F32
    torch.testing.assert_close(out, ref_out.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-5, rtol=1e-5)
    # more queries than keys, causal: the first rows see nothing -> out 0, lse -inf (flash-attn: +inf)
    out, lse = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([1, 8], dtype=torch.int32),
                                          causal=True, return_softmax_lse=True)
    assert torch.equal(out[0, :2], torch.zeros_like(out[0, :2])) and torch.isinf(lse[0, :, :2]).all()
    assert torch.isfinite(out).all()


def test_with_kvcache_refusals_name_the_alternative():
    q, kc, vc = torch.randn(1, 1, H, D), torch.randn(1, 8, H_KV, D), torch.randn(1, 8, H_KV, D)
    k, v = torch.randn(1, 1, H_KV, D), torch.randn(1, 1, H_KV, D)
    lens = torch.tensor([3], dtype=torch.int32)
    refused = [
        ("ALiBi.*flash-attn's own", dict(cache_seqlens=lens, alibi_slopes=torch.ones(H))),
        ("with new keys only", dict(cache_seqlens=lens, rotary_cos=torch.ones(8, 4), rotary_sin=torch.ones(8, 4))),
        ("needs cache_seqlens", dict(k=k, v=v)),
        ("k and v together", dict(k=k, cache_seqlens=lens)),
        ("allocate a longer cache", dict(k=k, v=v, cache_seqlens=torch.tensor([8], dtype=torch.int32))),
        ("block_table's rows", dict(cache_seqlens=lens, block_table=torch.zeros(1, 2, dtype=torch.int32),
                                    cache_batch_idx=torch.zeros(1, dtype=torch.int32))),
        ("tables covering the whole cache", dict(k=k, v=v, cache_seqlens=lens, rotary_cos=torch.ones(2, 4),
                                                 rotary_sin=torch.ones(2, 4))),
    ]
    for pattern, kw in refused:
        with pytest.raises((ValueError, TypeError), match=pattern):
            fa.flash_attn_with_kvcache(q, kc, vc, **kw)


# -- bert_padding -----------------------------------------------------------------------------------------------
def test_unpad_pad_round_trip_and_values():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 2, 4, generator=g, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    hidden, indices, cu, longest, used = bp.unpad_input(x, mask)
    assert indices.tolist() == [0, 1, 2, 5, 6, 7, 8, 9, 10]
    assert cu.tolist() == [0, 3, 8, 9] and cu.dtype == torch.int32 and longest == 5 and isinstance(longest, int)
    assert used.tolist() == [3, 5, 1] and used.dtype == torch.int32
    assert torch.equal(hidden, x.reshape(15, 2, 4)[indices])
    back = bp.pad_input(hidden, indices, 3, 5)
    assert torch.equal(back, x * mask[..., None, None])  # zeros at the padding
    back.sum().backward()
    assert torch.equal(x.grad, mask[..., None, None].float().expand_as(x))  # the gather's gradient scatters back
    # unused_mask: slots kept in the packing but not counted as used
    unused = torch.tensor([[0, 0, 0, 1, 0], [0] * 5, [0, 1, 1, 0, 0]])
    hidden, indices, cu, longest, used = bp.unpad_input(x.detach(), mask, unused)
    assert cu.tolist() == [0, 4, 9, 12] and used.tolist() == [3, 5, 1] and longest == 5


def test_concatenated_sequences_as_flash_attn_documents_them():
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])  # flash-attn's example
    x = torch.arange(18.0).reshape(3, 6, 1)
    hidden, indices, cu, longest = bp.unpad_input_for_concatenated_sequences(x, lengths)
    assert cu.tolist() == [0, 2, 5, 8, 10, 16] and longest == 6
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10] + list(range(12, 18))
    assert torch.equal(hidden[:, 0], torch.tensor([0, 1, 2, 3, 4, 6, 7, 8, 9, 10] + list(range(12, 18))).float())


def test_index_helpers():
    x = torch.randn(6, 3, requires_grad=True)
    idx = torch.tensor([4, 0, 2])
    assert torch.equal(bp.index_first_axis(x, idx), x[idx])
    put = bp.index_put_first_axis(x[idx], idx, 6)
    assert torch.equal(put[idx], x[idx]) and put[[1, 3, 5]].abs().sum() == 0
    rows, residual = bp.index_first_axis_residual(x, idx)
    (rows.sum() + residual.sum()).backward()
    assert x.grad[idx].eq(2).all() and x.grad[[1, 3, 5]].eq(1).all()
    with pytest.raises(ValueError, match="at least 2 dims"):
        bp.index_first_axis(torch.arange(3), idx)


def test_padded_batch_through_varlen_equals_masked_attention():
    """flash-attn's BERT recipe: unpad, flash_attn_varlen_func, pad back == attention with a key padding mask."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 7, h, D, generator=g) for h in (H, H_KV, H_KV))
    mask = torch.tensor([[1] * 5 + [0] * 2, [1] * 7])
    (qu, idx, cu, longest, _), (ku, _, _, _, _), (vu, _, _, _, _) = (bp.unpad_input(t, mask) for t in (q, k, v))
    out = bp.pad_input(fa.flash_attn_varlen_func(qu, ku, vu, cu, cu, longest, longest, causal=True), idx, 2, 7)
    for i, n in enumerate((5, 7)):
        ref, _ = masked_attention(q[i:i + 1, :n], k[i:i + 1, :n], v[i:i + 1, :n], band_mask(n, n, causal=True))
        torch.testing.assert_close(out[i:i + 1, :n], ref.float(), atol=1e-5, rtol=1e-5)
        assert out[i, n:].abs().sum() == 0
