"""Placements solved ahead (``distattn.schedule.ahead``): a worker process solves the next batch's placement while the
step before runs. The layout taken is the inline solve's, bit for bit, and it was solved in the worker, not here; the
solve's error is raised where the placement is asked for; a worker that dies costs a warning and an inline solve."""

from __future__ import annotations

import dataclasses
import time
import warnings

import pytest

from distattn.schedule import MaskSpec, ahead
from distattn.schedule.cli import document_lengths
from distattn.schedule.cluster import Cluster, cluster_from_env
from distattn.schedule.placement import _place_cached, place, solve_ahead

pytestmark = pytest.mark.timeout(300)

N = 4096


@pytest.fixture(autouse=True)
def _fresh():
    ahead.shutdown()
    yield
    ahead.shutdown()


def _spec(docs: str, p: int, seed: int, window=(-1, -1)) -> MaskSpec:
    return MaskSpec(causal=True, window=window, cu_seqlens=tuple(document_lengths(docs, p * N, seed=seed)))


CASES = [("longtail:2048", 8, 3, (-1, -1)), ("pile:4", 16, 5, (-1, -1)), ("uniform:8192", 8, 7, (4095, -1)),
         ("longtail:2048", 16, 9, (4095, -1))]


def test_a_placement_solved_ahead_is_the_inline_one_and_was_solved_in_the_worker():
    """Causal and windowed, 8 and 16 ranks, on NVLink and InfiniBand: every key asked for ahead, then taken. This
    process's solver cache gains no entry (the worker solved them), and each layout equals the inline solve."""
    assert ahead.start(1, wait=120)  # a worker still importing the library would leave them to inline solves
    clusters = (Cluster.preset("nvlink"), Cluster.preset("ib"))
    keys = [(_spec(d, p, s, w), p, N, cluster) for d, p, s, w in CASES for cluster in clusters]
    for spec, p, n, cluster in keys:
        solve_ahead(spec, p, n, cluster)
    assert ahead.pending() == len(keys)
    misses, served = _place_cached.cache_info().misses, ahead.served()
    got = [place(spec, p, n, cluster) for spec, p, n, cluster in keys]
    assert _place_cached.cache_info().misses == misses, "solved here, not in the worker"
    assert ahead.served() == served + len(keys) and ahead.pending() == 0
    for (spec, p, n, cluster), lay in zip(keys, got):
        want = _place_cached.__wrapped__(spec, p, n, None, cluster, 1)
        assert lay == want and lay.kind == "placed", (spec.window, p, lay.note, want.note)
    # asked again (the shards, then the attention call's plan): the same object, no second solve
    assert place(*keys[0]) is got[0] and ahead.served() == served + len(keys)


def test_the_solve_error_is_raised_where_the_placement_is_asked_for():
    bad = MaskSpec(causal=True, cu_seqlens=(0, 1000))  # past the stream of 8 x 64 tokens
    assert ahead.start(1, wait=120)
    solve_ahead(bad, 8, 64)
    misses = _place_cached.cache_info().misses
    with pytest.raises(AssertionError, match="past the stream's 512 tokens"):
        place(bad, 8, 64)
    assert ahead.pending() == 0 and _place_cached.cache_info().misses == misses  # the worker's error, not a solve here


def test_a_dead_worker_costs_a_warning_and_an_inline_solve():
    spec = _spec("longtail:2048", 8, 11)
    assert ahead.start(1, wait=120)
    solve_ahead(spec, 8, N)
    worker = ahead._workers[0]
    worker.proc.kill()
    with pytest.warns(RuntimeWarning, match="not solved by its worker"):
        lay = place(spec, 8, N)
    assert lay == _place_cached.__wrapped__(spec, 8, N, None, cluster_from_env(), 1)
    # the next ask starts a new worker, which answers
    other = _spec("longtail:2048", 8, 12)
    solve_ahead(other, 8, N)
    assert ahead._workers and ahead._workers[0] is not worker
    assert ahead.start(1, wait=120)
    served = ahead.served()
    assert place(other, 8, N) == _place_cached.__wrapped__(other, 8, N, None, cluster_from_env(), 1)
    assert ahead.served() == served + 1


def test_a_worker_still_starting_leaves_the_solve_inline():
    """Importing the library takes a worker longer than most solves: asked for before the worker is ready, the
    placement is solved inline at once, not after the import, and no warning."""
    spec = _spec("uniform:8192", 8, 4)
    solve_ahead(spec, 8, N)  # starts the worker: it is importing the library
    assert not ahead.ready()
    misses, served = _place_cached.cache_info().misses, ahead.served()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lay = place(spec, 8, N)
    assert _place_cached.cache_info().misses == misses + 1 and ahead.served() == served  # solved here
    assert lay == _place_cached.__wrapped__(spec, 8, N, None, cluster_from_env(), 1)
    assert ahead.start(1, wait=120) and ahead.ready()  # and the worker comes up for the next batches


