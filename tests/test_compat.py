"""The lower-end fallbacks (``distattn/_compat.py``, ``kernels/_interp_compat.py``) give the newer API's behaviour at
either end of the supported range (setup.py). CI runs this file on the newest pins and on the lower-end pins
(torch 2.11, Triton 3.6, transformers 5.17), so each fallback is exercised where it is taken and where it is not;
the parts that can only be made on one end emulate the other end and say so."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl

import distattn
from attn_ref import make_qkv, max_err, reference_grads
from dist_utils import run_distributed
from distattn import _compat, comm
from distattn.kernels import _interp_compat

WORLD = 3
ORDER = [2, 0, 1]  # an unsorted whole-world group: its group rank r is global rank ORDER[r]
N, H, D = 8, 2, 16  # tokens per rank, heads, head dim
# fp32 attention over 24 keys with O(1) values against fp64: a few ulps. A rank that computes another rank's
# chunk (a library group numbered differently from the user's) is off by O(1).
TOL = 1e-5
TIMEOUT_S = 240  # three gloo ranks, four communicators, two schedules each, on a shared two-core machine


# -- torch.distributed: dist.new_group(..., sort_ranks=False) ------------------------------------------------
def _attend(group, schedule):
    """This rank's out, dq, dk, dv errors against fp64 for its chunk of one causal sequence split over ``group``."""
    me = dist.get_rank(group)
    q, k, v, dout = make_qkv(1, WORLD * N, WORLD * N, H, H, D, torch.float32, seed=5)
    ref = reference_grads(q, k, v, dout, torch.float64, causal=True)
    mine = slice(me * N, (me + 1) * N)
    ql, kl, vl = (t[:, mine].clone().requires_grad_() for t in (q, k, v))
    out = distattn.dist_flash_attn_func(ql, kl, vl, causal=True, group=group, schedule=schedule, timeout=60)
    out.backward(dout[:, mine])
    ours = (out, ql.grad, kl.grad, vl.grad)
    return max(max_err(x, r[:, mine]) for x, r in zip(ours, (ref[0], ref[2], ref[3], ref[4])))


def _case(group, sort_ranks):
    """Attend over ``group`` with ``_compat.SORT_RANKS`` set as given (False emulates torch 2.11)."""
    real = _compat.SORT_RANKS
    _compat.SORT_RANKS = sort_ranks
    try:
        errs = [_attend(group, schedule) for schedule in ("ring", "balanced")]
        lib = comm.communicator(group, 60.0)  # the one the calls built (cached)
        return {"owned": lib.owned, "is_user_group": lib.fetch is group, "err": max(errs),
                "lib_ranks": dist.get_process_group_ranks(lib.fetch),
                "user_ranks": dist.get_process_group_ranks(group) if group is not None else list(range(WORLD))}
    finally:
        _compat.SORT_RANKS = real


def _groups_worker(rank, world):
    cases = {"default": _case(None, _compat.SORT_RANKS),
             "sorted": _case(dist.new_group(ranks=list(range(world))), _compat.SORT_RANKS)}
    if _compat.SORT_RANKS:  # only such a torch can make an unsorted group; every rank creates both (collectives)
        unsorted_a = dist.new_group(ranks=ORDER, sort_ranks=False)
        unsorted_b = dist.new_group(ranks=ORDER, sort_ranks=False)
        cases["unsorted"] = _case(unsorted_a, True)
        cases["unsorted, no sort_ranks"] = _case(unsorted_b, False)  # what torch 2.11 would do with it
    return cases


def test_library_groups_number_ranks_as_the_users_group_on_either_torch():
    results = run_distributed(_groups_worker, WORLD, timeout=TIMEOUT_S)
    for rank, cases in enumerate(results):
        for name, got in cases.items():
            assert got["err"] <= TOL, f"rank {rank}, {name} group: error {got['err']:.2e} > {TOL:g}"
            # Group rank r of the library's groups is group rank r of the user's group.
            assert got["lib_ranks"] == got["user_ranks"], (rank, name, got)
        assert cases["default"]["owned"] and cases["sorted"]["owned"], cases
        assert not cases["default"]["is_user_group"]
    if _compat.SORT_RANKS:
        assert results[0]["unsorted"]["lib_ranks"] == ORDER and results[0]["unsorted"]["owned"]
        # Without sort_ranks an unsorted group is served by the user's group itself, as a subgroup is.
        emulated = results[0]["unsorted, no sort_ranks"]
        assert not emulated["owned"] and emulated["is_user_group"], emulated


