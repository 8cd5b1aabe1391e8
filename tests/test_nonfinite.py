"""NaN and Inf come out of the distributed op where one device puts them (issue 21, item 2).

A NaN in a query row, or an infinite key, must never turn into a "masked" row (out 0, lse -inf) or vanish in
a merge: a diverging run has to look like one. References: ``F.scaled_dot_product_attention`` on one device
for the output's NaN/Inf pattern, distattn's own one-device call (``flash_attn_func``) for lse and gradients.

Which elements are non-finite, per input class (and so what the tests compare):
- NaN in one element of query row ``i``: out row ``i`` and lse row ``i`` (of that head) are NaN, nothing else;
  dq row ``i`` is NaN; dk/dv of every key row ``i`` sees are NaN.
- ``+inf`` in one element of key ``j``: every row that sees ``j`` gets a score of ``+inf`` or ``-inf`` (the sign
  of the matching query element); ``+inf`` makes the row NaN (as softmax over an infinite logit does on one
  device), ``-inf`` removes the key from that row.
Keys or rows that a NaN meets only with a zero weight inside a block (``0 * NaN``) follow the block structure
of the kernel that ran: the first tests do not compare those elements; every element whose true value depends on
a non-finite input is. The grid of issue 35 (below) compares them all: the distributed masks of out, lse, dq, dk,
dv equal the one-device call's with the whole matrix as one tile (``distattn.nonfinite``: the rules that make the
pairs a plan skips count as one device's masked zeros), for NaN, +inf and -inf in q, k, v or dout, every schedule,
P = 2..8, packed documents, and chunks longer than a kernel tile.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import distattn
from dist_utils import run_distributed
from distattn import kernels, single
from distattn.kernels._torch import TorchBackend

DIST_TIMEOUT = 240  # spawn + a handful of tiny calls per schedule on 2 shared cores
FINITE_TOL = 1e-4  # fp32 results of different summation orders (chunks vs one pass), magnitudes ~1


def _inputs(total, seed, h_q=2, h_kv=1, d=8, b=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, total, h, d, generator=g, dtype=torch.float64).float() for h in (h_q, h_kv, h_kv, h_q)]


def _poison(q, k, dout, kind, total):
    """Put one non-finite value in (copies of) the inputs; returns them and the poisoned global position."""
    q, k, dout = q.clone(), k.clone(), dout.clone()
    pos = max(1, (2 * total) // 3)  # not position 0: row 0 seeing only an infinite key is a degenerate row
    if kind == "nan_q":
        q[0, pos, 1, 3] = float("nan")
    elif kind == "inf_k":
        k[0, pos, 0, 2] = float("inf")
    elif kind == "nan_dout":
        dout[0, pos, 0, 1] = float("nan")
    return q, k, dout, pos


def _visible(total, causal):
    """keep[i, j]: query i sees key j (dense causal or full)."""
    i = torch.arange(total)[:, None]
    j = torch.arange(total)[None, :]
    return (j <= i) if causal else torch.ones(total, total, dtype=torch.bool)


def _must_be_nan(kind, pos, q, k, total, causal):
    """Per tensor, a bool mask of elements whose true value depends on the poison (so must be NaN), per
    (token, head) row; ``None`` where nothing is forced."""
    keep = _visible(total, causal)
    h_q, h_kv = q.shape[2], k.shape[2]
    group = h_q // h_kv
    rows = torch.zeros(total, h_q, dtype=torch.bool)  # (token, query head) rows whose out is NaN
    if kind == "nan_q":
        rows[pos, 1] = True
    elif kind == "inf_k":
        sign = torch.sign(q[0, :, :, 2].double())  # the infinite element's partner decides +inf / -inf
        for h in range(h_q):
            if h // group == 0:
                rows[:, h] = keep[:, pos] & (sign[:, h] > 0)
    return rows


def _one_device(q, k, v, dout, causal):
    """distattn's one-device call: out, lse, dq, dk, dv."""
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse, _ = distattn.flash_attn_func(qs, ks, vs, causal=causal, return_attn_probs=True)
    out.backward(dout)
    return out.detach(), lse.detach(), qs.grad, ks.grad, vs.grad


def _sdpa_out(q, k, v, causal):
    g = q.shape[2] // k.shape[2]
    qb, kb, vb = q.transpose(1, 2), k.repeat_interleave(g, 2).transpose(1, 2), v.repeat_interleave(g, 2).transpose(1, 2)
    return F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal).transpose(1, 2)


