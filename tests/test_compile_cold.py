"""torch.compile outside the Trainer (issue 38, part 3): compiles counted from a cold process, and the compat llama3
family compiled (fullgraph) against eager on gloo.

Counting runs in a fresh subprocess: the first call of a process is the one that used to build and cache the kernel
backend inside the traced frame (a guard on ``distattn.kernels._CACHE``, so the second call recompiled).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


from dist_utils import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Frames dynamo compiles: first call, same shapes again, a new length (automatic dynamic: one recompile), another
# new length (dynamic now: none). Dense single-device, packed single-device, and the distributed call on 1 rank.
_COLD = r'''
import json, os, tempfile, torch, torch.distributed as dist, distattn
from torch._dynamo.utils import counters
torch._dynamo.config.capture_scalar_outputs = True
dist.init_process_group("gloo", init_method="file://" + os.path.join(tempfile.mkdtemp(), "s"), rank=0, world_size=1)
def dense(n):
    q, k, v = (torch.randn(1, n, 2, 8, requires_grad=True) for _ in range(3))
    return q, k, v
def run(kind, n):
    if kind == "varlen":
        qkv = torch.randn(n, 3, 2, 8, requires_grad=True)
        cu = torch.tensor([0, n // 4, n], dtype=torch.int32)
        out = FN[kind](qkv, cu, n, causal=True)
    else:
        out = FN[kind](*dense(n), causal=True)
    out.sum().backward()
counts = {}
for kind, fn in (("dense", distattn.flash_attn_func), ("varlen", distattn.flash_attn_varlen_qkvpacked_func),
                 ("dist", distattn.dist_flash_attn_func)):
    torch._dynamo.reset(); counters.clear()
    FN = {kind: torch.compile(fn, backend="eager")}
    seen = []
    for n in (16, 16, 24, 32):
        run(kind, n)
        seen.append(counters["stats"]["unique_graphs"])
    counts[kind] = seen
print("COUNTS " + json.dumps(counts))
'''


def test_compiles_from_a_cold_process():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", _COLD], capture_output=True, text=True, timeout=240, env=env)
    line = [x for x in done.stdout.splitlines() if x.startswith("COUNTS ")]
    assert done.returncode == 0 and line, done.stderr[-3000:]
    counts = json.loads(line[0].removeprefix("COUNTS "))
    # cumulative frames after calls of 16, 16, 24, 32 tokens: the repeat compiles nothing, the first new length
    # recompiles once (the length becomes dynamic), the next new length nothing
    assert counts["dense"] == [1, 1, 2, 2], counts
    assert counts["dist"] == [1, 1, 2, 2], counts
    # the varlen function reads cu_seqlens on the host to validate it: dynamo restarts the frame around that
    # check, so its first call compiles more than one frame; still nothing at the repeat and one round per length
    first = counts["varlen"][0]
    assert counts["varlen"][1] == first and counts["varlen"][3] == counts["varlen"][2], counts


# -- llama3 compiled vs eager, 2 ranks ----------------------------------------------------------------------
TOL = 1e-5  # fp32, the same kernels in the same order: the compiled call differs from eager only by op boundaries


def _llama3_compiled(rank, world):
    import torch._dynamo
    from torch._dynamo.utils import counters

    from distattn.compat import ring_flash_attn as m

    torch._dynamo.config.capture_scalar_outputs = True
    n, h, d = 12, 2, 8
    results = []
    for name in ("llama3_flash_attn_varlen_qkvpacked_func", "llama3_flash_attn_varlen_kvpacked_func"):
        fn = getattr(m, name)
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
        graphs = []
        # same shapes, other documents: the first change of the local ints (max_seqlen_*, local_k_slice, the
        # number of local documents) recompiles once with them dynamic, then no layout compiles anything
        for lengths in ([5, 1, 11, 7], [9, 3, 12], [7, 2, 8, 7]):
            torch.manual_seed(0)
            qkv = torch.randn(world * n, 3, h, d)[rank * n:(rank + 1) * n]
            cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
            args = m.llama3_flash_attn_prepare_cu_seqlens(cu, True, rank, world)
            outs = []
            for f in (compiled, fn):
                x = qkv.clone().requires_grad_()
                packed = (x,) if "qkvpacked" in name else (x[:, 0], x[:, 1:])
                out, lse, _ = f(*packed, *args[:4], 1, args[4], causal=True, return_attn_probs=True)
                (out * torch.arange(out.numel()).reshape(out.shape).sin()).sum().backward()
                outs.append((out.detach(), lse, x.grad))
            results.append(max((a - b).abs().max().item() for a, b in zip(*outs)))
            graphs.append(counters["stats"]["unique_graphs"])
        results.append(graphs)
    return results


def test_llama3_family_compiles_fullgraph_and_matches_eager():
    for res in run_distributed(_llama3_compiled, 2, timeout=200):
        qkv_diffs, qkv_graphs = res[:3], res[3]
        kv_diffs, kv_graphs = res[4:7], res[7]
        assert max(qkv_diffs + kv_diffs) <= TOL, res
        assert qkv_graphs == kv_graphs == [1, 2, 2], res
