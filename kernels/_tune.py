"""Tune the Triton kernels' launch configs once, before training, in this process (no process group here).

By default each launch takes a deterministic config (``_triton._Heuristic``). A tuned table replaces it, for the
pick keys that ``cases`` launch (``_triton._PickKey``: kernel, BLOCK_D, dtype, MASK, length bucket, TMA, shared
memory), by the fastest of the configs the filter keeps (``_triton._kept``), measured on real tensors of each
case's shape. What this module does, all in one process:

* ``check_tune_args(cases, device=, timer=)``: validate the cases and the device (``TuneCase``s, the device);
* ``tune_table(cases, ...)``: read the disk cache, benchmark only the keys it lacks (``timer``), write it back,
  return ``{_PickKey: config}`` without installing it;
* ``install_table(table)``: every later launch in this process uses it (``_triton._CHOSEN``);
* ``table_to_json`` / ``table_from_json``: a table as plain JSON values (what a process group sends);
* ``autotune(cases, ...)``: ``tune_table`` then ``install_table``.

A process group must launch the same configs on every rank, which timings taken on each rank would not give:
``distattn.autotune`` (``distattn/tune.py``, the layer above) lets rank 0 tune the union of the ranks' cases with
``tune_table`` and installs rank 0's table on every rank. This module never imports ``torch.distributed``.

Cache: one JSON file per (GPU name, Triton version, hash of the kernel sources) under ``cache_dir``, else
``$DISTATTN_TUNE_CACHE``, else ``~/.cache/distattn/tune/``; a change to a kernel or to the config tables changes
the hash, so a stale choice is never used. Written atomically (a temporary file renamed over the old one).

Legend: ``b`` batch, ``s_q``/``s_k`` query/key length, ``h_q``/``h_kv`` heads, ``d`` head dim.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import tempfile
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import distattn.kernels._masks as _masks
import distattn.kernels._triton as tr

__all__ = ["TuneCase", "autotune", "autotune_enabled", "check_tune_args", "tune_table", "install_table",
           "table_to_json", "table_from_json", "AUTOTUNE_ENV", "CACHE_ENV"]

AUTOTUNE_ENV = "DISTATTN_AUTOTUNE"
CACHE_ENV = "DISTATTN_TUNE_CACHE"
_DTYPES = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float32": torch.float32, "fp32": torch.float32}


def autotune_enabled() -> bool:
    """``DISTATTN_AUTOTUNE=1``: ``launch/train.py`` tunes the configs before its first step (``distattn.autotune``);
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


def autotune(cases, *, device=None, cache_dir=None, timer=None) -> dict:
    """Tune the Triton kernels' configs for ``cases`` in this process and install the result here.

    One process only: on the ranks of a process group call ``distattn.autotune`` instead, which tunes on rank 0
    and installs rank 0's table on every rank (this function on every rank would benchmark on every rank, and
    the ranks could launch different configs). Nothing is benchmarked later, at launch time.

    Args:
        cases: ``TuneCase``s (or dicts of its fields).
        device: the CUDA device to tune on (default: the current one). A CPU device works only under
            ``TRITON_INTERPRET=1``, as a test vehicle (the interpreter's launches ignore the table).
        cache_dir: directory of the JSON cache (default ``$DISTATTN_TUNE_CACHE``, else ``~/.cache/distattn/tune``).
        timer: ``timer(fn) -> milliseconds`` for one launch ``fn()`` (default ``triton.testing.do_bench``);
            ``fn.kernel``, ``fn.config`` and ``fn.key`` say what it launches.

    Returns:
        ``{_PickKey: (BLOCK_M, BLOCK_N, num_warps, num_stages)}`` for the cases' launches (installed).

    Raises:
        ValueError, TypeError: a bad case or device (before anything is benchmarked or installed).
        RuntimeError: no kept config of a launch could run on this device (all out of resources).
    """
    table = tune_table(cases, device=device, cache_dir=cache_dir, timer=timer)
    install_table(table)
    return table


def check_tune_args(cases, *, device=None, timer=None) -> tuple[list[TuneCase], torch.device]:
    """``(cases as TuneCases, the device to tune on)``; ``ValueError``/``TypeError`` naming a bad case or device.

    Cheap and deterministic: ``distattn.autotune`` runs it on every rank before the ranks exchange anything."""
    dev = _device(device, timer)
    return [_as_case(c) for c in cases], dev


def tune_table(cases, *, device=None, cache_dir=None, timer=None) -> dict:
    """This process's table for ``cases``, not installed: cached choices, the rest benchmarked (then cached).

    Arguments and return value as ``autotune``."""
    todo, dev = check_tune_args(cases, device=device, timer=timer)
    return _tune_table(todo, dev, cache_dir, timer)


def install_table(table: dict) -> None:
    """Launches of this process use ``table``'s config for its keys from now on (other keys: the heuristic)."""
    tr._CHOSEN.update(table)


def table_to_json(table: dict) -> dict[str, list[int]]:
    """``table`` as JSON values: ``{key text: [BLOCK_M, BLOCK_N, num_warps, num_stages]}``."""
    return {k.text(): list(v) for k, v in table.items()}


def table_from_json(data: dict) -> dict:
    """The inverse of ``table_to_json``."""
    return {tr._PickKey.from_text(k): tuple(v) for k, v in data.items()}


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
        merged = table_to_json({**_read_cache(path, device), **new})
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
