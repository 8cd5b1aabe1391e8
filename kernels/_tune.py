"""Tune the Triton kernels' launch configs once, outside the distributed step, and give every rank rank 0's choice.

By default each launch takes a deterministic config (``_triton._Heuristic``). ``autotune(cases)`` replaces it, for
the pick keys that ``cases`` launch (``_triton._PickKey``: kernel, BLOCK_D, dtype, MASK, length bucket, TMA,
shared memory), by the fastest of the configs the filter keeps (``_triton._kept``), measured on real tensors of
each case's shape:

1. every rank sends its cases (or its validation error) to every other rank (all-gather);
2. rank 0 of the group reads its disk cache, benchmarks only the keys the cache lacks, writes the cache back;
3. rank 0's table (or its error) goes to every rank (all-gather, rank 0's entry read); every rank installs it in
   ``_triton._CHOSEN``, so every rank launches the same config no matter how its own timings would have come out.

Every wait is bounded (``timeout``), and a rank that fails sends its error instead of its part, so its peers
raise at once with that rank's message rather than wait. Only rank 0 reads or writes the cache, so ranks cannot
disagree because of different files. ``launch/train.py`` calls this when ``DISTATTN_AUTOTUNE=1``.

Cache: one JSON file per (GPU name, Triton version, hash of the kernel sources) under ``cache_dir``, else
``$DISTATTN_TUNE_CACHE``, else ``~/.cache/distattn/tune/``; a change to a kernel or to the config tables changes
the hash, so a stale choice is never used. Written atomically (a temporary file renamed over the old one).

Legend: ``b`` batch, ``s_q``/``s_k`` query/key length, ``h_q``/``h_kv`` heads, ``d`` head dim.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import math
import os
import re
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import _masks
from . import _triton as tr

__all__ = ["TuneCase", "autotune", "autotune_enabled", "AUTOTUNE_ENV", "CACHE_ENV"]

AUTOTUNE_ENV = "DISTATTN_AUTOTUNE"
CACHE_ENV = "DISTATTN_TUNE_CACHE"
DEFAULT_TIMEOUT_S = 600.0  # rank 0 compiles and times every kept config of every key while the others wait
_DTYPES = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float32": torch.float32, "fp32": torch.float32}


def autotune_enabled() -> bool:
    """``DISTATTN_AUTOTUNE=1``: ``launch/train.py`` tunes the configs before its first step (``autotune``);
    ``0`` or unset: the heuristic's configs. Raises ``ValueError`` for any other value."""
    raw = os.environ.get(AUTOTUNE_ENV, "0")
    if raw not in ("0", "1", ""):
        raise ValueError(f"{AUTOTUNE_ENV}={raw!r} must be 0 or 1 (1: tune the Triton configs once before "
                         f"training; 0: the deterministic heuristic)")
    return raw == "1"


@dataclass(frozen=True, kw_only=True)
class TuneCase:
    """One attention call shape to tune for: the shapes one kernel call of a rank sees (a sequence-parallel run:
    this rank's chunk, ``seq_q = seq_k = tokens per rank``). A dict with these keys is accepted too."""

    batch: int
    seq_q: int
    seq_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: torch.dtype | str
    """torch.float16 / bfloat16 / float32, or their names ("bf16", "bfloat16", ...)."""
    causal: bool = False
    """Causal mask (MASK 1). A causal sequence-parallel run also launches the dense off-diagonal pairs (MASK 0):
    tune both, with ``causal=True`` and ``causal=False``."""
    bounds: bool = False
    """Per-row key bounds (MASK 2: packed documents, sliding windows, zigzag layouts); excludes ``causal``."""

    def __post_init__(self):
        for name in ("batch", "seq_q", "seq_k", "heads_q", "heads_kv", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"TuneCase {name}={value!r} must be a positive int")
        if self.heads_q % self.heads_kv:
            raise ValueError(f"TuneCase heads_q ({self.heads_q}) must be a multiple of heads_kv ({self.heads_kv})")
        if self.head_dim > 256:
            raise ValueError(f"TuneCase head_dim={self.head_dim} > 256 is not supported by the triton backend")
        dtype = self.dtype
        if isinstance(dtype, str):
            if dtype.removeprefix("torch.") not in _DTYPES:
                raise ValueError(f"TuneCase dtype={dtype!r} must be one of {sorted(_DTYPES)} or a torch dtype")
            dtype = _DTYPES[dtype.removeprefix("torch.")]
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"TuneCase dtype={dtype!r} must be torch.float16, torch.bfloat16 or torch.float32")
        object.__setattr__(self, "dtype", dtype)
        if self.causal and self.bounds:
            raise ValueError("TuneCase causal=True and bounds=True: the bounds already describe the mask; pass "
                             "one of them")

    def as_json(self) -> dict:
        return dict(asdict(self), dtype=str(self.dtype).removeprefix("torch."))


