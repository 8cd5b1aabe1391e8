"""The planner's step peak for a ``SequenceParallelTrainer`` configuration against the step's measured live bytes.

Each configuration (the Trainer's length techniques) trains 2 SGD steps of a small LLaMA on 2 ranks over gloo (CPU,
fp32); the second step runs inside ``distattn.memory.measure.live_bytes`` (the peak of the bytes allocated in the
step, dispatch level) on rank 0. Measured = that peak + the parameters (allocated before the step; the gradients are
made inside it: ``Trainer`` zeroes them to ``None``). Predicted = ``distattn.memory.techniques.technique_peak`` for the
same model, tokens, P, precision, checkpointing and techniques (``mode="ddp", device="cpu"``), without AdamW's states
(SGD has none), at the largest of the model's moments inside ``training_step`` (the optimizer's step is not
measured: it runs after); on CPU the offloaded checkpoints' "host" copies are CPU tensors too, so the host bytes are
added to the device prediction. The FSDP2 rows run accelerate's own FSDP2 preparation (``TrainingArguments(fsdp=True,
fsdp_config={"fsdp_version": 2, ...})``) on CPU with ``tests/test_hf_trainer_fsdp2._accelerate_fsdp_on_cpu``, and
are measured with ``distattn.memory.tiers.step_bytes`` (it follows FSDP2's storage resizes; the sharded parameters
counted); predicted with ``mode="fsdp2", shard=P, fsdp_layout="split"`` (accelerate's groups).

    python bench/hf_trainer_memory.py            # writes bench/results/hf-trainer-memory/{results.csv,README.md}
"""

from __future__ import annotations

import csv
import os
import pathlib
import platform
import sys
import tempfile

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests")]  # this checkout's distattn, its tests' helpers
SIZES = dict(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, attention_dropout=0.0)
SEQ, P = 1024, 2
ALL = dict(tile_loss=128, tile_mlp=128, remat=True, offload_checkpoints=True)
CONFIGS = {"none": {}, "tile_loss 128": dict(tile_loss=128), "tile_mlp 128": dict(tile_mlp=128),
           "remat": dict(remat=True), "remat + offload": dict(remat=True, offload_checkpoints=True), "all": ALL,
           "fsdp2": dict(fsdp=True), "fsdp2 + tile_loss 128": dict(tile_loss=128, fsdp=True),
           "fsdp2 + remat + offload": dict(remat=True, offload_checkpoints=True, fsdp=True),
           "fsdp2 + all": dict(ALL, fsdp=True), "fsdp2 + cpu_offload": dict(fsdp=True, cpu_offload=True),
           "fsdp2 + cpu_offload + all": dict(ALL, fsdp=True, cpu_offload=True)}