class _Here(Cluster):
    """A cluster class the worker cannot import (it lives in this test module)."""


def test_a_request_the_worker_cannot_read_is_solved_here():
    spec = _spec("longtail:2048", 8, 13)
    assert ahead.start(1, wait=120)
    mine = _Here(**{f.name: getattr(Cluster.preset("nvlink"), f.name) for f in dataclasses.fields(Cluster)})
    solve_ahead(spec, 8, N, mine)
    with pytest.warns(RuntimeWarning, match="could not read the request"):
        lay = place(spec, 8, N, mine)
    assert lay == _place_cached.__wrapped__(spec, 8, N, None, mine, 1)
    # the worker lives on and answers the next request
    other = _spec("longtail:2048", 8, 14)
    solve_ahead(other, 8, N, Cluster.preset("nvlink"))
    served = ahead.served()
    place(other, 8, N, Cluster.preset("nvlink"))
    assert ahead.served() == served + 1 and len(ahead._workers) == 1


def test_a_request_that_does_not_pickle_is_solved_here():
    spec = _spec("longtail:2048", 8, 15)
    odd = _Here(**{f.name: getattr(Cluster.preset("nvlink"), f.name) for f in dataclasses.fields(Cluster)})
    object.__setattr__(odd, "hook", lambda: None)  # a lambda does not pickle
    with pytest.warns(RuntimeWarning, match="cannot be solved ahead"):
        solve_ahead(spec, 8, N, odd)
    assert ahead.pending() == 0
    assert place(spec, 8, N, odd) == _place_cached.__wrapped__(spec, 8, N, None, odd, 1)


def test_a_print_in_the_worker_does_not_reach_the_answers(monkeypatch, capfd):
    """The worker's descriptor 1 goes to stderr before the library is imported (ahead.BOOT): what a library prints
    on import, from Python or from a child process writing to descriptor 1, cannot corrupt the answers' pipe."""
    noisy = ahead.BOOT.replace("from distattn", "print('noise from python'); os.system('echo noise from a child'); "
                                                "from distattn")
    assert noisy != ahead.BOOT
    monkeypatch.setattr(ahead, "BOOT", noisy)
    assert ahead.start(1, wait=120)
    spec = _spec("uniform:8192", 8, 2)
    solve_ahead(spec, 8, N)
    served = ahead.served()
    assert place(spec, 8, N) == _place_cached.__wrapped__(spec, 8, N, None, cluster_from_env(), 1)
    assert ahead.served() == served + 1 and ahead._workers[0].alive
    err = capfd.readouterr().err
    assert "noise from python" in err and "noise from a child" in err


def test_waiting_for_a_solve_ahead_is_shorter_than_solving_it():
    """The point of it: a solve asked for while the caller does something else (here: sleeps as a step would) is
    ready when asked for. The worker is warm (its first solve imports the library)."""
    assert ahead.start(2, wait=120) and ahead.ready()
    assert len(ahead._workers) == 2
    warm = _spec("uniform:8192", 8, 1)
    solve_ahead(warm, 8, N)
    place(warm, 8, N)
    spec = _spec("pile:4", 16, 21, (4095, -1))
    t0 = time.process_time()
    _place_cached.__wrapped__(spec, 16, N, None, cluster_from_env(), 1)
    inline = time.process_time() - t0
    solve_ahead(spec, 16, N)
    time.sleep(max(1.0, 10 * inline))  # the step
    t0 = time.perf_counter()
    place(spec, 16, N)
    assert time.perf_counter() - t0 < inline / 2 + 0.05, inline


def test_arguments_are_checked_here():
    with pytest.raises(ValueError, match="workers=0"):
        ahead.submit((_spec("uniform:8192", 8, 1), 8, N, cluster_from_env(), 1), workers=0)
    with pytest.raises(ValueError, match="workers=True"):
        ahead.start(True)
    with pytest.raises(ValueError, match="n=0"):
        solve_ahead(_spec("uniform:8192", 8, 1), 8, 0)


def test_a_worker_whose_caller_ended_exits_quietly():
    """A training process that ends (or dies) while its worker still solves: the worker's answer meets a closed pipe,
    and it exits 0 without a traceback on the job's stderr (it printed a BrokenPipeError one). The worker's serve
    loop is run on an answers pipe whose reading end is already closed."""
    import subprocess
    import sys

    script = ("import io, os, sys\n"
              "from distattn.schedule import _ahead_worker\n"
              "read, write = os.pipe()\n"
              "os.close(read)  # the caller is gone\n"
              "sys.stdin = io.TextIOWrapper(io.BytesIO(b''))  # and so are its requests\n"
              "_ahead_worker.serve(write)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, (proc.returncode, proc.stderr[-3000:])
