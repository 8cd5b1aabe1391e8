"""Batches for sequence-parallel training loops (the HF ``Trainer`` integration and hand-written loops).

Re-exported by ``distattn.integrations.hf``:

* ``shard_inputs(batch, group)``: a collated Hugging Face batch (``input_ids``, ``labels`` and, optionally,
  ``attention_mask`` or the flattened ``position_ids`` of ``DataCollatorWithFlattening``), of any total length,
  -> this rank's ``input_ids``, ``position_ids`` and ``shift_labels``. It pads to the multiple the layout needs
  (labels -100 on the padding) and calls ``shard_batch``.
* ``check_same_batches(batches, group)``: every rank of a sequence-parallel group must shard the *same* batch;
  one all-reduce of a 63-bit digest of the batches finds a rank that got another, and every rank of the group
  raises the same ``ValueError``.
* ``ReplicaSampler``: the order of a map-style dataset for ``D`` data-parallel replicas of ``P`` ranks each, laid
  out so that a sampler that deals batches round-robin to all ``D * P`` ranks (accelerate's ``BatchSamplerShard``,
  what ``Accelerator.prepare(dataloader)`` adds) gives every rank of a replica that replica's batch.

Why padding is exact: attention is causal, so a token never sees the padding after it; padding appended to a
dense row or to a flattened stream (as a document of its own) changes no real token's output, and its targets
are -100, so the loss and every gradient are those of the unpadded batch.
"""

from __future__ import annotations

import functools
import hashlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distattn.comm import bounded_wait, default_timeout
from distattn.integrations._hf_batch import shard_batch
from distattn.packing import cu_seqlens_from_position_ids, pack_padded
from distattn.sharding import _world
from distattn.sharding import layout as _layout
from distattn.topology import split as _split_group

__all__ = ["shard_inputs", "check_same_batches", "sequence_multiple", "ReplicaSampler", "replica_of_ranks",
           "documents_kwargs", "placement_request", "placed_tokens"]

IGNORE_INDEX = -100
_HASH_MASK = (1 << 63) - 1  # 63 bits, so that -h is an int64 too


def sequence_multiple(group=None, schedule: str = "balanced") -> int:
    """The multiple every sequence (dense row or packed stream) is padded to: the group's size times the chunks per
    rank of ``schedule``'s layout (``"zigzag"``: 2; ``"placed"``: 1, its placement deals blocks of any stream)."""
    return _world(group)[1] * (1 if schedule == "placed" else _layout(group, schedule).divisor())