FSDP2 = {"fsdp_version": 2, "reshard_after_forward": True, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
KERNEL_FNS = ("fold_", "merge_", "attn_delta", "backward_chunk_")  # the CPU kernels' scratch: not a GPU's (as
# bench/step_memory.py)


def _measure(rank, world, out, names=None):
    """Rank ``rank``'s measured peak per configuration (``names``: those of ``CONFIGS``, default all)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from test_hf_trainer_fsdp2 import _accelerate_fsdp_on_cpu

    from distattn import kernels
    from distattn.integrations.hf import SequenceParallelTrainer
    from distattn.memory.measure import live_bytes
    from distattn.memory.tiers import step_bytes

    undo = _accelerate_fsdp_on_cpu()  # accelerate's own FSDP2 path, as on GPUs (tests/test_hf_trainer_fsdp2.py)
    peaks = {}
    for name, kw in CONFIGS.items():
        if names is not None and name not in names:
            continue
        kw = dict(kw)
        fsdp = kw.pop("fsdp", False)
        offload = kw.pop("cpu_offload", False)

        class Measured(SequenceParallelTrainer):
            def training_step(self, model, inputs, num_items_in_batch=None):
                if self.state.global_step == 0:
                    return super().training_step(model, inputs, num_items_in_batch)
                if not fsdp:
                    with live_bytes() as live:
                        loss = super().training_step(model, inputs, num_items_in_batch)
                    peaks[name] = live.peak + sum(p.numel() * p.element_size() for p in model.parameters())
                    return loss
                # FSDP2 grows and frees its unsharded parameters by storage resizes: step_bytes follows them; the
                # parameters' local shards are counted. cpu_offload: the shards and their gradients are host memory
                # (on the CPU no copy is made: they are named)
                saved = {f: getattr(kernels, f) for f in KERNEL_FNS}
                shards = [p for p in model.parameters() if hasattr(p, "_local_tensor")]
                host = (lambda: shards + [p.grad for p in shards if p.grad is not None]) if offload else None
                with step_bytes(model=model, host_compute=host) as mem:
                    mem.count([list(model.parameters())])
                    for f in KERNEL_FNS:
                        setattr(kernels, f, mem.opaque(saved[f]))
                    try:
                        loss = super().training_step(model, inputs, num_items_in_batch)
                    finally:
                        for f, fn in saved.items():
                            setattr(kernels, f, fn)
                peaks[name] = mem.device_peak
                peaks[name + " host"] = mem.host_peak
                return loss

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**SIZES))
        rows = torch.randint(0, SIZES["vocab_size"], (4, SEQ), generator=torch.Generator().manual_seed(1))
        data = [{"input_ids": r, "labels": r.clone()} for r in rows]
        args = TrainingArguments(output_dir=str(out / name.replace(" ", "")), use_cpu=True, max_steps=2,
                                 per_device_train_batch_size=1, report_to=[], optim="sgd", learning_rate=0.1,
                                 save_strategy="no", disable_tqdm=True, logging_steps=1,
                                 **(dict(fsdp=True, fsdp_config={**FSDP2, "cpu_offload": offload}) if fsdp else {}))
        stack = lambda fs: {k: torch.stack([f[k] for f in fs]) for k in fs[0]}  # noqa: E731
        Measured(model=model, args=args, train_dataset=data, data_collator=stack, **kw).train()
    undo()
    return peaks


def _predicted(kw) -> tuple[int, dict, str]:
    from transformers import LlamaConfig

    from distattn.memory import model_spec, steady_state_bytes
    from distattn.memory.techniques import Techniques, technique_peak

    spec = model_spec(LlamaConfig(**SIZES))
    strategy = "remat" if kw.get("remat") else ("full" if kw.get("offload_checkpoints") else "none")
    offload = bool(kw.get("cpu_offload"))
    tech = Techniques(loss_tile=kw.get("tile_loss"), mlp_tile=kw.get("tile_mlp"),
                      offload_checkpoints=bool(kw.get("offload_checkpoints")), offload_optimizer=offload)
    fsdp = kw.get("fsdp", False)  # else DDP: what Trainer wraps the model in on CPU
    peak = technique_peak(spec, 1, SEQ, sp=P, shard=P if fsdp else 1, precision="fp32", strategy=strategy, tech=tech,
                          pinned=False, mode="fsdp2" if fsdp else "ddp", device="cpu", fsdp_layout="split")
    # the measured region is ``training_step`` (forward, loss, backward): the optimizer's moment is outside it
    moment, total, parts = max((m for m in peak.moments if m[0] != "in the optimizer step"), key=lambda m: m[1])
    if offload:  # the device side; the offloaded checkpoints are CPU tensors here, counted with it (their bytes as
        # the model counts them alone: beside the offloaded optimizer the host peak is the optimizer's)
        ckpt = technique_peak(spec, 1, SEQ, sp=P, shard=P, precision="fp32", strategy=strategy, pinned=False,
                              tech=Techniques(offload_checkpoints=tech.offload_checkpoints), mode="fsdp2",
                              device="cpu", fsdp_layout="split").host.get("checkpoints", 0)
        return total + ckpt, parts, moment
    adam = steady_state_bytes(spec, shard=P if fsdp else 1)["adam"]
    return total - adam + peak.host_total, parts, moment


def _predicted_host(kw) -> int:
    """With ``cpu_offload``: the parameters' shards and their gradients in host memory (SGD keeps no state)."""
    from transformers import LlamaConfig

    from distattn.memory import model_spec
    from distattn.memory.techniques import optimizer_host_bytes

    host = optimizer_host_bytes(model_spec(LlamaConfig(**SIZES)), P, pinned=False)
    return host["weights (pinned)"] + host["grads (pinned)"]


def main() -> None:
    from dist_utils import run_distributed

    measured = run_distributed(_measure, P, pathlib.Path(tempfile.mkdtemp()), timeout=900)[0]
    out = HERE / "results" / "hf-trainer-memory"
    rows = []
    for name, kw in CONFIGS.items():
        predicted, parts, moment = _predicted(kw)
        host = kw.get("cpu_offload") and (measured[name + " host"], _predicted_host(kw))
        rows.append(dict(config=name, measured_bytes=measured[name], predicted_bytes=predicted,
                         ratio=round(predicted / measured[name], 3), predicted_moment=moment,
                         host_measured=host[0] if host else "", host_predicted=host[1] if host else "",
                         predicted_parts="; ".join(f"{k}={v}" for k, v in parts.items())))
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [f"# SequenceParallelTrainer step peak: planner vs measured (rank 0 of {P}, CPU gloo, fp32)", "",
             f"Machine: {platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}. Command: "
             f"`python bench/hf_trainer_memory.py`. Model: {SIZES}, {SEQ} tokens, batch 1, P = {P}, SGD.", "",
             "| config | measured MiB | predicted MiB | predicted / measured | predicted moment | host measured / "
             "predicted MiB |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['config']} | {r['measured_bytes'] / 2**20:.2f} | {r['predicted_bytes'] / 2**20:.2f} | "
              f"{r['ratio']} | {r['predicted_moment']} | " + (f"{r['host_measured'] / 2**20:.2f} / "
              f"{r['host_predicted'] / 2**20:.2f} |" if r["host_measured"] != "" else "- |") for r in rows]
    notes = (out / "NOTES.md").read_text()  # what the table shows (hand-written, kept by every rerun)
    (out / "README.md").write_text("\n".join(lines) + "\n\n" + notes)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
