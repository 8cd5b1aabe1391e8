"""The training step, ALST beside distattn (issue 37, part 2): a small HF LLaMA, one sequence length, P ranks.

Three stacks on the same batch and the same initial weights, a few AdamW steps each:

* ``distattn``: as its users run it (README, "Hugging Face models and rematerialization-aware checkpointing" and
  "The longest sequence"): ``use_distattn``, ``enable_remat_checkpointing(model, offload=CheckpointOffload(...))``,
  ``tile_mlp``, ``tile_loss``, ``shard_batch``, ``distattn.reduce_gradients``;
* ``alst``: DeepSpeed 0.19.8's ALST pieces as ArcticTraining calls them (``bench/peers/train_alst.py``: Ulysses
  attention registered with transformers, ``TiledMLP``, ``TiledFusedLogitsLoss``, ``CheckpointHiddenStatesOffload``
  with one listed patch so it offloads on a CPU accelerator), gradients summed over the group;
* ``hf``: plain transformers with gradient checkpointing on one process (the reference).

Per stack and step: the loss, held to an fp64 one-process run by the accuracy rule (STYLE.md 14: the error against
fp64 is at most twice the fp32 reference's plus a floor); per rank, the measured peak of live tensors, device- and
host-resident apart (``bench/peers/train_measure.py``: one measure for all three), and the planner's prediction
(``distattn.memory.techniques.technique_peak``) for this CPU run and for the same step on a GPU. Every rank runs under
``tests.dist_utils.run_distributed`` with a timeout; a stack that fails gives its row the error.

    python -m bench.peers.train_step --seq 8192           # P = 2 and 4, writes bench/results/peers-train-step/
    python -m bench.peers.train_step --world 2 --seq 256 --layers 2 --steps 2 --out runs/x   # smoke
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.peers.train_measure import host_site, measure_step

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "bench" / "results" / "peers-train-step"
STACKS = ("distattn", "alst", "hf")
LOSS_FLOOR_ULPS = 16  # floor of the rule in fp32 ulps of the loss: the three stacks sum the same terms in other orders


@dataclass(frozen=True)
class Setup:
    """The model and the run (CPU sizes)."""

    seq: int = 4096
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 4
    ffn: int = 688
    vocab: int = 8192
    steps: int = 3
    tile: int = 256
    """Tokens per tile of the MLP and of the LM head + loss, both stacks (ArcticTraining's MLP default: hidden)."""
    lr: float = 1e-3
    optimizer: str = "adamw"
    """``adamw`` (the runs), or ``sgd`` (tests: a gradient off by a factor moves its loss; AdamW's barely)."""
    seed: int = 0
    alst_head_fix: bool = True
    """Apply ``train_alst.fix_head_grad`` (without it ALST's LM head trains on a gradient (tokens) times too large)."""

    def config(self, attn: str = "sdpa"):
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.ffn,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, max_position_embeddings=self.seq,
                           attn_implementation=attn)

    def batch(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed + 1)
        return torch.randint(0, self.vocab, (1, self.seq), generator=gen)


def _model(setup: Setup, attn: str = "sdpa", dtype=torch.float32):
    from transformers import LlamaForCausalLM

    torch.manual_seed(setup.seed)  # the same weights in every stack and on every rank
    model = LlamaForCausalLM(setup.config(attn)).to(dtype)
    model.train()
    opt = torch.optim.SGD if setup.optimizer == "sgd" else torch.optim.AdamW
    return model, opt(model.parameters(), lr=setup.lr)


def _steps(setup: Setup, model, optimizer, step_fn) -> list[dict]:
    return [asdict(measure_step(model, optimizer, step_fn)) for _ in range(setup.steps)]


