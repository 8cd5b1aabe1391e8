"""The MoE router's load-balancing loss under ``SequenceParallelTrainer``, against one process with ``Trainer``.

transformers' MoE causal LMs (Qwen3-MoE, Mixtral, ...) built with ``output_router_logits=True`` add
``router_aux_loss_coef * aux`` to the loss, where ``aux = E * sum_e f_e * P_e`` takes ``f_e`` (the share of top-k
assignments that go to expert ``e``) and ``P_e`` (its mean router probability) over every token of the batch (all
layers, under the attention mask). Split over ranks, the whole sequence's ``f`` and ``P`` are sums over the shards, not
a mean of the shards' losses; each rank's gradient must be its share of the whole sequence's.

Every case compares the loss ``Trainer`` logs at every step and the weights after the last with a plain
``transformers.Trainer`` on one process that sees the same global batches (as in ``test_hf_trainer``), on tiny
Qwen3-MoE and Mixtral models built from a config:

* 2 ranks (P = 2): Qwen3-MoE on dense rows of odd length (the padding the sharding adds is not a token of the loss)
  with gradient accumulation 2 (each micro-batch's aux is added whole, as ``Trainer`` does); Mixtral on flattened
  documents; ``load_balancing_loss`` on sharded router logits against transformers' own function on the whole
  logits (value and gradient, with a padding mask); a model whose ``aux_loss`` is not that loss, refused on every rank;
* 4 ranks: Qwen3-MoE, 2 replicas x P = 2, on rows padded with an ``attention_mask`` (the aux over both replicas'
  tokens, as one process; with ``average_tokens_across_devices=False`` each replica's own, averaged); Mixtral with
  P = 4 on dense rows;
* GPU tier: ``load_balancing_loss`` on CUDA shards against transformers' function on CUDA.

``python tests/test_hf_moe.py`` prints the loss and weight differences from one process after 5 steps on 2 ranks
(Qwen3-MoE, the default coefficient 0.001), the figures of the issue.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # dist_utils and test_hf_trainer when run as a script

from dist_utils import refused, run_distributed
from test_hf_trainer import (_launch_env, _replica_means_trainer, dense_data, document_data, flatten,
                             pad_right, stack, training_args)

pytest.importorskip("accelerate")

TIMEOUT_S = 420  # 5 + 3 trainings of 3 steps on 4 ranks, each importing transformers' MoE models, on 2 shared cores
LOSS_TOL = 1e-5  # as test_hf_trainer: fp32 token means (loss ~4); a per-shard aux moves the loss by ~1e-3 (coef 0.05)
WEIGHT_TOL = 1e-6  # a few SGD steps of lr 0.1 on gradients that agree to ~1e-7; without the aux they differ by ~1e-3
AUX_TOL = 1e-6  # one fp32 load-balancing loss (~2) and its logit gradients (~1e-2): sums in another order
COEF = 0.05  # router_aux_loss_coef of the test models: 50x the default, so a wrong combination shows in the weights
VOCAB = 64
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              attention_dropout=0.0, output_router_logits=True, router_aux_loss_coef=COEF, num_experts_per_tok=2)
MODELS = {"qwen3": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                    dict(intermediate_size=64, moe_intermediate_size=16, num_experts=8, head_dim=8)),
          "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=32, num_local_experts=4))}
COLLATORS = {"dense": (dense_data, stack), "padded": (document_data, pad_right), "flattened": (document_data, flatten)}


def make_model(kind: str, **overrides):
    import transformers

    config_name, model_name, sizes = MODELS[kind]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**{**COMMON, **sizes, **overrides})
    return getattr(transformers, model_name)(config)


def train(trainer_cls, kind, data, out, batch, trainer_kw=None, model_kw=None, **overrides):
    """(logged loss per step, weights) of one run."""
    dataset, collator = COLLATORS[data]
    trainer = trainer_cls(model=make_model(kind, **(model_kw or {})), args=training_args(out, batch, **overrides),
                          train_dataset=dataset(), data_collator=collator, **(trainer_kw or {}))
    trainer.train()
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    weights = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    return losses, weights



# -- spawned side ----------------------------------------------------------------------------------------------------
def _doubled_aux_model():
    """A model whose ``aux_loss`` is not the load-balancing loss of its router logits (twice it)."""
    from transformers import Qwen3MoeForCausalLM

    class DoubledAux(Qwen3MoeForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  labels=labels, **kwargs)  # named: Trainer keeps the batch's columns the forward names
            out.aux_loss = out.aux_loss * 2
            return out

    return DoubledAux(make_model("qwen3").config)


def _sharded_logits(rank, world):
    """Router logits of 2 layers, a (2, 12) batch with padding, split over the ranks by sequence position: the whole
    logits and mask, and this rank's (leaves, to read their gradients)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 2, 12, 6, generator=g)  # (layer, batch, seq, experts)
    mask = torch.ones(2, 12, dtype=torch.int64)
    mask[0, 9:], mask[1, :2] = 0, 0  # right padding on one row, left on the other
    n = 12 // world
    mine = logits[:, :, rank * n:(rank + 1) * n].clone().requires_grad_(True)
    return logits, mask, mine, mask[:, rank * n:(rank + 1) * n]


