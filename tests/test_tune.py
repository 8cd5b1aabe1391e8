"""Configs tuned once, outside the distributed step: ``distattn.kernels.autotune`` (one process: validation, trials,
disk cache, installing a table) and ``distattn.autotune`` (a process group: rank 0's choice on every rank).

CPU tier: the launcher runs through the Triton interpreter (conftest.py sets TRITON_INTERPRET=1), where timing
measures nothing, so the timers here are fakes with deterministic preferences; each still launches the config
it is asked about, so a trial whose arguments differ from a real launch's fails here (and its output is checked
against the torch backend). Shared memory is Hopper's (the filter's input; a CPU has none).
GPU tier (``@pytest.mark.gpu``): the real ``triton.testing.do_bench``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

tr = pytest.importorskip("distattn.kernels._triton")
if tr._IMPORT_ERROR is not None:
    pytest.skip(f"triton not importable: {tr._IMPORT_ERROR}", allow_module_level=True)

import distattn  # noqa: E402
from distattn import kernels  # noqa: E402
from distattn.kernels import TuneCase, _tune  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_utils import run_distributed  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_OK, _WHY = tr.is_available(DEVICE)
pytestmark = pytest.mark.skipif(not _OK, reason=f"triton backend unavailable: {_WHY}")

H100_SMEM = 232448  # sm_90 opt-in shared memory per block
SPAWN_TIMEOUT_S = 120
ABSENT_TIMEOUT_S = 1  # autotune's bound when a rank never calls (the test waits this long)
# fp32 inputs, fp32 accumulation in both backends, another tile order: a few ulps of O(1) values.
TRIAL_TOL_F32 = 2e-5
# fp16 d=64, 64 tokens: the filter keeps several configs for fwd and dK/dV (so a timer's preference shows).
CASE = dict(batch=1, seq_q=64, seq_k=64, heads_q=2, heads_kv=1, head_dim=64, dtype="fp16", causal=True)


def _use_h100_smem():
    if not torch.cuda.is_available():
        tr._max_shared_mem_cached = lambda device: H100_SMEM


@pytest.fixture(autouse=True)
def _fresh_table(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setattr(tr, "_max_shared_mem_cached", lambda device: H100_SMEM)
    saved = dict(tr._CHOSEN)
    tr._CHOSEN.clear()
    yield
    tr._CHOSEN.clear()
    tr._CHOSEN.update(saved)


class PreferLast:
    """A fake timer: the later a config is in ``_CONFIGS`` the faster (the heuristic prefers the first kept, so
    a table from this timer differs from the heuristic wherever more than one config is kept). Launches the
    first trial of each kernel, so the trial path runs."""

    def __init__(self, sign: float = -1.0):
        self.sign, self.calls, self.launched = sign, [], set()

    def __call__(self, fn) -> float:
        self.calls.append((fn.key, fn.config))
        if fn.kernel not in self.launched:
            self.launched.add(fn.kernel)
            fn()
        return self.sign * tr._CONFIGS[fn.kernel].index(fn.config)


def _raising_timer(fn):
    raise AssertionError(f"benchmarked {fn.key.text()} {fn.config}, expected the cache to answer")


def _named(dtype=torch.bfloat16, block_d=128, mask=1, bucket=4096, tma=False) -> dict:
    return {"Q": torch.empty(1, dtype=dtype), "BLOCK_D": block_d, "MASK": mask, "LEN_BUCKET": bucket, "TMA": tma}


# ----------------------------------------------------------------------------- the table and the pick key

def test_the_table_changes_the_pick_for_its_key_only():
    h = tr._Heuristic("fwd", None)
    tuned, other = _named(), _named(mask=0)
    before = h.pick(tuned)
    assert before == tr._kept("fwd", tuned)[0]
    forced = next(c for c in tr._CONFIGS["fwd"] if c != before)
    tr._CHOSEN[tr._pick_key("fwd", tuned)] = forced
    assert h.pick(tuned) == forced and h.pick(dict(tuned)) == forced
    assert h.pick(other) == tr._kept("fwd", other)[0]  # another key: the heuristic
    assert tr._Heuristic("dq", None).pick(tuned) == tr._kept("dq", tuned)[0]  # another kernel: the heuristic


def test_the_pick_key_holds_everything_the_kept_list_depends_on(monkeypatch):
    base = _named()
    variants = {"dtype": _named(dtype=torch.float32), "block_d": _named(block_d=64), "mask": _named(mask=2),
                "len_bucket": _named(bucket=64), "tma": _named(tma=True)}
    key = tr._pick_key("dkdv", base)
    for field, named in variants.items():
        other = tr._pick_key("dkdv", named)
        assert other != key and [f for f in key._fields if getattr(key, f) != getattr(other, f)] == [field]
    monkeypatch.setattr(tr, "_max_shared_mem_cached", lambda device: 101376)  # sm_86: another device, another key
    assert tr._pick_key("dkdv", base).smem == 101376 != key.smem
    # The kept list is a function of the key: equal keys never keep different configs.
    seen = {}
    for smem in (H100_SMEM, 101376):
        monkeypatch.setattr(tr, "_max_shared_mem_cached", lambda device, smem=smem: smem)
        for name in ("fwd", "dq", "dkdv"):
            for dtype in (torch.float16, torch.bfloat16, torch.float32):
                for block_d in (16, 64, 128, 256):
                    for bucket in (64, 128, 4096):
                        for tma in (False, True):
                            named = _named(dtype, block_d, 1, bucket, tma)
                            kept = tr._kept(name, named)
                            assert seen.setdefault(tr._pick_key(name, named), kept) == kept
    assert tr._PickKey.from_text(key.text()) == key


# ----------------------------------------------------------------------------- one process

@pytest.mark.parametrize("mask", [dict(causal=True), dict(causal=False), dict(bounds=True)])
def test_a_trial_is_a_real_launch(mask):
    """Each recorded launch, run as a trial with a config other than the interpreter's 16x16, adds exactly what
    the torch backend adds: the trial passes the launcher's own arguments."""
    case = TuneCase(**{**CASE, "dtype": "fp32", "causal": False, **mask})
    ref = kernels.get_backend("torch", DEVICE)
    bounds = (kernels.window_bounds(64, 64, causal=True, window=(-1, -1), device=DEVICE)
              if case.bounds else None)
    kw = dict(scale=case.head_dim ** -0.5, q_start=0, k_start=0, causal=case.causal, bounds=bounds)
    launches = _tune._launches(case, torch.device(DEVICE))
    assert [name for name, *_ in launches] == ["fwd", "dkdv", "dq"]
    for launch in launches:
        name, named = launch[0], launch[4]
        q, k, v = named["Q"], named["K"], named["V"]
        config = tr._kept(name, named)[-1]
        assert config[:2] != (tr._INTERP_BLOCK, tr._INTERP_BLOCK)
        if name == "fwd":
            want = (named["O_ACC"].clone(), named["LSE"].clone())
            ref.fold_(*want, q, k, v, fresh=False, out_final=None, **kw)
            got = (named["O_ACC"], named["LSE"])
        else:
            want = tuple(torch.zeros(t.shape, device=t.device) for t in (q, k, v))
            ref.backward_chunk_(named["DO"], q, k, v, named["LSE"], named["DELTA"], *want, **kw)
            want = want[1:] if name == "dkdv" else want[:1]
            got = (named["DK"], named["DV"]) if name == "dkdv" else (named["DQ"],)
        _tune._Trial(launch, config, tr._pick_key(name, named))()
        for g, w in zip(got, want):
            assert (g - w).abs().max() <= TRIAL_TOL_F32, (name, config)