# -- the stacks, one rank each (spawned: each stack in fresh processes, so ALST's class patches stay in its own) ----
def hf_rank(rank: int, world: int, setup: Setup, dtype_name: str = "float32", checkpointing: bool = True):
    """The reference: plain transformers on the whole sequence, one process."""
    from distattn._compat import hf_checkpointing_enable

    torch.set_num_threads(1)
    model, optimizer = _model(setup, dtype=getattr(torch, dtype_name))
    if checkpointing:
        hf_checkpointing_enable(model, {"use_reentrant": False})
    ids = setup.batch()

    def step():
        if dtype_name == "float64":  # transformers' loss casts the logits to fp32: take them, stay in fp64
            logits = model(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    if dtype_name == "float64":  # the accuracy reference: losses only
        out = []
        for _ in range(setup.steps):
            out.append({"loss": float(step().detach())})
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return out
    return {"steps": _steps(setup, model, optimizer, step)}


def distattn_rank(rank: int, world: int, setup: Setup):
    import distattn
    from distattn.integrations.hf import enable_remat_checkpointing, shard_batch, tile_loss, tile_mlp, use_distattn
    from distattn.offload import CheckpointOffload

    torch.set_num_threads(1)
    undo = host_site(CheckpointOffload, "_offload")  # its one allocation is the host copy
    try:
        model, optimizer = _model(setup)
        use_distattn(model)
        offload = CheckpointOffload(remat=True)
        enable_remat_checkpointing(model, offload=offload)
        tile_mlp(model, setup.tile)
        tile_loss(model, setup.tile)
        batch = shard_batch(setup.batch(), labels=setup.batch())

        def step():
            loss = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                         shift_labels=batch["shift_labels"]).loss
            loss.backward()
            distattn.reduce_gradients(model)
            return loss

        steps = _steps(setup, model, optimizer, step)
        return {"steps": steps, "offloaded": offload.host_bytes}
    finally:
        undo()


def alst_rank(rank: int, world: int, setup: Setup):
    import torch.distributed as dist

    from bench.peers import train_alst
    from distattn._compat import hf_checkpointing_enable

    torch.set_num_threads(1)
    train_alst.init_deepspeed_comm()
    mpu = train_alst.register(setup.config(), sp=world, micro_batch=1, seq_len=setup.seq)
    group = mpu.get_sequence_parallel_group()
    from transformers.models.llama import modeling_llama

    train_alst.tile_mlp_class(modeling_llama.LlamaMLP, setup.tile)  # before the model is built, as ArcticTraining
    undo = host_site(*train_alst.host_buffer_site())
    try:
        model, optimizer = _model(setup)
        hf_checkpointing_enable(model, {"use_reentrant": False})
        batch = train_alst.shard(setup.batch(), rank, world)
        offloaded = []

        def step():
            ctx = train_alst.offload_context()
            with ctx:  # saved_tensors_hooks.__enter__ returns None: keep the object
                loss, good_tokens = train_alst.tiled_loss(model, batch, group, setup.tile)
                loss.backward()
                if setup.alst_head_fix:
                    train_alst.fix_head_grad(model, world, good_tokens)
                offloaded.append(ctx.stats.offloaded_bytes)
            # all_gather's backward sums every rank's d(loss) into each rank's copy: each rank holds P times its
            # share; DeepSpeed's engine averages over its data-parallel ranks (these ranks), which undoes it
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=group)
                    p.grad.div_(world)
            return loss

        steps = _steps(setup, model, optimizer, step)
        return {"steps": steps, "offloaded": max(offloaded)}
    finally:
        undo()


# -- the planner's prediction ---------------------------------------------------------------------------------
def predictions(setup: Setup, world: int) -> dict[str, dict]:
    """``technique_peak`` per stack: device bytes at its peak moment and host bytes (fp32, unpinned host), for the
    machine it is measured on (``device="cpu"``: AdamW's for-loop temporaries, an offloaded checkpoint used from its
    host copy) and, as ``gpu``, the same step on a GPU (foreach AdamW, checkpoints fetched back to the device)."""
    from distattn.memory.plan import model_spec
    from distattn.memory.techniques import Techniques, technique_peak

    spec = model_spec(setup.config())
    tech = Techniques(loss_tile=setup.tile, mlp_tile=setup.tile, offload_checkpoints=True)
    # the planner has no Ulysses implementation: ALST is modelled as SDPA on this rank's n = s / P tokens
    runs = {"distattn": dict(sp=world, strategy="remat", impl="distattn", tech=tech),
            "alst": dict(sp=world, strategy="full", impl="sdpa", tech=tech),
            "hf": dict(sp=1, strategy="full", impl="sdpa", tech=Techniques())}
    out = {}
    for name, kw in runs.items():
        peak = technique_peak(spec, 1, setup.seq, precision="fp32", pinned=False, device="cpu", **kw)
        gpu = technique_peak(spec, 1, setup.seq, precision="fp32", pinned=False, device="cuda", **kw)
        out[name] = {"device": peak.total, "host": peak.host_total, "moment": peak.moment, "gpu": gpu.total}
    return out