def _loss_on_shards(rank, world, device="cpu"):
    from distattn.integrations.hf import load_balancing_loss

    _, _, mine, mine_mask = _sharded_logits(rank, world)
    mine = mine.detach().to(device).requires_grad_(True)
    loss = load_balancing_loss(tuple(mine), top_k=2, token_mask=mine_mask.to(device))
    loss.backward()
    return float(loss), mine.grad.cpu()


def _cases_2(rank, world, out):
    _launch_env(rank, world)
    from distattn.integrations.hf import SequenceParallelTrainer

    res = {"qwen3 dense": train(SequenceParallelTrainer, "qwen3", "dense", out / "dense", 2,
                                gradient_accumulation_steps=2),
           "mixtral flattened": train(SequenceParallelTrainer, "mixtral", "flattened", out / "flat", 3),
           "function": _loss_on_shards(rank, world)}
    state = {}

    def doubled():
        state["trainer"] = SequenceParallelTrainer(model=_doubled_aux_model(), args=training_args(out / "bad", 2),
                                                   train_dataset=dense_data(), data_collator=stack)
        state["trainer"].train()

    res["doubled aux"] = refused(doubled)
    res["steps before the error"] = state["trainer"].state.global_step
    return res


def _cases_4(rank, world, out):
    _launch_env(rank, world)
    from distattn.integrations.hf import SequenceParallelTrainer

    sp2 = {"sequence_parallel_size": 2}
    return {"qwen3 padded": train(SequenceParallelTrainer, "qwen3", "padded", out / "padded", 1, trainer_kw=sp2),
            "qwen3 padded, replica means": train(SequenceParallelTrainer, "qwen3", "padded", out / "means", 1,
                                                 trainer_kw=sp2, average_tokens_across_devices=False),
            "mixtral dense": train(SequenceParallelTrainer, "mixtral", "dense", out / "dense", 2)}


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp_moe")
    return {world: run_distributed(fn, world, out / f"world{world}", timeout=TIMEOUT_S)
            for world, fn in ((2, _cases_2), (4, _cases_4))}


# -- one process -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The same runs with plain ``Trainer`` on one process (batch: the replicas' batches together)."""
    from transformers import Trainer

    out = tmp_path_factory.mktemp("moe_one_process")
    return {"qwen3 dense": train(Trainer, "qwen3", "dense", out / "dense", 2, gradient_accumulation_steps=2),
            "mixtral flattened": train(Trainer, "mixtral", "flattened", out / "flat", 3),
            "qwen3 padded": train(Trainer, "qwen3", "padded", out / "padded", 2),
            "qwen3 padded, replica means": train(_replica_means_trainer(), "qwen3", "padded", out / "means", 2),
            "mixtral dense": train(Trainer, "mixtral", "dense", out / "mixtral", 2)}


CASES = [(2, "qwen3 dense"), (2, "mixtral flattened"), (4, "qwen3 padded"), (4, "qwen3 padded, replica means"),
         (4, "mixtral dense")]


@pytest.mark.parametrize("world, case", CASES)
def test_moe_trainer_matches_one_process(spawned, references, world, case):
    """Loss logged at every step and weights after the last, on every rank, with the router loss counted."""
    ref_losses, ref_weights = references[case]
    for rank, (losses, weights) in enumerate(spawned[world][r][case] for r in range(world)):
        assert sorted(losses) == sorted(ref_losses), f"rank {rank} {case}: logged steps {sorted(losses)}"
        for step, ref in ref_losses.items():
            assert abs(losses[step] - ref) <= LOSS_TOL, \
                f"rank {rank} {case}: step {step} logged loss {losses[step]!r}, one process {ref!r}"
        for name, w in ref_weights.items():
            err = float((weights[name] - w).abs().max())
            assert err <= WEIGHT_TOL, f"rank {rank} {case}: {name} differs from one process by {err:.3g}"