def _nan_pattern_failures(label, ours, ref, forced_rows=None):
    """Where ``ref`` is NaN ours is NaN and vice versa; ±inf likewise; finite elements close."""
    fails = []
    if not torch.equal(torch.isnan(ours), torch.isnan(ref)):
        fails.append(f"{label}: NaN at {torch.isnan(ours).nonzero().tolist()[:6]} vs one device "
                     f"{torch.isnan(ref).nonzero().tolist()[:6]}")
    elif not torch.equal(torch.isinf(ours), torch.isinf(ref)):
        fails.append(f"{label}: Inf pattern differs")
    return fails


def _check_forward(label, out, lse, sdpa_out, ref_out, ref_lse, forced):
    fails = _nan_pattern_failures(f"{label} out vs sdpa", out, sdpa_out)
    fails += _nan_pattern_failures(f"{label} lse vs one device", lse, ref_lse)
    out_rows = torch.isnan(out[0]).any(-1)  # (token, head)
    if not torch.equal(out_rows & forced, forced):
        fails.append(f"{label}: rows that see the poison are not all NaN")
    fin = torch.isfinite(ref_out)
    if fin.any() and (out[fin] - ref_out[fin]).abs().max() > FINITE_TOL:
        fails.append(f"{label}: finite outputs differ from one device by {(out[fin] - ref_out[fin]).abs().max():.2e}")
    return fails


def _check_grads(label, grads, ref_grads, kind, pos, forced_rows, causal, total):
    """dq of a NaN query row or NaN dout row is row-local: its NaN pattern equals one device's exactly. For the
    rest, every element whose true value depends on the poison is NaN, elements finite on both sides agree,
    and a gradient that has a NaN on one device has one here (what ``0 * NaN`` inside a block adds follows the
    block structure, see the module docstring)."""
    fails = []
    dq, dk, dv = grads
    rdq, rdk, rdv = ref_grads
    if kind in ("nan_q", "nan_dout"):
        fails += _nan_pattern_failures(f"{label} dq", dq, rdq)
        keys = _visible(total, causal)[pos]  # every key the poisoned row sees: dk (nan_q) / dv (nan_dout)
        name, forced = ("dk", dk) if kind == "nan_q" else ("dv", dv)
        if not torch.isnan(forced[0, keys]).any(-1).all():
            fails.append(f"{label}: a key the poisoned row sees has a finite {name}")
    else:  # rows whose score is +inf have a NaN lse, so their dq is NaN
        if not torch.isnan(dq[0]).any(-1)[forced_rows].all():
            fails.append(f"{label}: a row that met the infinite key has a finite dq")
    for name, ours, ref in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        fin = torch.isfinite(ours) & torch.isfinite(ref)
        if fin.any() and (ours[fin] - ref[fin]).abs().max() > FINITE_TOL:
            fails.append(f"{label} {name}: finite values differ by {(ours[fin] - ref[fin]).abs().max():.2e}")
        if torch.isnan(ref).any() != torch.isnan(ours).any():
            fails.append(f"{label} {name}: NaN on one side only (one device: {bool(torch.isnan(ref).any())})")
    return fails


CASES = [(kind, causal, schedule) for kind in ("nan_q", "inf_k", "nan_dout") for causal in (True, False)
         for schedule in ("balanced", "ring", "zigzag")]


def _worker(rank, world, n):
    torch.manual_seed(0)
    total = world * n
    fails = []
    for i, (kind, causal, schedule) in enumerate(CASES):
        q, k, v, dout = _inputs(total, seed=100 + i)
        q, k, dout, pos = _poison(q, k, dout, kind, total)
        ref = _one_device(q, k, v, dout, causal)
        sdpa_out = _sdpa_out(q, k, v, causal)
        forced = _must_be_nan(kind, pos, q, k, total, causal)
        shard = lambda t: distattn.shard_sequence(t, schedule=schedule)  # noqa: E731
        qs, ks, vs = (shard(t).clone().requires_grad_() for t in (q, k, v))
        out, lse, _ = distattn.dist_flash_attn_func(qs, ks, vs, causal=causal, schedule=schedule,
                                                    return_attn_probs=True)
        out.backward(shard(dout))
        gather = lambda t, dim=1: distattn.gather_sequence(t.detach().contiguous(), dim=dim, schedule=schedule)  # noqa: E731
        full = [gather(out), gather(lse, 2), gather(qs.grad), gather(ks.grad), gather(vs.grad)]
        label = f"P={world} {kind} causal={causal} {schedule}"
        if kind != "nan_dout":
            fails += _check_forward(label, full[0], full[1], sdpa_out, ref[0], ref[1], forced)
        fails += _check_grads(label, full[2:], ref[2:], kind, pos, forced, causal, total)
    return fails


