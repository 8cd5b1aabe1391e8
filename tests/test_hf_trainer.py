"""``SequenceParallelTrainer`` (distattn.integrations._hf_trainer) against the same ``Trainer`` run on one process.

A tiny ``LlamaForCausalLM`` (from a config, the same weights everywhere) trains a few SGD steps on a tiny in-memory
dataset. Every case compares the loss that ``Trainer`` logs at every step and the weights after the last step
with a plain ``transformers.Trainer`` on one process that sees the same global batches (``D`` replicas of batch
``b`` there = one batch of ``D * b`` here, in the same random order). One spawn per world size runs every case:

* 2 ranks (P = 2): dense rows of odd length (padded to a multiple of P) with gradient accumulation 2; flattened
  documents (``DataCollatorWithFlattening``, odd total length), on contiguous shards and on ``schedule="placed"``
  (the placement of each batch's documents, solved ahead in worker processes); and two bad inputs: a sampler that
  deals different batches to the ranks of the group, and a two-dimensional group whose Ulysses ranks do not split
  the heads;
* 4 ranks (data parallel 2 x sequence parallel 2): rows padded with an ``attention_mask`` (a different number of
  target tokens per replica: the loss is the token mean over both; with ``average_tokens_across_devices=False``, the
  mean of each replica's token mean, as DDP averages them); a checkpoint at step 4 (in the second epoch),
  and a new trainer that resumes from it ends with the same weights; and ``sequence_parallel_size=3``, refused.

Trainer's count of the tokens seen (``include_num_input_tokens_seen``: ``"all"`` on the dense rows, ``"non_padding"``
on the padded ones) equals one process's: the padding sharding adds is not counted, and each replica's batch once.

Every bad input raises on every rank, before the first step (``global_step`` is still 0).
"""

from __future__ import annotations

import os

import pytest
import torch

from dist_utils import refused as _refused, run_distributed

pytest.importorskip("accelerate")

TIMEOUT_S = 300  # a spawn of 4 ranks, each importing transformers + accelerate and training, on a shared 2-core box
LOSS_TOL = 1e-5  # fp32 token mean over ~100 targets (loss ~4): the sharded sums differ from one process in rounding
WEIGHT_TOL = 1e-6  # a few SGD steps of lr 0.1 on gradients that agree to ~1e-7; a gradient off by P moves ~1e-2
VOCAB, SEQ = 64, 13  # SEQ odd: a multiple of neither 2 nor the 4 chunks of 2 ranks' layout; padded by the trainer
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, attention_dropout=0.0)


# -- model, data, arguments (both sides) -------------------------------------------------------------------------------
def make_model(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**SIZES, **overrides}))


def dense_data(n: int = 12):
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, VOCAB, (SEQ,), generator=g) for _ in range(n)]
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def document_data(n: int = 12):
    """Documents of 2 to 10 tokens (lists, as a tokenizer returns them)."""
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(2, 11, (n,), generator=g).tolist()
    return [{"input_ids": torch.randint(0, VOCAB, (k,), generator=g).tolist()} for k in lengths]


def stack(features):
    return {key: torch.stack([f[key] for f in features]) for key in features[0]}


def pad_right(features):
    """Rows padded on the right to the longest, labels -100 and attention_mask 0 on the padding."""
    longest = max(len(f["input_ids"]) for f in features)
    out = {"input_ids": [], "labels": [], "attention_mask": []}
    for f in features:
        ids, tail = torch.tensor(f["input_ids"]), longest - len(f["input_ids"])
        out["input_ids"].append(torch.cat([ids, torch.zeros(tail, dtype=ids.dtype)]))
        out["labels"].append(torch.cat([ids, torch.full((tail,), -100, dtype=ids.dtype)]))
        out["attention_mask"].append(torch.cat([torch.ones_like(ids), torch.zeros(tail, dtype=ids.dtype)]))
    return {key: torch.stack(rows) for key, rows in out.items()}


def flatten(features):
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening()(features)


COLLATORS = {"dense": (dense_data, stack), "padded": (document_data, pad_right),
             "flattened": (document_data, flatten)}


def training_args(out, batch, **overrides):
    from transformers import TrainingArguments

    kw = dict(output_dir=str(out), use_cpu=True, per_device_train_batch_size=batch, max_steps=3, logging_steps=1,
              save_strategy="no", report_to=[], optim="sgd", learning_rate=0.1, lr_scheduler_type="constant", seed=0,
              disable_tqdm=True, dataloader_num_workers=0)
    return TrainingArguments(**{**kw, **overrides})


