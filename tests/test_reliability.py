"""Never hang, never silently wrong (issue 14): rank agreement, bounded waits with abort, and edge inputs.

One spawn per world size runs every case in sequence (spawning costs seconds per rank on a small machine):
each disagreement raises the same ``ValueError`` on every rank, a rank that raises mid-forward or mid-backward
makes its peers raise ``DistAttnError`` quickly, a rank that skips a call makes its peers raise within the
timeout, and after every failure a correct call on all ranks proves the communicators recover.
"""

import re
import time

import pytest
import torch
import torch.distributed as dist

import distattn
from dist_utils import run_distributed
from distattn import kernels

SPAWN_TIMEOUT_S = 150  # the whole sequence of one world size, ranks sharing two cores
CALL_TIMEOUT_S = 10.0  # the timeout= of the calls under test: every wait inside them is bounded by it
SKIP_TIMEOUT_S = 2.0  # the timeout= of the call a peer skips (its peers wait this long, then fail)
REBUILD_TIMEOUT_S = 3.0  # DISTATTN_REBUILD_TIMEOUT here: how long a rebuild waits for a rank that does not come
AGREE_S = 3.0  # a disagreement must be reported within this (it takes milliseconds; slack for a loaded machine)
ABORT_S = 5.0  # a peer of a failing rank fails within this of the fault, well before CALL_TIMEOUT_S (on gloo
# the failing rank's sockets close: tens of milliseconds on an idle machine, ~2 s measured under load 17 on 2 cores)

# (name, field named in the message, per-rank call arguments: f(odd) -> (shape of q/k/v, dtype, kwargs));
# ``odd`` is True on the last rank only.
DISAGREEMENTS = [
    ("shard length", "q.shape", lambda odd: ((1, 6 if odd else 4, 2, 8), torch.float32, {})),
    ("heads", "q.shape", lambda odd: ((1, 4, 4 if odd else 2, 8), torch.float32, {})),
    ("head dim", "q.shape", lambda odd: ((1, 4, 2, 16 if odd else 8), torch.float32, {})),
    ("batch", "q.shape", lambda odd: ((2 if odd else 1, 4, 2, 8), torch.float32, {})),
    ("fp16 vs bf16", "dtype", lambda odd: ((1, 4, 2, 8), torch.bfloat16 if odd else torch.float16, {})),
    ("fp32 vs fp16", "dtype", lambda odd: ((1, 4, 2, 8), torch.float16 if odd else torch.float32, {})),
    ("causal", "causal", lambda odd: ((1, 4, 2, 8), torch.float32, {"causal": not odd})),
    ("schedule", "schedule", lambda odd: ((1, 4, 2, 8), torch.float32,
                                          {"causal": True, "schedule": "ring" if odd else "balanced"})),
    ("overlap", "overlap", lambda odd: ((1, 4, 2, 8), torch.float32, {"overlap": not odd})),
    ("scale", "scale", lambda odd: ((1, 4, 2, 8), torch.float32, {"softmax_scale": 0.3 if odd else 0.25})),
]


def _inputs(world, seed=0, n=4, dtype=torch.float32):
    """Full-sequence q, k, v, dout ``(2, world*n, 2, 8)``, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, world * n, 2, 8, generator=g).to(dtype) for _ in range(4)]


def _fwd_bwd(world, **kw):
    """One forward + backward on this rank's shards; ``[out, dq, dk, dv]`` of this rank."""
    q, k, v, dout = _inputs(world)
    qs, ks, vs = (distattn.shard_sequence(t).clone().requires_grad_() for t in (q, k, v))
    out = distattn.dist_flash_attn_func(qs, ks, vs, causal=True, timeout=CALL_TIMEOUT_S, **kw)
    out.backward(distattn.shard_sequence(dout))
    return [out.detach(), qs.grad, ks.grad, vs.grad]


def _timed(fn):
    """``(exception or None, seconds)`` of ``fn()``."""
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the tests inspect what was raised
        return exc, time.monotonic() - start
    return None, time.monotonic() - start


def _forward_matches(world, clean_out) -> bool:
    """A forward after a failure is correct (bit-identical to the clean run)."""
    q, k, v, _ = _inputs(world)
    out = distattn.dist_flash_attn_func(*(distattn.shard_sequence(t) for t in (q, k, v)), causal=True,
                                        timeout=CALL_TIMEOUT_S)
    return torch.equal(out, clean_out)