@pytest.mark.parametrize("world", [2, 3, 4])
def test_nan_and_inf_come_out_where_one_device_puts_them(world):
    results = run_distributed(_worker, world, 8, timeout=DIST_TIMEOUT)
    fails = [f for r in results for f in r]
    assert not fails, "\n".join(sorted(set(fails)))


def test_one_device_matches_sdpa_pattern():
    """The one-device call itself: NaN in a query row or an infinite key gives NaN where SDPA does."""
    for i, (kind, causal, _) in enumerate(c for c in CASES if c[2] == "balanced" and c[0] != "nan_dout"):
        q, k, v, dout = _inputs(24, seed=i)
        q, k, dout, pos = _poison(q, k, dout, kind, 24)
        out, lse, *_ = _one_device(q, k, v, dout, causal)
        forced = _must_be_nan(kind, pos, q, k, 24, causal)
        assert torch.isnan(out[0]).any(-1)[forced].all(), (kind, causal)
        assert torch.equal(torch.isnan(out), torch.isnan(_sdpa_out(q, k, v, causal))), (kind, causal)


@pytest.mark.parametrize("backend", ["torch", "sdpa", "triton"])
def test_merge_never_drops_nan(backend):
    """A partial whose lse or out is NaN makes the merged row NaN (it was turned into an empty side before)."""
    if backend not in kernels.available_backends("cpu"):
        pytest.skip(f"backend {backend} not available on this CPU machine")
    g = torch.Generator().manual_seed(0)
    out = torch.randn(1, 4, 2, 8, generator=g)
    lse = torch.randn(1, 2, 4, generator=g)
    part_out = torch.randn(1, 4, 2, 8, generator=g)
    part_lse = torch.randn(1, 2, 4, generator=g)
    part_lse[0, 1, 2] = float("nan")  # row 2 of head 1
    part_out[0, 3, 0, 5] = float("nan")  # row 3 of head 0
    lse[0, 0, 1] = float("-inf")  # an empty row on our side: merged = the partial, finite
    out[0, 1, 0] = 0.0
    state = kernels.AttnState(out.clone(), lse.clone())
    kernels.merge_(state, part_out, part_lse, backend=backend)
    assert torch.isnan(state.lse[0, 1, 2]) and torch.isnan(state.out[0, 2, 1]).all()
    assert torch.isnan(state.out[0, 3, 0, 5])
    assert torch.isfinite(state.lse[0, 0, 1]) and torch.allclose(state.out[0, 1, 0], part_out[0, 1, 0])
    finite_rows = torch.ones(2, 4, dtype=torch.bool)
    finite_rows[1, 2] = False
    assert torch.isfinite(state.lse[0][finite_rows]).all()


@pytest.mark.parametrize("backend", ["torch", "sdpa", "triton"])
def test_kernels_carry_nan_rows_and_infinite_keys(backend):
    """One chunk through each backend: a NaN query row is NaN in out and lse (never a masked row), a +inf
    logit makes its row NaN, other rows stay finite; in the backward every such row's dq is NaN."""
    if backend not in kernels.available_backends("cpu"):
        pytest.skip(f"backend {backend} not available on this CPU machine")
    q, k, v, dout = _inputs(12, seed=7, d=16)
    q[0, 5, 1, 3] = float("nan")
    k[0, 9, 0, 2] = float("inf")
    sees_inf = (torch.arange(12) >= 9)[:, None] & (q[0, :, :, 2] > 0)  # causal rows >= 9, positive partner
    out, lse = kernels.forward(q, k, v, softmax_scale=0.25, causal=True, backend=backend)
    nan_rows = torch.isnan(out[0]).any(-1)
    expect = sees_inf.clone()
    expect[5, 1] = True
    assert torch.equal(nan_rows, expect), (nan_rows, expect)
    assert torch.equal(torch.isnan(lse[0]).T, expect)
    dq, dk, dv = (torch.zeros(t.shape) for t in (q, k, v))
    delta = kernels.attn_delta(dout, out, backend=backend)
    kernels.backward_chunk_(dout, q, k, v, lse, delta, dq, dk, dv, softmax_scale=0.25, causal=True, backend=backend)
    assert torch.isnan(dq[0, 5, 1]).all()
    assert torch.isnan(dq[0]).any(-1)[expect].all(), "every row that met a NaN/+inf logit has a NaN dq"