def train(trainer_cls, data, out, batch, resume=None, trainer_kw=None, **overrides):
    """(logged loss per step, weights) of one run."""
    dataset, collator = COLLATORS[data]
    trainer = trainer_cls(model=make_model(), args=training_args(out, batch, **overrides), train_dataset=dataset(),
                          data_collator=collator, **(trainer_kw or {}))
    trainer.train(resume_from_checkpoint=resume)
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    weights = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    return losses, weights, trainer.state.num_input_tokens_seen


# -- spawned side ----------------------------------------------------------------------------------------------------
def _launch_env(rank: int, world: int) -> None:
    """What torchrun would set: accelerate reads these (the process group itself is already up)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


def _differing_sampler_trainer():
    """The mistake the digest check exists for: the Trainer's own sampler, dealt by accelerate to every rank."""
    from distattn.integrations.hf import SequenceParallelTrainer

    class PerRankSampling(SequenceParallelTrainer):
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    return PerRankSampling


def _cases_2(rank, world, out):
    _launch_env(rank, world)
    import distattn
    from distattn.integrations.hf import SequenceParallelTrainer

    res = {"dense": train(SequenceParallelTrainer, "dense", out / "dense", 2, gradient_accumulation_steps=2,
                          include_num_input_tokens_seen="all"),
           "flattened": train(SequenceParallelTrainer, "flattened", out / "flat", 3)}
    res["flattened, placed"], res["placement sources"] = _placed_run(out / "placed")
    res["placement requests"] = _placement_requests()
    state = {}

    def differing():
        trainer_cls = _differing_sampler_trainer()
        trainer = trainer_cls(model=make_model(), args=training_args(out / "bad", 2), train_dataset=dense_data(),
                              data_collator=stack)
        state["trainer"] = trainer
        trainer.train()

    res["sampler differs"] = _refused(differing)
    res["steps before the error"] = state["trainer"].state.global_step
    heads = dict(hidden_size=24, num_attention_heads=3, num_key_value_heads=3)  # 3 heads over 2 Ulysses ranks
    res["heads"] = _refused(lambda: SequenceParallelTrainer(
        model=make_model(**heads), args=training_args(out / "heads", 2), train_dataset=dense_data(),
        data_collator=stack, group=distattn.make_2d_groups(2)))
    return res


