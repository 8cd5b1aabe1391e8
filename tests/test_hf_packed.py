"""The gold test of padding-free training: a packed batch of documents trains exactly like each document alone.

A tiny LLaMA (GQA 4/2) and a tiny Mistral with a sliding window shorter than the documents run, through
``use_distattn``, on a packed stream of documents of lengths 1..9 split over 1, 2 and 3 gloo ranks. Three ways
in: a list of documents, a padded batch with its ``attention_mask``, and transformers' flattened format
(``position_ids`` restarting at 0). Each must give the per-document loss sums and the parameter gradients of
running every document alone through transformers' own eager attention (fp64 reference, fp32 baseline of the
accuracy rule), and the three inputs must agree with each other.
"""

import pytest
import torch

from attn_ref import assert_close_by_rule, magnitude_of
from dist_utils import run_distributed

transformers = pytest.importorskip("transformers")

from distattn.integrations import hf  # noqa: E402

TIMEOUT_S = 200
VOCAB = 48
LENGTHS = [5, 1, 9, 3, 6, 2]  # 26 tokens: one document of length 1, one shorter than Mistral's window
FAMILIES = {  # config class, model class, extra config
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4}),
}


def make_model(family, attn="eager", dtype=torch.float32):
    cfg_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, cfg_name)(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, attn_implementation=attn,
        use_cache=False, **extra)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).to(dtype).train()


def documents():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]


def _doc_of_positions(total):
    """Document index of every stream position (-1 for the padding tail)."""
    doc = torch.full((total,), -1)
    start = 0
    for i, n in enumerate(LENGTHS):
        doc[start:start + n] = i
        start += n
    return doc


# -- spawned side ---------------------------------------------------------------------------------------------
def _run(model, batch, group, world, schedule="balanced"):
    import torch.distributed as dist

    from distattn.sharding import positions

    model.zero_grad(set_to_none=True)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    loss = hf.causal_lm_loss(logits, batch["shift_labels"], group=group)
    loss.backward()
    per_token = torch.nn.functional.cross_entropy(logits[0].float().detach(), batch["shift_labels"][0],
                                                  ignore_index=-100, reduction="none")
    n = per_token.numel()
    doc = _doc_of_positions(n * world)[positions(n, group, schedule)]  # this rank's tokens, by the layout
    sums = torch.zeros(len(LENGTHS), dtype=torch.float64)
    sums.index_add_(0, doc.clamp(min=0), torch.where(doc >= 0, per_token.double(), 0.0))
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        grads[name] = g
    dist.all_reduce(sums, group=group)
    return {"loss": loss.detach(), "doc_sums": sums, "grads": grads}


def _cases(rank, world_size):
    import torch.distributed as dist

    groups = {1: dist.new_group([0]), 2: dist.new_group([0, 1]), 3: None}
    docs = documents()
    results = {}
    for size, group in groups.items():
        if rank >= size:
            continue
        for family in FAMILIES:
            model = hf.use_distattn(make_model(family, attn="sdpa"), group=group)
            got = {"list": _run(model, hf.shard_batch(docs, labels=docs, group=group), group, size)}
            # the same documents as a right-padded batch with its attention mask
            width = max(LENGTHS)
            ids = torch.zeros(len(docs), width, dtype=torch.long)
            mask = torch.zeros(len(docs), width, dtype=torch.long)
            for i, d in enumerate(docs):
                ids[i, :len(d)], mask[i, :len(d)] = d, 1
            got["padded"] = _run(model, hf.shard_batch(ids, labels=ids, group=group, attention_mask=mask), group,
                                 size)
            if sum(LENGTHS) % size == 0:  # transformers' flattened format needs no tail padding
                stream = torch.cat(docs)[None]
                positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
                got["flattened"] = _run(model, hf.shard_batch(stream, labels=stream, group=group,
                                                              position_ids=positions), group, size)
            if rank == 0:
                results[(size, family)] = got
    return results


# -- parent side ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def spawned():
    return run_distributed(_cases, 3, timeout=TIMEOUT_S)[0]


def _alone(family, dtype):
    """Per-document loss sums and gradients of the summed loss / total targets, each document run alone."""
    model = make_model(family, attn="eager", dtype=dtype)
    targets = sum(n - 1 for n in LENGTHS)
    sums = []
    total = 0.0
    for doc in documents():
        logits = model(input_ids=doc[None]).logits[0]
        s = torch.nn.functional.cross_entropy(logits[:-1], doc[1:], reduction="sum") if len(doc) > 1 else \
            logits.sum() * 0.0
        sums.append(s.detach())
        total = total + s
    (total / targets).backward()
    return (total / targets).detach(), torch.stack(sums), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("size", [1, 2, 3])