def test_new_group_in_order_refuses_an_order_it_cannot_keep(monkeypatch):
    monkeypatch.setattr(_compat, "SORT_RANKS", False)
    assert _compat.keeps_order([0, 1, 2]) and not _compat.keeps_order([2, 0, 1])
    # Raised before any collective, so no process group is needed.
    with pytest.raises(ValueError, match=r"ranks \[2, 0, 1\] are not sorted.*no sort_ranks="):
        _compat.new_group_in_order([2, 0, 1])
    monkeypatch.setattr(_compat, "SORT_RANKS", True)
    assert _compat.keeps_order([2, 0, 1])


def test_sort_ranks_detection_matches_this_torch():
    # torch 2.11 lacks the keyword (the lower end), 2.13 has it (CI's pin).
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if version <= (2, 11) or version >= (2, 13):
        assert _compat.SORT_RANKS == (version >= (2, 13))


# -- transformers: activation_checkpointing_* (newer 5.x) vs gradient_checkpointing_* (5.17) -------------------
class _OldNames:
    """A model as transformers 5.17 has it: only the gradient_checkpointing_* names."""

    def __init__(self):
        self.calls = []

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        self.calls.append(("enable", gradient_checkpointing_kwargs))

    def gradient_checkpointing_disable(self):
        self.calls.append(("disable",))


class _NewNames(_OldNames):
    """A newer 5.x model: activation_checkpointing_* first (the old names are its deprecated aliases)."""

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None):
        self.calls.append(("new enable", activation_checkpointing_kwargs))

    def activation_checkpointing_disable(self):
        self.calls.append(("new disable",))


@pytest.mark.parametrize("cls, want", [(_OldNames, ["enable", "disable"]), (_NewNames, ["new enable", "new disable"])])
def test_hf_checkpointing_takes_the_name_this_release_has(cls, want):
    model = cls()
    _compat.hf_checkpointing_enable(model, {"use_reentrant": False})
    _compat.hf_checkpointing_disable(model)
    assert [c[0] for c in model.calls] == want
    assert model.calls[0][1] == {"use_reentrant": False}


def test_hf_checkpointing_on_the_installed_transformers():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    # is_activation_checkpointing where it exists (is_gradient_checkpointing is deprecated there), else the old name
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"
    _compat.hf_checkpointing_enable(model, {"use_reentrant": False})
    assert getattr(model, name)
    _compat.hf_checkpointing_disable(model)
    assert not getattr(model, name)


# -- Triton: the 3.6 interpreter's scalar __index__ under NumPy >= 2.4 ----------------------------------------
@pytest.mark.parametrize("triton_v, numpy_v, want", [("3.6.0", "2.4.6", True), ("3.6.1", "2.4.0", True),
                                                     ("3.6.0", "2.3.5", False), ("3.7.0", "2.4.6", False),
                                                     ("3.9.0", "2.4.6", False), ("3.10.0", "2.5.0rc1", False)])
def test_interpreter_adapter_only_for_triton_3_6_with_numpy_2_4(triton_v, numpy_v, want):
    assert _interp_compat.needed(triton_v, numpy_v) is want


@triton.jit
def _prefix_sum_kernel(X, OUT):
    pid = tl.program_id(0)
    acc = 0.0
    for i in range(0, pid + 1):  # a tensor loop bound: the interpreter calls its __index__
        acc += tl.load(X + i)
    tl.store(OUT + pid, acc)


def test_a_loop_with_a_tensor_bound_runs_on_the_installed_triton():
    interpreted = type(_prefix_sum_kernel).__name__ == "InterpretedFunction"
    assert _interp_compat.install() == _interp_compat.needed()  # distattn.kernels._triton installs it when interpreting
    if not interpreted and not torch.cuda.is_available():
        pytest.skip("Triton compiles for a GPU here and there is none")
    device = "cpu" if interpreted else "cuda"
    x = torch.arange(1, 6, dtype=torch.float32, device=device)
    out = torch.zeros_like(x)
    _prefix_sum_kernel[(x.numel(),)](x, out)
    assert torch.equal(out.cpu(), torch.cumsum(x, 0).cpu())