# -- sharding a collated batch -------------------------------------------------------------------------------------
def shard_inputs(batch, group=None, *, schedule: str = "balanced", pad_id: int = 0,
                 token_mask: bool = False, window=(-1, -1)) -> dict:
    """This rank's share of a collated Hugging Face causal-LM batch, of any total length (padded here).

    Three kinds of batch, the same on every rank of ``group``:

    * dense: ``input_ids`` and ``labels`` ``(batch, seq)`` (an all-ones ``attention_mask`` is ignored): each row
      is padded on the right to a multiple of ``sequence_multiple(group, schedule)``;
    * padded: an ``attention_mask`` with zeros (0 = pad): the pad tokens are removed and the rows packed as
      documents (``shard_batch(..., attention_mask=mask)``), the stream padded to the multiple;
    * flattened: ``input_ids``, ``labels`` and ``position_ids`` ``(1, T)``, the positions restarting at 0 at every
      document (``DataCollatorWithFlattening``): padded with one more document.

    Args:
        batch: a mapping with ``input_ids`` and ``labels`` (unshifted, -100 where no loss is wanted) and optionally
            ``attention_mask`` / ``position_ids``, and the document boundaries ``DataCollatorWithFlattening`` adds
            (``cu_seq_lens_q/k``, ``max_length_q/k``, ``seq_idx``: checked against ``position_ids``, which carry
            the same documents). Any other key is refused (:func:`_check_keys`), never dropped unseen.
        group: the sequence-parallel group (as for ``use_distattn``).
        schedule: the model's schedule (``use_distattn(model, group, schedule)``).
        pad_id: token id of the padding (any id: no real token sees it).
        token_mask: also return ``"token_mask"``: 1 for this rank's tokens of the batch, 0 for the padding added here
            (a padded batch's pad tokens are already gone), i.e. the tokens one process counts under the batch's
            ``attention_mask`` (the MoE load-balancing loss counts those, ``load_balancing_loss``).
        window: ``schedule="placed"`` only: the window the placement is solved for (``shard_batch``'s ``window``).

    Returns:
        ``{"input_ids", "position_ids", "shift_labels"}`` (and ``"token_mask"``), this rank's ``(rows, n)`` tensors:
        call the model with the first two and give ``shift_labels`` to ``causal_lm_loss``. ``schedule="placed"``
        (padded or flattened batches: packed documents on their placement) adds ``"cu_seq_lens"`` and
        ``"max_length"``: pass them to the model as ``cu_seq_lens_q/k`` and ``max_length_q/k``, so that its hook knows
        the layout (:func:`documents_kwargs`).

    Raises:
        ValueError: no ``input_ids``/``labels``, labels already shifted (``shift_labels``), position ids that
            restart on a batch of more than one row, a key this function would not hand on (e.g. ``pixel_values``,
            ``inputs_embeds``, ``token_type_ids``), document boundaries that disagree with ``position_ids``, or a
            dense batch with ``schedule="placed"`` (it places documents).
    """
    ids, labels = batch.get("input_ids"), batch.get("labels")
    if ids is None or labels is None:
        raise ValueError(f"a sequence-parallel batch needs input_ids and labels (got keys {sorted(batch)}): use a "
                         f"causal-LM collator, e.g. DataCollatorForLanguageModeling(tokenizer, mlm=False) or "
                         f"DataCollatorWithFlattening()")
    if "shift_labels" in batch:
        raise ValueError("the batch has shift_labels: give the unshifted labels instead (distattn shifts them on the "
                         "whole sequence, before sharding, so that each shard's last token keeps its target)")
    if ids.dim() != 2 or labels.shape != ids.shape:
        raise ValueError(f"input_ids and labels must both be (batch, seq), got {tuple(ids.shape)} and "
                         f"{tuple(labels.shape)}")
    mask, positions = batch.get("attention_mask"), batch.get("position_ids")
    _check_keys(batch, positions)
    padded = mask is not None and not bool(mask.bool().all())
    flattened = not padded and positions is not None and _restarts(positions)
    if flattened and (ids.shape[0] != 1 or positions.shape != ids.shape):
        raise ValueError(f"position_ids that restart at 0 mean a flattened batch, which must be one row (1, T) "
                         f"like input_ids; got position_ids {tuple(positions.shape)}, input_ids "
                         f"{tuple(ids.shape)}: collate with DataCollatorWithFlattening")
    if schedule == "placed" and not (padded or flattened):
        raise ValueError("schedule='placed' places packed documents: collate with DataCollatorWithFlattening (or pad "
                         "rows with an attention_mask); a batch of dense rows runs on 'balanced' or 'zigzag'")
    rows = functools.partial(_shard_rows, labels=labels, mask=mask if padded else None,
                             positions=positions if flattened else None, group=group, schedule=schedule,
                             window=window)
    out = rows(ids, pad_id=pad_id)
    keep = ("input_ids", "position_ids", "shift_labels") + (("cu_seq_lens", "max_length") if schedule == "placed"
                                                             else ())
    out = {key: out[key] for key in keep}
    if token_mask:  # the same path on ones, padded with 0: the tokens land where the batch's do
        out["token_mask"] = rows(torch.ones_like(ids), pad_id=0)["input_ids"]
    return out


# The keys shard_inputs reads, and the keys DataCollatorWithFlattening adds that restate position_ids' documents.
_READ = frozenset({"input_ids", "labels", "attention_mask", "position_ids"})
_BOUNDARIES = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"})