def test_autotune_installs_the_fastest_kept_config(tmp_path):
    timer = PreferLast()
    table = kernels.autotune([CASE], device=DEVICE, cache_dir=tmp_path, timer=timer)
    launches = _tune._launches(TuneCase(**CASE), torch.device(DEVICE))
    assert set(table) == {tr._pick_key(name, named) for name, _, _, _, named in launches}
    assert tr._CHOSEN == table
    timed = 0
    for name, _, _, _, named in launches:
        kept = tr._kept(name, named)
        key = tr._pick_key(name, named)
        assert table[key] == kept[-1] and tr._Heuristic(name, None).pick(named) == kept[-1]
        timed += len(kept) if len(kept) > 1 else 0  # a single kept config is not timed
    assert len(timer.calls) == timed > 0 and timer.launched  # every kept config timed once, trials launched
    assert any(len(tr._kept(name, named)) > 1 for name, *_, named in launches)


def test_the_cache_answers_a_second_call_and_misses_on_new_sources_or_gpu(tmp_path, monkeypatch):
    first = kernels.autotune([CASE], device=DEVICE, cache_dir=tmp_path, timer=PreferLast())
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and not list(tmp_path.glob("*.tmp"))
    data = json.loads(files[0].read_text())
    assert data["gpu"] == _tune._device_name(torch.device(DEVICE)) and len(data["choices"]) == len(first)
    tr._CHOSEN.clear()  # as in a new process
    assert kernels.tune_table([CASE], device=DEVICE, cache_dir=tmp_path, timer=_raising_timer) == first
    assert not tr._CHOSEN  # tune_table does not install
    assert kernels.table_from_json(json.loads(json.dumps(kernels.table_to_json(first)))) == first
    assert kernels.autotune([CASE], device=DEVICE, cache_dir=tmp_path, timer=_raising_timer) == first
    assert tr._CHOSEN == first
    for patch in ("_kernel_source_hash", "_device_name"):
        with monkeypatch.context() as m:
            m.setattr(_tune, patch, lambda *a: "something else")
            timer = PreferLast(sign=+1.0)  # prefers the first kept config: a fresh tuning shows
            again = kernels.autotune([CASE], device=DEVICE, cache_dir=tmp_path, timer=timer)
            assert timer.calls and again != first, patch
    assert len(list(tmp_path.iterdir())) == 3  # one file per (GPU, Triton, kernel sources)
    monkeypatch.setenv("DISTATTN_TUNE_CACHE", str(tmp_path))  # the environment names the same directory
    assert kernels.autotune([CASE], device=DEVICE, timer=_raising_timer) == first


