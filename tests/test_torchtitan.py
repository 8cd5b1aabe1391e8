"""distattn.integrations.torchtitan: torchtitan models converted by DistAttnConverter, on 2 and 3 gloo ranks, against
the same model on one process with an fp64 reference attention (loss and every gradient).

What runs here (CPU): torchtitan's llama3 debug model (MHA; a windowed variant) and qwen3 debug model (GQA 16/8,
head_dim 128, QK norm, tied embeddings), built through their ``model_registry`` with the converter, fed packed
documents of lengths that are multiples of nothing, sharded by ``shard_batch``; the plain loop
(``distattn.reduce_gradients``) at P = 3 and FSDP2 (``fully_shard`` per block and the root,
``distattn.set_fsdp_gradient_divide_factor``) with an optimizer step at P = 2, and data-parallel replicas (2 replicas
x 2 sequence-parallel ranks, each replica its own batch, FSDP2 over the 4) against one process averaging the two
batches' losses. torchtitan's ``Trainer`` does not run
on CPU (its Flex backend has no CPU backward, its varlen needs CUDA, and it imports tensorboard/wandb), so the
Trainer's own loop is not exercised: these tests run model + converter + loss + FSDP2 step outside it.

Accuracy (STYLE 14): the distributed fp32 result's error against the fp64 reference is at most twice the error of
the same model run in fp32 on one process with plain SDPA, plus ``ABS_FLOOR``.

torchtitan is not in the ``test`` extra (0.3.0 pins ``datasets<4.8`` and pulls wandb, tensorboard, grpcio): the
tests skip when it is not installed (``pip install 'distattn[torchtitan]'`` runs them).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install 'distattn[torchtitan]'); it is "
                                         "not in the test extra: its 0.3.0 pins datasets<4.8 and pulls wandb")

from dist_utils import run_distributed

TIMEOUT_S = 420  # torchtitan's debug models (6-8 layers) x a few cases per spawn, on a shared 2-core machine
ABS_FLOOR = 1e-5  # fp32 rounding of values O(1) summed over a few hundred terms
ROWS = (  # two rows of 60 tokens: documents of lengths that are multiples of nothing (1 and 59 included)
    (7, 23, 1, 29),
    (31, 11, 18),
)
SEQ = 60  # divisible by 2 and 3 ranks, and by 2P for zigzag


def _positions(rows=ROWS) -> torch.Tensor:
    """torchtitan's per-document positions: restart at 0 at each document."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 2048, (len(ROWS), SEQ + 1), generator=g)
    labels = tokens[:, 1:].clone()
    labels[0, 5] = -100  # one ignored label: the global token count must see it
    return tokens[:, :-1].contiguous(), labels


class _RefAttention(torch.nn.Module):
    """Masked SDPA on the whole rows: causal within each document (and the window), GQA by repetition."""

    def __init__(self, window_size):
        super().__init__()
        self.window_size = tuple(window_size)
        self.allowed = None  # (b, S, S) bool, set per batch

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        mask = None if self.allowed is None else self.allowed[:, None]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def _allowed(rows, window_size, seq=SEQ) -> torch.Tensor:
    doc = _positions(rows).eq(0).cumsum(1) if rows is not None else torch.zeros(1, seq, dtype=torch.long)
    i = torch.arange(seq)
    q, k = i[:, None], i[None, :]
    left = window_size[0]
    band = (k <= q) & ((q - k <= left) if left >= 0 else torch.ones_like(q - k, dtype=torch.bool))
    return (doc[:, :, None] == doc[:, None, :]) & band


def _build(family: str, flavor: str, window: int | None, **converter):
    """(converted model, its config): torchtitan's registry, the varlen backend, DistAttnConverter."""
    import importlib

    from distattn.integrations.torchtitan import DistAttnConverter

    registry = importlib.import_module(f"torchtitan.models.{family}").model_registry
    spec = registry(flavor, attn_backend="varlen")
    if window is not None:  # a windowed variant: every other block, as gpt-oss does
        for layer in spec.model.layers[::2]:
            layer.attention.inner_attention.window_size = (window - 1, 0)
    config = DistAttnConverter.Config(**converter).build().convert(spec.model)
    torch.manual_seed(0)
    model = config.build()
    model.init_states(buffer_device=torch.device("cpu"))
    return model, config