# -- the run ----------------------------------------------------------------------------------------------------
def run_stack(name: str, setup: Setup, world: int, timeout: float) -> dict:
    from tests.dist_utils import run_distributed

    fn = {"distattn": distattn_rank, "alst": alst_rank, "hf": hf_rank}[name]
    env = {"DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0"} if name == "alst" else None
    start = time.monotonic()
    try:
        ranks = run_distributed(fn, 1 if name == "hf" else world, setup, timeout=timeout, env=env)
    except Exception as exc:  # noqa: BLE001 - the row carries the error
        return {"error": f"{type(exc).__name__}: {str(exc).strip()[-600:]}", "seconds": time.monotonic() - start}
    return {"ranks": ranks, "seconds": time.monotonic() - start}


def reference_losses(setup: Setup, timeout: float) -> list[float]:
    from tests.dist_utils import run_distributed

    return [s["loss"] for s in run_distributed(hf_rank, 1, setup, "float64", False, timeout=timeout)[0]]


def check_losses(losses: list[float], ref64: list[float], ref32: list[float]) -> list[tuple[float, float, bool]]:
    """(error, allowed, ok) per step: |loss - fp64| <= 2 |fp32 reference - fp64| + LOSS_FLOOR_ULPS ulps."""
    rows = []
    for loss, r64, r32 in zip(losses, ref64, ref32):
        allowed = 2 * abs(r32 - r64) + LOSS_FLOOR_ULPS * torch.finfo(torch.float32).eps * abs(r64)
        err = abs(loss - r64)
        rows.append((err, allowed, err <= allowed))
    return rows


def summarize(setup: Setup, world: int, results: dict, ref64: list[float]) -> list[dict]:
    """One row per stack: losses checked, the largest per-rank peaks over the steps, the prediction."""
    pred = predictions(setup, world)
    ref32 = [s["loss"] for s in results["hf"]["ranks"][0]["steps"]] if "ranks" in results["hf"] else ref64
    rows = []
    for name in STACKS:
        res = results[name]
        row = {"stack": name, "P": 1 if name == "hf" else world, "seq": setup.seq, "seconds": round(res["seconds"], 1)}
        if "error" in res:
            rows.append({**row, "error": res["error"]})
            continue
        ranks = res["ranks"]
        losses = [s["loss"] for s in ranks[0]["steps"]]
        checks = check_losses(losses, ref64, ref32)
        # memory: the last step (the first one also creates AdamW's states inside the step), the largest rank
        last = max((r["steps"][-1] for r in ranks), key=lambda s: s["resident"] + s["device_peak"])
        host = max(r["steps"][-1]["host_peak"] for r in ranks)
        row.update(losses=losses, loss_err=[c[0] for c in checks], loss_allowed=[c[1] for c in checks],
                   loss_ok=all(c[2] for c in checks), resident=last["resident"],
                   device_peak=last["resident"] + last["device_peak"], step_peak=last["device_peak"],
                   host_peak=host, at_peak=last["at_peak"],
                   allocator=max(r["steps"][-1]["resident"] + r["steps"][-1]["allocator_peak"] for r in ranks),
                   offloaded=max(r.get("offloaded", 0) for r in ranks),
                   pred_device=pred[name]["device"], pred_host=pred[name]["host"], pred_moment=pred[name]["moment"],
                   pred_gpu=pred[name]["gpu"])
        rows.append(row)
    return rows


def _mib(x) -> str:
    return f"{x / 2**20:.2f}"