def _disagreements(rank, world, clean):
    """Every disagreement: the error, its time; then a correct call (the communicators still work)."""
    found = []
    for name, _, make in DISAGREEMENTS:
        shape, dtype, kw = make(rank == world - 1)
        x = torch.zeros(shape, dtype=dtype)
        exc, took = _timed(lambda: distattn.dist_flash_attn_func(x, x, x, timeout=CALL_TIMEOUT_S, **kw))
        found.append((name, type(exc).__name__, str(exc), took, _forward_matches(world, clean[0])))
    return found


class _Fault:
    """Patches ``kernels.<name>`` on this rank so that its ``nth`` call raises (a kernel failing mid-call)."""

    def __init__(self, name, nth):
        self.name, self.nth, self.calls = name, nth, 0
        self.real = getattr(kernels, name)
        self.raised_at = None  # time.monotonic() of the fault (one clock for all processes of this machine)

    def __enter__(self):
        def failing(*args, **kw):
            self.calls += 1
            if self.calls == self.nth:
                self.raised_at = time.monotonic()
                raise RuntimeError(f"injected fault in kernels.{self.name}")
            return self.real(*args, **kw)
        setattr(kernels, self.name, failing)
        return self

    def __exit__(self, *exc):
        setattr(kernels, self.name, self.real)


def _faults(rank, world, clean):
    """A rank raising mid-forward / mid-backward and staying alive; a rank skipping a call. After each, every
    rank catches the error, skips the batch as a training loop would, and the next call must be correct."""
    found = []
    for phase, kernel in (("forward", "fold_"), ("backward", "backward_chunk_")):
        with _Fault(kernel, nth=2 if rank == world - 1 else 0) as fault:  # the last rank has a task at every
            exc, _ = _timed(lambda: _fwd_bwd(world))  # step of the causal plans: its 2nd kernel call is step 1
        failed_at = time.monotonic()
        fault_at = torch.tensor([fault.raised_at or 0.0], dtype=torch.float64)
        dist.all_reduce(fault_at, op=dist.ReduceOp.MAX)  # when the fault happened, on every rank
        after = _fwd_bwd(world)
        found.append((phase, type(exc).__name__, str(exc), failed_at - fault_at.item(),
                      all(torch.equal(a, b) for a, b in zip(after, clean))))
    # Rank 0 skips a call (and goes on to a user collective, as a rank that skipped its batch would). Its program
    # then makes one call fewer than its peers': the declared steps are what tells the library where they meet again.
    distattn.set_step(100)
    x = torch.zeros(1, 4, 2, 8)
    if rank == 0:
        exc, took = None, 0.0
    else:
        exc, took = _timed(lambda: distattn.dist_flash_attn_func(x, x, x, timeout=SKIP_TIMEOUT_S))
    dist.barrier()
    # The peers abandoned the communicators while rank 0 was away: rank 0's next call learns it and raises once,
    # without joining the rebuild (it cannot tell "skipped" from "stalled", and pairing its call with the peers'
    # next one could pair different batches); the peers' next call finds that rank 0 gave it up (or waits the
    # rebuild bound for it) and raises too. Every rank skips that batch, as a training loop would, and the call of
    # the next step is exact everywhere.
    distattn.set_step(101)
    retry_exc, retry_took = _timed(lambda: _fwd_bwd(world))
    dist.barrier()
    distattn.set_step(102)
    after = _fwd_bwd(world)
    found.append(("skip", type(exc).__name__, str(exc), took, all(torch.equal(a, b) for a, b in zip(after, clean)),
                  type(retry_exc).__name__, str(retry_exc), retry_took))
    return found


def _outsider(rank, world):
    """A rank outside ``group`` gets a distattn message (every rank creates the group: new_group is collective)."""
    group = dist.new_group(ranks=list(range(world - 1)))
    # new_group, like init, returns on a rank once its own pairs are up, possibly before a peer has finished its
    # handshake: a member that returned at once and exited would close a socket a slower member is still connecting
    # through ("Connection closed by peer" in its new_group, then a hang). The members use the group once, and every
    # rank waits for the others before leaving.
    found = None
    if rank != world - 1:
        dist.all_reduce(torch.ones(1), group=group)
    else:
        x = torch.zeros(1, 4, 2, 8)
        exc, _ = _timed(lambda: distattn.dist_flash_attn_func(x, x, x, group=group))
        found = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    return found


