"""Model of ``launch/train.py``: build a LLaMA, swap in distattn, shard its parameters (FSDP2 or DDP).

Initialization is rank 0's: rank 0 builds (or loads) the full model on the CPU with the job's seed, every
other rank builds the same architecture on the ``meta`` device (no memory, no reading of the checkpoint),
and the weights are broadcast into the shards. So a run starts from the same weights at every world size,
and a 7B checkpoint is read once, not once per rank. With ``--offload-optimizer`` (FSDP2's ``CPUOffloadPolicy``)
every rank builds the same weights itself (same seed, or the same files), since the parameter shards then live
on the CPU, where an NCCL broadcast cannot reach them.

Gradients: with a sequence split over the ``sp`` ranks of a group, each rank's backward produces only the
part of every parameter's gradient that flows through its tokens (its loss term, its queries' attention),
and the true gradient is their sum. ``causal_lm_loss`` normalizes each rank's term by the token count of
the *whole* group, so summing over the sp ranks gives the gradient of the global mean loss; data-parallel
replicas (``dp``) see different samples and are averaged. The gradient reduction over all ``sp * dp``
ranks therefore sums and divides by ``dp`` only, not by the world size: distattn's own setting for each
wrapper (``distattn.gradients``: a DDP communication hook, FSDP2's gradient divide factor).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
import torch.distributed as dist

from train_config import RunConfig, UsageError

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def hf_config(cfg: RunConfig, vocab_size: int):
    """The ``transformers`` config of the preset or checkpoint, checked against the tokenizer."""
    from transformers import AutoConfig, LlamaConfig

    if cfg.preset is None:
        try:
            config = AutoConfig.from_pretrained(cfg.args.model, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--model {cfg.args.model}: cannot read its config.json "
                             f"({str(exc).splitlines()[0]})") from exc
        if vocab_size > config.vocab_size:
            raise UsageError(f"the tokenizer has {vocab_size} tokens but --model {cfg.args.model} embeds only "
                             f"{config.vocab_size}; pass the tokenizer the checkpoint was trained with")
        return config
    fields = dict(cfg.preset)
    rope_theta = fields.pop("rope_theta", 10000.0)
    return LlamaConfig(vocab_size=vocab_size, max_position_embeddings=max(cfg.args.seq_len, 2048),
                       rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
                       tie_word_embeddings=False, use_cache=False, **fields)


def check_weights(cfg: RunConfig) -> None:
    """``--model DIR`` must hold safetensors weights: ``model.safetensors``, or ``model.safetensors.index.json`` and
    every shard it names. Checked on every rank before the process group exists, since only rank 0 reads them
    (in :func:`build`, after it), where a failure could not be reported as one clean error.

    A pickle-only checkpoint (``pytorch_model.bin``) is refused with the command that converts it, rather than
    loaded with ``torch.load(weights_only=True)``: unpickling is the part of loading that can run code from the
    file, and the restricted unpickler has had bypasses (CVE-2025-32434); a safetensors file holds tensors and a
    JSON header, nothing else, which is the promise the job's own checkpoints keep ("loading never runs code from
    the files"). Converting is one explicit step that the user takes once, trusting the file.
    """
    if cfg.preset is not None:
        return
    path = Path(cfg.args.model)
    if (path / SAFETENSORS).is_file():
        return
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UsageError(f"--model {path}: cannot read {SAFETENSORS_INDEX} ({type(exc).__name__}: {exc}); "
                             f"re-save the model with save_pretrained") from exc
        missing = [name for name in shards if not (path / name).is_file()]
        if missing:
            more = ", ..." if len(missing) > 3 else ""
            raise UsageError(f"--model {path}: {SAFETENSORS_INDEX} names {len(shards)} weight shards but "
                             f"{len(missing)} are missing ({', '.join(missing[:3])}{more}); finish the download or "
                             f"copy")
        return
    pickles = [name for name in PICKLES if (path / name).is_file()]
    if pickles:
        raise UsageError(f"--model {path} has its weights only as {pickles[0]}, a pickle file, and train.py loads "
                         f"safetensors weights only (a pickle can run code when loaded); if you trust the file, "
                         f"convert it once: python -c \"from transformers import AutoModelForCausalLM as M; "
                         f"M.from_pretrained('{path}').save_pretrained('{path}')\" (writes {SAFETENSORS})")
    raise UsageError(f"--model {path} has a config.json but no weights: found neither {SAFETENSORS} nor "
                     f"{SAFETENSORS_INDEX} (train.py loads safetensors weights); copy the weights into it, or train "
                     f"from random initialization with a preset (--model tiny, small, ...)")


def build(cfg: RunConfig, config, materialize: bool) -> torch.nn.Module:
    """The model in fp32 on the CPU (``materialize``) or on the ``meta`` device."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.args.seed)
    if materialize and cfg.preset is None:
        return AutoModelForCausalLM.from_pretrained(cfg.args.model, config=config, dtype=torch.float32,
                                                    local_files_only=True)
    with torch.device("cpu" if materialize else "meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def decoder_layers(model) -> torch.nn.ModuleList:
    """The transformer blocks (``model.model.layers`` in every LLaMA-family HF model)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"--model: {type(model).__name__} has no model.layers; a LLaMA-family causal LM is needed")
    return layers


def _fsdp_unsupported(device: torch.device) -> str | None:
    """Why the process group cannot run FSDP2's collectives, or ``None`` if it can (every rank alike)."""
    world = dist.get_world_size()
    try:
        full = torch.zeros(world, device=device)
        part = torch.zeros(1, device=device)
        # the newer names when torch has them; the *_tensor ones still work but warn
        getattr(dist, "reduce_scatter_single", getattr(dist, "reduce_scatter_tensor", None))(part, full)
        getattr(dist, "all_gather_single", getattr(dist, "all_gather_into_tensor", None))(full, part)
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        return f"{dist.get_backend()} lacks reduce_scatter/all_gather_into_tensor ({str(exc).splitlines()[0]})"
    return None


def shard(model, cfg: RunConfig, device: torch.device, log, group=None) -> tuple[torch.nn.Module, str]:
    """Shard or replicate the parameters over all ranks; returns the model and ``"fsdp2"``/``"ddp"``/``"none"``.

    Rank 0's model holds the weights; the others' are on ``meta`` and receive them here. ``group``: the
    sequence-parallel group (``train_groups.sequence_group``), over which the gradient reduction sums.
    """
    if cfg.args.offload_optimizer:  # CPUOffloadPolicy is FSDP2's
        why = _fsdp_unsupported(device) if cfg.env.world_size > 1 else None
        if why is not None:
            raise UsageError(f"--offload-optimizer needs FSDP2, but {why}")
        return _fully_shard(model, cfg, device, group), "fsdp2"
    if cfg.env.world_size == 1:
        if cfg.dtype == torch.float32:
            return model.to(device), "none"
        # Nothing to shard, but FSDP2's mixed-precision policy (compute in cfg.dtype, fp32 parameters and
        # gradients) gives the numerics of world > 1; autocast would leave q/k in fp32 after RoPE, v in bf16.
        return _fully_shard(model, cfg, device, group), "fsdp2"
    mode = cfg.args.shard
    if mode in ("auto", "fsdp"):
        why = _fsdp_unsupported(device)
        if why is not None and mode == "fsdp":
            raise RuntimeError(f"--shard fsdp: {why}")
        if why is not None:
            log(f"FSDP2 is not possible here: {why}; falling back to DDP (parameters replicated)")
            mode = "ddp"
        else:
            mode = "fsdp"
    if mode == "fsdp":
        return _fully_shard(model, cfg, device, group), "fsdp2"
    return _replicate(model, cfg, device, group), "ddp"


def _fully_shard(model, cfg: RunConfig, device: torch.device, group):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from distattn import set_fsdp_gradient_divide_factor

    offload = cfg.args.offload_optimizer
    full_sd = model.state_dict() if cfg.env.rank == 0 and not offload else {}  # rank 0's full fp32 tensors
    mesh = init_device_mesh(device.type, (cfg.env.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=cfg.dtype, reduce_dtype=torch.float32)
    # Parameter shards, gradients and AdamW states in host memory (pinned on CUDA: train_offload checked it).
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")} if offload else {}
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, **policy)
    fully_shard(model, mesh=mesh, mp_policy=mp, **policy)
    set_fsdp_gradient_divide_factor(model, group)  # sum over sp, mean over dp (module docstring)
    if offload:
        # Every rank built the same weights (the seed, or the same files): nothing to send. Broadcasting from
        # rank 0 is not possible here: set_model_state_dict broadcasts on the parameters' device, now the CPU,
        # which NCCL cannot. fully_shard moved the buffers (rotary inv_freq) to the device.
        return model
    if cfg.env.rank != 0:
        model.to_empty(device=device)
    set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    _broadcast_buffers(model)
    return model


def _broadcast_buffers(model) -> None:
    # Non-persistent buffers (rotary inv_freq) are in no state dict; they left meta as garbage on ranks > 0.
    for buf in model.buffers():
        dist.broadcast(buf, src=0)


def _replicate(model, cfg: RunConfig, device: torch.device, group):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from distattn import register_ddp_gradient_hook

    if cfg.env.rank != 0:
        model.to_empty(device=device)
    # DDP broadcasts rank 0's parameters and buffers (rotary inv_freq included) when it is built.
    ddp = DDP(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)
    return register_ddp_gradient_hook(ddp, group)  # DDP's default divides by the world size; we want dp


def autocast(cfg: RunConfig, mode: str):
    """Mixed precision for DDP (FSDP2 casts parameters itself)."""
    if cfg.dtype == torch.float32 or mode != "ddp":
        return contextlib.nullcontext()
    return torch.autocast(device_type=cfg.device_type, dtype=cfg.dtype)


def param_groups(model, weight_decay: float) -> list[dict]:
    """AdamW groups: decay matrices, not norms or biases."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def count_params(config) -> int:
    """Parameter count from the config alone (ranks > 0 hold meta tensors; FSDP shards the rest)."""
    h, i, n, v = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    attn = h * d * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    per_layer = attn + 3 * h * i + 2 * h
    embed = v * h * (1 if config.tie_word_embeddings else 2)
    return n * per_layer + embed + h
