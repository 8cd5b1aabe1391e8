"""A windowed schedule="placed" call on spawned gloo ranks (issue 39): the inputs sharded on the placement solved for
the call's window (``distattn.sharding.placement(cu, n, window=)``), the call's plan on the same placement.

Tokens per rank 13 (a prime: blocks of one token), documents of 1, 7, 10 and 11 tokens and a padding tail, so no
length is a multiple of anything. Every rank checks out/dq/dk/dv against the fp64 reference (the accuracy rule), its
bytes against the simulator's plan of the windowed mask (so the executor ran the window's placement), a causal call
on the same shards (a model's global layer: the plan follows the shards' placement), and the ambiguity error when
the documents were placed for two windows and the call has a third.
"""

import pytest
import torch

import distattn
from attn_ref import assert_all_close_by_rule
from dist_utils import run_distributed
from distattn import comm
from distattn.schedule import MaskSpec, Shapes, layout_of, simulate
from distattn.schedule.build import placement_mask
from distattn.sharding import gather_sequence, placement, shard_sequence
from test_dist_varlen import _reference, _stream_mask

TIMEOUT_S = 180
N = 13
# per world size: documents (a single-token one first, the stream's tail padded) and a window whose placement is not
# the causal one's (checked by test_the_window_moves_the_placement)
STREAMS = {2: ((0, 1, 8, 9, 20, 21, 24), (1, 0)), 3: ((0, 1, 2, 9, 20, 27, 37), (1, 0))}
D = 16


def _call(rank, world, cu, causal, window, lay, seed, h_q=2, h_kv=1):
    total = world * N
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(total, h, D, generator=g) for h in (h_q, h_kv, h_kv, h_q))
    qs, ks, vs = (shard_sequence(t, 0, layout=lay).clone().requires_grad_() for t in (q, k, v))
    comm.reset_counters()
    out = distattn.dist_flash_attn_varlen_func(qs, ks, vs, torch.tensor(cu, dtype=torch.int32), total,
                                               causal=causal, window_size=window, schedule="placed",
                                               backend="torch")
    out.backward(shard_sequence(dout, 0, layout=lay))
    keep = _stream_mask(cu, total, causal, window)
    ref = [shard_sequence(t, 0, layout=lay) for t in _reference(q, k, v, dout, keep, torch.float64)]
    base = [shard_sequence(t, 0, layout=lay) for t in _reference(q, k, v, dout, keep, torch.float32)]
    assert_all_close_by_rule(("out", "dq", "dk", "dv"), [out, qs.grad, ks.grad, vs.grad], base, ref, torch.float32)
    assert torch.equal(shard_sequence(gather_sequence(out.detach(), 0, layout=lay), 0, layout=lay), out.detach())
    return (comm.COUNTERS.bytes_sent, comm.COUNTERS.bytes_recv), Shapes(batch=1, seq_per_rank=N, heads_q=h_q,
                                                                           heads_kv=h_kv, head_dim=D, dtype_bytes=4)


def _worker(rank, world):
    cu, window = STREAMS[world]
    lay = placement(cu, N, window=window)  # the call's window: the placement balances the windowed work
    for i, (causal, win) in enumerate(((True, window), (False, (window[0], 2)))):  # one placement: left window
        counted, shapes = _call(rank, world, cu, causal, win, lay, seed=i)
        rep = simulate(world, causal, "placed", shapes, mask=MaskSpec(causal=causal, window=win, cu_seqlens=cu))
        assert counted == (rep.bytes_sent[rank], rep.bytes_recv[rank]), (causal, win)
    _call(rank, world, cu, True, (-1, -1), lay, seed=5)  # a global layer on the windowed shards: exact too
    placement(cu, N)  # the same documents placed for causal work as well: a third window is ambiguous
    with pytest.raises(ValueError, match=r"placed for the windows .* window_size=\(7, 0\) is none of them"):
        _call(rank, world, cu, True, (7, 0), lay, seed=6)
    return lay.placement


@pytest.mark.parametrize("world", [2, 3])
def test_the_window_moves_the_placement(world):
    cu, window = STREAMS[world]
    causal = layout_of("placed", world, mask=MaskSpec(causal=True, cu_seqlens=cu), n=N)
    windowed = layout_of("placed", world, mask=placement_mask(cu, window), n=N)
    assert windowed.kind == causal.kind == "placed" and windowed.placement != causal.placement


@pytest.mark.parametrize("world", [2, 3])
def test_windowed_placed_call_against_reference(world):
    seen = run_distributed(_worker, world, timeout=TIMEOUT_S)
    assert all(s == seen[0] for s in seen)  # one placement on every rank
    assert seen[0] == layout_of("placed", world, mask=placement_mask(STREAMS[world][0], STREAMS[world][1]),
                                n=N).placement