def _reference(model, rows, dtype):
    """Same weights on one process, every inner attention swapped for the reference."""
    ref = copy.deepcopy(model)
    complex_dtype = torch.complex128 if dtype == torch.float64 else torch.complex64
    for t in list(ref.parameters()) + list(ref.buffers()):  # llama3's RoPE cache is complex: keep it complex
        t.data = t.data.to(complex_dtype if t.is_complex() else dtype)
    for layer in ref.layers.values():
        inner = _RefAttention(layer.attention.inner_attention.window_size)
        inner.allowed = _allowed(rows, inner.window_size)
        layer.attention.inner_attention = inner
    return ref


def _loss(pred, labels, valid):
    return F.cross_entropy(pred.flatten(0, 1).float() if pred.dtype != torch.float64 else pred.flatten(0, 1),
                           labels.flatten(), reduction="sum", ignore_index=-100) / valid


def _ref_run(model, rows, dtype, seed: int = 0):
    ref = _reference(model, rows, dtype)
    tokens, labels = _batch(seed)
    positions = _positions(rows) if rows is not None else None
    loss = _loss(ref(tokens, positions=positions), labels, (labels != -100).sum())
    loss.backward()
    return loss.detach().double(), {n: p.grad.double() for n, p in ref.named_parameters()}


def _dist_run(model, rows, seed: int = 0):
    from distattn.integrations.torchtitan import shard_batch

    tokens, labels = _batch(seed)
    batch = shard_batch(model, tokens, labels, _positions(rows) if rows is not None else None)
    pred = model(batch["tokens"], positions=batch["positions"], attention_masks=batch["attention_masks"])
    return _loss(pred, batch["labels"], batch["global_valid_tokens"])


def _errors(model, dist_loss, dist_grads, rows):
    """{quantity: (error of the distributed run, error of plain fp32)} against fp64, max over each quantity."""
    loss64, g64 = _ref_run(model, rows, torch.float64)
    loss32, g32 = _ref_run(model, rows, torch.float32)
    out = {"loss": ((dist_loss.double() - loss64).abs().item(), (loss32 - loss64).abs().item())}
    dist_max = max((dist_grads[n].double() - g64[n]).abs().max().item() for n in g64)
    plain_max = max((g32[n] - g64[n]).abs().max().item() for n in g64)
    out["grads"] = (dist_max, plain_max)
    missing = sorted(set(g64) - set(dist_grads))
    assert not missing, missing
    return out


def _plain_case(family, flavor, window, rows, **converter):
    import distattn
    from distattn.integrations.torchtitan import sp_group

    model, _ = _build(family, flavor, window, **converter)
    loss = _dist_run(model, rows)
    loss_sum = loss.detach().clone()
    torch.distributed.all_reduce(loss_sum)  # the group is the world here: the sum is the replica's loss
    loss.backward()
    distattn.reduce_gradients(model, sp_group(model))
    grads = {n: p.grad for n, p in model.named_parameters()}
    return _errors(model, loss_sum, grads, rows)


