"""bench/peers (issue 37): the byte counter counts known collectives exactly; each installed peer's adapter is exact
at P = 2 on a tiny case; a peer that hangs or raises gives its error row within the deadline.

A peer is skipped only when its package is not installed (CI installs ``.[peers]`` before running this file).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bench.peers.adapters import RingFlashAttn
from tests.dist_utils import run_distributed

WORLD = 2


def _count_known_collectives(rank, world):
    import torch.distributed._functional_collectives as fc

    from bench.peers.measure import count_bytes

    p = world
    n = 4 * p  # fp32 elements: 16 * p bytes, divisible by p
    nb = n * 4
    got = {}
    x = torch.ones(n)

    def region(name, fn):
        with count_bytes() as c:
            fn()
        got[name] = (c.sent, c.recv, dict(c.calls), [])

    region("all_reduce", lambda: dist.all_reduce(x))
    region("all_to_all_single", lambda: dist.all_to_all_single(torch.empty(n), torch.ones(n)))
    region("all_to_all_uneven", lambda: dist.all_to_all_single(
        torch.empty(6 if rank == 0 else 1), torch.ones(3 if rank == 0 else 4),
        output_split_sizes=[3, 3] if rank == 0 else [0, 1],
        input_split_sizes=[3, 0] if rank == 0 else [3, 1]))
    region("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(torch.empty(n * p), x))
    region("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(torch.empty(n), torch.ones(n * p)))
    region("send_recv", lambda: dist.send(x, 1) if rank == 0 else dist.recv(torch.empty(n), 0))

    def isend_irecv():
        w = dist.isend(x, 1 - rank)
        r = dist.irecv(torch.empty(n), 1 - rank)
        w.wait()
        r.wait()

    region("isend_irecv", isend_irecv)

    def batch():  # as distattn.comm posts a round: P2POp(isend) and P2POp(irecv) in one batch
        ops = [dist.P2POp(dist.isend, torch.ones(2 * n), 1 - rank),
               dist.P2POp(dist.irecv, torch.empty(2 * n), 1 - rank)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    region("batch_isend_irecv", batch)
    region("functional_all_to_all", lambda: fc.wait_tensor(fc.all_to_all_single(torch.ones(n), None, None,
                                                                                  dist.group.WORLD)))
    region("functional_all_gather", lambda: fc.wait_tensor(fc.all_gather_tensor(torch.ones(n), 0, dist.group.WORLD)))
    region("barrier", lambda: dist.barrier())  # looked up when called, as callers do
    return got, nb


def test_byte_counter_counts_known_collectives_exactly():
    (r0, nb), (r1, _) = run_distributed(_count_known_collectives, WORLD, timeout=90)
    p = WORLD
    ring = (p - 1) * nb  # all_gather in / reduce_scatter out of nb bytes
    expect = {
        "all_reduce": ((2 * (p - 1) * nb // p,) * 2, (2 * (p - 1) * nb // p,) * 2, {"all_reduce": 1}),
        "all_to_all_single": ((nb // 2, nb // 2), (nb // 2, nb // 2), {"all_to_all_single": 1}),
        # rank 0 sends 3 elements to itself and 0 to rank 1; receives 3 from itself and 3 from rank 1.
        # rank 1 sends 3 to rank 0 and keeps 1; receives 0 from rank 0 and keeps 1.
        "all_to_all_uneven": ((0, 12), (12, 0), {"all_to_all_single": 1}),
        "all_gather_into_tensor": ((ring, ring), (ring, ring), {"all_gather_into_tensor": 1}),  # not its delegate
        "reduce_scatter_tensor": ((ring, ring), (ring, ring), {"reduce_scatter_tensor": 1}),
        "send_recv": ((nb, 0), (0, nb), None),
        "isend_irecv": ((nb, nb), (nb, nb), {"isend": 1, "irecv": 1}),
        "batch_isend_irecv": ((2 * nb, 2 * nb), (2 * nb, 2 * nb), {"isend": 1, "irecv": 1}),
        "functional_all_to_all": ((nb // 2, nb // 2), (nb // 2, nb // 2), {"funcol.all_to_all_single": 1}),
        "functional_all_gather": ((ring, ring), (ring, ring), {"funcol.all_gather_tensor": 1}),
        "barrier": ((0, 0), (0, 0), None),
    }
    for name, (e0, e1, calls) in expect.items():
        for rank, got in ((0, r0), (1, r1)):
            sent, recv, got_calls, unknown = got[name]
            assert (sent, recv) == (e0 if rank == 0 else e1), (name, rank, sent, recv)
            assert not unknown, (name, unknown)
            if calls is not None:
                assert got_calls == calls, (name, rank, got_calls)
    assert r0["send_recv"][2] == {"send": 1} and r1["send_recv"][2] == {"recv": 1}
    assert r0["barrier"][2] == {"barrier": 1}


# -- adapters: each installed peer exact at P = 2 on a tiny case, with its bytes counted ------------------------------
def _tiny(mask="causal"):
    from bench.peers.workload import Workload
    kw = {"window": 9} if mask == "window" else {}
    return Workload(name=f"tiny-{mask}", world=WORLD, tokens_per_rank=16, heads_q=4, heads_kv=2, head_dim=16,
                    mask=mask, **kw)


def _installed(system):
    from bench.peers.adapters import adapter
    a = adapter(system)
    if a.version() is None:
        pytest.skip(f"{a.package} is not installed (pip install -e '.[peers]')")
    return a


@pytest.mark.parametrize("system,mask", [
    ("distattn-balanced", "causal"), ("distattn-zigzag", "window"), ("distattn-placed", "docs"),
    ("distattn-2d", "docs"), ("distattn-2d", "window"),
    ("deepspeed-ulysses", "causal"), ("deepspeed-ulysses", "docs"), ("torch-cp-alltoall", "causal"),
    ("torch-cp-allgather", "causal"), ("usp", "causal"), ("megatron-core", "causal"), ("megatron-core", "window"),
    ("megatron-core", "docs")])
def test_adapter_exact_at_p2(system, mask):
    from bench.peers.harness import run_one
    _installed(system)
    row = run_one(system, _tiny(mask), timeout=150, reps=1)
    assert row.status == "ok", row.note
    assert row.exact, (row.err_out, row.err_dq, row.err_dk, row.err_dv)
    if system == "usp":  # forward only (yunchang's torch attention has no backward): out compared, no gradients
        assert row.err_out is not None and row.err_dq is None
    assert row.sent_max > 0 and row.recv_max > 0, row.calls  # the counter saw the system's transfers
    assert row.peak_max > 0 and row.work_max > 0
    if system.startswith("distattn"):
        assert row.crosscheck == "own counters equal, simulator equal", row.crosscheck


@pytest.mark.parametrize("mask", ["causal", "docs"])
def test_distattn_2d_with_a_ring_is_exact_and_counted(mask):
    """P = 4 with 2 heads: U = 2 over the heads, a ring of R = 2 (zigzag; the placement on documents); the counter's
    bytes (all-to-alls and ring) equal distattn's own counters and its simulator's 2-D figure."""
    import dataclasses

    from bench.peers.harness import run_one
    w = dataclasses.replace(_tiny(mask), world=4, heads_q=2, heads_kv=2)
    row = run_one("distattn-2d", w, timeout=150, reps=1)
    assert row.status == "ok", row.note
    assert row.exact, (row.err_out, row.err_dq, row.err_dk, row.err_dv)
    assert "all_to_all" in row.calls, row.calls
    if mask == "causal":  # the ring ran too (on documents the placement may keep each document on one ring rank)
        assert row.p2p_sent_max > 0, row.calls
    assert row.crosscheck == "own counters equal, simulator equal", row.crosscheck


def test_tables_show_every_cell_as_measured():
    """``bench.peers.tables``: a column per system, a row per (P, workload); refusals, errors and n/a as such."""
    import csv
    import dataclasses
    import io

    from bench.peers.harness import FIELDS, Row
    from bench.peers.tables import tables
    rows = [Row(system="distattn (2-D)", workload="docs", world=8, status="ok", exact=True, err_out=1e-6, err_dq=3e-6,
                err_dk=2e-6, err_dv=1e-6, sent_max=2048, saved_max=1024, peak_max=4096, balance=1.0),
            Row(system="PyTorch CP (alltoall)", workload="docs", world=8, status="refused", note="no attn_mask"),
            Row(system="distattn (placed)", workload="mha", world=8, status="n/a"),
            Row(system="USP (yunchang)", workload="mha", world=8, status="timeout")]
    buf = io.StringIO()
    wr = csv.DictWriter(buf, fieldnames=FIELDS)
    wr.writeheader()
    wr.writerows(dataclasses.asdict(r) for r in rows)
    md = tables(list(csv.DictReader(io.StringIO(buf.getvalue()))))
    assert "| P | workload | distattn 2-D | CP a2a | distattn placed | USP (fwd only) |" in md
    assert "| 8 | docs | yes 3.0e-06 | refused |  |  |" in md
    assert "| 8 | docs | 2.0 | refused |  |  |" in md  # bytes sent, KiB
    assert "| 8 | mha |  |  | – | timeout |" in md
    assert "| 8 | docs | 1.00 | refused |  |  |" in md  # balance
    assert "| 8 | docs | 2 / 4 | refused |  |  |" in md  # bytes / peak together


def test_refusal_is_a_row_with_its_reason():
    from bench.peers.harness import run_one
    _installed("torch-cp-alltoall")
    row = run_one("torch-cp-alltoall", _tiny("docs"), timeout=60, reps=1)
    assert row.status == "refused" and "attn_mask" in row.note


def test_megatron_core_refusals_are_rows_with_its_own_words():
    """megatron-core's context parallel needs TransformerEngine; TP splits whole heads and whole kv groups."""
    import dataclasses

    from bench.peers.harness import run_one
    _installed("megatron-core")
    row = run_one("megatron-core-cp", _tiny(), timeout=90, reps=1)
    assert row.status == "refused" and "Context parallelism is only supported by TEDotProductAttention" in row.note
    odd = dataclasses.replace(_tiny(), heads_q=3, heads_kv=3)
    row = run_one("megatron-core", odd, timeout=90, reps=1)
    assert row.status == "refused" and "num_attention_heads (3) must be a multiple of tensor_model_parallel_size (2)" \
        in row.note, row.note
    mqa = dataclasses.replace(_tiny(), heads_kv=1)
    row = run_one("megatron-core", mqa, timeout=90, reps=1)
    assert row.status == "refused" and "splits num_query_groups (1) over tensor_model_parallel_size (2)" in row.note


