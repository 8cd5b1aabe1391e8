"""The per-pair timeline: a plan run with the executor's synchronisation, on a cluster's links.

The lockstep figure (``distattn.schedule.sim``: every step lasts as long as its largest pair) is not what the executor
does. The executor (``distattn.executor.Executor._run``) synchronises per pair: rank ``r`` waits only for the rounds it
takes part in. Per rank and phase it runs, with its compute stream and two side streams for the exchange (fetch rounds
on one, return rounds on the other: ``distattn.comm.PeerExchange``)::

    post F(0) .. F(depth - 1);  compute the head (the backward: the first rows of the local pair)
    for t in steps:  post F(t + depth)  (prefetch);  wait F(t);  compute(t);  wait R(t - keep), absorb;  post R(t)
    wait R(last - keep + 1) .. R(last), absorb

with ``depth`` the plan's prefetch depth (``Plan.prefetch``: 1, or up to 12 where the placement solver found a deeper
depth faster and its buffers admit it) and ``depth + 1`` fetch slots of receive buffers alternating, ``keep`` its
return depth (``Plan.return_depth``: 1, or up to 8 likewise) and ``keep + 1`` return slots,

with ``steps`` in the phase's order (``Plan.run_order``): the plan's steps in the forward, reversed in the backward
(its local pair last, hiding the previous step's dk/dv return; its first fetch is the forward's last step's, one of
the light ones). In that reversed view a rank computes the *head* of its local pair first, the rows holding
``Plan.head`` of its work (``Layout.head``: ``HEAD``, a quarter, or none where the placement solver finds that faster;
``Plan.head_task``), while the first fetches travel, and the rest at the last step. A step number in
:func:`rank_events` and the executor's trace is its place in the phase's order.

``F(t)`` is the round of step ``t``'s fetches (k/v to an owner task, q to a helper), ``R(t)`` of its returns (a helper's
partial output / dq, an owner's dk/dv partial; none for owner tasks in the forward). This module replays that order
(:func:`rank_events`, held equal to the executor's own trace on gloo by ``tests/test_timeline.py``) and times it
(:func:`timeline`) under these rules, all read off the plan's runs as arrays:

* rounds of one kind run in posting order on that kind's side stream (``F0, F1, F2, ..`` on one, ``R0, R1, ..`` on
  the other, so a return never queues behind the next fetch); a round waits for the compute stream's point at its
  posting (``F(t + depth)``: compute ``t - 1`` done, the last to read the slot it reuses; ``R(t)``: compute ``t``
  done), and starts when every peer it
  exchanges with has reached the same round (a message needs both ends); an empty round costs nothing and waits for
  nothing;
* a round on rank ``r`` lasts ``max(bytes sent, bytes received) / bandwidth + latency * messages`` per link, the
  links of a node (``src // gpus_per_node == dst // gpus_per_node``, ranks ``U`` apart for a Ulysses x ring plan) and
  across nodes working side by side (a fetch and a return in flight at once each take the link's full rate: the
  model leaves out contention between them, as it leaves out contention beyond a rank's own link);
* the host posts in the order above and a wait blocks it until its round is done (NCCL: it polls, bounded), so a
  round is also never posted before the host is past the waits before it (``F(t + depth)``: those of step ``t - 1``;
  ``R(t)``: ``F(t)`` and ``R(t - keep)``);
* the head computes from time 0, ``Plan.head`` of the local pair's work (taken off the last step's);
* compute ``t`` starts when compute ``t - 1`` is done, ``F(t)`` has arrived and ``R(t - 1 - keep)`` was waited for
  (the host waits in that order), and lasts the task's work (in full ``m x m`` pairs) x ``4 b m^2 h d`` FLOPs (x2.5
  backward) / the cluster's FLOP/s.

Per rank it reports the makespan, the compute time, the idle time and its part spent waiting inside the rank's own
transfers (*exposed communication*; the rest of the idle is waiting for late peers, i.e. imbalance). ``prefetch``
(default ``None``: the plan's, as the executor runs it) is a what-if otherwise: ``F(t + prefetch)`` posted at step
``t``, the first ``prefetch`` rounds before step 0 (``bench/placement_diagnose.py`` weighs depths on the worst
seeds). ``slots`` (default ``"executor"``: ``prefetch + 1``) is another: a fetch round waits for the compute that last
read the receive buffers it reuses, ``slots - prefetch`` steps before its posting step (one more slot than the depth
needs: it waits for an earlier compute; ``None``: fresh buffers every round, no wait, memory growing with how far the
host runs ahead; the worst seeds weigh both in ``bench/results/placement-sim/WHATIF.md``). ``return_stream=False``
is the what-if of the executor before it had the second side stream (every round on one, in posting order ``F0, F1,
R0, F2, R1, ..``: the backward's dk/dv return waited behind the next fetch), kept to show what the stream buys
(``bench/results/placement-sim/COMPARE-200.md``). Left out, as in the cost model: kernel launch overheads, the absorb's
adds, contention beyond a rank's own link. Pure Python + numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from distattn.schedule.cluster import BWD_FLOP_FACTOR, Cluster
from distattn.schedule.plan import PHASES, Plan, _check_phase
from distattn.schedule.wire import Shapes, payload_bytes, transfer_spans

__all__ = ["PhaseTimeline", "phase_timeline", "timeline", "step_timeline", "rank_events", "owner_bounds"]


@dataclass(frozen=True)
class PhaseTimeline:
    """One phase of a plan on the per-pair timeline (seconds; arrays are per ring rank, float64)."""

    phase: str
    finish: np.ndarray
    """when the rank's last compute and last wait are done"""
    busy: np.ndarray
    """the rank's compute time"""
    exposed: np.ndarray
    """compute-stream idle spent inside the rank's own transfers"""

    @property
    def makespan(self) -> float:
        return float(self.finish.max(initial=0.0))

    @property
    def perfect(self) -> float:
        """Total compute / ranks: the makespan of perfect balance with no communication."""
        return float(self.busy.mean()) if len(self.busy) else 0.0

    @property
    def compute_idle(self) -> float:
        """1 - total compute / (ranks x makespan)."""
        return 1.0 - self.perfect / self.makespan if self.makespan else 0.0


