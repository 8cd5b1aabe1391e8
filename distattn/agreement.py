"""Rank agreement: before the first transfer of every call, the ranks check that they make the same call.

Ranks that disagree on anything that shapes the communication (shard shapes, dtypes, the mask, the schedule,
...) would otherwise send and receive messages of different sizes or in a different order: gloo aborts the
process, NCCL hangs or returns garbage. The check is always on and costs one all-reduce of two int64 numbers:
every rank hashes a readable description of its call (``fields``) to 63 bits ``h`` and the group reduces
``(h, -h)`` with MAX, which gives the maximum and (negated) the minimum of the hashes in one collective. They
are equal on every rank exactly when all ranks hashed the same description. Only on a mismatch, which every
rank sees, do the ranks all-gather their descriptions, so every rank raises the same ``ValueError`` listing
each rank's value of every field that differs.

What is checked is one dict: the call's shapes, dtypes, device type, phase and position (``distattn.communicators``:
the call's place in the process's calls on the group, across failures and rebuilds, within the declared step), plus
``DistAttnConfig.fingerprint_fields()`` (the options and any mask metadata the config carries). A new field
is covered by adding it there.

A rank whose own input failed validation still takes part, with ``rejected_fields`` (its phase, call number and
the error) in place of the call's description: every rank then raises the same error, of the failing rank's type
(``TypeError`` or ``ValueError``), naming that rank and its reason, and every rank has used the same call number,
so the next call pairs batch ``k + 1`` with batch ``k + 1`` everywhere. After the last step, ``confirm`` (a second one-number all-reduce) makes every
rank fail the same call when one rank fails. ``DISTATTN_CHECK=0`` turns both off (see ``enabled``).
"""

from __future__ import annotations

import hashlib
import json
import os

import torch
import torch.distributed as dist

from distattn._bounded import DistAttnError, all_gather_text, bounded_wait
from distattn.communicators import Communicator, describe

__all__ = ["CHECK_ENV", "enabled", "call_fields", "rejected_fields", "rejection", "agree", "confirm"]

CHECK_ENV = "DISTATTN_CHECK"
_HASH_MASK = (1 << 63) - 1  # 63 bits: -h is an int64 too


def enabled() -> bool:
    """The check runs unless ``DISTATTN_CHECK=0``."""
    return os.environ.get(CHECK_ENV, "1") != "0"


def call_fields(phase: str, seq: int, tensors: dict[str, torch.Tensor], config_fields: dict) -> dict:
    """The readable description of one call that every rank must share (JSON-friendly values)."""
    fields = {"phase": phase, "call": seq}
    for name, t in tensors.items():
        fields[f"{name}.shape"] = list(t.shape)
    first = next(iter(tensors.values()))
    fields["dtype"] = str(first.dtype).removeprefix("torch.")
    fields["device"] = first.device.type
    fields.update(config_fields)
    return fields


def rejected_fields(phase: str, seq: int, error: Exception) -> dict:
    """The description a rank sends when its own input failed validation with ``error``."""
    return {"phase": phase, "call": seq, "rejected": f"{type(error).__name__}: {error}"}


def rejection(per_rank: list[dict]) -> Exception | None:
    """The error every rank raises when some rank's input failed validation (``None``: none did).

    ``TypeError`` when every failing rank's error was one, else ``ValueError``; the message names each failing
    rank (group rank) and its reason, the same text on every rank."""
    failed = {r: f["rejected"] for r, f in enumerate(per_rank) if "rejected" in f}
    if not failed:
        return None
    kind = TypeError if all(reason.startswith("TypeError: ") for reason in failed.values()) else ValueError
    reasons = "\n".join(f"  rank {r}: {reason.split(': ', 1)[1]}" for r, reason in failed.items())
    return kind(f"distattn: the input of rank(s) {sorted(failed)} of the group failed validation, so every rank "
                f"of the group raises this error (the call is skipped everywhere and the ranks stay in step):\n"
                f"{reasons}")