# -- the megatron-core patches: each still replaces what megatron-core calls, and says so when it moves ----------------
def test_megatron_cpu_masks_are_megatrons_masks_on_the_cpu(monkeypatch):
    """The patched masks equal megatron-core's own functions run with ``device="cuda"`` read as the CPU (so a release
    that changes the masks' formulas fails here), the originals come back, and a moved name raises PatchBroken."""
    import importlib
    import inspect

    from bench.peers import patches
    _installed("megatron-core")
    utils = importlib.import_module("megatron.core.transformer.utils")
    fused = importlib.import_module("megatron.core.fusions.fused_softmax")
    theirs = {}
    for name in ("get_default_causal_mask", "get_sliding_window_causal_mask"):
        src = inspect.getsource(getattr(utils, name))
        assert 'device="cuda"' in src, f"megatron-core's {name} no longer builds on cuda: is the patch still needed?"
        scope = {"torch": torch}
        exec(src.replace('device="cuda"', 'device="cpu"'), scope)  # their formula, on the CPU
        theirs[name] = scope[name]
    before = (fused.get_default_causal_mask, fused.get_sliding_window_causal_mask)
    with patches.megatron_cpu_masks():
        for sq in (1, 5, 16):
            assert torch.equal(fused.get_default_causal_mask(sq), theirs["get_default_causal_mask"](sq))
            for skv, window in ((sq, (3, 0)), (sq + 4, (2, 0)), (sq, (0, 0))):
                assert torch.equal(fused.get_sliding_window_causal_mask(sq, skv, window),
                                   theirs["get_sliding_window_causal_mask"](sq, skv, window))
    assert (fused.get_default_causal_mask, fused.get_sliding_window_causal_mask) == before
    monkeypatch.delattr(fused, "get_sliding_window_causal_mask")
    with pytest.raises(patches.PatchBroken, match="megatron-core .*get_sliding_window_causal_mask"):
        with patches.megatron_cpu_masks():
            pass