def test_a_damaged_or_unwritable_cache_warns_and_tunes(tmp_path):
    path = _tune._cache_path(tmp_path, torch.device(DEVICE))
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring the unreadable cache file"):
        table = kernels.autotune([CASE], device=DEVICE, cache_dir=tmp_path, timer=PreferLast())
    assert json.loads(path.read_text())["choices"]  # rewritten
    afile = tmp_path / "afile"
    afile.write_text("x")
    tr._CHOSEN.clear()
    with pytest.warns(UserWarning, match="could not write the cache"):
        assert kernels.autotune([CASE], device=DEVICE, cache_dir=afile / "sub", timer=PreferLast()) == table
    assert tr._CHOSEN == table  # installed all the same


def test_bad_arguments_name_the_value_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"heads_q \(3\) must be a multiple of heads_kv \(2\)"):
        TuneCase(**dict(CASE, heads_q=3, heads_kv=2))
    with pytest.raises(ValueError, match=r"dtype='int8' must be one of"):
        TuneCase(**dict(CASE, dtype="int8"))
    with pytest.raises(ValueError, match=r"seq_q=0 must be a positive int"):
        TuneCase(**dict(CASE, seq_q=0))
    with pytest.raises(ValueError, match=r"causal=True and bounds=True"):
        TuneCase(**dict(CASE, bounds=True))
    with pytest.raises(TypeError, match=r"unknown keys \['seq'\]"):
        kernels.autotune([dict(CASE, seq=3)], device=DEVICE, cache_dir=tmp_path, timer=PreferLast())
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match=r"nothing to time: pass timer="):
            kernels.autotune([CASE], device="cpu", cache_dir=tmp_path)
    assert not tr._CHOSEN


def test_distattn_autotune_without_a_process_group_tunes_this_process(tmp_path):
    """No ``torch.distributed``: ``distattn.autotune`` is ``distattn.kernels.autotune`` (after checking its own
    arguments, which name the fix)."""
    with pytest.raises(ValueError, match=r"autotune\(group=\.\.\.\) needs torch.distributed to be initialized"):
        distattn.autotune([CASE], device=DEVICE, group=object(), cache_dir=tmp_path, timer=PreferLast())
    with pytest.raises(ValueError, match=r"timeout=0 must be a positive number of seconds"):
        distattn.autotune([CASE], device=DEVICE, cache_dir=tmp_path, timer=PreferLast(), timeout=0)
    with pytest.raises(TypeError, match=r"unknown keys \['seq'\]"):
        distattn.autotune([dict(CASE, seq=3)], device=DEVICE, cache_dir=tmp_path, timer=PreferLast())
    assert not tr._CHOSEN
    table = distattn.autotune([CASE], device=DEVICE, cache_dir=tmp_path, timer=PreferLast())
    assert tr._CHOSEN == table
    assert kernels.tune_table([CASE], device=DEVICE, cache_dir=tmp_path, timer=_raising_timer) == table  # cached


# ----------------------------------------------------------------------------- process groups (distattn.autotune)