def _placed_run(out):
    """The flattened run on ``schedule="placed"``, its workers started first (so that the steps after the first take
    their placements from them, not inline: deterministic, not a race with the workers' start)."""
    from distattn.integrations.hf import SequenceParallelTrainer
    from distattn.schedule import ahead

    assert ahead.start(2, wait=120), "the placement workers did not start"
    made = []

    class Recorded(SequenceParallelTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    run = train(Recorded, "flattened", out, 3, trainer_kw={"schedule": "placed"})
    return run, dict(made[0].placement_sources)


def _placement_requests():
    """What the trainer hands to the workers (``placement_request``: documents, tokens per rank) against what
    ``shard_inputs`` then places (its ``cu_seq_lens``, this rank's tokens), for a flattened batch and a batch padded
    with an attention mask, of an odd number of real tokens (so both are padded to a multiple of P); and the stream's
    tokens ``placed_tokens`` reads off the batch (the window's input) against the tokens ``shard_inputs`` placed."""
    import torch.distributed as dist

    from distattn.integrations._hf_data import placed_tokens, placement_request, shard_inputs

    features = document_data(12)
    k = next(k for k in range(1, 13) if sum(len(f["input_ids"]) for f in features[:k]) % 2)
    requests = []
    for batch in (flatten(features[:k]), pad_right(features[:k])):
        out = shard_inputs(batch, schedule="placed")
        n = out["input_ids"].shape[1]
        requests.append((placement_request(batch) + (placed_tokens(batch),),
                         (out["cu_seq_lens"].tolist(), n, n * dist.get_world_size())))
    return requests


def _cases_4(rank, world, out):
    _launch_env(rank, world)
    from distattn.integrations.hf import SequenceParallelTrainer

    sp2 = {"sequence_parallel_size": 2}
    res = {"padded": train(SequenceParallelTrainer, "padded", out / "padded", 1, trainer_kw=sp2,
                           include_num_input_tokens_seen="non_padding"),
           "padded, replica means": train(SequenceParallelTrainer, "padded", out / "replica_means", 1, trainer_kw=sp2,
                                          average_tokens_across_devices=False)}
    # 3 steps an epoch; step 4 starts epoch 1, the resumed run skips its trained batches and replays epoch 1's order
    saving = dict(max_steps=5, gradient_accumulation_steps=2, save_strategy="steps", save_steps=4)
    res["saved"] = train(SequenceParallelTrainer, "dense", out / "ckpt", 1, trainer_kw=sp2, **saving)
    res["resumed"] = train(SequenceParallelTrainer, "dense", out / "ckpt", 1, trainer_kw=sp2,
                           resume=str(out / "ckpt" / "checkpoint-4"), **saving)
    res["sp 3"] = _refused(lambda: SequenceParallelTrainer(
        model=make_model(), args=training_args(out / "sp3", 1), train_dataset=dense_data(), data_collator=stack,
        sequence_parallel_size=3))
    return res


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp_trainer")
    return {world: run_distributed(fn, world, out / f"world{world}", timeout=TIMEOUT_S)
            for world, fn in ((2, _cases_2), (4, _cases_4))}


# -- one process -----------------------------------------------------------------------------------------------------
def _replica_means_trainer():
    from transformers import Trainer

    class ReplicaMeans(Trainer):
        """``average_tokens_across_devices=False`` on ``D`` replicas of one row each, on one process: every row's
        token mean (what each replica's loss is), averaged over the rows (what DDP does to the gradients, and
        ``Trainer`` to the logged loss)."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            rows = range(inputs["input_ids"].shape[0])
            means = [model(**{k: v[i:i + 1] for k, v in inputs.items()}).loss for i in rows]
            return torch.stack(means).mean()

    return ReplicaMeans


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The same runs with plain ``Trainer`` on one process (batch: the replicas' batches together)."""
    from transformers import Trainer

    out = tmp_path_factory.mktemp("one_process")
    return {"dense": train(Trainer, "dense", out / "dense", 2, gradient_accumulation_steps=2,
                           include_num_input_tokens_seen="all"),
            "flattened": train(Trainer, "flattened", out / "flat", 3),
            "padded": train(Trainer, "padded", out / "padded", 2, include_num_input_tokens_seen="non_padding"),
            "replica means": train(_replica_means_trainer(), "padded", out / "replica_means", 2),
            "saved": train(Trainer, "dense", out / "ckpt", 2, max_steps=5, gradient_accumulation_steps=2)}


def _assert_same_run(label, ours, reference, steps=None):
    losses, weights, tokens = ours
    ref_losses, ref_weights, ref_tokens = reference
    if steps is None:  # a whole run: Trainer's count of the tokens seen (the resumed one restores it)
        assert tokens == ref_tokens, f"{label}: {tokens} input tokens seen, one process {ref_tokens}"
    steps = sorted(ref_losses) if steps is None else steps
    assert set(steps) <= set(losses), f"{label}: logged steps {sorted(losses)}, wanted {steps}"
    for step in steps:
        assert abs(losses[step] - ref_losses[step]) <= LOSS_TOL, \
            f"{label}: step {step} logged loss {losses[step]!r}, one process {ref_losses[step]!r}"
    for name, w in ref_weights.items():
        err = float((weights[name] - w).abs().max())
        assert err <= WEIGHT_TOL, f"{label}: {name} differs from one process by {err:.3g} after {steps[-1]} steps"


CASES = [(2, "dense", "dense"), (2, "flattened", "flattened"), (2, "flattened, placed", "flattened"),
         (4, "padded", "padded"), (4, "saved", "saved"),
         (4, "padded, replica means", "replica means")]


@pytest.mark.parametrize("world, case, reference", CASES)
def test_trainer_matches_one_process(spawned, references, world, case, reference):
    """Loss logged at every step and weights after the last, on every rank."""
    for rank, res in enumerate(spawned[world]):
        _assert_same_run(f"world {world} rank {rank} {case}", res[case], references[reference])


def test_placed_steps_take_their_placements_solved_ahead(spawned):
    """``schedule="placed"``: the first step's placement is solved inline, the next steps' by the workers while the
    steps before ran (each step takes the next two micro-batches ahead); the requests handed to them are the streams
    ``shard_inputs`` places, its padding included."""
    for rank, res in enumerate(spawned[2]):
        assert res["placement sources"] == {"ahead": 2, "inline": 1, "cached": 0}, (rank, res["placement sources"])
        for asked, placed in res["placement requests"]:
            assert asked == placed, (rank, asked, placed)


def test_resume_from_a_checkpoint_continues_the_same_run(spawned, references):
    for rank, res in enumerate(spawned[4]):
        _assert_same_run(f"rank {rank} resumed at step 4", res["resumed"], references["saved"], steps=[5])


def test_bad_input_raises_on_every_rank_before_the_first_step(spawned):
    for rank, res in enumerate(spawned[2]):
        assert "ranks of a sequence-parallel group hold different batches at optimizer step 1" in \
            res["sampler differs"], f"rank {rank}: {res['sampler differs']}"
        assert res["steps before the error"] == 0, f"rank {rank} trained {res['steps before the error']} steps"
        assert res["heads"].startswith("use_distattn with a two-dimensional group:"), f"rank {rank}: {res['heads']}"
    for rank, res in enumerate(spawned[4]):
        assert "sequence_parallel_size=3 must be a positive int that divides the world size (4 ranks)" in \
            res["sp 3"], f"rank {rank}: {res['sp 3']}"


# -- one process: what is refused at construction, and the data order ------------------------------------------------
class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(dense_data())


@pytest.mark.parametrize("overrides, trainer_kw, match", [
    ({"label_smoothing_factor": 0.1}, {}, r"label_smoothing_factor=0.1 is not supported with sequence parallelism"),
    ({"eval_strategy": "steps"}, {"eval_dataset": dense_data(2)}, r"evaluation is not supported with sequence"),
    ({"train_sampling_strategy": "group_by_length"}, {}, r"train_sampling_strategy='group_by_length' is not supported"),
    ({}, {"train_dataset": _Stream()}, r"an IterableDataset cannot be dealt to sequence-parallel replicas"),
    ({}, {"compute_loss_func": lambda *a, **k: 0.0}, r"compute_loss_func is not used with sequence parallelism"),
    ({}, {"sequence_parallel_size": 2}, r"sequence_parallel_size=2 needs that many ranks, but this run has 1 process"),
])
def test_unsupported_arguments_are_refused_at_construction(tmp_path, overrides, trainer_kw, match):
    from distattn.integrations.hf import SequenceParallelTrainer

    kw = {"train_dataset": dense_data(), **trainer_kw}
    with pytest.raises(ValueError, match=match):
        SequenceParallelTrainer(model=make_model(), args=training_args(tmp_path, 2, **overrides), data_collator=stack,
                                **kw)


def test_replica_sampler_deals_each_replica_its_batch_on_every_rank():
    """4 ranks, replicas {0, 2} and {1, 3} (not consecutive): a round-robin dealer gives each rank its replica's
    batch; the replicas' batches together are one process's batches of 2 * 3, in the same order; a short last round
    wraps around."""
    from distattn.integrations.hf import ReplicaSampler

    replica, batch, n = [0, 1, 0, 1], 3, 10
    sampler = ReplicaSampler(n, batch, replica, seed=5)
    sampler.set_epoch(1)
    batches = list(torch.utils.data.BatchSampler(sampler, batch, drop_last=False))
    assert len(batches) == 2 * len(replica)  # ceil(10 / 6) rounds, one batch per rank
    dealt = {rank: batches[rank::len(replica)] for rank in range(len(replica))}  # BatchSamplerShard's round-robin
    assert dealt[0] == dealt[2] and dealt[1] == dealt[3]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(5 + 1)).tolist()
    one_process = [order[i:i + 2 * batch] for i in range(0, n, 2 * batch)]
    assert [dealt[0][k] + dealt[1][k] for k in range(2)] == [one_process[0], one_process[1] + order[:2]]
    assert len(ReplicaSampler(n, batch, replica, drop_last=True)) == 1 * len(replica) * batch