def test_megatron_cpu_device_is_held_and_released(monkeypatch):
    import importlib

    from bench.peers import patches
    _installed("megatron-core")
    original = torch.cuda.current_device
    with patches.megatron_cpu_device():
        assert torch.cuda.current_device() == "cpu"
        torch.empty(2, device=torch.cuda.current_device())  # what megatron-core's buffers do
    assert torch.cuda.current_device is original
    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    monkeypatch.setattr(patches, "_source", lambda m: "" if m is mappings else "torch.cuda.current_device()")
    with pytest.raises(patches.PatchBroken, match="mappings no longer allocates"):
        with patches.megatron_cpu_device():
            pass
    assert torch.cuda.current_device is original


# -- a peer that hangs or raises: its error row within the deadline ------------------------------------------------
class _Hangs:
    """An adapter whose rank 1 never joins the collective rank 0 waits in (a peer's deadlock)."""

    name, package, patches, forward_only = "hangs", "", (), False

    def version(self):
        return "test"

    def applies(self, w):
        return True

    def prepare(self, w):
        import time
        if dist.get_rank() == 1:
            time.sleep(3600)
        dist.barrier()


class _Raises(_Hangs):
    name = "raises"

    def prepare(self, w):
        raise RuntimeError("peer exploded on purpose")


