"""A HF Mistral with a sliding window of 3 tokens on packed documents with schedule="placed", the batch placed for
that window (``shard_batch(..., window=(2, 0))``, issue 39): the model's hook gathers by the same placement and every
layer's call runs its plan on it (``distattn.sharding.placed_window``); loss, per-document loss sums and gradients
equal each document run alone (the accuracy rule, fp64 reference). The documents (5, 1, 9, 3, 6, 2 tokens over 3
ranks of 9) are placed otherwise for the window than for causal work (checked below)."""

import torch

from attn_ref import assert_close_by_rule, magnitude_of
from dist_utils import run_distributed
from distattn.integrations import hf
from test_hf_packed import FAMILIES, LENGTHS, TIMEOUT_S, _alone, _doc_of_positions, documents, make_model

FAMILY = "mistral, window 3"  # test_hf_packed's Mistral has a window of 4, whose placement is the causal one's here
FAMILIES[FAMILY] = ("MistralConfig", "MistralForCausalLM", {"sliding_window": 3})  # on import: spawned ranks too
WINDOW = (2, 0)  # transformers' sliding_window = 3: the key itself and the 2 before it


def _cases(rank, world):
    import torch.distributed as dist

    from distattn.sharding import placement

    docs = documents()
    model = hf.use_distattn(make_model(FAMILY, attn="sdpa"), schedule="placed")
    batch = hf.shard_batch(docs, labels=docs, schedule="placed", window=WINDOW)
    cu = batch["cu_seq_lens"]
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], cu_seq_lens_q=cu,
                   cu_seq_lens_k=cu, max_length_q=batch["max_length"], max_length_k=batch["max_length"]).logits
    loss = hf.causal_lm_loss(logits, batch["shift_labels"])
    loss.backward()
    per_token = torch.nn.functional.cross_entropy(logits[0].float().detach(), batch["shift_labels"][0],
                                                  ignore_index=-100, reduction="none")
    n = per_token.numel()
    lay, causal = placement(cu, n, window=WINDOW), placement(cu, n)
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
    return {"loss": loss.detach(), "doc_sums": sums, "grads": grads, "moved": lay.placement != causal.placement}


def test_packed_batch_placed_for_the_window_equals_each_document_alone():
    ranks = run_distributed(_cases, 3, timeout=TIMEOUT_S)
    ref, base = _alone(FAMILY, torch.float64), _alone(FAMILY, torch.float32)
    mag = magnitude_of(*ref[2].values())
    for rank, res in enumerate(ranks):
        assert res["moved"]  # the window's placement is not the causal one here
        assert_close_by_rule("loss", res["loss"], base[0], ref[0], torch.float32)
        assert_close_by_rule("doc sums", res["doc_sums"], base[1], ref[1], torch.float32)
        for name, g in res["grads"].items():
            assert_close_by_rule(f"rank {rank} grad {name}", g, base[2][name], ref[2][name], torch.float32,
                                 magnitude=mag)


def test_the_placement_window_is_the_window_of_most_layers():
    """``hf.placement_window(config, total)``, what ``launch/train.py --pack`` passes to ``shard_batch``: the window
    most attention layers call with (transformers' ``sliding_window`` W as ``(W - 1, 0)``), else causal."""
    import transformers

    assert hf.placement_window(transformers.MistralConfig(sliding_window=64), 1000) == (63, 0)
    assert hf.placement_window(transformers.MistralConfig(sliding_window=64), 64) == (-1, -1)  # covers the stream
    assert hf.placement_window(transformers.LlamaConfig(), 1000) == (-1, -1)
    three_of_four = transformers.Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=1,
                                             num_hidden_layers=4)  # layer_types: full, then 3 sliding
    assert hf.placement_window(three_of_four, 1000) == (15, 0)
    assert hf.placement_window(transformers.Qwen2Config(sliding_window=16, num_hidden_layers=4), 1000) == (-1, -1)
    assert hf.placement_window(transformers.Gemma2Config(sliding_window=16, num_hidden_layers=4), 1000) == (-1, -1)