def autotune(cases, *, device=None, group=None, cache_dir=None, timer=None,
             timeout: float = DEFAULT_TIMEOUT_S) -> dict:
    """Tune the Triton kernels' configs for ``cases`` once and install rank 0's choice on every rank.

    Call it after the process group exists and before the first step, on every rank of ``group``. Nothing is
    benchmarked later, at launch time.

    Args:
        cases: ``TuneCase``s (or dicts of its fields); the union over the ranks is tuned.
        device: the CUDA device to tune on (default: the current one). A CPU device works only under
            ``TRITON_INTERPRET=1``, as a test vehicle (the interpreter's launches ignore the table).
        group: the process group whose ranks must agree (default: the world if ``torch.distributed`` is
            initialized, else this process alone). Only its rank 0 benchmarks and touches the cache.
        cache_dir: directory of the JSON cache (default ``$DISTATTN_TUNE_CACHE``, else ``~/.cache/distattn/tune``).
        timer: ``timer(fn) -> milliseconds`` for one launch ``fn()`` (default ``triton.testing.do_bench``);
            ``fn.kernel``, ``fn.config`` and ``fn.key`` say what it launches.
        timeout: seconds any rank waits for the others (rank 0's benchmarking included).

    Returns:
        ``{_PickKey: (BLOCK_M, BLOCK_N, num_warps, num_stages)}`` for the cases' launches (installed).

    Raises:
        ValueError: a bad case, device or group, on every rank of the group alike.
        RuntimeError: rank 0 failed while tuning, or a rank did not answer within ``timeout``.
    """
    pg = _process_group(group)
    try:
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"autotune timeout={timeout!r} must be a positive number of seconds (default "
                             f"{DEFAULT_TIMEOUT_S:g})")
        dev = _device(device, timer)
        todo = [_as_case(c) for c in cases]
        mine = {"cases": [c.as_json() for c in todo]}
    except (ValueError, TypeError) as exc:
        if pg is None:
            raise
        mine = {"error": str(exc), "type": type(exc).__name__}
    if pg is None:
        table = _tune_table(todo, dev, cache_dir, timer)
    else:
        table = _shared_table(pg, mine, lambda union: _tune_table(union, dev, cache_dir, timer), timeout)
    tr._CHOSEN.update(table)
    return table


# ----------------------------------------------------------------------------- arguments

def _as_case(case) -> TuneCase:
    if isinstance(case, TuneCase):
        return case
    if isinstance(case, dict):
        unknown = set(case) - set(TuneCase.__dataclass_fields__)
        if unknown:
            raise TypeError(f"autotune case {case!r} has unknown keys {sorted(unknown)}; the keys are "
                            f"{list(TuneCase.__dataclass_fields__)}")
        return TuneCase(**case)
    raise TypeError(f"autotune case {case!r} must be a TuneCase or a dict of its fields")