def _ranks_agree(rank, world_size, cache_root):
    """Every rank's timer prefers another config; rank 0's table lands everywhere; failures reach every rank."""
    _use_h100_smem()
    timer = PreferLast(sign=-1.0 if rank == 0 else 1.0)
    cases = [CASE] if rank != 1 else [CASE, dict(CASE, seq_q=128, seq_k=128)]  # the union is tuned
    cache = Path(cache_root) / f"rank{rank}"
    table = distattn.autotune(cases, device=DEVICE, cache_dir=cache, timer=timer, timeout=60)
    out = {"table": {k.text(): v for k, v in table.items()}, "installed": tr._CHOSEN == table,
           "timed": len(timer.calls), "cache": cache.exists()}
    # what this rank's own timer would have chosen (a process of its own, no cache): not the table, for rank > 0
    tr._CHOSEN.clear()
    own = kernels.tune_table([CASE], device=DEVICE, cache_dir=Path(cache_root) / f"own{rank}", timer=timer)
    out["differs_from_own"] = any(table[k] != v for k, v in own.items())

    # rank 0 fails while tuning (a fresh cache: it must benchmark): every rank raises, within seconds
    t0 = time.monotonic()
    try:
        distattn.autotune([dict(CASE, seq_q=256, seq_k=256)], device=DEVICE, cache_dir=Path(cache_root) / "fail",
                          timer=_raising_timer, timeout=60)
    except (AssertionError, distattn.DistAttnError) as exc:
        out["rank0_failure"] = (type(exc).__name__, str(exc), time.monotonic() - t0)
    # one rank passes a bad case: every rank raises the same ValueError naming it
    try:
        distattn.autotune([dict(CASE, heads_q=3, heads_kv=2) if rank == world_size - 1 else CASE], device=DEVICE,
                          cache_dir=cache, timer=timer, timeout=60)
    except ValueError as exc:
        out["bad_case"] = str(exc)
    # the last rank is alive but never calls: the others give up after the timeout instead of waiting forever
    if rank != world_size - 1:
        t0 = time.monotonic()
        try:
            distattn.autotune([CASE], device=DEVICE, cache_dir=cache, timer=timer, timeout=ABSENT_TIMEOUT_S)
        except distattn.DistAttnError as exc:
            out["absent_peer"] = (str(exc), exc.timed_out, time.monotonic() - t0)
        (Path(cache_root) / f"gave-up{rank}").touch()
    else:  # stay in the group until the others gave up (a rank that left would fail its peers at once)
        deadline = time.monotonic() + 30
        while len(list(Path(cache_root).glob("gave-up*"))) < world_size - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_installs_rank0s_table(world_size, tmp_path):
    results = run_distributed(_ranks_agree, world_size, str(tmp_path), timeout=SPAWN_TIMEOUT_S)
    first = results[0]["table"]
    assert any("len_bucket=128" in k for k in first)  # rank 1's extra case
    for rank, r in enumerate(results):
        assert r["table"] == first and r["installed"], rank
        if rank:
            assert r["timed"] == 0 and not r["cache"] and r["differs_from_own"], rank  # never benchmarked
        else:
            assert r["timed"] > 0 and r["cache"]
        kind, message, seconds = r["rank0_failure"]
        assert seconds < 10, (rank, seconds)
        if rank == 0:
            assert kind == "AssertionError" and "expected the cache to answer" in message
        else:
            assert kind == "DistAttnError" and "rank 0 of the group failed while tuning (AssertionError" in message
        assert f"rank {world_size - 1}: TuneCase heads_q (3) must be a multiple of heads_kv (2)" in r["bad_case"]
        if rank != world_size - 1:
            message, timed_out, seconds = r["absent_peer"]
            assert timed_out and f"rank {rank}: exchanging the cases to tune: a rank of the group did not answer " \
                                 f"within {ABSENT_TIMEOUT_S:g} s" in message, (rank, message)
            assert "must call distattn.autotune" in message and seconds < 10, (rank, seconds)


# ----------------------------------------------------------------------------- GPU tier

# CUDA-only: kernels/_tune.py with triton.testing.do_bench on a CUDA device, its disk cache, the tuned launch.
@pytest.mark.gpu
def test_do_bench_tunes_on_cuda_and_the_launcher_uses_it(tmp_path):
    case = dict(batch=1, seq_q=1024, seq_k=1024, heads_q=8, heads_kv=2, head_dim=128, dtype="bf16", causal=True)
    table = kernels.autotune([case, dict(case, causal=False)], device="cuda", cache_dir=tmp_path)
    assert {k.kernel for k in table} == {"fwd", "dq", "dkdv"} and {k.mask for k in table} == {0, 1}
    assert all(v in tr._CONFIGS[k.kernel] for k, v in table.items())
    tr._CHOSEN.clear()
    assert kernels.autotune([case], device="cuda", cache_dir=tmp_path, timer=_raising_timer).items() <= table.items()
    q, k, v = (torch.randn(1, 1024, h, 128, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
    out, _ = kernels.forward(q, k, v, softmax_scale=128 ** -0.5, causal=True, backend="triton")
    want, _ = kernels.forward(q, k, v, softmax_scale=128 ** -0.5, causal=True, backend="torch")
    assert (out.float() - want.float()).abs().max() < 2e-2  # bf16 output rounding, O(1) values