def test_hang_and_raise_give_error_rows_within_the_deadline():
    import time

    from bench.peers.harness import run_one
    t0 = time.monotonic()
    row = run_one(_Hangs, _tiny(), timeout=8, reps=1)
    assert time.monotonic() - t0 < 30
    assert row.status == "error" and "timed out after 8 s" in row.note, row
    row = run_one(_Raises, _tiny(), timeout=60, reps=1)
    assert row.status == "error" and "peer exploded on purpose" in row.note, row


# -- ring-flash-attention (GPU only: flash-attn's CUDA build) and the CUDA mode ------------------------------------
class _RingFlashAttnThroughDropIn(RingFlashAttn):
    """The ring-flash-attn adapter with its calls sent to distattn's drop-in of the same API (module-level: the
    harness's ranks unpickle it)."""

    name = "ring-flash-attn (API through distattn.compat)"
    module = "distattn.compat.ring_flash_attn"
    needs_flash_attn = False

    def version(self):
        return "drop-in"


@pytest.mark.parametrize("mask", ["causal", "docs"])
def test_ring_flash_attn_adapter_shards_and_calls_its_api_exactly(mask):
    """The adapter's zigzag shards, llama3 varlen arguments (``llama3_flash_attn_prepare_cu_seqlens``) and the
    placement of its results back, held to fp64 through an implementation of the same API that runs on the CPU;
    the real package (CUDA only) gives a "not installed" row here, without starting a process."""
    from bench.peers.harness import run_one
    row = run_one(_RingFlashAttnThroughDropIn, _tiny(mask), timeout=150, reps=1)
    assert row.status == "ok", row.note
    assert row.exact, (row.err_out, row.err_dq, row.err_dk, row.err_dv)
    assert row.sent_max > 0
    real = run_one("ring-flash-attn", _tiny(mask), timeout=5, reps=1)
    if real.version is None or real.status == "not installed":
        assert real.status == "not installed" and "pip install ring-flash-attn" in real.note, real


def test_ring_flash_attn_refusals_are_rows_known_before_any_process():
    """What the real package cannot run is a refused row, decided in the parent (no spawn): the window (its
    window_size is per block, local), the CPU, fp32, and ranks sharing a GPU over gloo (its ring sends CUDA tensors
    point to point)."""
    import dataclasses

    from bench.peers.adapters import RingFlashAttn
    a = RingFlashAttn()
    bf16 = dataclasses.replace(_tiny(), dtype="bfloat16")
    assert "no sliding window" in a.refuses(_tiny("window"), "cuda")
    assert "CUDA only" in a.refuses(bf16, "cpu")
    assert "fp16 and bf16" in a.refuses(_tiny(), "cuda")
    assert "gloo cannot carry" in a.refuses(bf16, "cuda")
    assert _RingFlashAttnThroughDropIn().refuses(_tiny(), "cpu") is None
    assert "no sliding window" in _RingFlashAttnThroughDropIn().refuses(_tiny("window"), "cpu")


def test_cuda_mode_without_a_gpu_is_a_row_that_says_so():
    """``device="cuda"`` on a machine without CUDA: an error row naming it, no process started, never a crash; an
    unknown device is the caller's mistake (ValueError)."""
    import torch

    from bench.peers.harness import run_one
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA (the GPU check runs the CUDA mode)")
    row = run_one("distattn-zigzag", _tiny(), timeout=5, reps=1, device="cuda")
    assert row.status == "error" and "no CUDA device" in row.note and row.device == "cuda", row
    with pytest.raises(ValueError, match="use 'cpu' or 'cuda'"):
        run_one("distattn-zigzag", _tiny(), device="tpu")
