"""Hugging Face ``Trainer`` with distattn sequence parallelism (re-exported lazily by ``distattn.integrations.hf``).

``SequenceParallelTrainer`` is ``transformers.Trainer`` plus five things (``SequenceParallelMixin`` adds them to
another ``Trainer`` subclass: ``class MyTrainer(SequenceParallelMixin, SFTTrainer)``):

1. the model's attention is distattn's (``use_distattn(model, group, schedule)``), checked before any step;
2. **the data**: every rank of a sequence-parallel group gets the same batch and the ``D`` data-parallel replicas
   (the groups) get consecutive ones: the training sampler is a ``ReplicaSampler`` that accelerate's own
   ``prepare`` (its round-robin ``BatchSamplerShard``) deals out; each optimizer step's micro-batches are checked to
   be the same on every rank of a group (``check_same_batches``: one all-reduce of a digest) before they are
   sharded (``shard_inputs``: dense, padded, or flattened ``position_ids``; any length);
3. **the loss** is the step's token mean over all ranks, micro-batches and replicas, as one process computes it
   (``get_batch_samples`` counts the step's targets; ``compute_loss`` sums the cross-entropy over the group), plus
   an MoE model's router load-balancing loss (``output_router_logits=True``) over each micro-batch's whole sequence,
   as one process adds it (``_hf_router``: the shards' expert counts and router-probability sums are all-reduced);
4. **the gradient**: DDP (what ``Trainer`` wraps the model in under ``torchrun``) or FSDP2 (``fsdp_config=
   {"fsdp_version": 2}``, where accelerate runs it: GPUs) sums over the group and averages over the replicas
   (``_hf_techniques.reduce_over_group``, before the first backward; under ``torch_compile=True`` on the wrapper
   inside the compiled module);
5. **the logged loss** is that mean (each rank of a group returns the same value; ``Trainer`` averages the ranks).

The length techniques (``tile_loss=``, ``tile_mlp=``, ``remat=``, ``offload_checkpoints=``; ``_hf_techniques``) are
applied to the model at construction; with ``tile_loss`` the loss is the model's tiled head + cross-entropy
(``compute_loss`` passes the shard's ``shift_labels`` and sums ``loss_sum``), so no logits are made.

The groups: by default the world is one sequence-parallel group (``D = 1``); ``sequence_parallel_size=P`` makes
``D = world / P`` groups of ``P`` consecutive ranks; ``group=`` takes any distattn group (a ``ProcessGroup``, a
two-dimensional ``(ulysses_group, ring_group)`` pair, a ``DeviceMesh``) whose copies tile the world.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import Trainer, TrainerCallback

from distattn.integrations._hf_attention import placement_window, use_distattn
from distattn.integrations._hf_data import (IGNORE_INDEX, ReplicaSampler, bounded_all_reduce, check_same_batches,
                                            documents_kwargs, placed_tokens, placement_request, replica_of_ranks,
                                            shard_inputs)
from distattn.integrations._hf_router import (balancing_loss, balancing_sums, model_aux_mismatch, outputs_router_logits,
                                              refuse_other_losses, router_loss_terms)
from distattn.integrations._hf_techniques import (TrainerTechniques, apply_techniques, reduce_over_group,
                                                  refuse_ignored_fsdp)
from distattn.integrations._hf_tiling import global_mean
from distattn.sharding import _world, placement_source

__all__ = ["SequenceParallelMixin", "SequenceParallelTrainer"]

_SAMPLING = ("random", "sequential")  # the train_sampling_strategy values whose order ReplicaSampler reproduces


def sequence_parallel_groups(sequence_parallel_size: int):
    """This rank's group of ``D = world / P`` consecutive blocks of ``P`` ranks (``None`` when ``P`` is the world).
    Every rank creates every group (``new_group`` is collective), after the same size check."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if not isinstance(sequence_parallel_size, int) or sequence_parallel_size < 1 or world % sequence_parallel_size:
        raise ValueError(f"sequence_parallel_size={sequence_parallel_size!r} must be a positive int that divides the "
                         f"world size ({world} ranks): the world is D data-parallel replicas of P ranks each; pick P "
                         f"among the divisors {[p for p in range(1, world + 1) if world % p == 0]}")
    if sequence_parallel_size == world:
        return None
    p = sequence_parallel_size
    groups = [dist.new_group(list(range(d * p, (d + 1) * p))) for d in range(world // p)]
    return groups[rank // p]


_TOKENS_KEY = "distattn_input_tokens"  # a sharded micro-batch's token count before sharding (``_input_tokens``)
PLACEMENT_AHEAD = 2
"""``schedule="placed"``: micro-batches taken from the data ahead of the step that trains them, their placements
solved meanwhile in as many worker processes (``distattn.sharding.solve_ahead``; ``launch/train.py``'s ``AHEAD``)."""


class SequenceParallelMixin:
    """Sequence parallelism for a ``transformers.Trainer`` subclass (put it first among the bases).

    Args (keyword-only, before the Trainer's own):
        group: the sequence-parallel group (``None``: the world, or blocks of ``sequence_parallel_size`` ranks).
        sequence_parallel_size: ``P``; the world is ``world / P`` data-parallel replicas of ``P`` consecutive ranks.
        schedule: distattn's schedule (``"balanced"``, ``"ring"``, ``"zigzag"``, ``"auto"``), as for
            ``use_distattn``; ``"placed"``: packed documents (``DataCollatorWithFlattening``, or rows padded with an
            ``attention_mask``) on the work-balanced placement of each micro-batch's documents, solved for the
            window most of the model's layers run with (``placement_window``). Each step also takes the next
            :data:`PLACEMENT_AHEAD` micro-batches from the data and hands their placements to worker processes, so
            that a step waits only for what is left of its solve (``placement_sources`` counts where each came
            from: ``"ahead"``, a worker's; ``"inline"`` or ``"cached"``).
        backend: kernel backend for ``use_distattn`` (``None``: the best on the model's device).
        pad_id: token id of the padding ``shard_inputs`` appends (``None``: the processing class's pad token,
            else 0; no real token ever sees it).
        tile_loss: tokens per tile of the LM head + loss (``_hf_tiling.tile_loss``): the ``(tokens, vocab)`` logits
            never exist (a model the user wrapped with ``tile_loss`` keeps its tile); ``None``: untiled.
        tile_mlp: tokens per tile of every decoder layer's MLP (``_hf_tiling.tile_mlp``); ``None``: untiled.
        remat: checkpoint every decoder layer at attention's output (``enable_remat_checkpointing``).
        offload_checkpoints: what each layer's checkpoint keeps waits in host memory (``offload_checkpoints``;
            layer-boundary checkpointing, or remat's with ``remat=True``).

    Raises (on every rank, before any step): ``ValueError`` for a ``sequence_parallel_size`` that does not divide
    the world, both ``group`` and ``sequence_parallel_size``, a model whose heads do not split over a
    two-dimensional group's Ulysses ranks, a ``compute_loss_func``, label smoothing, a sampling strategy other than
    ``"random"``/``"sequential"``, an ``IterableDataset``, an ``eval_strategy`` (evaluation is not supported), a
    technique that cannot run (``_hf_techniques.apply_techniques``), or ``fsdp`` that accelerate ignores (CPU);
    at the first step (before its forward), if the ranks of a group hold different batches.
    """

    def __init__(self, *args, group=None, sequence_parallel_size: int | None = None, schedule: str = "balanced",
                 backend: str | None = None, pad_id: int | None = None, tile_loss: int | None = None,
                 tile_mlp: int | None = None, remat: bool = False, offload_checkpoints: bool = False, **kwargs):
        techniques = TrainerTechniques(tile_loss=tile_loss, tile_mlp=tile_mlp, remat=remat,
                                       offload_checkpoints=offload_checkpoints)  # checked before the Trainer is built
        super().__init__(*args, **kwargs)
        self._check_arguments()
        world = self.args.world_size  # the process group exists now (TrainingArguments set it up)
        if sequence_parallel_size is not None and group is not None:
            raise ValueError("pass group= or sequence_parallel_size=, not both: sequence_parallel_size=P builds the "
                             "groups (blocks of P consecutive ranks)")
        if sequence_parallel_size is not None and world > 1:
            group = sequence_parallel_groups(sequence_parallel_size)
        elif sequence_parallel_size not in (None, 1):
            raise ValueError(f"sequence_parallel_size={sequence_parallel_size} needs that many ranks, but this run "
                             f"has 1 process: launch with torchrun --nproc-per-node N")
        use_distattn(self.model, group, schedule, backend=backend)  # refuses heads that do not split, every rank
        self.techniques = apply_techniques(self.model, techniques, group, self.args)
        refuse_ignored_fsdp(self.args, self.is_fsdp_enabled)
        self.sequence_parallel_group, self.schedule = group, schedule
        self.sequence_parallel_size = _world(group)[1]
        self.pad_id = self._default_pad_id() if pad_id is None else pad_id
        self._replica = replica_of_ranks(group, device=self._comm_device()) if world > 1 else [0]
        self._hooked_ddp = None
        self._train_sampler = None
        self._pulled_from, self._pulled = None, []  # micro-batches taken ahead from that epoch iterator ("placed")
        self.placement_sources = {"ahead": 0, "inline": 0, "cached": 0}
        self.add_callback(_SamplerEpoch(self))
        # compute_loss returns the step-normalized loss whenever get_batch_samples counted the step's targets
        self.model_accepts_loss_kwargs = True

    loss_is_scaled_for_ga = True  # transformers >= 5.23 reads this; older ones model_accepts_loss_kwargs

    def _check_arguments(self) -> None:
        if getattr(self, "compute_loss_func", None) is not None:
            raise ValueError("compute_loss_func is not used with sequence parallelism: the loss is distattn's token "
                             "mean over all ranks (causal_lm_loss); drop compute_loss_func")
        if self.args.label_smoothing_factor:
            raise ValueError(f"label_smoothing_factor={self.args.label_smoothing_factor} is not supported with "
                             f"sequence parallelism; set it to 0")
        strategy = getattr(self.args, "train_sampling_strategy", "random")
        if strategy not in _SAMPLING:
            raise ValueError(f"train_sampling_strategy={strategy!r} is not supported with sequence parallelism; use "
                             f"one of {_SAMPLING}")
        if getattr(self.args, "eval_strategy", "no") != "no":
            raise ValueError(f"eval_strategy={self.args.eval_strategy!r}: evaluation is not supported with sequence "
                             f"parallelism yet (its batches would be dealt to every rank separately); set "
                             f"eval_strategy='no' and evaluate on one process")
        if isinstance(self.train_dataset, torch.utils.data.IterableDataset):
            raise ValueError("an IterableDataset cannot be dealt to sequence-parallel replicas (every rank of a group "
                             "needs the same batch); use a map-style dataset (datasets.Dataset, a list, ...)")

    def _default_pad_id(self) -> int:
        pad = getattr(getattr(self, "processing_class", None), "pad_token_id", None)
        return int(pad) if pad is not None else 0

    def _comm_device(self) -> torch.device:
        """Where the collectives' tensors live: the training device (CUDA on NCCL, CPU on gloo)."""
        return self.args.device

    def evaluate(self, *args, **kwargs):
        raise ValueError("evaluation is not supported with sequence parallelism yet (Trainer deals its batches to "
                         "every rank separately); evaluate the saved model on one process")

    def predict(self, *args, **kwargs):
        raise ValueError("prediction is not supported with sequence parallelism yet; predict with the saved model on "
                         "one process")

    # -- data ------------------------------------------------------------------------------------------------------
    def _get_train_sampler(self, train_dataset=None):
        """The order of the training set for every rank: see ``ReplicaSampler`` (the DataLoader that Trainer
        builds around it is prepared by accelerate as usual)."""
        dataset = self.train_dataset if train_dataset is None else train_dataset
        args = self.args
        self._train_sampler = ReplicaSampler(len(dataset), self._train_batch_size, self._replica,
                              shuffle=getattr(args, "train_sampling_strategy", "random") == "random",
                              seed=args.data_seed if args.data_seed is not None else args.seed,
                              drop_last=args.dataloader_drop_last)
        return self._train_sampler

    def get_total_train_batch_size(self, args) -> int:
        """Samples per optimizer step over all replicas: the ranks of a replica share their batch."""
        return super().get_total_train_batch_size(args) // self.sequence_parallel_size

    def get_batch_samples(self, epoch_iterator, num_batches: int, device):
        """The step's micro-batches, checked equal across the group and sharded, and the step's target count (over
        all replicas with ``average_tokens_across_devices``, else this replica's)."""
        batches = self._take_batches(epoch_iterator, num_batches)
        group = self.sequence_parallel_group
        check_same_batches(batches, group, device=self._comm_device(),
                           what=f"optimizer step {self.state.global_step + 1}")
        self._solve_ahead(batches[1:] + self._pulled)  # "placed": after the check, so every rank asks alike
        mask = outputs_router_logits(self.model)  # the load-balancing loss counts the batch's tokens, not padding
        sharded = [self._shard(b, mask) for b in batches]
        for batch, shard in zip(batches, sharded):
            shard[_TOKENS_KEY] = self._input_tokens(batch)
        if not sharded:
            return sharded, None
        count = sum(int((b["shift_labels"] != IGNORE_INDEX).sum()) for b in sharded)
        count = torch.tensor([float(count)], dtype=torch.float64, device=self._comm_device())
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            bounded_all_reduce(count, None, "counting the step's target tokens")  # the targets of all replicas
        else:
            bounded_all_reduce(count, group, "counting the step's target tokens")  # this replica's targets
        return sharded, count[0].to(device)

    def _take_batches(self, epoch_iterator, num_batches: int) -> list:
        """The step's micro-batches from ``epoch_iterator``. With ``schedule="placed"`` the next
        :data:`PLACEMENT_AHEAD` are taken now too (kept for the steps they belong to; the order is unchanged)."""
        if self._pulled_from is not epoch_iterator:  # a new epoch's iterator: nothing taken ahead from it
            self._pulled_from, self._pulled = epoch_iterator, []
        batches = []
        while len(batches) < num_batches:
            if self._pulled:
                batches.append(self._pulled.pop(0))
                continue
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        if self.schedule != "placed" or self.sequence_parallel_size == 1:
            return batches
        while len(self._pulled) < PLACEMENT_AHEAD:
            try:
                self._pulled.append(next(epoch_iterator))
            except StopIteration:
                break
        return batches

    def _solve_ahead(self, batches: list) -> None:
        """``schedule="placed"``: hand these micro-batches' placements to worker processes, in the order they will be
        asked for, while the workers have room (``distattn.schedule.ahead.PENDING``: more would drop the oldest,
        the ones needed first). A batch its step would refuse is left to that step, which raises the clear error."""
        if self.schedule != "placed" or self.sequence_parallel_size == 1:
            return
        from distattn.schedule import ahead
        from distattn.sharding import solve_ahead

        for batch in batches:
            if ahead.pending() >= ahead.PENDING:
                break
            try:
                request = placement_request(batch, self.sequence_parallel_group, self.pad_id)
            except Exception:  # noqa: BLE001 - a malformed batch: shard_inputs raises its error at its step
                continue
            if request is not None:  # None: dense rows, refused when their step shards them
                cu, n = request
                window = self._placement_window(n * self.sequence_parallel_size)
                solve_ahead(cu, n, self.sequence_parallel_group, window=window, workers=PLACEMENT_AHEAD)

    def _placement_window(self, total: int) -> tuple[int, int]:
        """The window a packed stream of ``total`` tokens is placed for: most of the model's layers' own."""
        return placement_window(self.model.config, total)

    def _shard(self, batch, token_mask: bool) -> dict:
        """``shard_inputs`` with this trainer's schedule; ``"placed"``: on the placement for the model's window,
        taken from a worker when it was solved ahead (counted in ``placement_sources``)."""
        kw = dict(schedule=self.schedule, pad_id=self.pad_id, token_mask=token_mask)
        total = placed_tokens(batch, self.sequence_parallel_group) if self.schedule == "placed" else None
        if total is None:
            return shard_inputs(batch, self.sequence_parallel_group, **kw)
        window = self._placement_window(total)
        with placement_source() as where:
            out = shard_inputs(batch, self.sequence_parallel_group, window=window, **kw)
        self.placement_sources[where["source"]] += 1
        return out

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:  # the last epoch's iterator (its DataLoader workers) and the batches taken ahead from it
            self._pulled_from, self._pulled = None, []

    def _input_tokens(self, batch) -> torch.Tensor:
        """What ``Trainer`` would count of this micro-batch on one process (``include_num_input_tokens_seen``): all
        its tokens, or those under its ``attention_mask`` (else not the processing class's pad token) for
        ``"non_padding"``; counted before sharding, so the padding ``shard_inputs`` adds is never counted."""
        ids = batch["input_ids"]
        counted = ids.numel()
        if getattr(self.args, "include_num_input_tokens_seen", "no") == "non_padding":
            pad = getattr(getattr(self, "processing_class", None), "pad_token_id", None)
            if batch.get("attention_mask") is not None:
                counted = int(batch["attention_mask"].sum())
            elif pad is not None:
                counted = int((ids != pad).sum())
        return torch.tensor(counted, dtype=torch.int64)

    def _track_num_input_tokens(self, inputs):
        """``Trainer``'s count of the tokens seen, once per replica: the ranks of a group hold shards of one batch,
        so the group's first rank brings the batch's count (``_input_tokens``) and the others 0 to the gather that
        ``Trainer`` makes over every process."""
        if _TOKENS_KEY not in inputs or getattr(self.args, "include_num_input_tokens_seen", "no") in ("no", False):
            return super()._track_num_input_tokens(inputs)
        first = _world(self.sequence_parallel_group)[0] == 0
        count = inputs[_TOKENS_KEY] if first else torch.zeros_like(inputs[_TOKENS_KEY])
        count = torch.as_tensor(count, device=self.args.device, dtype=torch.int64)
        self.state.num_input_tokens_seen += self.accelerator.gather(count).sum().item()

    # -- loss and gradients ------------------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        self._reduce_gradients_over_the_group(model)
        return super().training_step(model, inputs, num_items_in_batch)

    def _reduce_gradients_over_the_group(self, model) -> None:
        """Before the first backward of a wrapped model: DDP or FSDP2 sum over the group, average over replicas
        (``_hf_techniques.reduce_over_group``; under ``torch_compile=True`` the wrapper inside the compiled one)."""
        self._hooked_ddp = reduce_over_group(model, self.sequence_parallel_group, self.args.world_size,
                                             self._hooked_ddp)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The step's token-mean loss: every rank of a group returns its replica's share, the same value; the
        backward of each rank gives its own tokens' part (``distattn.gradients`` sums them)."""
        if "shift_labels" not in inputs:  # a batch that did not come through get_batch_samples
            inputs = self._shard(inputs, outputs_router_logits(self.model))
        labels, documents = inputs["shift_labels"], documents_kwargs(inputs)  # "placed": the layout, for the hook
        if self.techniques.tile_loss is not None:  # the model's tiled head + loss: no logits, this rank's loss sum
            outputs = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], shift_labels=labels,
                            **documents)
            local_sum = outputs.loss_sum
        else:
            outputs = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], **documents)
            labels = labels.to(outputs.logits.device)
            local_sum = F.cross_entropy(outputs.logits.float().flatten(0, 1), labels.flatten(),
                                        ignore_index=IGNORE_INDEX, reduction="sum")
        labels = labels.to(local_sum.device)
        across = (num_items_in_batch is not None and self.args.average_tokens_across_devices
                  and self.args.world_size > 1)
        router = self._router_loss(model, outputs, inputs.get("token_mask"), across)
        if num_items_in_batch is None:
            loss = global_mean(local_sum, labels, self.sequence_parallel_group) + router  # this micro-batch's mean
        else:
            loss = self._step_mean(local_sum, num_items_in_batch, router)
        return (loss, outputs) if return_outputs else loss

    def _step_mean(self, local_sum: torch.Tensor, count, router=0.0) -> torch.Tensor:
        """``replicas * ((the group's sum) / count + router)``, differentiated as ``replicas * (local_sum / count +
        router)``.

        With ``average_tokens_across_devices`` the count covers all replicas and DDP (with distattn's hook) divides
        the gradient by the replicas, so the factor ``D`` gives one process's ``sum / count``; ``Trainer`` averages
        the logged value over all ranks, which is the same ``sum / count``. ``router``: ``_router_loss``'s term."""
        total = local_sum.detach().double().reshape(1)
        if self.sequence_parallel_size > 1:
            bounded_all_reduce(total, self.sequence_parallel_group, "summing the step's loss")
        replicas = len(set(self._replica)) if self.args.average_tokens_across_devices else 1
        count = torch.as_tensor(count, dtype=torch.float64, device=local_sum.device).clamp(min=1.0)
        value = (total[0] / count).float() + (local_sum - local_sum.detach()) / count.float()
        return (value + router) * replicas

    def _router_loss(self, model, outputs, token_mask, across_replicas: bool):
        """``coef * aux``, the model's load-balancing loss over the micro-batch's whole sequence (``_hf_router``), as
        the model adds it to its loss on one process; 0 for a model that returns no ``aux_loss``.

        ``across_replicas`` (``average_tokens_across_devices``): the sums cover every replica's tokens, as one
        process sees the replicas' batches together, and the value is ``coef * aux / D`` (``_step_mean`` multiplies
        by ``D``; ``Trainer`` averages over the ranks); else this group's tokens, each replica its own ``aux``.
        The gradient is this rank's share either way. The model's own ``aux_loss`` (of this rank's rows) is held to
        the same formula on them: a model that computes another loss is refused on every rank."""
        # keep_torch_compile=False: with it True, accelerate (1.15) sets a compiled model's _orig_mod to the model
        # it unwrapped, dropping the DDP between them (no gradient reduction from the next step on)
        unwrapped = self.accelerator.unwrap_model(model, keep_torch_compile=False)
        refuse_other_losses(unwrapped, outputs)
        if getattr(outputs, "aux_loss", None) is None:
            return 0.0
        terms, logits = router_loss_terms(unwrapped), getattr(outputs, "router_logits", None)
        if not logits:
            raise ValueError(f"{type(unwrapped).__name__} returns an aux_loss but no router_logits, so distattn "
                             f"cannot form it over the whole sequence; build it with output_router_logits=False")
        counts, probs, rows = balancing_sums(logits, terms.top_k, token_mask)
        own = model_aux_mismatch(outputs.aux_loss, logits, terms.top_k, token_mask, (counts, probs, rows))
        totals = torch.cat([counts.detach(), probs.detach(), rows.reshape(1), own.reshape(1)]).double()
        if across_replicas:
            bounded_all_reduce(totals, None, "summing the router's load-balancing statistics")
        elif self.sequence_parallel_size > 1:
            bounded_all_reduce(totals, self.sequence_parallel_group, "summing the router's load-balancing statistics")
        if float(totals[-1]):
            raise ValueError(f"{type(unwrapped).__name__}'s aux_loss is not transformers' load-balancing loss of its "
                             f"router_logits with top_k={terms.top_k} (on {int(totals[-1])} ranks), so distattn "
                             f"cannot form it over the whole sequence; build it with output_router_logits=False")
        aux, share = balancing_loss(counts, probs, rows, totals[:-1])
        replicas = len(set(self._replica)) if across_replicas else 1
        return terms.coef * ((aux / replicas).float() + (share - share.detach()))


class _SamplerEpoch(TrainerCallback):
    """Sets the sampler's epoch at every epoch's start. Trainer's own ``set_epoch`` does not reach it through the
    loader that skips the trained batches of a resumed epoch (accelerate's ``SkipBatchSampler`` around its
    ``BatchSamplerShard``), so a run resumed in epoch ``e > 0`` would replay epoch 0's order."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_epoch_begin(self, args, state, control, **kwargs):
        if self.trainer._train_sampler is not None:
            # state.epoch is e + (steps done) / (steps per epoch) here: its floor is the epoch that begins
            self.trainer._train_sampler.set_epoch(math.floor((state.epoch or 0.0) + 1e-9))


class SequenceParallelTrainer(SequenceParallelMixin, Trainer):
    """``transformers.Trainer`` with distattn sequence parallelism (see ``SequenceParallelMixin`` and the module
    doc): ``SequenceParallelTrainer(model=model, args=args, train_dataset=ds, data_collator=collator)``, launched
    with ``torchrun --nproc-per-node N``; ``sequence_parallel_size=P`` for ``N / P`` data-parallel replicas."""