# -- GPU tier: the collectives' CUDA tensors ---------------------------------------------------------------------------
def _collectives_on_cuda(rank, world):
    from distattn.integrations._hf_data import bounded_all_reduce, check_same_batches

    device = torch.device("cuda", 0)  # the ranks share one GPU over gloo (NCCL refuses two ranks on one device)
    same = [{"input_ids": torch.arange(6)}]
    check_same_batches(same, device=device)  # equal batches: no error
    try:
        check_same_batches([{"input_ids": torch.arange(6) + rank}], device=device)
        differing = "no error"
    except ValueError as exc:
        differing = str(exc)
    count = torch.tensor([rank + 1.0], device=device)
    bounded_all_reduce(count, None, "counting the step's target tokens")  # over the world (no group), as the Trainer
    return differing, float(count)


# CUDA-only: _hf_data.bounded_all_reduce polls the CUDA work of its bounded waits (the digest check, the token count)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_trainer_collectives_on_cuda_over_gloo():
    """The batch-digest check and the token count on CUDA tensors: the same error on both ranks for differing
    batches, and the count summed over the world."""
    per_rank = run_distributed(_collectives_on_cuda, 2, timeout=TIMEOUT_S)
    for differing, count in per_rank:
        assert "hold different batches" in differing, differing
        assert count == 3.0
    assert per_rank[0][0] == per_rank[1][0]