def _check_keys(batch, positions) -> None:
    """Refuse a batch key the sharded call would not pass on: the model would run without it while the one-process
    ``Trainer`` passes it (a silently different model, e.g. a vision model's ``pixel_values``). The flattening
    collator's document boundaries are accepted when they name the documents ``position_ids`` name."""
    extra = sorted(set(batch) - _READ - _BOUNDARIES)
    if extra:
        raise ValueError(f"the batch has keys the sequence-parallel path does not pass to the model: {extra}; it "
                         f"shards input_ids, labels, attention_mask and position_ids only (a model that needs more, "
                         f"e.g. pixel_values or inputs_embeds, is not supported): remove them from the batch "
                         f"(TrainingArguments(remove_unused_columns=True), the collator)")
    given = sorted(set(batch) & _BOUNDARIES)
    if not given:
        return
    if positions is None:
        raise ValueError(f"the batch has document boundaries {given} but no position_ids: collate with "
                         f"DataCollatorWithFlattening (its position_ids carry the documents distattn shards)")
    cu = cu_seqlens_from_position_ids(positions).long().cpu()
    lengths = cu[1:] - cu[:-1]
    expected = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": int(lengths.max()),
                "max_length_k": int(lengths.max()),
                "seq_idx": torch.repeat_interleave(torch.arange(len(lengths)), lengths)}
    for key in given:
        value, want = batch[key], expected[key]
        same = (torch.equal(torch.as_tensor(value).reshape(-1).long().cpu(), want) if isinstance(want, torch.Tensor)
                else int(value) == want)
        if not same:
            raise ValueError(f"the batch's {key} does not describe the documents its position_ids do (position ids "
                             f"restarting at 0 give {key} = {want.tolist() if isinstance(want, torch.Tensor) else want})")


def documents_kwargs(inputs) -> dict:
    """The model's document arguments for a batch ``shard_inputs`` placed (``cu_seq_lens_q/k``, ``max_length_q/k``:
    the hook reads the placement's layout from them); ``{}`` for any other schedule's batch."""
    if "cu_seq_lens" not in inputs:
        return {}
    cu, longest = inputs["cu_seq_lens"], inputs["max_length"]
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def placement_request(batch, group=None, pad_id: int = 0) -> tuple[list[int], int] | None:
    """``(cu_seqlens, tokens per rank)`` of the stream ``shard_inputs(batch, group, schedule="placed")`` places (its
    padding included: a flattened batch's is a document of its own, a padded batch's documents end before it): the
    arguments it gives ``distattn.sharding.placement``, for ``solve_ahead``. ``None`` for a batch it would refuse
    (dense rows)."""
    kind, total = _placed_stream(batch, group)
    if kind is None:
        return None
    ids, multiple = batch["input_ids"], sequence_multiple(group, "placed")
    if kind == "padded":
        cu = pack_padded(ids, batch["attention_mask"], multiple_of=multiple, pad_id=pad_id).cu_seqlens
    else:
        cu = cu_seqlens_from_position_ids(_pad_flattened(ids, ids, batch["position_ids"], multiple, pad_id)[2])
    return [int(c) for c in cu], total // _world(group)[1]


def placed_tokens(batch, group=None) -> int | None:
    """The tokens of the stream ``shard_inputs(batch, group, schedule="placed")`` places, its padding included (what
    the window it is placed for depends on), from the batch's shape and mask alone; ``None`` for dense rows."""
    return _placed_stream(batch, group)[1]


