"""The sequence-parallel group as given by the user, resolved once: flat, or two-dimensional (Ulysses x ring).

``group=`` of every distattn entry point accepts

* ``None`` or a ``ProcessGroup``: one ring of ``P`` ranks (``U = 1``);
* a pair ``(ulysses_group, ring_group)``: two-dimensional sequence parallelism with ``U`` ranks per all-to-all
  and ``R`` ranks per ring, ``U * R = P``; every rank is in one Ulysses group and one ring group, the ranks of a
  Ulysses group share their ring rank, and the ranks of a ring share their Ulysses rank (checked on first use);
* a 2-D ``DeviceMesh`` whose dimensions are named ``"ulysses"`` and ``"ring"`` (any order), or a 1-D mesh.

Rank ``(r, u)`` (ring rank ``r``, Ulysses rank ``u``) has the *sequence index* ``g = r * U + u``: the index
``distattn.schedule.layouts.Layout`` lays out by (put a Ulysses group inside a node: its all-to-alls are the
heavy traffic). :func:`make_2d_groups` builds such groups from a flat group with that convention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Topology", "topology", "make_2d_groups", "is_2d", "all_reduce"]

ULYSSES, RING = "ulysses", "ring"


@dataclass(frozen=True, eq=False)
class Topology:
    """A resolved sequence-parallel group: ``U`` x ``R`` ranks; this rank is ``(r, u)``, sequence index ``g``."""

    ulysses_group: object  # None when U == 1
    ring_group: object  # None: the default group
    U: int
    R: int
    u: int
    r: int

    @property
    def world_size(self) -> int:
        return self.U * self.R

    @property
    def index(self) -> int:
        """This rank's position in the sequence layout (``r * U + u``)."""
        return self.r * self.U + self.u

    @property
    def two_d(self) -> bool:
        return self.U > 1


def is_2d(group) -> bool:
    """Whether ``group`` names two groups (a pair or a 2-D mesh), even if one of them has a single rank."""
    if isinstance(group, tuple):
        return True
    return _is_mesh(group) and group.ndim == 2


def _is_mesh(group) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - every supported torch has it
        return False
    return isinstance(group, DeviceMesh)


def split(group) -> tuple[object, object]:
    """``(ulysses_group, ring_group)`` of a group spec (``ulysses_group`` None for a flat one). Raises on a
    malformed spec; no communication."""
    if group is None or isinstance(group, dist.ProcessGroup) or group is dist.GroupMember.NON_GROUP_MEMBER:
        return None, group  # NON_GROUP_MEMBER: new_group's answer on a non-member (its calls then say so)
    if isinstance(group, tuple):
        if len(group) != 2 or not all(g is None or isinstance(g, dist.ProcessGroup) for g in group):
            raise TypeError(f"group=(ulysses_group, ring_group) must be a pair of ProcessGroups, got {group!r}")
        return group
    if _is_mesh(group):
        if group.ndim == 1:
            return None, group.get_group()
        names = tuple(group.mesh_dim_names or ())
        if group.ndim != 2 or sorted(names) != [RING, ULYSSES]:
            raise ValueError(f"a DeviceMesh given as group= must be 1-D, or 2-D with dimensions named "
                             f"('{RING}', '{ULYSSES}') in any order; got ndim={group.ndim}, names={names}: build it "
                             f"with init_device_mesh(device, (R, U), mesh_dim_names=('ring', 'ulysses'))")
        return group.get_group(ULYSSES), group.get_group(RING)
    raise TypeError(f"group must be None, a ProcessGroup, a pair (ulysses_group, ring_group) or a DeviceMesh, got "
                    f"{type(group).__name__}")


_CHECKED: dict[tuple[int, int], tuple[int, int]] = {}


def topology(group, *, check: bool = True) -> Topology:
    """Resolve ``group`` (see the module doc). A two-dimensional spec is checked once per process and pair of
    groups (one small all-gather on each): ranks of a Ulysses group must share their ring rank and vice versa."""
    ug, rg = split(group)
    R, r = dist.get_world_size(rg), dist.get_rank(rg)
    if ug is None:
        return Topology(None, rg, 1, R, 0, r)
    U, u = dist.get_world_size(ug), dist.get_rank(ug)
    if r < 0 or u < 0:
        raise ValueError(f"global rank {dist.get_rank()} is not a member of both groups of group=(ulysses, ring)")
    key = (id(ug), id(rg))
    if check and key not in _CHECKED:
        ring_ranks = _gather_int(r, ug)
        u_ranks = _gather_int(u, rg)
        if len(set(ring_ranks)) != 1 or len(set(u_ranks)) != 1:
            raise ValueError(f"group=(ulysses_group, ring_group) is not a grid: the ranks of this rank's Ulysses "
                             f"group have ring ranks {ring_ranks} (must all be equal) and the ranks of its ring have "
                             f"Ulysses ranks {u_ranks} (must all be equal); build the groups with "
                             f"distattn.make_2d_groups(ulysses=U) or init_device_mesh(..., ('ring', 'ulysses'))")
        _CHECKED[key] = (r, u)
    return Topology(ug, rg, U, R, u, r)


def _gather_int(value: int, group) -> list[int]:
    backend = str(dist.get_backend(group))
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend and "gloo" not in backend \
        else torch.device("cpu")
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return [int(p.item()) for p in parts]


def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    """All-reduce ``t`` in place over every rank of ``group``; a two-dimensional group reduces over its Ulysses
    row, then over its ring: all ``U * R`` ranks."""
    ulysses_group, ring_group = split(group)
    if ulysses_group is not None:
        dist.all_reduce(t, op=op, group=ulysses_group)
    dist.all_reduce(t, op=op, group=ring_group)


def make_2d_groups(ulysses: int, group=None) -> tuple[object, object]:
    """``(ulysses_group, ring_group)`` over the ranks of ``group`` (default: the world) with ``U = ulysses``:
    group rank ``g`` is ``(r, u) = divmod(g, U)``, so a Ulysses group is ``U`` consecutive ranks (one node).

    A collective: every process of the job must call it, in the same order (``dist.new_group``)."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    p = len(ranks)
    if isinstance(ulysses, bool) or not isinstance(ulysses, int) or ulysses < 1 or p % ulysses:
        raise ValueError(f"ulysses={ulysses!r} must be a positive int dividing the group size {p}")
    mine_u = mine_r = None
    for r in range(p // ulysses):  # every process creates every group, in the same order
        g = dist.new_group([ranks[r * ulysses + u] for u in range(ulysses)])
        if dist.get_rank() in ranks[r * ulysses:(r + 1) * ulysses]:
            mine_u = g
    for u in range(ulysses):
        g = dist.new_group([ranks[r * ulysses + u] for r in range(p // ulysses)])
        if dist.get_rank() in ranks[u::ulysses]:
            mine_r = g
    return mine_u, mine_r