# -- issue 35: gradients as one device, the pairs the plan skips included ------------------------------------------
# The target (``distattn.nonfinite``): the one-device call with the whole (query, key) matrix as one kernel tile, what
# ``flash_attn_func`` computes on CPU for a sequence of at most one tile (128 tokens: every grid below). A skipped pair
# still multiplies its masked zeros with the operand on one device (0 * NaN): a non-finite query element reaches dk of
# every key, a non-finite key dq of every row, v the masked rows of out, dout the keys a poisoned row does not see.
VALUES = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}
GRID_INPUTS = ("q", "k", "v", "dout")
GRID_SCHEDULES = ("ring", "balanced", "zigzag")
NAMES = ("out", "lse", "dq", "dk", "dv")


def _grid_cases(total):
    """(value, input, position, causal, schedule): every poison at an early row (its query chunk skips every later kv
    chunk when causal) and a late one (a key in a chunk every earlier query chunk skips), causal on every schedule;
    not causal (nothing skipped, nothing may change) on one."""
    for value in VALUES:
        for name in GRID_INPUTS:
            for pos in (1, total - 2):
                for schedule in GRID_SCHEDULES:
                    yield value, name, pos, True, schedule
                yield value, name, pos, False, "balanced"


def _poisoned(total, seed, name, pos, value):
    """q, k, v, dout with one element of ``name`` at row ``pos`` set to ``value`` (head 0: GQA group 0)."""
    tensors = dict(zip(("q", "k", "v", "dout"), _inputs(total, seed)))
    tensors[name][0, pos, 0, 3] = VALUES[value]
    return [tensors[n] for n in ("q", "k", "v", "dout")]


def _sdpa_all(q, k, v, dout, causal):
    """fp64 SDPA's out, dq, dk, dv (math path: the dense products, masked probabilities 0)."""
    qd, kd, vd = (t.double().clone().requires_grad_() for t in (q, k, v))
    out = _sdpa_out(qd, kd, vd, causal)
    out.backward(dout.double())
    return out.detach(), qd.grad, kd.grad, vd.grad


def _mask_diff(label, ours, ref):
    """Where NaN, +inf and -inf are, on both sides; the first few differing places named."""
    for what, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        a, b = test(ours), test(ref)
        if not torch.equal(a, b):
            return [f"{label}: {what} at {a.nonzero().tolist()[:4]} (ours) vs {b.nonzero().tolist()[:4]}"]
    return []


def _dist_call(q, k, v, dout, causal, schedule):
    """The distributed call on this rank's shards: out, lse, dq, dk, dv gathered in sequence order."""
    shard = lambda t: distattn.shard_sequence(t, schedule=schedule)  # noqa: E731
    qs, ks, vs = (shard(t).clone().requires_grad_() for t in (q, k, v))
    out, lse, _ = distattn.dist_flash_attn_func(qs, ks, vs, causal=causal, schedule=schedule, return_attn_probs=True)
    out.backward(shard(dout))

    def gather(t, dim=1):
        return distattn.gather_sequence(t.detach().contiguous(), dim=dim, schedule=schedule)

    return [gather(out), gather(lse, 2), gather(qs.grad), gather(ks.grad), gather(vs.grad)]


def _grid_worker(rank, world, n):
    total = world * n
    fails, cases = [], 0
    for i, (value, name, pos, causal, schedule) in enumerate(_grid_cases(total)):
        q, k, v, dout = _poisoned(total, 1000 + i, name, pos, value)
        ours = _dist_call(q, k, v, dout, causal, schedule)
        if rank:  # the references once, on rank 0
            continue
        cases += 1
        label = f"P={world} {value} in {name}[{pos}] causal={causal} {schedule}"
        ref = _one_device(q, k, v, dout, causal)
        for nm, a, b in zip(NAMES, ours, ref):
            fails += _mask_diff(f"{label} {nm} vs one device", a, b)
            fin = torch.isfinite(a) & torch.isfinite(b)
            if fin.any() and (a[fin] - b[fin]).abs().max() > FINITE_TOL:
                fails.append(f"{label} {nm}: finite values differ from one device")
        sdpa = dict(zip(("out", "dq", "dk", "dv"), _sdpa_all(q, k, v, dout, causal)))
        # SDPA's dk differs from one device's where a NaN-delta row has masked keys (its masked dS is 0 * NaN)
        for nm in ("out", "dq", "dv") + (() if causal else ("dk",)):
            fails += _mask_diff(f"{label} {nm} vs sdpa", ours[NAMES.index(nm)], sdpa[nm])
    return fails, cases


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 7, 8])
def test_gradient_nan_inf_masks_equal_one_device(world):
    """NaN, +inf, -inf in q, k, v or dout, early or late, on every schedule: the NaN/+inf/-inf masks of out, lse, dq,
    dk, dv equal the one-device call's (and fp64 SDPA's where its definition agrees: out, dq, dv; dk not causal)."""
    (fails, cases), *_ = run_distributed(_grid_worker, world, 8, timeout=DIST_TIMEOUT)
    assert cases == 3 * 4 * 2 * 4
    assert not fails, f"{len(fails)} differences:\n" + "\n".join(fails[:40])


