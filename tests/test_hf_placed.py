"""A HF LLaMA on packed documents with schedule="placed": shard_batch places the stream by its documents
(position ids and labels follow the tokens), the model's hook learns the layout from ``cu_seq_lens``, and the
loss, per-document loss sums and gradients equal each document run alone (the accuracy rule, fp64 reference)."""

import torch

from attn_ref import assert_close_by_rule, magnitude_of
from dist_utils import run_distributed
from distattn.integrations import hf
from test_hf_packed import LENGTHS, TIMEOUT_S, _alone, _doc_of_positions, documents, make_model


def _run_placed(model, batch, world):
    import torch.distributed as dist

    from distattn.sharding import placement

    model.zero_grad(set_to_none=True)
    cu = batch["cu_seq_lens"]
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], cu_seq_lens_q=cu,
                   cu_seq_lens_k=cu, max_length_q=batch["max_length"], max_length_k=batch["max_length"]).logits
    loss = hf.causal_lm_loss(logits, batch["shift_labels"])
    loss.backward()
    per_token = torch.nn.functional.cross_entropy(logits[0].float().detach(), batch["shift_labels"][0],
                                                  ignore_index=-100, reduction="none")
    n = per_token.numel()
    lay = placement(cu, n)
    mine = torch.from_numpy(lay.positions(dist.get_rank(), n))
    doc = _doc_of_positions(n * world)[mine]
    sums = torch.zeros(len(LENGTHS), dtype=torch.float64)
    sums.index_add_(0, doc.clamp(min=0), torch.where(doc >= 0, per_token.double(), 0.0))
    dist.all_reduce(sums)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        grads[name] = g
    return {"loss": loss.detach(), "doc_sums": sums, "grads": grads, "kind": lay.kind,
            "positions": batch["position_ids"][0].tolist(), "mine": mine.tolist()}


def _placed_cases(rank, world_size):
    docs = documents()
    model = hf.use_distattn(make_model("llama", attn="sdpa"), schedule="placed")
    return _run_placed(model, hf.shard_batch(docs, labels=docs, schedule="placed"), world_size)


def test_packed_batch_on_the_placement_equals_each_document_alone():
    ranks = run_distributed(_placed_cases, 3, timeout=TIMEOUT_S)
    ref, base = _alone("llama", torch.float64), _alone("llama", torch.float32)
    mag = magnitude_of(*ref[2].values())
    stream_positions = torch.cat([torch.arange(n) for n in [*LENGTHS, 1]])  # 26 tokens + a 1-token tail (27 = 3 x 9)
    for rank, res in enumerate(ranks):
        assert res["kind"] == "placed"
        assert res["positions"] == stream_positions[res["mine"]].tolist()  # position ids follow their tokens
        assert_close_by_rule("placed loss", res["loss"], base[0], ref[0], torch.float32)
        assert_close_by_rule("placed doc sums", res["doc_sums"], base[1], ref[1], torch.float32)
        for name, g in res["grads"].items():
            assert_close_by_rule(f"placed rank {rank} grad {name}", g, base[2][name], ref[2][name], torch.float32,
                                 magnitude=mag)