def _worker(rank, world):
    marks = [time.monotonic()]
    clean = _fwd_bwd(world)
    marks.append(time.monotonic())
    found = {"disagree": _disagreements(rank, world, clean)}
    marks.append(time.monotonic())
    found["faults"] = _faults(rank, world, clean)
    marks.append(time.monotonic())
    found["outsider"] = _outsider(rank, world)
    marks.append(time.monotonic())
    found["seconds"] = [b - a for a, b in zip(marks, marks[1:])]  # clean, disagreements, faults, outsider
    return found


@pytest.mark.parametrize("world", [2, 4])
def test_disagreements_faults_and_skips_fail_fast_and_recover(world):
    per_rank = run_distributed(_worker, world, timeout=SPAWN_TIMEOUT_S,
                               env={"DISTATTN_REBUILD_TIMEOUT": str(REBUILD_TIMEOUT_S)})

    # disagreements: the same ValueError on every rank, every rank's value listed, quickly; then recovery
    for i, (name, field, _) in enumerate(DISAGREEMENTS):
        results = [r["disagree"][i] for r in per_rank]
        for _, kind, msg, took, recovered in results:
            assert kind == "ValueError", (name, kind, msg)
            assert msg == results[0][2], (name, msg, results[0][2])
            assert took < AGREE_S, (name, took)
            assert recovered, name
        msg = results[0][2]
        assert "the ranks of the group disagree" in msg
        line = next(ln for ln in msg.splitlines() if ln.strip().startswith(field + ":"))
        assert all(f"rank {r}:" in line for r in range(world)), line
    scale_line = next(ln for ln in per_rank[0]["disagree"][9][2].splitlines() if "scale:" in ln)
    assert "rank 0: 0.25" in scale_line and f"rank {world - 1}: 0.3" in scale_line

    # a rank raising mid-call: it re-raises its own error, its peers raise DistAttnError fast; then recovery
    for i, phase in enumerate(("forward", "backward")):
        for rank, r in enumerate(per_rank):
            _, kind, msg, took, recovered = r["faults"][i]
            if rank == world - 1:
                assert kind == "RuntimeError" and "injected fault" in msg, (phase, msg)
            else:
                assert kind == "DistAttnError", (phase, rank, kind, msg)
                assert f"rank {rank}, " in msg and f"{phase} call" in msg, msg
                # The failing rank's abort wakes its peers: its closed connections, and the given-up mark in the
                # job's store, which every point-to-point wait reads (a receive posted after the connection closed
                # was seen in CI on gloo to wait out its whole bound, 10 s here, when only the connection told). A
                # gloo collective (the confirmation after the last step) is not woken by the closed connection when
                # it was posted before it, and reads no mark (distattn.communicators: watch_collective): it fails at
                # its own bound. On NCCL every wait reads the mark.
                if "confirming that every rank finished" in msg:
                    assert took < CALL_TIMEOUT_S + ABORT_S, (phase, rank, took, msg)
                else:
                    assert "a peer failed and aborted" in msg, (phase, rank, msg)
                    assert took < ABORT_S, (phase, rank, took, msg)
            assert recovered, (phase, rank)

    # a rank skipping a call: its peers raise DistAttnError within the timeout; the next call raises once on every
    # rank (rank 0: abandoned while away; the peers: rank 0 gave it up, or did not come to the rebuild), quickly;
    # then recovery
    for rank, r in enumerate(per_rank):
        _, kind, msg, took, recovered, retry_kind, retry_msg, retry_took = r["faults"][2]
        if rank != 0:
            assert kind == "DistAttnError" and "timeout" in msg, (rank, kind, msg)
            assert took < SKIP_TIMEOUT_S + 2.0, (rank, took)
            # rank 0 is named; on a loaded machine a peer that arrived seconds earlier may have given up too
            missing = re.search(r"group rank\(s\) \[([\d, ]+)\] did not arrive at the rebuild", retry_msg)
            gave_up = "gave call 1 of step 101 up" in retry_msg and "group rank 0 failed it and aborted" in retry_msg
            assert retry_kind == "DistAttnError", retry_msg
            assert gave_up or (missing and "0" in missing.group(1).split(", ")), retry_msg
            assert retry_took < REBUILD_TIMEOUT_S + ABORT_S, (rank, retry_took)
        else:
            assert retry_kind == "DistAttnError" and "abandoned" in retry_msg, retry_msg
            assert retry_took < ABORT_S, retry_took
        assert recovered, rank

    assert "is not a member of the group" in per_rank[-1]["outsider"]