class _Rounds:
    """The messages of one kind of round (fetch or return), grouped by step, with each rank's duration per round."""

    def __init__(self, plan: Plan, phase: str, which: str, sizes: dict, cluster: Cluster, stride: int):
        step, src, dst, size = transfer_spans(plan, phase, which, sizes).messages()  # one per task
        p, n_steps = plan.world_size, plan.num_steps()
        order = np.argsort(step, kind="stable")
        self.step, self.src, self.dst, size = step[order], src[order], dst[order], size[order]
        self.bounds = np.searchsorted(self.step, np.arange(n_steps + 1))
        g = cluster.gpus_per_node
        inter = (self.src * stride) // g != (self.dst * stride) // g
        cells = n_steps * p
        at_src, at_dst = self.step * p + self.src, self.step * p + self.dst  # (step, rank) cells, flat
        self.dur = np.zeros((n_steps, p))
        for link, on in ((cluster.intra, ~inter), (cluster.inter, inter)):
            if not on.any():
                continue
            sz = size[on].astype(np.float64)  # bincount sums in the messages' order, as np.add.at did
            sent, recv = (np.bincount(at[on], weights=sz, minlength=cells).reshape(n_steps, p)
                          for at in (at_src, at_dst))
            msgs = np.bincount(at_src[on], minlength=cells) + np.bincount(at_dst[on], minlength=cells)
            msgs = msgs.reshape(n_steps, p)
            self.dur = np.maximum(self.dur, np.maximum(sent, recv) / link.bandwidth + msgs * link.latency)
        sends, recvs = (np.bincount(at, minlength=cells).reshape(n_steps, p) for at in (at_src, at_dst))
        self.has = (sends + recvs) > 0
        # a round where no rank sends twice (or receives twice) meets its peers by plain indexing, not np.maximum.at
        self.single = (sends.max(axis=1, initial=0) <= 1) & (recvs.max(axis=1, initial=0) <= 1)
        self.none = np.full(p, -np.inf)
        self.none.flags.writeable = False  # the end of a round without messages, shared (read-only)

    def run(self, t: int, ready: np.ndarray, side: np.ndarray) -> np.ndarray:
        """End time per rank of round ``t`` (``-inf`` where the rank has no message); ``ready``: the compute
        point each rank's round waits for; updates ``side`` (the side streams' free times) in place."""
        if t < 0 or t >= len(self.dur) or self.bounds[t] == self.bounds[t + 1]:
            return self.none
        lo, hi = self.bounds[t], self.bounds[t + 1]
        has = self.has[t]
        own = np.maximum(ready, side)  # the rank reaches the round
        src, dst = self.src[lo:hi], self.dst[lo:hi]
        meet = np.maximum(own[src], own[dst])  # a message starts when both ends are there
        start = own.copy()
        if self.single[t]:  # each rank sends at most once and receives at most once: no index repeats
            start[src] = np.maximum(start[src], meet)
            start[dst] = np.maximum(start[dst], meet)
        else:
            np.maximum.at(start, src, meet)
            np.maximum.at(start, dst, meet)
        end = np.full(len(side), -np.inf)
        end[has] = start[has] + self.dur[t][has]
        side[has] = end[has]
        return end