def _placed_stream(batch, group) -> tuple[str | None, int | None]:
    """``("padded" | "flattened", the placed stream's tokens)`` of a batch ``shard_inputs`` places, ``(None, None)``
    for dense rows: a padded batch's real tokens packed (``pack_padded``), a flattened one with a padding document
    (``_pad_flattened``), each up to the group's multiple."""
    ids, mask, positions = batch.get("input_ids"), batch.get("attention_mask"), batch.get("position_ids")
    multiple = sequence_multiple(group, "placed")
    if mask is not None and not bool(mask.bool().all()):  # its documents end before the stream's padding
        return "padded", max(-(-int(mask.bool().sum()) // multiple), 1) * multiple  # pack_sequences' total
    if positions is not None and _restarts(positions) and ids.shape[0] == 1:  # its padding is a document
        return "flattened", -(-ids.shape[1] // multiple) * multiple
    return None, None


def _shard_rows(ids, *, labels, mask, positions, group, schedule: str, pad_id: int, window=(-1, -1)) -> dict:
    """``shard_batch`` on a dense (padded to the layout's multiple), padded (``mask``) or flattened
    (``positions``) batch."""
    multiple = sequence_multiple(group, schedule)
    shard = dict(group=group, schedule=schedule, pad_id=pad_id)
    if schedule == "placed":
        shard["window"] = window
    if mask is not None:
        return shard_batch(ids, labels, attention_mask=mask, **shard)
    if positions is not None:
        ids, labels, positions = _pad_flattened(ids, labels, positions, multiple, pad_id)
        return shard_batch(ids, labels, position_ids=positions, **shard)
    tail = -ids.shape[1] % multiple
    return shard_batch(F.pad(ids, (0, tail), value=pad_id), F.pad(labels, (0, tail), value=IGNORE_INDEX), **shard)


def _restarts(positions: torch.Tensor) -> bool:
    """Whether position ids restart at 0 after the first token of a row (a flattened, packed batch)."""
    return bool((positions[..., 1:] == 0).any())


def _pad_flattened(ids, labels, positions, multiple: int, pad_id: int):
    """Append one padding document (positions 0, 1, ...; labels -100) up to a multiple of ``multiple``."""
    tail = -ids.shape[1] % multiple
    if not tail:
        return ids, labels, positions
    tail_positions = torch.arange(tail, dtype=positions.dtype, device=positions.device).unsqueeze(0)
    return (F.pad(ids, (0, tail), value=pad_id), F.pad(labels, (0, tail), value=IGNORE_INDEX),
            torch.cat([positions, tail_positions], dim=1))


# -- the same batch on every rank of a group ---------------------------------------------------------------------
def _digest(batches) -> int:
    """63 bits of a hash of every tensor of every batch (names, shapes, dtypes, values), in order."""
    h = hashlib.blake2b(digest_size=8)
    h.update(str(len(batches)).encode())
    for batch in batches:
        items = [("", batch)] if isinstance(batch, torch.Tensor) else [(key, batch[key]) for key in sorted(batch)]
        for key, value in items:
            if isinstance(value, torch.Tensor):
                h.update(f"{key}{tuple(value.shape)}{value.dtype}".encode())
                h.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest(), "little") & _HASH_MASK


def check_same_batches(batches, group=None, *, device=None, what: str = "this step") -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` unless all its ranks hold equal ``batches``.

    One all-reduce of two int64 numbers (``(h, -h)`` with MAX: the largest and smallest digest); only on a
    mismatch a second one gathers every rank's digest for the message. Waits are bounded
    (``distattn.comm.default_timeout``).

    Args:
        batches: a list of tensors or mappings of tensors (the micro-batches of one optimizer step).
        group: the sequence-parallel group.
        device: where the collective's tensors live (the CUDA device on NCCL; default CPU).
        what: names the batches in the error.
    """
    index, size = _world(group)
    if size == 1:
        return
    h = _digest(batches)
    both = torch.tensor([h, -h], dtype=torch.int64, device=device)
    bounded_all_reduce(both, group, "agreeing on the batch digest", dist.ReduceOp.MAX)
    hi, neg_lo = both.tolist()
    if hi == h and -neg_lo == h:
        return
    every = torch.zeros(size, dtype=torch.int64, device=device)
    every[index] = h
    bounded_all_reduce(every, group, "gathering the batch digests")
    digests = ", ".join(f"rank {r}: {d:016x}" for r, d in enumerate(every.tolist()))
    raise ValueError(f"distattn: the ranks of a sequence-parallel group hold different batches at {what} (digests "
                     f"of their input_ids/labels/...: {digests}); every rank of a sequence-parallel group must shard "
                     f"the same batch. A sampler or dataloader that deals different batches to different ranks "
                     f"(Trainer's default, a DistributedSampler over the world, a dataset that depends on the rank) "
                     f"causes this: use distattn's SequenceParallelTrainer as it is (do not override its sampler), "
                     f"or ReplicaSampler in your own loop")


def bounded_all_reduce(t: torch.Tensor, group, what: str, op=dist.ReduceOp.SUM) -> None:
    """All-reduce ``t`` in place over every rank of ``group`` (None: the world; a two-dimensional one: its Ulysses
    row, then its ring), each wait bounded by ``distattn.comm.default_timeout``."""
    ulysses_group, ring_group = _split_group(group)
    poll = t.device.type == "cuda"
    for g in ([ulysses_group] if ulysses_group is not None else []) + [ring_group]:
        bounded_wait([dist.all_reduce(t, op=op, group=g, async_op=True)], default_timeout(),
                     f"distattn: rank {dist.get_rank()}, {what}", poll=poll)


# -- which rank is in which replica --------------------------------------------------------------------------------
def _group_ranks(g) -> set[int]:
    return set(range(dist.get_world_size())) if g is None else set(dist.get_process_group_ranks(g))


def replica_of_ranks(group=None, *, device=None) -> list[int]:
    """For every global rank, the index of the data-parallel replica (sequence-parallel group) it belongs to,
    numbered by each group's lowest rank; the same list on every rank. Two small collectives: the lowest rank of
    this rank's group (MIN over it), then every rank's (all-gather over the world).

    Raises:
        ValueError: the sequence-parallel groups are not all of the same size (they must tile the world).
    """
    ulysses_group, ring_group = _split_group(group)
    mine = _group_ranks(ring_group) | (_group_ranks(ulysses_group) if ulysses_group is not None else set())
    low = torch.tensor([min(mine)], dtype=torch.int64, device=device)
    bounded_all_reduce(low, group, "finding the lowest rank of the sequence-parallel group", dist.ReduceOp.MIN)
    lows = [torch.empty_like(low) for _ in range(dist.get_world_size())]
    dist.all_gather(lows, low)
    lows = [int(x.item()) for x in lows]
    firsts = sorted(set(lows))
    sizes = [lows.count(f) for f in firsts]
    if len(set(sizes)) != 1:
        raise ValueError(f"the sequence-parallel groups must all have the same size, got groups of {sizes} ranks "
                         f"(first ranks {firsts}): build them as equal blocks, e.g. sequence_parallel_size=P")
    return [firsts.index(x) for x in lows]


# -- the data order --------------------------------------------------------------------------------------------------
class ReplicaSampler(torch.utils.data.Sampler):
    """Indices of a map-style dataset for ``D`` replicas of ``P`` ranks, in the order a round-robin batch dealer
    over all ``D * P`` ranks needs (``BatchSamplerShard``, which ``Accelerator.prepare`` wraps a DataLoader's batch
    sampler in): round ``k`` holds one batch per global rank, and rank ``g``'s is batch ``k * D + replica[g]`` of
    the epoch's order, so every rank of a replica gets the same batch and the replicas get consecutive ones.

    The epoch's order is ``torch.randperm(n)`` seeded with ``seed + epoch`` (the order accelerate's seedable
    sampler gives one process), or ``0, 1, ...`` without ``shuffle``; a last round that is not full wraps around
    to the start of the order (accelerate's ``even_batches``), or is dropped with ``drop_last``. Give it the
    DataLoader's ``batch_size``.
    """

    def __init__(self, num_samples: int, batch_size: int, replica: list[int], *, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False):
        if num_samples < 1 or batch_size < 1:
            raise ValueError(f"ReplicaSampler needs a non-empty dataset and batch_size >= 1, got {num_samples} "
                             f"samples and batch_size={batch_size}")
        self.num_samples, self.batch_size, self.replica = num_samples, batch_size, list(replica)
        self.replicas = len(set(self.replica))
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _rounds(self) -> int:
        per_round = self.replicas * self.batch_size
        return self.num_samples // per_round if self.drop_last else math.ceil(self.num_samples / per_round)

    def __len__(self) -> int:
        return self._rounds() * len(self.replica) * self.batch_size

    def __iter__(self):
        n, b, d = self.num_samples, self.batch_size, self.replicas
        if self.shuffle:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(n)
        need = self._rounds() * d * b
        order = order.repeat(math.ceil(need / n))[:need].tolist()  # wrap around to fill the last round
        for k in range(self._rounds()):
            for replica in self.replica:  # global rank order: the dealer's round-robin
                start = (k * d + replica) * b
                yield from order[start:start + b]