def _device(device, timer) -> torch.device:
    dev = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    ok, why = tr.is_available(dev)
    if not ok:
        raise ValueError(f"autotune needs the triton backend on device {dev}: {why}")
    if dev.type != "cuda" and timer is None:
        raise ValueError(f"autotune on device {dev} (the Triton interpreter) has nothing to time: pass timer=, or "
                         f"tune on a CUDA device")
    return dev


# ----------------------------------------------------------------------------- the launches of one case

class _Recorder:
    """Stands in for ``_triton._kernel(name)``: records the launch the launcher makes instead of running it."""

    def __init__(self, name: str, launches: list):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            kwargs = {k: v for k, v in kwargs.items() if k not in ("BLOCK_M", "BLOCK_N")}  # interpreter's tiles
            named = dict(zip(tr._raw_kernel(self.name).arg_names, args), **kwargs)
            self.launches.append((self.name, grid, args, kwargs, named))
        return record


def _case_tensors(case: TuneCase, device) -> dict:
    """Random inputs and scratch outputs of one fold and one backward chunk; everything here is ours to overwrite
    (the kernels read-modify-write their outputs, so nothing of the caller's is ever launched on)."""
    b, s_q, s_k, h_q, h_kv, d = case.batch, case.seq_q, case.seq_k, case.heads_q, case.heads_kv, case.head_dim
    g = torch.Generator(device=device).manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g, device=device, dtype=case.dtype)  # noqa: E731
    f32 = dict(dtype=torch.float32, device=device)
    return dict(q=rand(b, s_q, h_q, d), k=rand(b, s_k, h_kv, d), v=rand(b, s_k, h_kv, d), dout=rand(b, s_q, h_q, d),
                acc=torch.zeros(b, s_q, h_q, d, **f32), lse=torch.full((b, h_q, s_q), math.log(s_k), **f32),
                delta=torch.zeros(b, h_q, s_q, **f32), dq=torch.zeros(b, s_q, h_q, d, **f32),
                dk=torch.zeros(b, s_k, h_kv, d, **f32), dv=torch.zeros(b, s_k, h_kv, d, **f32))


def _launches(case: TuneCase, device) -> list:
    """``[(kernel, grid, args, kwargs, named)]``: exactly what the launcher passes for a fold and a backward
    chunk of ``case`` (``_triton._kernel`` swapped for a recorder, as ``bench/compile_report.py`` does)."""
    t = _case_tensors(case, device)
    q_start = max(0, case.seq_k - case.seq_q)  # bottom-right causal alignment: every row sees a key
    bounds = (_masks.window_bounds(case.seq_q, case.seq_k, causal=True, window=(-1, -1), device=device)
              if case.bounds else None)
    mask = dict(scale=case.head_dim ** -0.5, q_start=q_start, k_start=0, causal=case.causal, bounds=bounds)
    launches: list = []
    saved = tr._kernel
    tr._kernel = lambda name: _Recorder(name, launches)
    try:
        be = tr.TritonBackend()
        be.fold_(t["acc"], t["lse"], t["q"], t["k"], t["v"], fresh=False, out_final=None, **mask)
        be.backward_chunk_(t["dout"], t["q"], t["k"], t["v"], t["lse"], t["delta"], t["dq"], t["dk"], t["dv"],
                           **mask)
    finally:
        tr._kernel = saved
    return launches


class _Fixed(tr._Heuristic):
    """The launcher's own launch path with one config forced (so a trial passes exactly a real launch's
    arguments)."""

    def __init__(self, name: str, config: tuple):
        super().__init__(name, tr._raw_kernel(name))
        self.config = config

    def pick(self, named: dict) -> tuple:
        return self.config


class _Trial:
    """``fn()`` for the timer: one launch of ``kernel`` with ``config`` on the case's scratch tensors."""

    def __init__(self, launch, config: tuple, key):
        self.kernel, self.grid, self.args, self.kwargs, _ = launch
        self.config, self.key = config, key

    def __call__(self):
        return _Fixed(self.kernel, self.config)[self.grid](*self.args, **self.kwargs)