def test_packed_batch_equals_each_document_alone(spawned, family, size):
    ref = _alone(family, torch.float64)
    base = _alone(family, torch.float32)
    got = spawned[(size, family)]
    assert set(got) >= {"list", "padded"}
    for how, res in got.items():
        assert_close_by_rule(f"{how} loss", res["loss"], base[0], ref[0], torch.float32)
        assert_close_by_rule(f"{how} doc sums", res["doc_sums"], base[1], ref[1], torch.float32)
        mag = magnitude_of(*ref[2].values())
        for name, g in res["grads"].items():
            assert_close_by_rule(f"{how} grad {name}", g, base[2][name], ref[2][name], torch.float32, magnitude=mag)
    # the three ways into the same stream agree to round-off
    for how in got:
        assert torch.allclose(got[how]["loss"], got["list"]["loss"], rtol=1e-6, atol=0)


# -- the zigzag layout: rank r holds chunks r and 2P-1-r of the stream ------------------------------------------
def _zigzag_cases(rank, world_size):
    docs = documents()
    model = hf.use_distattn(make_model("llama", attn="sdpa"), schedule="zigzag")
    shard = lambda *a, **kw: hf.shard_batch(*a, schedule="zigzag", **kw)  # noqa: E731
    got = {"list": _run(model, shard(docs, labels=docs), None, world_size, "zigzag")}
    width = max(LENGTHS)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    mask = torch.zeros(len(docs), width, dtype=torch.long)
    for i, d in enumerate(docs):
        ids[i, :len(d)], mask[i, :len(d)] = d, 1
    got["padded"] = _run(model, shard(ids, labels=ids, attention_mask=mask), None, world_size, "zigzag")
    # transformers' flattened format, with a 2-token tail document up to a multiple of 2P = 4 (26 + 2 tokens)
    stream = torch.cat([*docs, torch.zeros(2, dtype=torch.long)])[None]
    labels = torch.cat([*docs, torch.full((2,), -100)])[None]
    positions = torch.cat([torch.arange(n) for n in [*LENGTHS, 2]])[None]
    flat = shard(stream, labels=labels, position_ids=positions)
    got["flattened"] = _run(model, flat, None, world_size, "zigzag")
    got["positions"] = {how: b["position_ids"] for how, b in
                        (("list", shard(docs)), ("flattened", flat))}
    return got


def test_packed_batch_with_zigzag_layout_equals_each_document_alone():
    from distattn.schedule import layout_of

    ranks = run_distributed(_zigzag_cases, 2, timeout=TIMEOUT_S)
    ref, base = _alone("llama", torch.float64), _alone("llama", torch.float32)
    mag = magnitude_of(*ref[2].values())
    stream_positions = torch.cat([torch.arange(n) for n in [*LENGTHS, 2]])  # documents, then the 2-token tail
    for rank, got in enumerate(ranks):
        for how in ("list", "padded", "flattened"):
            res = got[how]
            assert_close_by_rule(f"zigzag {how} loss", res["loss"], base[0], ref[0], torch.float32)
            assert_close_by_rule(f"zigzag {how} doc sums", res["doc_sums"], base[1], ref[1], torch.float32)
            for name, g in res["grads"].items():
                assert_close_by_rule(f"zigzag {how} rank {rank} grad {name}", g, base[2][name], ref[2][name],
                                     torch.float32, magnitude=mag)
        mine = torch.from_numpy(layout_of("zigzag", 2).positions(rank, 14))  # 28 tokens: chunks of 7
        for how, pos in got["positions"].items():  # positions within documents, sharded like the tokens
            assert pos[0].tolist() == stream_positions[mine].tolist(), (rank, how)


def test_packed_shard_batch_layout():
    docs = documents()
    out = hf.shard_batch(docs, labels=docs)
    assert out["input_ids"].shape == (1, sum(LENGTHS)) and out["cu_seq_lens"].tolist()[-1] == sum(LENGTHS)
    assert out["position_ids"][0, :6].tolist() == [0, 1, 2, 3, 4, 0]  # restarts at the second document
    labels = out["shift_labels"][0]
    assert labels[4] == -100 and labels[5] == -100  # last token of a document, a document of length 1
    assert labels[6] == docs[2][1]
