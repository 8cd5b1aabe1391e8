"""The whole training step's byte model against a measurement: predicted vs measured peak, device and host.

Each case runs ``launch/train.py``'s model and step on gloo ranks of this machine (``train.setup_model`` and
``train.train_step``, the job's own code: FSDP2 or the plain model, remat/offloaded checkpoints, tiled loss and MLP,
optimizer offload), one warm-up step (AdamW makes its states), then measures the second step with
``distattn.memory.tiers.step_bytes`` (device and host live bytes; the CPU attention kernels' per-tile scratch kept
apart, as ``tests/test_executor_memory.py`` does) and compares with ``launch/train_memory.step_prediction``, the byte
model ``train.py``'s JSON summary reports. Writes ``bench/results/step-memory/step_memory.csv`` and ``README.md``.

    python bench/step_memory.py                 # the grid: techniques x schedules x P = 1, 2, 4 x two lengths
    python bench/step_memory.py --quick         # P = 1, 2, one length
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "launch", ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402

COMBOS = {"none": [], "remat": ["--remat"], "tile-loss": ["--tile-loss", "64"], "tile-mlp": ["--tile-mlp", "64"],
          "offload-ckpt": ["--offload-checkpoints"], "offload-ckpt+remat": ["--offload-checkpoints", "--remat"],
          "offload-optim": ["--offload-optimizer"],
          "all": ["--remat", "--offload-checkpoints", "--offload-optimizer", "--tile-loss", "64", "--tile-mlp", "64"]}
SCHEDULES = ("balanced", "zigzag", "placed")
VOCAB = 2048  # the loss's (tokens, vocab) logits are what the tiled loss removes: a vocabulary larger than hidden
KERNEL_FNS = ("fold_", "merge_", "attn_delta", "backward_chunk_")  # the CPU kernels: their scratch is not a GPU's


def _argv(flags, seq, schedule):
    argv = ["--model", "tiny", "--seq-len", str(seq), "--batch-size", "1", "--steps", "2", "--schedule", schedule,
            "--no-progress", *flags]
    return argv + (["--pack"] if schedule == "placed" else [])


def _batch(cfg, seq: int, vocab: int):
    """Step 2's batch: ``(1, seq)`` ids; placed: a packed stream of three documents (its positions restart)."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(vocab, (1, seq), generator=g)
    if cfg.args.pack:
        cuts = [0, seq // 3, seq // 2 + 8, seq]
        positions = torch.cat([torch.arange(b - a) for a, b in zip(cuts, cuts[1:])])
        return ids[0], positions
    return ids


def measure_case(rank, world, flags, seq, schedule, vocab=VOCAB):
    """One case on this rank: ``{"device", "host", "moment", "predicted_device", "predicted_host", ...}``."""
    import train
    import train_config
    import train_memory
    import train_model

    from distattn import kernels
    from distattn.memory.tiers import step_bytes

    argv = _argv(flags, seq, schedule)
    cfg = train_config.resolve(train_config.build_parser().parse_args(argv),
                               train_config.Env(rank=rank, world_size=world, local_rank=rank, local_world_size=world))
    config = train_model.hf_config(cfg, vocab)
    torch.manual_seed(0)
    group = train.sequence_group(cfg)
    model, mode = train.setup_model(cfg, config, group, torch.device("cpu"))
    optimizer = torch.optim.AdamW(train_model.param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    batch = _batch(cfg, seq, vocab)
    train.train_step(model, optimizer, batch, cfg, group, mode)  # AdamW makes its states
    host, host_compute = train_memory.host_tensors(model, optimizer, cfg)
    saved = {name: getattr(kernels, name) for name in KERNEL_FNS}
    snapshot = bool(os.environ.get("STEP_MEMORY_SNAPSHOT"))
    with step_bytes(host=host, host_compute=host_compute, model=model, snapshot=snapshot) as mem:
        mem.count([list(model.parameters()), list(model.buffers()), train_memory.optimizer_tensors(optimizer),
                   list(batch) if isinstance(batch, tuple) else batch])
        for name in KERNEL_FNS:
            setattr(kernels, name, mem.opaque(saved[name]))
        try:
            train.train_step(model, optimizer, batch, cfg, group, mode)
        finally:
            for name, fn in saved.items():
                setattr(kernels, name, fn)
    pred = train_memory.step_prediction(cfg, config, mode)
    return {"device": mem.device_peak, "host": mem.host_peak, "moment": str(mem.moment), "mode": mode,
            "host_moment": str(mem.host_moment),
            "predicted_device": pred.total, "predicted_host": pred.host_total, "predicted_moment": pred.moment,
            "parts": pred.parts, "moments": pred.moments, "at_peak": _largest(mem.at_peak)}


def _largest(at_peak, top=40):
    groups = {}
    for tier, where, nbytes in at_peak:
        key = (tier, where)
        groups[key] = (groups.get(key, (0, 0))[0] + nbytes, groups.get(key, (0, 0))[1] + 1)
    return sorted(((v[0], v[1], k) for k, v in groups.items()), reverse=True)[:top]


def _case_rows(rank, world, cases):
    out = []
    for name, seq, schedule in cases:
        t0 = time.perf_counter()
        res = measure_case(rank, world, COMBOS[name], seq, schedule)
        out.append({"combo": name, "P": world, "seq": seq, "schedule": schedule, **res,
                    "seconds": time.perf_counter() - t0})
    return out


def run_grid(worlds, lengths, combos=COMBOS, schedules=SCHEDULES, timeout=1800):
    from dist_utils import run_distributed

    rows = []
    for world in worlds:
        cases = [(c, s, sch) for c in combos for s in lengths for sch in schedules
                 if not (world == 1 and sch != "balanced")]  # one rank: every schedule is the same single call
        per_rank = run_distributed(_case_rows, world, cases, timeout=timeout)
        for i in range(len(cases)):  # the peak rank: the largest device peak
            rows.append(max((r[i] for r in per_rank), key=lambda r: r["device"]))
    return rows


def error(pred: int, meas: int) -> float:
    return (pred - meas) / meas if meas else 0.0


def write(rows, out_dir: Path, command: str, name: str = "step_memory") -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    keys = ["combo", "schedule", "P", "seq", "mode", "predicted_device", "device", "predicted_host", "host",
            "predicted_moment", "moment"]
    with open(out_dir / f"{name}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(keys + ["device_error", "host_error"])
        for r in rows:
            w.writerow([r[k] for k in keys] + [f"{error(r['predicted_device'], r['device']):+.4f}",
                                               f"{error(r['predicted_host'], r['host']):+.4f}"])
    worst = max(abs(error(r["predicted_device"], r["device"])) for r in rows)
    worst_h = max((abs(error(r["predicted_host"], r["host"])) for r in rows if r["host"]), default=0.0)
    lines = ["# The whole step's byte model vs a measurement (issue 36)", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, CPU + gloo, torch "
             f"{torch.__version__}. Command: `{command}`.", "",
             "Model: `launch/train.py --model tiny` (hidden 128, 4 layers, 4/4 heads, ffn 384), vocabulary "
             f"{VOCAB}, batch 1, fp32 (train.py's CPU dtype); tiles 64 tokens. Measured: "
             "`distattn.memory.tiers.step_bytes` over step 2 (forward, loss, backward, clip, AdamW step); the peak "
             "rank. Predicted: `launch/train_memory.step_prediction` (what the JSON summary reports).", "",
             f"Largest |error|: device {worst:.2%}, host {worst_h:.2%}.", "",
             "| combo | schedule | P | seq | mode | device pred | device meas | err | host pred | host meas | "
             "predicted moment | measured moment |", "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {r['combo']} | {r['schedule']} | {r['P']} | {r['seq']} | {r['mode']} | "
                     f"{r['predicted_device']:,} | {r['device']:,} | {error(r['predicted_device'], r['device']):+.2%} "
                     f"| {r['predicted_host']:,} | {r['host']:,} | {r['predicted_moment']} | {r['moment']} |")
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="P = 1, 2 and one length")
    p.add_argument("--worlds", type=int, nargs="*", default=None)
    p.add_argument("--lengths", type=int, nargs="*", default=None)
    p.add_argument("--combos", nargs="*", default=list(COMBOS))
    p.add_argument("--schedules", nargs="*", default=list(SCHEDULES))
    p.add_argument("--name", default="step_memory", help="file name of the table (CSV and markdown)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "step-memory")
    a = p.parse_args(argv)
    worlds = a.worlds or ([1, 2] if a.quick else [1, 2, 4])
    lengths = a.lengths or ([512] if a.quick else [512, 1024])
    rows = run_grid(worlds, lengths, {c: COMBOS[c] for c in a.combos}, schedules=tuple(a.schedules))
    command = "python bench/step_memory.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write(rows, a.out, command.strip(), a.name)
    for r in rows:
        print(f"{r['combo']:>20} {r['schedule']:>8} P={r['P']} n={r['seq']:>5} device "
              f"{error(r['predicted_device'], r['device']):+.2%} host {r['host']:,}/{r['predicted_host']:,} "
              f"{r['moment']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
