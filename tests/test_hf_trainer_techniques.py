"""``SequenceParallelTrainer``'s length techniques and ``torch_compile`` against the plain ``Trainer`` on one process.

The tiny LLaMA, data and arguments of ``tests/test_hf_trainer.py`` (rows of 13 tokens, padded to 14: 7 tokens of each
of 2 rows per rank, P = 2, three SGD steps). One spawn of 2 ranks trains with each technique (``tile_loss``,
``tile_mlp``, offloaded checkpoints layer-boundary and remat, all together, ``tile_loss`` applied by the user before
the Trainer) and with ``TrainingArguments(torch_compile=True)``; every run must log the plain one-process Trainer's loss
at every step and end with its weights (``LOSS_TOL``/``WEIGHT_TOL`` of ``test_hf_trainer``: the techniques only
reorder fp32 sums). A dispatch-level probe over whole training steps holds the tiled loss to never making a tensor of
more than one tile's rows of logits (the untiled step, probed the same way, makes all 14). Refusals on one process.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import refused as _refused, run_distributed
from test_hf_trainer import (SIZES, TIMEOUT_S, _assert_same_run, _launch_env, dense_data, make_model, stack, train,
                             training_args)

pytest.importorskip("accelerate")

TILE = 4  # tokens per tile: 14 tokens per rank -> 4 tiles (the last one short)
TECHNIQUES = {
    "tile_loss": dict(tile_loss=TILE),
    "tile_mlp": dict(tile_mlp=TILE),
    "offload_checkpoints": dict(offload_checkpoints=True),
    "remat + offload_checkpoints": dict(remat=True, offload_checkpoints=True),
    "all": dict(tile_loss=TILE, tile_mlp=3, remat=True, offload_checkpoints=True),
}
PROBE_VOCAB = 96  # a vocabulary no other dimension of the model has: a (..., 96) tensor is logits or their gradient


class _LogitsProbe(torch.utils._python_dispatch.TorchDispatchMode):
    """The most rows (elements / vocabulary) of any tensor an op returns whose last dimension is the vocabulary, but
    the head's weight seen transposed, ``(hidden, vocab)``."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == self.vocab and \
                    tuple(t.shape) != (SIZES["hidden_size"], self.vocab):
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def _probed_rows(out, **trainer_kw) -> int:
    """Rows of logits of the largest logits-shaped tensor of a training step (forward and backward)."""
    from distattn.integrations.hf import SequenceParallelTrainer

    class Probed(SequenceParallelTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            with probe:
                return super().training_step(model, inputs, num_items_in_batch)

    probe = _LogitsProbe(PROBE_VOCAB)
    data = [{"input_ids": r["input_ids"] % PROBE_VOCAB, "labels": r["labels"] % PROBE_VOCAB} for r in dense_data()]
    trainer = Probed(model=make_model(vocab_size=PROBE_VOCAB), args=training_args(out, 2, max_steps=1),
                     train_dataset=data, data_collator=stack, **trainer_kw)
    trainer.train()
    return probe.rows


def _user_tiled(out):
    """``tile_loss(model, TILE)`` before the Trainer (no Trainer keyword): the Trainer keeps the user's tile."""
    from distattn.integrations.hf import SequenceParallelTrainer, tile_loss

    trainer = SequenceParallelTrainer(model=tile_loss(make_model(), TILE), args=training_args(out, 2),
                                      train_dataset=dense_data(), data_collator=stack)
    trainer.train()
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    weights = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    return losses, weights, trainer.techniques.tile_loss


def _cases(rank, world, out):
    _launch_env(rank, world)
    from distattn.integrations.hf import SequenceParallelTrainer

    res = {name: train(SequenceParallelTrainer, "dense", out / name.replace(" ", ""), 2, trainer_kw=kw)
           for name, kw in TECHNIQUES.items()}
    res["user tile_loss"] = _user_tiled(out / "user")
    res["torch_compile"] = train(SequenceParallelTrainer, "dense", out / "compiled", 2, torch_compile=True)
    res["rows, untiled"] = _probed_rows(out / "probe0")
    res["rows, tiled"] = _probed_rows(out / "probe1", tile_loss=TILE)
    # FSDP2 as a Trainer user asks for it: on CPU accelerate keeps DDP and ignores it, so it is refused
    fsdp = dict(fsdp=True, fsdp_config={"fsdp_version": 2})
    res["fsdp on CPU"] = _refused(lambda: SequenceParallelTrainer(
        model=make_model(), args=training_args(out / "fsdp", 2, **fsdp), train_dataset=dense_data(),
        data_collator=stack))
    return res


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    return run_distributed(_cases, 2, tmp_path_factory.mktemp("sp_techniques"), timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from transformers import Trainer

    return train(Trainer, "dense", tmp_path_factory.mktemp("one_process"), 2)


@pytest.mark.parametrize("case", list(TECHNIQUES) + ["torch_compile"])
def test_technique_matches_one_process(spawned, reference, case):
    """Loss logged at every step and weights after the last, on both ranks."""
    for rank, res in enumerate(spawned):
        _assert_same_run(f"rank {rank} {case}", res[case], reference)


def test_tile_loss_applied_by_the_user_is_kept(spawned, reference):
    for rank, res in enumerate(spawned):
        losses, weights, tile = res["user tile_loss"]
        assert tile == TILE, f"rank {rank}: the Trainer runs tile {tile}, the user's model {TILE}"
        _assert_same_run(f"rank {rank} user tile_loss", (losses, weights, reference[2]), reference)


def test_tiled_loss_never_makes_the_shards_logits(spawned):
    """14 tokens per rank: the untiled step holds (14, vocab) logits (the probe sees them); the tiled one at most
    one tile's (TILE, vocab), forward and backward."""
    for rank, res in enumerate(spawned):
        assert res["rows, untiled"] == 14, f"rank {rank}: the probe saw {res['rows, untiled']} rows untiled"
        assert 0 < res["rows, tiled"] <= TILE, f"rank {rank}: {res['rows, tiled']} rows of logits with tiles of {TILE}"


def test_fsdp_that_accelerate_ignores_is_refused_on_every_rank(spawned):
    for rank, res in enumerate(spawned):
        message = res["fsdp on CPU"]
        assert "asks for FSDP, but accelerate did not set it up" in message, f"rank {rank}: {message}"


# -- one process: refusals at construction ---------------------------------------------------------------------------
def _moe_model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                              moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                                              num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                              output_router_logits=True, attention_dropout=0.0))


@pytest.mark.parametrize("overrides, trainer_kw, match", [
    ({"activation_checkpointing": True}, {"remat": True},
     r"checkpoints the decoder layers itself; TrainingArguments\(activation_checkpointing=True\)"),
    ({}, {"tile_loss": 0}, r"tile_loss size must be a positive number of tokens, got 0"),
    ({}, {"tile_mlp": 2.5}, r"tile_mlp size must be a positive int"),
    ({}, {"tile_loss": 4, "model": "moe"}, r"tile_loss with Qwen3MoeForCausalLM's router loss"),
])
def test_technique_refusals(tmp_path, overrides, trainer_kw, match):
    from distattn.integrations.hf import SequenceParallelTrainer

    model = _moe_model() if trainer_kw.pop("model", None) == "moe" else make_model()
    with pytest.raises(ValueError, match=match):
        SequenceParallelTrainer(model=model, args=training_args(tmp_path, 2, **overrides), train_dataset=dense_data(),
                                data_collator=stack, **trainer_kw)
