"""Batch keys under ``SequenceParallelTrainer`` (issue 38): every key of a batch is passed on as the one-process
``Trainer`` passes it, or refused by name on every rank before the first step; none is dropped unseen.

``shard_inputs`` shards ``input_ids``, ``labels``, ``attention_mask`` and ``position_ids``. The flattening collator's
document boundaries (``cu_seq_lens_q/k``, ``max_length_q/k``, ``seq_idx``) restate ``position_ids``' documents:
accepted when they agree with them (a run with them equals the plain ``Trainer``'s), refused when they do not. Any
other key (``pixel_values``, ``inputs_embeds``, ``token_type_ids``, ...) is refused: the model would otherwise run
without it while one process runs with it.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import refused, run_distributed
from test_hf_trainer import (TIMEOUT_S, _assert_same_run, _launch_env, dense_data, document_data, make_model,
                             training_args)


def flatten_with_boundaries(features):
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(features)


def with_token_types(features):
    batch = {key: torch.stack([f[key] for f in features]) for key in features[0]}
    batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
    return batch


def _run(trainer_cls, collator, data, out, batch, **overrides):
    trainer = trainer_cls(model=make_model(), args=training_args(out, batch, **overrides), train_dataset=data,
                          data_collator=collator)
    trainer.train()
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    return losses, {k: v.detach().clone() for k, v in trainer.model.named_parameters()}, \
        trainer.state.num_input_tokens_seen, trainer


def _ranks(rank, world, out):
    _launch_env(rank, world)
    from distattn.integrations.hf import SequenceParallelTrainer

    res = {"boundaries": _run(SequenceParallelTrainer, flatten_with_boundaries, document_data(), out / "flat", 3)[:3]}
    state = {}

    def token_types():
        trainer = SequenceParallelTrainer(model=make_model(), args=training_args(out / "tt", 2,
                                                                                 remove_unused_columns=False),
                                          train_dataset=dense_data(), data_collator=with_token_types)
        state["trainer"] = trainer
        before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
        state["before"] = before
        trainer.train()

    res["token_type_ids"] = refused(token_types)
    trainer = state["trainer"]
    res["steps"] = trainer.state.global_step
    res["unchanged"] = all(torch.equal(v, state["before"][k]) for k, v in trainer.model.named_parameters())
    return res


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    return run_distributed(_ranks, 2, tmp_path_factory.mktemp("batch_keys"), timeout=TIMEOUT_S)


def test_flattening_boundaries_are_passed_as_one_process_passes_them(spawned, tmp_path):
    from transformers import Trainer

    reference = _run(Trainer, flatten_with_boundaries, document_data(), tmp_path, 3)[:3]
    for rank, res in enumerate(spawned):
        _assert_same_run(f"rank {rank}, flattened with cu_seq_lens/seq_idx", res["boundaries"], reference)


def test_a_key_the_model_would_lose_is_refused_on_every_rank_before_the_first_step(spawned):
    for rank, res in enumerate(spawned):
        assert "does not pass to the model: ['token_type_ids']" in res["token_type_ids"], \
            f"rank {rank}: {res['token_type_ids']}"
        assert res["steps"] == 0 and res["unchanged"], f"rank {rank}: trained before the refusal"


@pytest.mark.parametrize("key, value", [
    ("pixel_values", torch.zeros(1, 3, 4, 4)),
    ("inputs_embeds", torch.zeros(1, 6, 8)),
    ("token_type_ids", torch.zeros(1, 6, dtype=torch.long)),
    ("cache_position", torch.arange(6)),
])
def test_shard_inputs_refuses_each_key_it_would_drop(key, value):
    from distattn.integrations._hf_data import shard_inputs

    ids = torch.arange(6).unsqueeze(0)
    with pytest.raises(ValueError, match=rf"does not pass to the model: \['{key}'\]"):
        shard_inputs({"input_ids": ids, "labels": ids.clone(), key: value})


def test_boundaries_that_disagree_with_the_positions_are_refused():
    from distattn.integrations._hf_data import shard_inputs

    batch = flatten_with_boundaries([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}, {"input_ids": [6]}])
    shard_inputs(dict(batch))  # as the collator made them: accepted
    bad = dict(batch, cu_seq_lens_q=torch.tensor([0, 2, 5, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seq_lens_q does not describe the documents its position_ids do"):
        shard_inputs(bad)
    bad = dict(batch, max_length_k=2)
    with pytest.raises(ValueError, match=r"max_length_k does not describe"):
        shard_inputs(bad)
    no_positions = {k: v for k, v in batch.items() if k != "position_ids"}
    with pytest.raises(ValueError, match=r"document boundaries \['cu_seq_lens_k', 'cu_seq_lens_q', 'max_length_k', "):
        shard_inputs(no_positions)


def test_a_dense_batch_is_refused_on_the_placement():
    """``schedule="placed"`` places packed documents; dense rows have none to place (they run on "balanced" or
    "zigzag"), and ``placement_request`` asks no worker to solve them."""
    from distattn.integrations._hf_data import placed_tokens, placement_request, shard_inputs

    ids = torch.arange(12).reshape(2, 6)
    with pytest.raises(ValueError, match="places packed documents"):
        shard_inputs({"input_ids": ids, "labels": ids.clone()}, schedule="placed")
    assert placement_request({"input_ids": ids, "labels": ids.clone()}) is None
    assert placed_tokens({"input_ids": ids, "labels": ids.clone()}) is None