def phase_timeline(plan: Plan, phase: str, shapes: Shapes, cluster: Cluster = Cluster(), partials: str = "fp32",
                   stride: int = 1, prefetch: int | None = None, return_stream: bool = True,
                   slots: int | str | None = "executor", stop_at: float = float("inf")) -> PhaseTimeline:
    """One phase of ``plan`` on the per-pair timeline (module docstring; ``prefetch`` and ``slots`` other than the
    plan's and ``return_stream=False`` are what-ifs). ``stop_at``: stop as soon as a compute ends at or after it (the
    makespan reaches it; a search drops such a candidate): the makespan is then reported as ``inf``."""
    _check_phase(phase)
    plan = plan.run_order(phase)  # the order the phase runs its steps in (the backward: reversed)
    prefetch = plan.prefetch if prefetch is None else prefetch
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
        raise ValueError(f"prefetch={prefetch!r}: the executor posts at least the next step's fetch (an int >= 1)")
    keep = plan.return_depth
    slots = prefetch + 1 if slots == "executor" else slots
    if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < prefetch + 1):
        raise ValueError(f"slots={slots!r}: receive slots of the fetch rounds are an int >= prefetch + 1 = "
                         f"{prefetch + 1} (the executor's), 'executor' or None (fresh buffers, no wait)")
    p, n_steps = plan.world_size, plan.num_steps()
    kinds = ("kv", "q", "out") if phase == "forward" else ("kv", "q", "dkv", "dq")
    sizes = {kind: payload_bytes(kind, phase, shapes, partials) for kind in kinds}
    fetch, back = (_Rounds(plan, phase, which, sizes, cluster, stride) for which in ("fetch", "return"))
    b, m, d = shapes.batch, shapes.seq_per_rank, shapes.head_dim
    pair_s = 4 * b * m * m * shapes.heads_q * d * (BWD_FLOP_FACTOR if phase == "backward" else 1.0) / cluster.flops
    rt = plan.run_table
    cost = np.zeros((n_steps, p + 1))  # per step and rank, seconds (a run adds at its start, takes away after it)
    np.add.at(cost, (rt.step, rt.start), rt.cost * pair_s)
    np.add.at(cost, (rt.step, rt.stop), -rt.cost * pair_s)
    cost = np.cumsum(cost, axis=1)[:, :p]
    head = _head(plan, cost)
    cost[-1:] -= head  # the head is computed first; the local pair's rest at its own step, the last
    side, zero = np.zeros(p), np.zeros(p)  # the fetch stream's free time per rank
    back_side = np.zeros(p) if return_stream else side  # the return stream's (the what-if: the same stream)
    done = [zero, head]  # compute end of steps t - 2, t - 1 (before step 0: the head)
    computed = []  # computed[t]: compute end of step t (an idle step keeps the one before)
    host = zero.copy()  # when the host gets past its latest wait (a wait blocks it until the round is done)
    ends = {}  # ("F" | "R", t): end per rank (-inf: no round)
    exposed = np.zeros(p)
    never, active = fetch.none, cost > 0  # no round: -inf; the steps a rank computes
    stops = stop_at < np.inf  # else no per-step check (the search's bound only)
    for t in range(prefetch):
        ends[("F", t)] = fetch.run(t, zero, side)
    for t in range(n_steps):
        if t + prefetch < n_steps:  # posted at compute t - 1's point, once the host is past step t - 1's waits
            last = None if slots is None else t + prefetch - slots  # the compute that last read the slot it reuses
            gate = computed[last] if last is not None and last >= 0 else zero  # buffer reuse
            ends[("F", t + prefetch)] = fetch.run(t + prefetch, np.maximum(gate, host), side)
        f_end, r_old = ends.pop(("F", t)), ends.get(("R", t - 1 - keep), never)
        host = np.maximum(host, f_end)  # wait F(t)
        start = np.maximum(np.maximum(done[1], f_end), np.maximum(r_old, host))
        waited = start - done[1]  # the compute stream's gap before step t (>= 0: start is at least done[1])
        exposed += np.where(active[t], np.minimum(waited, _own(fetch, t) + _own(back, t - 1 - keep)), 0.0)
        end = np.where(active[t], start + cost[t], done[1])
        if stops and end.max(initial=-np.inf) >= stop_at:
            return PhaseTimeline(phase, np.full(p, np.inf), cost.sum(axis=0) + head, exposed)
        done = [done[1], end]
        computed.append(end)
        host = np.maximum(host, ends.get(("R", t - keep), zero))  # wait R(t - keep)
        ends[("R", t)] = back.run(t, np.maximum(end, host), back_side)
    # a rank is done when its last compute and its last wait are: the host waited for every round it takes part in
    # (a round it only sends in, a partial it absorbs after its last compute) and waits for the last returns here
    finish = np.maximum.reduce([done[1], host] + [ends.get(("R", n_steps - 1 - i), zero) for i in range(keep + 1)])
    return PhaseTimeline(phase, finish, cost.sum(axis=0) + head, exposed)


