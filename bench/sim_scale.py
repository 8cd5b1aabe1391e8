"""How long the simulator and the cost model take at large P (measured, CPU; a check of issue 21's scale item).

    python bench/sim_scale.py --world 1024 4096 16384 --seq-per-rank 1048576 --out bench/results/sim-scale

For every P a fresh Python process (so no plan is cached) times, in-process and after the imports:

* ``table``: ``python -m distattn.schedule --world P --seq-per-rank N`` (build the ring, balanced and zigzag plans,
  simulate them, print the markdown table);
* ``explain``: ``python -m distattn.schedule explain --world P --seq-per-rank N --link ib`` (the cost model predicts
  every candidate: flat ring/balanced/zigzag and Ulysses x ring for every U <= 8 dividing P);

and reports the process's peak resident memory and the whole command's wall time (imports included: importing
``distattn`` imports torch). Writes ``results.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._util import cpu_name  # noqa: E402

_CHILD = """
import contextlib, io, json, resource, sys, time
world, n = sys.argv[1], sys.argv[2]
from distattn.schedule.cli import main
args = ["--world", world, "--seq-per-rank", n, "--heads", "32", "--heads-kv", "8"]
with contextlib.redirect_stdout(io.StringIO()) as table:
    t0 = time.perf_counter(); main(args); t1 = time.perf_counter()
with contextlib.redirect_stdout(io.StringIO()):
    main(["explain", *args, "--link", "ib"]); t2 = time.perf_counter()
print(json.dumps({"table_s": t1 - t0, "explain_s": t2 - t1, "peak_rss_mib": resource.getrusage(
    resource.RUSAGE_SELF).ru_maxrss / 1024, "table": table.getvalue().splitlines()[1:]}))
"""


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--world", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--seq-per-rank", type=int, default=1 << 20)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = _parse(argv)
    root = Path(__file__).resolve().parents[1]
    rows = []
    for p in args.world:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", _CHILD, str(p), str(args.seq_per_rank)], cwd=root, check=True,
                              capture_output=True, text=True)
        wall = time.perf_counter() - start
        rows.append({"P": p, **json.loads(done.stdout.splitlines()[-1]), "wall_s": wall})
        print(f"P={p}: table {rows[-1]['table_s']:.2f} s, explain {rows[-1]['explain_s']:.2f} s, "
              f"peak RSS {rows[-1]['peak_rss_mib']:.0f} MiB, process {wall:.1f} s", flush=True)
    lines = [
        "# Simulator and cost model at large P (measured, CPU)", "",
        f"Machine: {cpu_name()}, {os.cpu_count()} cores shared with other jobs (load average "
        f"{os.getloadavg()[0]:.1f} at the end), Python {platform.python_version()}. {args.seq_per_rank} tokens per "
        "rank, 32 query / 8 kv heads, d 128, bf16, causal. Command:", "",
        "    python bench/sim_scale.py --world " + " ".join(map(str, args.world))
        + f" --seq-per-rank {args.seq_per_rank} --out {args.out}", "",
        "| P | table s (3 plans) | explain s (all candidates) | peak RSS MiB | process s (with imports) |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {r['P']} | {r['table_s']:.2f} | {r['explain_s']:.2f} | {r['peak_rss_mib']:.0f} | {r['wall_s']:.1f} |"
              for r in rows]
    lines += ["", "The simulator's table (the table command's output; MiB per rank), for the record:", ""]
    lines += rows[0]["table"][:2] + [line for r in rows for line in r["table"][2:]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'results.md'}")


if __name__ == "__main__":
    main()