def write(rows: list[dict], setup: Setup, out: Path, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    fields = ["stack", "P", "seq", "loss_ok", "losses", "loss_err", "loss_allowed", "resident", "step_peak",
              "device_peak", "host_peak", "allocator", "offloaded", "pred_device", "pred_host", "pred_moment",
              "pred_gpu", "at_peak", "seconds", "error"]
    with open(out / "train_step.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    import deepspeed  # noqa: F401 - its version goes in the table
    import transformers

    lines = ["# The training step: distattn, ALST (DeepSpeed 0.19.8) and plain HF, per rank", "",
             f"Command: `{command}`", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, gloo, fp32, CPU "
             f"(host and device are one memory: host-resident = allocated by an offloader's host-buffer routine, "
             f"`bench/peers/train_measure.py`). torch {torch.__version__}, transformers {transformers.__version__}, "
             f"deepspeed {deepspeed.__version__}.", "",
             f"Model: LLaMA, {setup.layers} layers, hidden {setup.hidden}, {setup.heads}/{setup.kv_heads} heads, ffn "
             f"{setup.ffn}, vocab {setup.vocab}; batch 1 x {setup.seq} tokens; {setup.steps} AdamW steps (lr "
             f"{setup.lr}); tiles of {setup.tile} tokens (MLP and loss, both stacks).", "",
             "MiB per rank, measured in the last step (the first also creates AdamW's states), largest rank. "
             "resident: parameters + AdamW states when a step begins; step peak: the most device-resident bytes "
             "allocated during the step on top (gradients, activations, buffers); device = resident + step peak; "
             "allocator (all): resident + the rise of the CPU allocator's live bytes over the step, every allocation "
             "(op scratch included; device and host together; the harness's `allocator_peak`); "
             "predicted: `technique_peak` (fp32, unpinned host) for this CPU run (`device=\"cpu\"`: AdamW's "
             "for-loop temporaries, offloaded checkpoints used from their host copies); predicted on a GPU: the same "
             "step as the planner models it on a GPU (foreach AdamW, checkpoints fetched back), not measured here.",
             "", "| stack | P | loss = fp64 ref (rule) | resident | step peak | device peak | host peak | "
             "allocator (all) | predicted device | predicted host | predicted on a GPU | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['stack']} | {r['P']} | error: {r['error'][:200]} | | | | | | | | | {r['seconds']} |")
            continue
        ok = "yes" if r["loss_ok"] else "**no**"
        lines.append(f"| {r['stack']} | {r['P']} | {ok} (max err {max(r['loss_err']):.1e}) | {_mib(r['resident'])} | "
                     f"{_mib(r['step_peak'])} | {_mib(r['device_peak'])} | {_mib(r['host_peak'])} | "
                     f"{_mib(r['allocator'])} | "
                     f"{_mib(r['pred_device'])} | {_mib(r['pred_host'])} | {_mib(r['pred_gpu'])} | {r['seconds']} |")
    lines += ["", "Live device-resident bytes at each device peak (last step, largest rank) by the op that allocated "
              "them, MiB (the largest six; parameters and AdamW states are in resident):", ""]
    for r in rows:
        if "at_peak" in r:
            parts = ", ".join(f"{op} {_mib(b)}" for op, b in r["at_peak"].items())
            lines.append(f"- {r['stack']}, P = {r['P']}: {parts}; the planner's moment: {r['pred_moment']}")
    from bench.peers.train_alst import PATCHES

    lines += ["", "Patches: " + "; ".join(f"`{k}`: {v}" for k, v in PATCHES.items()) + "."]
    (out / "README.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, nargs="+", default=[2, 4])
    for field in ("seq", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "steps", "tile"):
        p.add_argument("--" + field.replace("_", "-"), type=int, default=getattr(Setup, field))
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per stack run (all ranks)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    setup = Setup(**{f: getattr(args, f) for f in ("seq", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab",
                                                    "steps", "tile")})
    ref64 = reference_losses(setup, args.timeout)
    rows = []
    hf = run_stack("hf", setup, 1, args.timeout)  # one process: the same run for every P
    for world in args.world:
        results = {name: run_stack(name, setup, world, args.timeout) for name in STACKS if name != "hf"}
        results["hf"] = hf
        rows += summarize(setup, world, results, ref64)
        for r in rows[-3:]:
            print({k: r.get(k) for k in ("stack", "P", "loss_ok", "device_peak", "host_peak", "pred_device",
                                         "error")}, flush=True)
        command = "python -m bench.peers.train_step " + " ".join(argv if argv is not None else os.sys.argv[1:])
        write(rows, setup, args.out, command.strip())  # after each P: a long run keeps what it has measured
    return 0 if all(r.get("loss_ok") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