def _whole_sequence_loss(device="cpu"):
    """transformers' loss of the whole logits of ``_sharded_logits`` and their gradient, on ``device``."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    logits, mask, _, _ = _sharded_logits(0, 2)
    whole = logits.to(device).requires_grad_(True)
    expected = load_balancing_loss_func(tuple(whole.flatten(1, 2)), 6, 2, mask.to(device))
    expected.backward()
    return float(expected.detach()), whole.grad.cpu()


def _assert_shards_match(per_rank, expected, whole_grad):
    """Every rank's value is the whole sequence's; its gradient is its slice of the whole logits' gradient."""
    for rank, (value, grad) in enumerate(per_rank):
        assert abs(value - expected) <= AUX_TOL, f"rank {rank}: {value!r}, transformers {expected!r}"
        n = grad.shape[2]
        err = float((grad - whole_grad[:, :, rank * n:(rank + 1) * n]).abs().max())
        assert err <= AUX_TOL, f"rank {rank}: the logits' gradient differs from transformers' slice by {err:.3g}"


def test_load_balancing_loss_on_shards_is_transformers_on_the_whole_sequence(spawned):
    """``load_balancing_loss`` on 2 shards (with padding) against transformers' function on the whole logits; the mean
    of the shards' own losses is another number."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    expected, whole_grad = _whole_sequence_loss()
    _assert_shards_match([res["function"] for res in spawned[2]], expected, whole_grad)
    logits, mask, _, _ = _sharded_logits(0, 2)
    per_shard = [float(load_balancing_loss_func(tuple(logits[:, :, r * 6:(r + 1) * 6].flatten(1, 2)), 6, 2,
                                                mask[:, r * 6:(r + 1) * 6])) for r in range(2)]
    assert abs(sum(per_shard) / 2 - expected) > 100 * AUX_TOL  # the test tells the two apart


def test_a_model_whose_aux_loss_is_another_is_refused_on_every_rank(spawned):
    for rank, res in enumerate(spawned[2]):
        assert "DoubledAux's aux_loss is not transformers' load-balancing loss of its router_logits with top_k=2" \
            in res["doubled aux"], f"rank {rank}: {res['doubled aux']}"
        assert res["steps before the error"] == 0, f"rank {rank} trained {res['steps before the error']} steps"


def _loss_on_cuda_shards(rank, world):
    return _loss_on_shards(rank, world, device="cuda")


# CUDA-only: transformers counts the top-k assignments with histc on int32 on CUDA (float on CPU); the sums and the
# all-reduce of load_balancing_loss on CUDA tensors (the ranks share one GPU over gloo, as test_hf_trainer's GPU test)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_load_balancing_loss_on_cuda_shards():
    per_rank = run_distributed(_loss_on_cuda_shards, 2, timeout=TIMEOUT_S)
    _assert_shards_match(per_rank, *_whole_sequence_loss("cuda"))


# -- the figures: python tests/test_hf_moe.py -----------------------------------------------------------------
def _measure_rank(rank, world, out):
    _launch_env(rank, world)
    from distattn.integrations.hf import SequenceParallelTrainer

    return train(SequenceParallelTrainer, "qwen3", "dense", out / "sp", 2, model_kw={"router_aux_loss_coef": 0.001},
                 max_steps=5)


def _differences(ours, reference):
    (losses, weights), (ref_losses, ref_weights) = ours, reference
    loss = max(abs(losses[s] - ref_losses[s]) for s in ref_losses)
    weight = max(float((weights[k] - w).abs().max()) for k, w in ref_weights.items())
    return loss, weight


def main():
    import tempfile

    from transformers import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        ours = run_distributed(_measure_rank, 2, out, timeout=TIMEOUT_S)[0]
        kw = dict(max_steps=5)
        with_aux = train(Trainer, "qwen3", "dense", out / "one", 2, model_kw={"router_aux_loss_coef": 0.001}, **kw)
        without = train(Trainer, "qwen3", "dense", out / "none", 2, model_kw={"router_aux_loss_coef": 0.0}, **kw)
    print("Qwen3-MoE, 2 ranks vs one process, 5 SGD steps (lr 0.1), dense rows of 13 tokens, batch 2, coef 0.001")
    for label, reference in (("plain Trainer", with_aux), ("plain Trainer without the aux loss", without)):
        loss, weight = _differences(ours, reference)
        print(f"  vs {label:36s} max |loss diff| over steps {loss:.3g}, max |weight diff| {weight:.3g}")


if __name__ == "__main__":
    main()