def _fastest(launch, key, timer) -> tuple:
    """The fastest kept config for ``launch`` (ties: the heuristic's order); a single kept config is not timed."""
    kept = tr._kept(launch[0], launch[4])
    if len(kept) == 1:
        return tuple(kept[0])
    best, best_ms = None, math.inf
    for config in kept:
        try:
            ms = timer(_Trial(launch, tuple(config), key))
        except Exception as exc:  # a config that does not fit this device (the filter's estimate missed it)
            if type(exc).__name__ != "OutOfResources":
                raise
            continue
        if not isinstance(ms, (int, float)):
            raise TypeError(f"autotune timer returned {ms!r} for {key.text()} {config}; it must return milliseconds "
                            f"as a float")
        if not math.isnan(ms) and ms < best_ms:
            best, best_ms = tuple(config), ms
    if best is None:
        raise RuntimeError(f"autotune: no config of {kept} could launch for {key.text()} (all out of resources)")
    return best


def _default_timer(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn))


def _tune_table(cases: list, device, cache_dir, timer) -> dict:
    """This process's table for ``cases``: cached choices, the rest benchmarked (and then cached)."""
    path = _cache_path(cache_dir, device)
    cached = _read_cache(path, device)
    table, new = {}, {}
    for case in cases:
        for launch in _launches(case, device):
            key = tr._pick_key(launch[0], launch[4])
            if key in table:
                continue  # e.g. a second case of the same bucket
            if key not in cached:
                new[key] = _fastest(launch, key, timer or _default_timer)
            table[key] = cached.get(key, new.get(key))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # one case's tensors at a time
    if new:
        _write_cache(path, device, new)
    return table


# ----------------------------------------------------------------------------- disk cache

def _device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"{device.type}-interpreter"


@functools.lru_cache(maxsize=None)
def _kernel_source_hash() -> str:
    """Hash of the kernels and of the launcher (its config tables and filter): any edit invalidates the cache."""
    h = hashlib.blake2b(digest_size=8)
    for module in (tr._fwd, tr._bwd, tr):
        h.update(Path(module.__file__).read_bytes())
    return h.hexdigest()


def _cache_header(device) -> dict:
    import triton

    return {"gpu": _device_name(device), "triton": triton.__version__, "kernels": _kernel_source_hash()}


def _cache_path(cache_dir, device) -> Path:
    root = Path(cache_dir or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "distattn" / "tune")
    head = _cache_header(device)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", head["gpu"])
    return root / f"{slug}-triton-{head['triton']}-{head['kernels']}.json"


def _read_cache(path: Path, device) -> dict:
    """``{_PickKey: config}`` from ``path`` ({} if absent, or written for another GPU, Triton or kernel source);
    an unreadable file is ignored with a warning, an entry naming a config no longer listed is dropped."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if {k: data.get(k) for k in ("gpu", "triton", "kernels")} != _cache_header(device):
            return {}  # another GPU whose name gives the same file name
        choices = data["choices"]
        table = {}
        for text, config in choices.items():
            key = tr._PickKey.from_text(text)
            if tuple(config) in map(tuple, tr._CONFIGS.get(key.kernel, ())):
                table[key] = tuple(config)
        return table
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        warnings.warn(f"distattn autotune: ignoring the unreadable cache file {path} ({exc}); it will be rewritten",
                      stacklevel=3)
        return {}


def _write_cache(path: Path, device, new: dict) -> None:
    """Merge ``new`` into the cache file: a temporary file in the same directory, renamed over the old one."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = {k.text(): list(v) for k, v in {**_read_cache(path, device), **new}.items()}
        head = json.dumps(_cache_header(device))[:-1]
        # One choice a line: a person can read (and a diff can show) what was tuned.
        body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(merged.items()))
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(f'{head}, "choices": {{\n{body}\n}}}}\n')
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:  # the choices are installed all the same; only the next run will tune again
        warnings.warn(f"distattn autotune: could not write the cache {path} ({exc}); set {CACHE_ENV} or "
                      f"cache_dir= to a writable directory", stacklevel=3)