def _hash63(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & _HASH_MASK


def agree(comm: Communicator, fields: dict, device: torch.device, timeout: float, where: str) -> None:
    """Raise the same ``ValueError`` on every rank unless all ranks of ``comm`` passed equal ``fields``.

    The call's position is checked too (``fields["call"]`` is replaced by it): ranks at different positions raise
    ``DistAttnError`` (see ``out_of_step``).

    ``device``: where the collective's tensors live (the call's device on NCCL, CPU otherwise).
    """
    fields = {**fields, "call": describe(comm.position)}
    text = json.dumps(fields, default=str)
    h = _hash63(text)
    both = torch.tensor([h, -h], dtype=torch.int64, device=device)
    bounded_wait([dist.all_reduce(both, op=dist.ReduceOp.MAX, group=comm.fetch, async_op=True)], timeout,
                 f"distattn: rank {comm.rank}, {where}: agreement check", poll=comm.nccl)
    hi, neg_lo = both.tolist()
    if hi == h and -neg_lo == h:
        return
    everyone = [json.loads(t) for t in _all_gather_text(comm, text, device, timeout, where)]
    rejected = rejection(everyone)
    if any(fields.get("call") != everyone[0].get("call") for fields in everyone):
        # Ranks at different calls: pairing them would pair different batches. Every rank fails this call and
        # aborts, which raises the given-up mark to its position: the ranks behind fail, at once, the calls their
        # peers already gave up, and the next calls agree again.
        comm.abort()
        raise out_of_step(everyone)
    raise rejected if rejected is not None else ValueError(describe_mismatch(everyone))


def out_of_step(per_rank: list[dict]) -> DistAttnError:
    """The error of ranks at different positions (identical on every rank)."""
    where = ", ".join(f"rank {r}: {fields.get('call')}" for r, fields in enumerate(per_rank))
    return DistAttnError(f"distattn: the ranks of the group are at different calls ({where}): a rank came back from a "
                         f"failure behind its peers, or the ranks' programs made different calls. Every rank fails this "
                         f"call; the ranks behind then fail the calls their peers gave up, at once, so that the next "
                         f"calls pair the same batches again (distattn.set_step realigns ranks at every step)")


def confirm(comm: Communicator, device: torch.device, timeout: float, where: str) -> None:
    """Every rank finished the call: one all-reduce after the last step, which completes only when every rank
    reaches it. A rank that failed mid-call has aborted the communicator and marked the call given up, so this fails
    on its peers too (on NCCL at once, at the mark; on gloo when the closed connections reach it, else at its bound:
    ``Communicator.watch_collective``): every rank then fails the same call, and a loop that skips the failed batch
    skips it everywhere."""
    done = torch.ones(1, dtype=torch.int64, device=device)
    bounded_wait([dist.all_reduce(done, group=comm.fetch, async_op=True)], timeout,
                 f"distattn: rank {comm.rank}, {where}: confirming that every rank finished", poll=comm.nccl,
                 gave_up=comm.watch_collective)


def _all_gather_text(comm: Communicator, text: str, device, timeout: float, where: str) -> list[str]:
    """Every rank's ``text`` (JSON, no pickle), on the library's fetch group."""
    what = f"distattn: rank {comm.rank}, {where}: gathering the ranks' calls after a disagreement"
    return all_gather_text(comm.fetch, text, device, timeout, what)


def describe_mismatch(per_rank: list[dict]) -> str:
    """One line per differing field with every rank's value (identical on every rank)."""
    names = list(dict.fromkeys(name for fields in per_rank for name in fields))
    lines = []
    for name in names:
        values = [fields.get(name, "<missing>") for fields in per_rank]
        if any(v != values[0] for v in values):
            lines.append(f"  {name}: " + ", ".join(f"rank {r}: {_show(v)}" for r, v in enumerate(values)))
    return ("distattn: the ranks of the group disagree on the attention call; every rank must pass the same "
            "shard shapes, dtype and options (and make the same calls in the same order). Differences:\n"
            + "\n".join(lines))


def _show(value) -> str:
    if isinstance(value, list):
        return "(" + ", ".join(map(str, value)) + ")"
    return repr(value) if isinstance(value, str) else str(value)