def _fsdp_case(family, flavor, window, rows, **converter):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import distattn
    from distattn.integrations.torchtitan import sp_group

    model, _ = _build(family, flavor, window, **converter)
    before = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    distattn.set_fsdp_gradient_divide_factor(model, sp_group(model))
    loss = _dist_run(model, rows)
    loss_sum = loss.detach().clone()
    torch.distributed.all_reduce(loss_sum)
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    errors = _errors(before, loss_sum, grads, rows)
    # one SGD step on the sharded gradients lands where the reference's full gradients take the weights
    lr = 0.1
    torch.optim.SGD(model.parameters(), lr=lr).step()
    _, g64 = _ref_run(before, rows, torch.float64)
    step = max((p.full_tensor().double() - (dict(before.named_parameters())[n].double() - lr * g64[n])).abs().max()
               .item() for n, p in model.named_parameters())
    # a step's error is the fp32 rounding of the weights (one ulp of the largest), plus lr x the gradient's
    ulp = torch.finfo(torch.float32).eps * max(p.detach().abs().max().item() for p in before.parameters())
    errors["step"] = (step, ulp + lr * errors["grads"][1])
    return errors


def _replicas_case(family, flavor, rows):
    """Data-parallel replicas x sequence parallelism: 4 ranks = 2 replicas (ranks {0, 1} and {2, 3}, each its own
    batch) x 2 sequence-parallel ranks, FSDP2 over all 4 with ``set_fsdp_gradient_divide_factor``. The gradients must
    be the mean over the replicas of each batch's token-mean loss gradient (what one process running both batches
    and averaging their losses computes); each replica's loss its own batch's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import distattn
    from distattn.integrations.torchtitan import sp_group

    model, _ = _build(family, flavor, None, sp_degree=2)
    before = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    group = sp_group(model)
    distattn.set_fsdp_gradient_divide_factor(model, group)
    replica = torch.distributed.get_rank() // 2
    loss = _dist_run(model, rows, seed=replica)
    loss_sum = loss.detach().clone()
    torch.distributed.all_reduce(loss_sum, group=group)  # this replica's loss
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    refs = {dtype: [_ref_run(before, rows, dtype, seed) for seed in (0, 1)] for dtype in (torch.float64, torch.float32)}
    mean = {dtype: {n: (runs[0][1][n] + runs[1][1][n]) / 2 for n in runs[0][1]} for dtype, runs in refs.items()}
    g64, g32 = mean[torch.float64], mean[torch.float32]
    loss64, loss32 = refs[torch.float64][replica][0], refs[torch.float32][replica][0]
    return {"loss": ((loss_sum.double() - loss64).abs().item(), (loss32 - loss64).abs().item()),
            "grads": (max((grads[n].double() - g64[n]).abs().max().item() for n in g64),
                      max((g32[n] - g64[n]).abs().max().item() for n in g64))}


def _refusal(fn) -> str:
    """The message of the ValueError/TypeError that ``fn()`` raises on this rank, or "no error"."""
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _bad_inputs():
    """What each rank says to inputs distattn cannot serve, before any step (the same facts on every rank)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from distattn.integrations.torchtitan import DistAttnConverter

    model, _ = _build("llama3", "debugmodel", None)
    tokens, _ = _batch()
    n = SEQ // torch.distributed.get_world_size()
    shard = slice(torch.distributed.get_rank() * n, (torch.distributed.get_rank() + 1) * n)
    block_mask = create_block_mask(lambda b, h, q, k: k <= q, len(ROWS), None, n, n, device="cpu")
    return {
        "heads for Ulysses 3": _refusal(lambda: DistAttnConverter.Config(ulysses_degree=3).build().convert(
            _build_config("llama3"))),
        "flex BlockMask": _refusal(lambda: model(tokens[:, shard], attention_masks=block_mask)),
        "masks from the shard": _refusal(lambda: model(
            tokens[:, shard], positions=_positions()[:, shard],
            attention_masks=model.get_attention_masks(positions=_positions()[:, shard]))),
    }


def _build_config(family):
    import importlib

    return importlib.import_module(f"torchtitan.models.{family}").model_registry("debugmodel",
                                                                                 attn_backend="varlen").model


def _cases_p3(rank, world_size):
    return {"bad inputs": _bad_inputs(), 
        "llama3 docs balanced": _plain_case("llama3", "debugmodel", None, ROWS),
        "llama3 docs zigzag, window 9": _plain_case("llama3", "debugmodel", 9, ROWS, schedule="zigzag"),
        "llama3 dense ring": _plain_case("llama3", "debugmodel", None, None, schedule="ring"),
        "qwen3 docs (GQA 16/8)": _plain_case("qwen3", "debugmodel", None, ROWS)
    }


