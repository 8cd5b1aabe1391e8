"""``distattn.autotune``: the Triton launch configs tuned once for a process group, rank 0's choice on every rank.

``distattn.kernels.autotune`` tunes in one process. On the ranks of a process group that is not enough: every
rank would benchmark (and write the cache), and ranks whose timings came out differently would launch different
configs for the same call. ``autotune`` here, called on every rank of ``group``:

1. every rank validates its arguments (``distattn.kernels.check_tune_args``) and sends its cases, or its error, to
   every other rank (an all-gather of JSON text); an error on any rank raises on every rank, naming the rank;
2. rank 0 tunes the union of the ranks' cases (``distattn.kernels.tune_table``: its disk cache, then its timer);
   no other rank times anything or touches a cache, so ranks cannot disagree because of different files;
3. rank 0's table, or its error, goes to every rank (an all-gather of which every rank reads rank 0's entry);
   every rank installs it (``distattn.kernels.install_table``) or raises.

Every wait is bounded by ``timeout`` (``distattn.comm.bounded_wait``): a rank that fails sends its error instead
of its part, so its peers raise at once with its message, and a rank that never calls makes the others raise
``DistAttnError`` after ``timeout``. The exchanges run on ``group`` itself, once, before training: JSON over
``all_gather`` rather than ``broadcast_object_list``, which has no asynchronous form (its wait could not be
bounded) and unpickles what it receives. ``launch/train.py`` calls this when ``DISTATTN_AUTOTUNE=1``.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

import distattn.kernels as kernels
from distattn.comm import DistAttnError, all_gather_text

__all__ = ["autotune", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 600.0  # rank 0 compiles and times every kept config of every key while the others wait


def autotune(cases, *, group=None, device=None, cache_dir=None, timer=None,
             timeout: float = DEFAULT_TIMEOUT_S) -> dict:
    """Tune the Triton kernels' configs for ``cases`` once and install rank 0's choice on every rank of ``group``.

    Call it on every rank of ``group``, after the process group exists and before the first step. Nothing is
    benchmarked later, at launch time. Without ``torch.distributed`` (or with a group of one rank) it is
    ``distattn.kernels.autotune``.

    Args:
        cases: ``distattn.kernels.TuneCase``s (or dicts of its fields): the shapes this rank's kernel calls see;
            the union over the ranks is tuned.
        group: the process group whose ranks must launch the same configs (default: the world if
            ``torch.distributed`` is initialized, else this process alone). Only its rank 0 benchmarks and touches
            the cache.
        device: the CUDA device to tune on (default: the current one). A CPU device works only under
            ``TRITON_INTERPRET=1``, as a test vehicle.
        cache_dir: directory of rank 0's JSON cache (default ``$DISTATTN_TUNE_CACHE``, else
            ``~/.cache/distattn/tune``).
        timer: ``timer(fn) -> milliseconds`` for one launch ``fn()`` (default ``triton.testing.do_bench``); only
            rank 0 calls it.
        timeout: seconds any rank waits for the others (rank 0's benchmarking included).

    Returns:
        Rank 0's table ``{_PickKey: (BLOCK_M, BLOCK_N, num_warps, num_stages)}`` (installed on this rank).

    Raises:
        ValueError, TypeError: a bad case, device, group or timeout, on every rank of the group alike.
        DistAttnError: rank 0 failed while tuning (rank 0 itself raises its own error), or a rank did not answer
            within ``timeout``.
    """
    shared = _shared(group)
    try:
        _check_timeout(timeout)
        todo, dev = kernels.check_tune_args(cases, device=device, timer=timer)
        mine = {"cases": [c.as_json() for c in todo]}
    except (ValueError, TypeError) as exc:
        if not shared:
            raise
        mine = {"error": str(exc), "type": type(exc).__name__}
        timeout = timeout if _valid_timeout(timeout) else DEFAULT_TIMEOUT_S  # still share the error, bounded
    if not shared:
        return kernels.autotune(todo, device=dev, cache_dir=cache_dir, timer=timer)
    table = _rank0s_table(group, mine, lambda union: kernels.tune_table(union, device=dev, cache_dir=cache_dir,
                                                                           timer=timer), timeout)
    kernels.install_table(table)
    return table


def _valid_timeout(timeout) -> bool:
    return isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and 0 < timeout < float("inf")


def _check_timeout(timeout) -> None:
    if not _valid_timeout(timeout):
        raise ValueError(f"distattn.autotune timeout={timeout!r} must be a positive number of seconds (default "
                         f"{DEFAULT_TIMEOUT_S:g})")


def _shared(group) -> bool:
    """True when the ranks of ``group`` must agree (more than one rank); False when this process is alone."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("distattn.autotune(group=...) needs torch.distributed to be initialized; call "
                             "init_process_group first, or pass group=None to tune this process alone")
        return False
    if dist.get_rank(group) < 0:
        raise ValueError(f"distattn.autotune(group={group!r}): this process (global rank {dist.get_rank()}) is not "
                         f"a member of the group; call it on the group's ranks only")
    return dist.get_world_size(group) > 1


def _rank0s_table(group, mine: dict, tune, timeout: float) -> dict:
    """Rank 0 of ``group`` runs ``tune(union of every rank's cases)``; every rank returns rank 0's table or raises.

    ``mine``: ``{"cases": [TuneCase.as_json()]}``, or ``{"error", "type"}`` when this rank's arguments are bad."""
    rank = dist.get_rank(group)
    everyone = _all_gather_json(group, mine, timeout, "exchanging the cases to tune")
    failed = [(r, e) for r, e in enumerate(everyone) if "error" in e]
    if failed:
        cls = ValueError if all(e["type"] == "ValueError" for _, e in failed) else TypeError
        raise cls("distattn.autotune: bad arguments on " + "; ".join(f"rank {r}: {e['error']}" for r, e in failed))
    union = list({json.dumps(c, sort_keys=True): c for e in everyone for c in e["cases"]}.values())
    result, error = {}, None
    if rank == 0:
        try:
            result = {"table": kernels.table_to_json(tune([kernels.TuneCase(**c) for c in union]))}
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, or they wait for the table
            error = exc
            result = {"error": f"{type(exc).__name__}: {exc}"}
    first = _all_gather_json(group, result, timeout, "waiting for rank 0's tuned configs")[0]
    if error is not None:
        raise error
    if "error" in first:
        raise DistAttnError(f"distattn.autotune: rank 0 of the group failed while tuning ({first['error']}); every "
                            f"rank raises, none installs a table")
    return kernels.table_from_json(first["table"])


def _all_gather_json(group, obj: dict, timeout: float, what: str) -> list[dict]:
    """Every rank's ``obj`` through ``distattn.comm.all_gather_text``, with autotune's own message on a failure."""
    device = (torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend(group))
              else torch.device("cpu"))
    where = f"distattn.autotune, rank {dist.get_rank(group)}: {what}"
    try:
        texts = all_gather_text(group, json.dumps(obj), device, timeout, where)
    except DistAttnError as exc:
        cause = (f"a rank of the group did not answer within {timeout:g} s" if exc.timed_out else
                 f"a rank of the group failed or left ({str(exc).removeprefix(where + ': ')})")
        raise DistAttnError(f"{where}: {cause}; every rank of the group must call distattn.autotune, with the same "
                            f"group (raise timeout= if rank 0's benchmarking needs longer)",
                            timed_out=exc.timed_out) from None
    return [json.loads(t) for t in texts]