# ----------------------------------------------------------------------------- process group (rank 0 decides)

def _process_group(group):
    """The group to agree over, or None when this process is alone."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("autotune(group=...) needs torch.distributed to be initialized; call "
                             "init_process_group first, or pass group=None to tune this process alone")
        return None
    group = group if group is not None else dist.group.WORLD
    if dist.get_rank(group) < 0:
        raise ValueError(f"autotune(group={group!r}): this process (global rank {dist.get_rank()}) is not a member "
                         f"of the group; call it on the group's ranks only")
    return group if dist.get_world_size(group) > 1 else None


def _shared_table(pg, mine: dict, tune, timeout: float) -> dict:
    """Rank 0 of ``pg`` tunes the union of every rank's cases; every rank returns rank 0's table or raises.

    Rank 0's table travels by an all-gather of JSON of which every rank reads rank 0's entry, not by
    ``broadcast_object_list``: that has no asynchronous form (so its wait could not be bounded) and unpickles."""
    import torch.distributed as dist

    rank = dist.get_rank(pg)
    everyone = _all_gather_json(pg, mine, timeout, "exchanging the cases to tune")
    failed = [(r, e) for r, e in enumerate(everyone) if "error" in e]
    if failed:
        cls = ValueError if all(e["type"] == "ValueError" for _, e in failed) else TypeError
        raise cls("distattn.kernels.autotune: bad arguments on " + "; ".join(
            f"rank {r}: {e['error']}" for r, e in failed))
    union = list({json.dumps(c, sort_keys=True): c for e in everyone for c in e["cases"]}.values())
    result, error = {}, None
    if rank == 0:
        try:
            table = tune([TuneCase(**c) for c in union])
            result = {"table": {k.text(): list(v) for k, v in table.items()}}
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, or they wait for the table
            error = exc
            result = {"error": f"{type(exc).__name__}: {exc}"}
    first = _all_gather_json(pg, result, timeout, "waiting for rank 0's tuned configs")[0]
    if error is not None:
        raise error
    if "error" in first:
        raise RuntimeError(f"distattn.kernels.autotune: rank 0 of the group failed while tuning ({first['error']}); "
                           f"every rank raises, none installs a table")
    return {tr._PickKey.from_text(k): tuple(v) for k, v in first["table"].items()}


def _all_gather_json(pg, obj: dict, timeout: float, what: str) -> list[dict]:
    """Every rank's ``obj`` (JSON, never pickle): byte lengths first, then the zero-padded UTF-8 bytes."""
    import torch.distributed as dist

    nccl = dist.get_backend(pg) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)
    n = dist.get_world_size(pg)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    _wait(dist.all_gather(lengths, torch.tensor([data.numel()], device=device), group=pg, async_op=True),
          timeout, what, nccl)
    longest = max(int(t.item()) for t in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:data.numel()] = data
    bufs = [torch.zeros(longest, dtype=torch.uint8, device=device) for _ in range(n)]
    _wait(dist.all_gather(bufs, padded.to(device), group=pg, async_op=True), timeout, what, nccl)
    return [json.loads(bytes(b[:int(m.item())].tolist()).decode()) for b, m in zip(bufs, lengths)]


def _wait(work, timeout: float, what: str, nccl: bool) -> None:
    """Wait at most ``timeout`` s (NCCL: polled on the host, a hung collective never returns from a wait)."""
    try:
        if nccl:
            deadline = time.monotonic() + timeout
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"timed out after {timeout:g} s")
                time.sleep(1e-3)
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001
        reason = str(exc).strip().splitlines()[-1][:160] if str(exc).strip() else type(exc).__name__
        raise RuntimeError(f"distattn.kernels.autotune: {what}: a rank of the group did not answer within "
                           f"{timeout:g} s or failed ({reason}); every rank must call autotune, with the same "
                           f"group (raise timeout= if rank 0's benchmarking needs longer)") from None