def owner_bounds(table, n: int, shapes: Shapes, cluster: Cluster, stride: int = 1) -> tuple[float, float]:
    """Lower bounds ``(forward, backward)`` of the makespans of every plan of owner tasks over the pairs of ``table``
    (``distattn.schedule.pairs.PairTable``, ``n`` tokens per rank; a placed plan in any order, depth, backward or
    head) on this timeline. A rank computes its tasks one after another; the rounds of one kind it takes part in run
    one after another on that kind's side stream, each lasting at least the larger of the bytes it sends and receives
    in it over the link's bandwidth, plus the link's latency per message at this rank; and the rank is done only when
    its host has waited for every one of them. So a rank's makespan is at least its compute, at least the sum of its
    fetch rounds (a pair's key rows, from the kv rank to the query rank) and, in the backward, of its return rounds
    (the dk/dv partials back), per link; the bounds are the busiest rank's. Order-free: a search can drop a deal whose
    bounds already lose before it builds any of the deal's plans."""
    p, q, kv, seen = table.world_size, table.q, table.kv, table.seen
    m = shapes.seq_per_rank
    per_work = 4 * shapes.batch * m * m * shapes.heads_q * shapes.head_dim / cluster.flops / n ** 2
    busy = np.bincount(q, weights=table.work * per_work, minlength=p)  # the forward's compute per rank
    off = q != kv
    q, kv, seen = q[off], kv[off], seen[off]
    inter = (q * stride) // cluster.gpus_per_node != (kv * stride) // cluster.gpus_per_node

    def rounds(kind: str, phase: str) -> np.ndarray:
        row = payload_bytes(kind, phase, shapes) // n  # bytes per row borrowed: k/v in, or the fp32 dk/dv back
        out = np.zeros(p)
        for link, on in ((cluster.intra, ~inter), (cluster.inter, inter)):
            if on.any():
                size = (row * seen[on]).astype(np.float64)
                ends = [np.bincount(x[on], weights=size, minlength=p) for x in (q, kv)]
                msgs = np.bincount(q[on], minlength=p) + np.bincount(kv[on], minlength=p)
                out = np.maximum(out, np.maximum(*ends) / link.bandwidth + msgs * link.latency)
        return out

    fetch = rounds("kv", "forward")  # the backward fetches the same rows, as many bytes
    return (float(np.maximum(busy, fetch).max(initial=0.0)),
            float(np.maximum.reduce([BWD_FLOP_FACTOR * busy, fetch, rounds("dkv", "backward")]).max(initial=0.0)))


