"""flash-attn's whole function family (packed variants, one device and across ranks), its signatures, tensor
``window_size``, and the guard for per-rank local ``cu_seqlens`` in ``dist_flash_attn_varlen_func``.

Results are checked against the fp64 reference of ``attn_ref`` by the accuracy rule (fp32 plain PyTorch as the
baseline); gradients are read from the packed tensor's ``.grad`` and unpacked for the comparison.
"""

import functools
import inspect

import pytest
import torch

import distattn
from attn_ref import assert_all_close_by_rule, make_qkv, masked_reference_grads, varlen_mask
from dist_utils import run_distributed

F32 = torch.float32
TIMEOUT_S = 180  # harness bound for a spawned run (a few seconds idle); the library's own waits are the subject

# -- flash-attn 2.x's documented signatures (flash_attn/flash_attn_interface.py): names, order, defaults -------
_E = inspect.Parameter.empty
_TAIL = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
         ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
_REQ = lambda *names: [(n, _E) for n in names]  # noqa: E731
FLASH_ATTN = {
    "flash_attn_func": _REQ("q", "k", "v") + _TAIL,
    "flash_attn_qkvpacked_func": _REQ("qkv") + _TAIL,
    "flash_attn_kvpacked_func": _REQ("q", "kv") + _TAIL,
    "flash_attn_varlen_func": _REQ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
    + _TAIL + [("block_table", None)],
    "flash_attn_varlen_qkvpacked_func": _REQ("qkv", "cu_seqlens", "max_seqlen") + _TAIL,
    "flash_attn_varlen_kvpacked_func": _REQ("q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                            "max_seqlen_k") + _TAIL,
}
# across ranks: flash-attn's arguments; the varlen forms take one stream, so one cu_seqlens/max_seqlen
DIST = {
    "dist_flash_attn_func": FLASH_ATTN["flash_attn_func"],
    "dist_flash_attn_qkvpacked_func": FLASH_ATTN["flash_attn_qkvpacked_func"],
    "dist_flash_attn_kvpacked_func": FLASH_ATTN["flash_attn_kvpacked_func"],
    "dist_flash_attn_varlen_func": _REQ("q", "k", "v", "cu_seqlens", "max_seqlen") + _TAIL,
    "dist_flash_attn_varlen_qkvpacked_func": _REQ("qkv", "cu_seqlens", "max_seqlen") + _TAIL,
    "dist_flash_attn_varlen_kvpacked_func": _REQ("q", "kv", "cu_seqlens", "max_seqlen") + _TAIL,
}


@pytest.mark.parametrize("name,want", list(FLASH_ATTN.items()) + list(DIST.items()), ids=list(FLASH_ATTN) + list(DIST))
def test_signature_is_flash_attns(name, want):
    params = list(inspect.signature(getattr(distattn, name)).parameters.values())
    positional = [p for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert [(p.name, p.default) for p in positional] == want  # renamed, reordered or re-defaulted: fails
    assert params[:len(positional)] == positional  # flash-attn's arguments first
    assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in params[len(positional):])  # then distattn's
    assert name in distattn.__all__


# -- one device ------------------------------------------------------------------------------------------
def _check(ours_out, ours_lse, grads, q, k, v, dout, mask, names=("out", "lse", "dq", "dk", "dv")):
    ref = masked_reference_grads(q, k, v, dout, mask, torch.float64)
    base = masked_reference_grads(q, k, v, dout, mask, F32)
    assert_all_close_by_rule(names, (ours_out, ours_lse, *grads), base, ref, F32)


@pytest.mark.parametrize("causal", [False, True])
def test_qkvpacked_against_reference(causal):
    q, k, v, dout = make_qkv(2, 37, 37, 3, 3, 80, F32, seed=1)  # odd length, head dim 80
    qkv = torch.stack((q, k, v), dim=2).requires_grad_()  # (b, s, 3, h, d)
    out, lse, s_dmask = distattn.flash_attn_qkvpacked_func(qkv, 0.0, None, causal, return_attn_probs=True)
    out.backward(dout)
    assert s_dmask is None and qkv.grad.shape == qkv.shape
    _check(out, lse, qkv.grad.unbind(2), q, k, v, dout, varlen_mask([37], [37], causal=causal))


def test_kvpacked_gqa_window_against_reference():
    q, k, v, dout = make_qkv(1, 23, 41, 6, 2, 80, F32, seed=2)  # GQA 3, s_q < s_k: bottom-right alignment
    qg, kv = q.clone().requires_grad_(), torch.stack((k, v), dim=2).requires_grad_()  # (b, s_k, 2, h_kv, d)
    out, lse = distattn.flash_attn_kvpacked_func(qg, kv, causal=True, window_size=torch.tensor([7, 0]),
                                                 return_lse=True)
    out.backward(dout)
    _check(out, lse, (qg.grad, *kv.grad.unbind(2)), q, k, v, dout,
           varlen_mask([23], [41], causal=True, window=(7, 0)))


def test_varlen_qkvpacked_and_kvpacked_against_reference():
    lens = [5, 1, 17, 10]
    cu = torch.tensor([0, 5, 6, 23, 33], dtype=torch.int32)
    q, k, v, dout = make_qkv(1, 33, 33, 4, 2, 80, F32, seed=3)
    mask = varlen_mask(lens, lens, causal=True)
    kv = torch.stack((k[0], v[0]), dim=1).requires_grad_()  # (total, 2, h_kv, d)
    qg = q[0].clone().requires_grad_()
    out, lse, _ = distattn.flash_attn_varlen_kvpacked_func(qg, kv, cu, cu, 17, 17, 0.0, None, True,
                                                           return_attn_probs=True)
    out.backward(dout[0])
    _check(out[None], lse[None], [g[None] for g in (qg.grad, *kv.grad.unbind(1))], q, k, v, dout, mask)
    k_mha, v_mha = (t.repeat_interleave(2, dim=2) for t in (k, v))  # qkvpacked: one head count
    qkv = torch.stack((q[0], k_mha[0], v_mha[0]), dim=1).requires_grad_()  # (total, 3, h, d)
    out, lse = distattn.flash_attn_varlen_qkvpacked_func(qkv, cu, 17, causal=True, return_lse=True)
    out.backward(dout[0])
    _check(out[None], lse[None], [g[None] for g in qkv.grad.unbind(1)], q, k_mha, v_mha, dout, mask)


@pytest.mark.parametrize("fn,packed,match", [
    (distattn.flash_attn_qkvpacked_func, torch.zeros(1, 4, 2, 2, 8), r"qkv must have shape \(batch, seq, 3, "),
    (distattn.flash_attn_qkvpacked_func, torch.zeros(4, 3, 2, 8), r"qkv must have shape .* got \(4, 3, 2, 8\)"),
])
def test_bad_packed_shape_message(fn, packed, match):
    with pytest.raises(ValueError, match=match):
        fn(packed)
    with pytest.raises(TypeError, match="kv must be a torch.Tensor"):
        distattn.flash_attn_kvpacked_func(torch.zeros(1, 4, 2, 8), [1, 2])


# -- window_size as a tensor -----------------------------------------------------------------------------
def test_window_size_tensor_list_and_tuple_agree():
    q, k, v, _ = make_qkv(1, 19, 19, 2, 2, 16, F32, seed=4)
    want = distattn.flash_attn_func(q, k, v, causal=True, window_size=(4, 0))
    for window in (torch.tensor([4, 0]), torch.tensor([4, 0], dtype=torch.int32), [4, 0]):
        assert torch.equal(distattn.flash_attn_func(q, k, v, causal=True, window_size=window), want)
    assert not torch.equal(distattn.flash_attn_func(q, k, v, causal=True), want)  # the window did something


@pytest.mark.parametrize("window,match", [
    (torch.tensor([4.0, 0.0]), r"1-D integer tensor of 2 elements .*torch.float32"),
    (torch.tensor([4, 0, 1]), r"1-D integer tensor of 2 elements .*shape \(3,\)"),
    (torch.tensor([[4, 0]]), r"1-D integer tensor of 2 elements .*shape \(1, 2\)"),
    ("ab", r"window_size must be a pair .*'ab'"),
    ({4, 0}, r"window_size must be a pair .*tuple, a list or a 2-element integer tensor"),
])
def test_window_size_bad_values(window, match):
    q, k, v, _ = make_qkv(1, 4, 4, 1, 1, 8, F32)
    with pytest.raises(TypeError, match=match):
        distattn.flash_attn_func(q, k, v, window_size=window)
    with pytest.raises(ValueError, match=r"window_size left .*-3"):
        distattn.flash_attn_func(q, k, v, window_size=torch.tensor([-3, 0]))


# -- across ranks ----------------------------------------------------------------------------------------
def _dist_dense(rank, world, n):
    """qkvpacked (MHA) and kvpacked (GQA) against the whole sequence's reference; this rank's shard."""
    total, mine = world * n, slice(rank * n, (rank + 1) * n)
    q, k, v, dout = make_qkv(1, total, total, 4, 2, 80, F32, seed=5)
    mask = varlen_mask([total], [total], causal=True)
    kv = torch.stack((k[:, mine], v[:, mine]), dim=2).requires_grad_()
    qs = q[:, mine].clone().requires_grad_()
    out, lse, _ = distattn.dist_flash_attn_kvpacked_func(qs, kv, 0.0, None, True, return_attn_probs=True)
    out.backward(dout[:, mine])
    _dist_check(mine, (out, lse, qs.grad, *kv.grad.unbind(2)), q, k, v, dout, mask)
    k2, v2 = (t.repeat_interleave(2, dim=2) for t in (k, v))
    qkv = torch.stack((q[:, mine], k2[:, mine], v2[:, mine]), dim=2).requires_grad_()
    out, lse = distattn.dist_flash_attn_qkvpacked_func(qkv, causal=True, window_size=torch.tensor([5, 0]),
                                                       return_lse=True, schedule="ring")
    out.backward(dout[:, mine])
    _dist_check(mine, (out, lse, *qkv.grad.unbind(2)), q, k2, v2, dout,
                varlen_mask([total], [total], causal=True, window=(5, 0)))


def _dist_check(mine, ours, q, k, v, dout, mask, seq_dims=(1, 2, 1, 1, 1)):
    ref = masked_reference_grads(q, k, v, dout, mask, torch.float64)
    base = masked_reference_grads(q, k, v, dout, mask, F32)
    cut = lambda ts: [t.narrow(d, mine.start, mine.stop - mine.start) for t, d in zip(ts, seq_dims)]  # noqa: E731
    assert_all_close_by_rule(("out", "lse", "dq", "dk", "dv"), ours, cut(base), cut(ref), F32)


def _dist_varlen(rank, world, n):
    """varlen kvpacked (GQA) and qkvpacked over a stream whose documents straddle rank boundaries."""
    total, mine = world * n, slice(rank * n, (rank + 1) * n)
    lens = [3, n + 2, 1, total - n - 6]
    cu = torch.tensor([0, 3, n + 5, n + 6, total], dtype=torch.int32)
    q, k, v, dout = make_qkv(1, total, total, 4, 2, 80, F32, seed=6)
    mask = varlen_mask(lens, lens, causal=True)
    kv = torch.stack((k[0, mine], v[0, mine]), dim=1).requires_grad_()
    qs = q[0, mine].clone().requires_grad_()
    out, lse = distattn.dist_flash_attn_varlen_kvpacked_func(qs, kv, cu, total, causal=True, return_lse=True)
    out.backward(dout[0, mine])
    unb = kv.grad.unbind(1)
    _dist_check(mine, (out[None], lse[None], qs.grad[None], unb[0][None], unb[1][None]), q, k, v, dout, mask)
    k2, v2 = (t.repeat_interleave(2, dim=2) for t in (k, v))
    qkv = torch.stack((q[0, mine], k2[0, mine], v2[0, mine]), dim=1).requires_grad_()
    out, lse, _ = distattn.dist_flash_attn_varlen_qkvpacked_func(qkv, cu, total, 0.0, None, True,
                                                                 return_attn_probs=True)
    out.backward(dout[0, mine])
    _dist_check(mine, (out[None], lse[None], *[g[None] for g in qkv.grad.unbind(1)]), q, k2, v2, dout, mask)


def _errors(calls):
    msgs = []
    for call in calls:
        try:
            call()
            msgs.append(None)
        except (ValueError, TypeError) as exc:
            msgs.append(f"{type(exc).__name__}: {exc}")
    return msgs


def _guard(rank, world, n):
    """Per-rank local cu_seqlens (ring-flash-attention's convention) raise on every rank; good calls then run."""
    x = torch.randn(n, 2, 8)
    fn = functools.partial(distattn.dist_flash_attn_varlen_func, max_seqlen=world * n)
    local = torch.tensor([0, 3, n], dtype=torch.int32)  # what each rank's own shard looks like: ends at n
    mixed = local if rank == 1 else torch.tensor([0, 3, world * n], dtype=torch.int32)  # one rank wrong
    bad_pack = torch.zeros(n, 3 if rank == 0 else 2, 2, 8)  # one rank's qkv packs 2 tensors
    msgs = _errors([lambda: fn(x, x, x, local, causal=True),
                    lambda: fn(x, x, x, mixed, causal=True),
                    lambda: distattn.dist_flash_attn_varlen_qkvpacked_func(bad_pack, local[[0, 2]] * world, world * n),
                    lambda: fn(x, x, x, torch.tensor([0, 3, world * n], dtype=torch.int32), causal=True),
                    lambda: fn(x, x, x, torch.tensor([0, world * n - 5], dtype=torch.int32), causal=True),
                    lambda: fn(x[:2], x[:2], x[:2], torch.tensor([0, 1], dtype=torch.int32))])  # tiny: legal
    return msgs


def _dist_worker(rank, world, n, guard):
    _dist_dense(rank, world, n)
    _dist_varlen(rank, world, n)
    return _guard(rank, world, n) if guard else None


@pytest.mark.parametrize("world,n,guard", [(2, 11, True), (3, 9, False)])
def test_packed_family_across_ranks_and_local_cu_seqlens_guard(world, n, guard):
    msgs = run_distributed(_dist_worker, world, n, guard, timeout=TIMEOUT_S)
    if not guard:
        return
    assert msgs[0] == msgs[1]  # every rank raised the same errors, and no call hung
    local, mixed, bad_pack, *good = msgs[0]
    assert good == [None, None, None]  # the next calls work: global cu_seqlens, a short stream, a tiny legal one
    assert local.startswith("ValueError: cu_seqlens ends at 11, exactly at the end of rank 0's shard (11 tokens per "
                            "rank)")
    for msg in (local, mixed):
        assert "LOCAL cu_seqlens" in msg and "the cu_seqlens of the WHOLE stream" in msg
        assert "append 22 to cu_seqlens" in msg
    assert "rank 1" in mixed
    assert bad_pack.startswith("ValueError") and r"qkv must have shape (total, 3, heads, head_dim)" in bad_pack