def _cases_p2(rank, world_size):
    return {
        "llama3 docs FSDP2 + SGD step": _fsdp_case("llama3", "debugmodel", None, ROWS),
        "qwen3 docs window 13, Ulysses 2": _plain_case("qwen3", "debugmodel", 13, ROWS, ulysses_degree=2),
    }


BAD_INPUTS = {  # what every rank must say
    "heads for Ulysses 3":
        r"ValueError: layers\[0\]\.attention\.n_heads \(16\) must be a multiple of ulysses_degree \(3\)",
    "flex BlockMask": r"TypeError: DistAttention serves torchtitan's VarlenMetadata masks .* got BlockMask",
    "masks from the shard": r"ValueError: attention_masks cover 40 tokens, but the batch is 2 rows x 60 tokens",
}


def _check(results):
    import re

    said = results.pop("bad inputs", {})
    for name, pattern in BAD_INPUTS.items() if said else ():
        assert re.match(pattern, said[name]), (name, said[name])
    for name, errs in results.items():
        for what, (ours, plain) in errs.items():
            assert ours <= 2 * plain + ABS_FLOOR, f"{name} {what}: {ours:.3g} vs plain fp32 {plain:.3g}"


def _cases_p4(rank, world_size):
    return {"llama3 docs, 2 replicas x SP 2, FSDP2": _replicas_case("llama3", "debugmodel", ROWS)}


@pytest.mark.parametrize("world_size,cases", [(3, _cases_p3), (2, _cases_p2), (4, _cases_p4)],
                         ids=["P3", "P2", "P4-replicas"])
def test_converted_models_match_one_process(world_size, cases):
    ranks = run_distributed(cases, world_size, timeout=TIMEOUT_S)
    for results in ranks:
        _check(results)
    print({name: {w: f"{o:.2e} (plain {p:.2e})" for w, (o, p) in e.items()} for name, e in ranks[0].items()})


def test_bad_configs_refused_before_a_step():
    """Config facts every rank shares: refused on one process as on all (no communication involved)."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.models.common.attention import ScaledDotProductAttention

    from distattn.integrations.torchtitan import DistAttnConverter, check_parallelism

    with pytest.raises(ValueError, match=r"context_parallel_degree = 2 with DistAttnConverter: distattn shards the "
                                         r"sequence itself .* set context_parallel_degree = 1"):
        check_parallelism(ParallelismConfig(context_parallel_degree=2))
    with pytest.raises(ValueError, match=r"tensor_parallel_degree = 2 is not composed"):
        check_parallelism(ParallelismConfig(tensor_parallel_degree=2))
    check_parallelism(ParallelismConfig(), _build_config("llama3"), world_size=4)  # the default: fine
    converted = DistAttnConverter.Config(sp_degree=3).build().convert(_build_config("llama3"))
    with pytest.raises(ValueError, match=r"sp_degree=3 must divide the world size 4"):
        check_parallelism(ParallelismConfig(), converted, world_size=4)
    with pytest.raises(ValueError, match=r"schedule='placed' must be one of .* lays out each batch"):
        DistAttnConverter.Config(schedule="placed")
    config = _build_config("llama3")
    config.layers[1].attention.inner_attention = ScaledDotProductAttention.Config()
    with pytest.raises(ValueError, match=r"layers\[1\]\.attention\.inner_attention is ScaledDotProductAttention\.Config"
                                         r", which DistAttnConverter cannot serve"):
        DistAttnConverter.Config().build().convert(config)
    with pytest.raises(ValueError, match=r"n_kv_heads \(8\) must be a multiple of ulysses_degree \(16\)"):
        DistAttnConverter.Config(ulysses_degree=16).build().convert(_build_config("qwen3"))