def _head(plan: Plan, cost: np.ndarray) -> np.ndarray:
    """Per rank, the seconds of the local pair computed before step 0 (``Plan.head_task``): ``plan.head`` of the last
    step's cost where that step's task is the rank's local pair, else 0."""
    p, head = plan.world_size, np.zeros(plan.world_size)
    if not plan.head or len(cost) < 2:  # one step: no fetch to hide, no head
        return head
    rt, last = plan.run_table, len(cost) - 1
    lo, hi = rt.offsets[last], rt.offsets[last + 1]
    runs = lo + np.flatnonzero((rt.dq[lo:hi] == 0) & (rt.dkv[lo:hi] == 0))  # the local pairs' runs
    local = np.zeros(p + 1)
    np.add.at(local, rt.start[runs], 1)
    np.add.at(local, rt.stop[runs], -1)
    return np.where(np.cumsum(local)[:p] > 0, cost[last] * plan.head, 0.0)


def _own(rounds: _Rounds, t: int) -> np.ndarray:
    """Each rank's own transfer time in round ``t`` (0 outside the plan)."""
    return rounds.dur[t] if 0 <= t < len(rounds.dur) else 0.0


def timeline(plan: Plan, shapes: Shapes, cluster: Cluster = Cluster(), partials: str = "fp32",
             stride: int = 1, prefetch: int | None = None, return_stream: bool = True,
             slots: int | str | None = "executor") -> tuple[PhaseTimeline, PhaseTimeline]:
    """The forward and backward of ``plan`` (ring ranks, shards shaped ``shapes``) on the per-pair timeline.
    ``stride``: global ranks between neighbouring ring ranks (the Ulysses degree), for which link a message takes;
    ``prefetch``, ``return_stream``, ``slots``: what-ifs (module docstring)."""
    return tuple(phase_timeline(plan, phase, shapes, cluster, partials, stride, prefetch, return_stream, slots)
                 for phase in PHASES)


def step_timeline(plan: Plan, shapes: Shapes, cluster: Cluster = Cluster(), partials: str = "fp32",
                  stride: int = 1, prefetch: int | None = None, return_stream: bool = True,
                  slots: int | str | None = "executor") -> dict:
    """One training step's attention (forward + backward) on the per-pair timeline: ``makespan`` (s), ``perfect``
    (total compute / ranks, s), ``ratio`` (makespan / perfect), ``compute_idle`` and ``exposed`` (the busiest-exposed
    rank's waits inside its own transfers, s)."""
    fwd, bwd = timeline(plan, shapes, cluster, partials, stride, prefetch, return_stream, slots)
    makespan, perfect = fwd.makespan + bwd.makespan, fwd.perfect + bwd.perfect
    return {"makespan": makespan, "perfect": perfect, "ratio": makespan / perfect if perfect else 1.0,
            "compute_idle": 1.0 - perfect / makespan if makespan else 0.0,
            "busiest": float((fwd.busy + bwd.busy).max(initial=0.0)),
            "exposed": float((fwd.exposed + bwd.exposed).max(initial=0.0))}


def rank_events(plan: Plan, rank: int, phase: str) -> list[tuple]:
    """The executor's event order on ``rank`` for ``phase``, as the timeline runs it: ``("post", "fetch"|"return",
    step, sends, recvs)`` with ``sends``/``recvs`` the sorted peers of the round, ``("wait", kind, step)``,
    ``("compute", step, q_chunk, kv_chunk)`` (no entry for an idle step) and, after the first posts,
    ``("head", last step, rank, rank)``: the local pair's first rows (``Plan.head_task``; its rest is the last step's
    compute)."""
    _check_phase(phase)
    plan = plan.run_order(phase)
    n_steps, out = plan.num_steps(), []

    def post(which, t):
        sends, recvs = plan.rank_ops(t, rank, phase, which)
        out.append(("post", which, t, tuple(sorted(tr.dst for tr in sends)), tuple(sorted(tr.src for tr in recvs))))

    depth, keep = plan.prefetch, plan.return_depth
    for t in range(min(depth, n_steps)):
        post("fetch", t)
    head = plan.head_task(rank)
    if head is not None:
        out.append(("head", n_steps - 1, head.q_chunk, head.kv_chunk))
    for t in range(n_steps):
        if t + depth < n_steps:
            post("fetch", t + depth)
        out.append(("wait", "fetch", t))
        task = plan.task(t, rank)
        if task is not None:
            out.append(("compute", t, task.q_chunk, task.kv_chunk))
        if t >= keep:
            out.append(("wait", "return", t - keep))
        post("return", t)
    out += [("wait", "return", t) for t in range(max(0, n_steps - keep), n_steps)]
    return out