def _one_tile(q, k, v, dout, causal):
    """The one-device call with the whole matrix as one tile of the torch reference (the rules' definition)."""
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    tile = TorchBackend(block_q=q.shape[1], block_k=k.shape[1])
    out, lse = single.attention(qs, ks, vs, scale=q.shape[-1] ** -0.5, causal=causal, window=(-1, -1), softcap=0.0,
                                backend=tile)
    out.backward(dout)
    return [out.detach(), lse.detach(), qs.grad, ks.grad, vs.grad]


def _long_worker(rank, world, n):
    """Chunks longer than a kernel tile (n = 160 > 128): the per-pair kernels skip masked tiles inside pairs too, the
    rules set what one tile would; ``dout`` poisoned early and ``q`` late, together with ``k`` and ``v``."""
    total = world * n
    fails = []
    for i, schedule in enumerate(GRID_SCHEDULES):
        q, k, v, dout = _inputs(total, 2000 + i)
        q[0, total - 3, 1, 5] = float("nan")
        k[0, n + 2, 0, 1] = float("inf")
        v[0, total - 1, 0, 6] = float("-inf")
        dout[0, 2, 0, 3] = float("inf")
        ours = _dist_call(q, k, v, dout, True, schedule)
        if rank == 0:
            for nm, a, b in zip(NAMES, ours, _one_tile(q, k, v, dout, True)):
                fails += _mask_diff(f"P={world} n={n} {schedule} {nm} vs one tile", a, b)
    return fails


def test_masks_do_not_depend_on_the_kernel_tiles():
    fails = run_distributed(_long_worker, 2, 160, timeout=DIST_TIMEOUT)[0]
    assert not fails, "\n".join(fails)


def _varlen_worker(rank, world, n):
    """Packed documents (masked plans drop the pairs of different documents; placed moves the shards): the same masks
    as the one-device varlen call."""
    total = world * n
    cu = [0, 5, total // 2 + 3, total - 4, total]
    cu_t = torch.tensor(cu, dtype=torch.int32)
    fails = []
    for i, (schedule, causal, name, pos, value) in enumerate([
            ("balanced", True, "q", 1, "nan"), ("placed", True, "k", total - 2, "+inf"),
            ("balanced", False, "v", total - 2, "nan"), ("placed", True, "dout", 2, "-inf"),
            ("ring", True, "dout", total // 2, "nan"), ("placed", False, "q", total - 1, "+inf")]):
        q, k, v, dout = (t[0] for t in _poisoned(total, 3000 + i, name, pos, value))
        lay = distattn.sharding.placement(cu, n) if schedule == "placed" else None
        shard = lambda t: distattn.shard_sequence(t, 0, schedule=schedule, layout=lay)  # noqa: E731
        qs, ks, vs = (shard(t).clone().requires_grad_() for t in (q, k, v))
        out, lse, _ = distattn.dist_flash_attn_varlen_func(qs, ks, vs, cu_t, total, causal=causal, schedule=schedule,
                                                           return_attn_probs=True)
        out.backward(shard(dout))
        ours = [distattn.gather_sequence(t.detach().contiguous(), dim, schedule=schedule, layout=lay)
                for t, dim in ((out, 0), (lse, 1), (qs.grad, 0), (ks.grad, 0), (vs.grad, 0))]
        if rank == 0:
            qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
            r_out, r_lse, _ = distattn.flash_attn_varlen_func(qr, kr, vr, cu_t, cu_t, total, total, causal=causal,
                                                              return_attn_probs=True)
            r_out.backward(dout)
            ref = [r_out.detach(), r_lse.detach(), qr.grad, kr.grad, vr.grad]
            for nm, a, b in zip(NAMES, ours, ref):
                fails += _mask_diff(f"P={world} varlen {schedule} causal={causal} {value} in {name}[{pos}] {nm}", a, b)
    return fails


@pytest.mark.parametrize("world", [2, 4])
def test_varlen_nan_inf_masks_equal_one_device(world):
    fails = run_distributed(_varlen_worker, world, 8, timeout=DIST_TIMEOUT)[0]
    assert not fails, "\n".join(fails)