# -- edges (one process: validation happens before any communication) -----------------------------------------
def test_empty_batch_and_zero_heads_are_rejected():
    with pytest.raises(ValueError, match=r"batch size must be >= 1, got q of shape \(0, 4, 2, 8\)"):
        distattn.flash_attn_func(*(torch.zeros(0, 4, 2, 8),) * 3)
    with pytest.raises(ValueError, match=r"q must have >= 1 head, got q of shape \(1, 4, 0, 8\)"):
        distattn.flash_attn_func(torch.zeros(1, 4, 0, 8), torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8))


@pytest.mark.parametrize("causal", ["yes", None, 1, 0.0])
def test_causal_must_be_a_bool(causal):
    x = torch.zeros(1, 4, 2, 8)
    with pytest.raises(TypeError, match=r"causal must be a bool \(True or False\), got"):
        distattn.flash_attn_func(x, x, x, causal=causal)


@pytest.mark.parametrize("scale, error, match", [
    ("abc", TypeError, r"softmax_scale must be a number or None \(head_dim \*\* -0.5\), got 'abc'"),
    (True, TypeError, r"softmax_scale must be a number or None"),
    (0.0, ValueError, r"softmax_scale \(0.0\) must be a finite positive number"),
    (-1.0, ValueError, r"softmax_scale \(-1.0\) must be a finite positive number"),
    (float("nan"), ValueError, r"softmax_scale \(nan\) must be a finite positive number"),
    (float("inf"), ValueError, r"softmax_scale \(inf\) must be a finite positive number"),
])
def test_scale_must_be_positive_finite_number(scale, error, match):
    x = torch.zeros(1, 4, 2, 8)
    with pytest.raises(error, match=match):
        distattn.flash_attn_func(x, x, x, softmax_scale=scale)


def test_timeout_validation():
    from distattn.api import check_timeout

    for bad, error in (("5", TypeError), (0, ValueError), (-1.0, ValueError), (float("inf"), ValueError)):
        with pytest.raises(error, match="timeout must be"):
            check_timeout(bad)
    assert check_timeout(7) == 7.0


def test_timeout_env_default(monkeypatch):
    from distattn.comm import DEFAULT_TIMEOUT_S, default_timeout

    monkeypatch.delenv("DISTATTN_TIMEOUT", raising=False)
    assert default_timeout() == DEFAULT_TIMEOUT_S == 300.0
    monkeypatch.setenv("DISTATTN_TIMEOUT", "12.5")
    assert default_timeout() == 12.5
    monkeypatch.setenv("DISTATTN_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"DISTATTN_TIMEOUT='soon' must be a positive number of seconds"):
        default_timeout()


def test_dist_attn_error_is_exported_runtime_error():
    assert issubclass(distattn.DistAttnError, RuntimeError) and "DistAttnError" in distattn.__all__


def test_every_config_field_is_checked_or_explicitly_local():
    """A new ``DistAttnConfig`` field (e.g. packed-sequence metadata) must be added to ``fingerprint_fields``
    (checked on every call) or listed here as rank-local: forgetting it would let ranks disagree silently."""
    import dataclasses

    from distattn.attention import DistAttnConfig

    local = {"group": "the group itself (the communicator)", "timeout": "each rank's own bound on its waits"}
    cfg = DistAttnConfig(causal=True, scale=0.5)
    names = {f.name for f in dataclasses.fields(cfg)}
    assert set(cfg.fingerprint_fields()) == names - set(local)


def test_mismatch_message_lists_every_rank_for_differing_fields_only():
    from distattn.agreement import describe_mismatch

    msg = describe_mismatch([{"call": 3, "scale": 0.25, "causal": True}, {"call": 3, "scale": 0.3, "causal": True}])
    assert msg.splitlines()[1:] == ["  scale: rank 0: 0.25, rank 1: 0.3"]
