"""Seconds of the first compiled call (forward + backward) of ``distattn.flash_attn_varlen_qkvpacked_func``.

    python bench/compile_varlen.py 64            # inductor, capture_scalar_outputs, 3 documents of 64 tokens
    python bench/compile_varlen.py 512 aot_eager

Issue 38: the compile used to grow with the token count (the kernels' host tile loops were traced, one symbolic
int per query row); attention is now an opaque registered op. Prints one line: tokens, backend, seconds of the
first call, and the largest difference from the eager call. Results: ``bench/results/compile-varlen/``.
"""

from __future__ import annotations

import sys
import time

import torch
import torch._dynamo

import distattn


def main(argv: list[str]) -> int:
    tokens = int(argv[0])
    backend = argv[1] if len(argv) > 1 else "inductor"
    torch._dynamo.config.capture_scalar_outputs = True
    torch.manual_seed(0)
    lens = [tokens // 4, tokens // 2, tokens - tokens // 4 - tokens // 2]
    cu = torch.tensor([0, lens[0], lens[0] + lens[1], tokens], dtype=torch.int32)
    qkv = torch.randn(tokens, 3, 2, 16, requires_grad=True)
    compiled = torch.compile(distattn.flash_attn_varlen_qkvpacked_func, backend=backend)
    t0 = time.perf_counter()
    out = compiled(qkv, cu, max(lens), causal=True)
    out.sum().backward()
    seconds = time.perf_counter() - t0
    ref = distattn.flash_attn_varlen_qkvpacked_func(qkv.detach(), cu, max(lens), causal=True)
    print(f"tokens={tokens} backend={backend} first_call_s={seconds:.1f} diff={(out - ref).abs().max().item():.1e}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
