"""Checkpoints of ``launch/train.py`` with ``torch.distributed.checkpoint`` (DCP).

Layout: ``<ckpt-dir>/step_00000040/`` per save, each a DCP checkpoint of the model (FSDP2 shards, DDP or a
plain module alike, through ``get_state_dict``), the optimizer and the job's progress (step, samples
consumed, losses so far). DCP writes ``.metadata`` last, from the coordinator, after every rank has written
its shards, so a directory without it is an interrupted save and is never resumed from. DCP reshards on
load, so a checkpoint can be resumed at another world size.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

_PREFIX = "step_"


class TrainState(Stateful):
    """Model + optimizer + progress, as one DCP ``Stateful``."""

    def __init__(self, model, optimizer, progress: dict):
        self.model = model
        self.optimizer = optimizer
        self.progress = progress  # plain Python values; updated in place by load_state_dict

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "progress": dict(self.progress)}

    def load_state_dict(self, state_dict: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])
        self.progress.update(state_dict["progress"])


def _step_dir(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"{_PREFIX}{step:08d}"


def complete_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every finished checkpoint under ``ckpt_dir``, oldest first."""
    found = []
    for path in ckpt_dir.glob(f"{_PREFIX}*") if ckpt_dir.is_dir() else ():
        suffix = path.name[len(_PREFIX):]
        if suffix.isdigit() and (path / ".metadata").is_file():
            found.append((int(suffix), path))
    return sorted(found)


def latest_step(ckpt_dir: Path) -> int | None:
    """The newest finished checkpoint's step, as rank 0 sees it (broadcast so that all ranks agree)."""
    found = complete_checkpoints(ckpt_dir) if dist.get_rank() == 0 else []
    box = [found[-1][0] if found else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save(state: TrainState, ckpt_dir: Path, step: int, keep: int) -> Path:
    """Save ``state`` as step ``step``; keep only the newest ``keep`` finished checkpoints."""
    path = _step_dir(ckpt_dir, step)
    dcp.save(state_dict={"train": state}, checkpoint_id=str(path))
    dist.barrier()  # every rank's shards and the metadata are on disk before anything is deleted
    if dist.get_rank() == 0:
        for _, old in complete_checkpoints(ckpt_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def load(state: TrainState, ckpt_dir: Path, step: int) -> Path:
    """Load step ``step`` into ``state`` (model, optimizer and progress)."""
    path = _step_dir(ckpt_dir, step)
    dcp.load(state_dict={"train": state}, checkpoint_id=str(path))
    return path
